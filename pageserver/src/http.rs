//! The management API (docs/http-api.md): tenants, tenant config, metrics.
//!
//! Handlers are thin: they parse, call [`Tenants`]/[`crate::tenant::Tenant`], and map errors to
//! status codes. Every error body is `{"error": "..."}`, unknown routes (404) and wrong methods
//! (405, with `Allow`) included.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use axum::{Json, Router};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::process_metrics::{self, GIT_COMMIT, VERSION};
use crate::tenant::TenantConfOverrides;
use crate::tenants::{TenantError, Tenants};

struct AppState {
    tenants: Arc<Tenants>,
    registry: prometheus::Registry,
}

/// An error reply: a status and a message.
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(serde_json::json!({ "error": self.1 }))).into_response()
    }
}

impl From<TenantError> for ApiError {
    fn from(e: TenantError) -> ApiError {
        let status = match &e {
            TenantError::Exists(_) => StatusCode::CONFLICT,
            TenantError::NotFound(_) => StatusCode::NOT_FOUND,
            TenantError::InvalidId(_) => StatusCode::BAD_REQUEST,
            TenantError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            TenantError::Other(_) => {
                tracing::error!("management request failed: {e:#}");
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        ApiError(status, e.to_string())
    }
}

impl From<JsonRejection> for ApiError {
    fn from(e: JsonRejection) -> ApiError {
        ApiError(StatusCode::BAD_REQUEST, e.body_text())
    }
}

type ApiResult = Result<Response, ApiError>;

/// Serves the API on `listener` until `cancel`; registers the process metrics and
/// `pageserver_build_info` in `registry` first.
///
/// Cancel-safe: dropping it closes the listener and the connections.
pub async fn serve(
    listener: tokio::net::TcpListener,
    tenants: Arc<Tenants>,
    registry: prometheus::Registry,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    process_metrics::register(&registry)?;
    let state = Arc::new(AppState { tenants, registry });
    let app = Router::new()
        .route("/v1/status", get(status))
        .route("/v1/tenant", get(list_tenants).post(create_tenant))
        .route("/v1/tenant/{id}", get(get_tenant).delete(delete_tenant))
        .route("/v1/tenant/{id}/config", put(put_tenant_config))
        .route("/metrics", get(metrics))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .with_state(state);
    axum::serve(listener, app).with_graceful_shutdown(async move { cancel.cancelled().await }).await?;
    Ok(())
}

async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError(StatusCode::NOT_FOUND, format!("no route {method} {}", uri.path()))
}

/// axum adds the `Allow` header to this answer.
async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    ApiError(StatusCode::METHOD_NOT_ALLOWED, format!("method {method} is not allowed on {}", uri.path()))
}

async fn status(State(state): State<Arc<AppState>>) -> ApiResult {
    let body =
        serde_json::json!({ "version": VERSION, "git_commit": GIT_COMMIT, "tenants": state.tenants.len() });
    Ok(Json(body).into_response())
}

async fn list_tenants(State(state): State<Arc<AppState>>) -> ApiResult {
    let statuses: Vec<_> = state.tenants.list().iter().map(|t| t.status()).collect();
    Ok(Json(statuses).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateTenant {
    id: String,
    #[serde(default)]
    config: TenantConfOverrides,
}

async fn create_tenant(
    State(state): State<Arc<AppState>>,
    body: Result<Json<CreateTenant>, JsonRejection>,
) -> ApiResult {
    let Json(request) = body?;
    let tenant = state.tenants.create(&request.id, request.config).await?;
    Ok((StatusCode::CREATED, Json(tenant.status())).into_response())
}

async fn get_tenant(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> ApiResult {
    let tenant = state.tenants.get(&id).ok_or(TenantError::NotFound(id))?;
    Ok(Json(tenant.status()).into_response())
}

async fn delete_tenant(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> ApiResult {
    state.tenants.delete(&id).await?;
    Ok(Json(serde_json::json!({})).into_response())
}

async fn put_tenant_config(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: Result<Json<TenantConfOverrides>, JsonRejection>,
) -> ApiResult {
    let Json(overrides) = body?;
    let tenant = state.tenants.get(&id).ok_or(TenantError::NotFound(id))?;
    tenant.set_overrides(overrides).map_err(TenantError::Other)?;
    tracing::info!(tenant_id = tenant.id, config = ?tenant.overrides(), "tenant config changed");
    Ok(Json(tenant.status()).into_response())
}

async fn metrics(State(state): State<Arc<AppState>>) -> ApiResult {
    let text = prometheus::TextEncoder::new()
        .encode_to_string(&state.registry.gather())
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, format!("encode metrics: {e}")))?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}
