//! The management API (docs/http-api.md): tenants, tenant config, metrics.
//!
//! Handlers are thin: they parse, call [`Tenants`]/[`crate::tenant::Tenant`], and map errors to
//! status codes. Every error body is `{"error": "..."}`, unknown routes (404) and wrong methods
//! (405, with `Allow`) included.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::serve::Listener;
use axum::{Json, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::process_metrics::{GIT_COMMIT, VERSION};
use crate::storage::{Key, Lsn};
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
            TenantError::Broken { .. } => StatusCode::CONFLICT,
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

/// The request line and headers of a request must arrive within this; a client that trickles
/// them (a byte now and then, which the listener's idle timeout alone would allow) is cut off.
pub const HTTP_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the API on `listener` until `cancel`, `/metrics` from `registry` (where
/// `server::run` registered every family, the process metrics included). On `cancel` it stops accepting, lets each
/// connection finish the request it is serving (hyper's graceful shutdown), and returns once
/// every connection is closed (bounded by the listener's idle timeout and the header timeout).
///
/// Cancel-safe: dropping it drops the listener; connections already accepted run on as tasks
/// of their own until their request is done or a timeout closes them.
pub async fn serve(
    mut listener: crate::server::HttpListener,
    tenants: Arc<Tenants>,
    registry: prometheus::Registry,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let state = Arc::new(AppState { tenants, registry });
    let app = Router::new()
        .route("/v1/status", get(status))
        .route("/v1/tenant", get(list_tenants).post(create_tenant))
        .route("/v1/tenant/{id}", get(get_tenant).delete(delete_tenant))
        .route("/v1/tenant/{id}/config", put(put_tenant_config))
        .route("/v1/tenant/{id}/keyspace", get(get_keyspace))
        .route("/v1/tenant/{id}/compact", post(compact_tenant))
        .route("/metrics", get(metrics))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .with_state(state);
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1.timer(TokioTimer::new()).header_read_timeout(HTTP_HEADER_READ_TIMEOUT);
    let connections = TaskTracker::new();
    loop {
        let (io, _peer) = tokio::select! {
            () = cancel.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let service = TowerToHyperService::new(app.clone());
        let conn = http1.serve_connection(TokioIo::new(io), service);
        let cancel = cancel.clone();
        connections.spawn(async move {
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                () = cancel.cancelled() => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
        });
    }
    connections.close();
    connections.wait().await;
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
    let tenant = state.tenants.slot(&id).ok_or(TenantError::NotFound(id))?;
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
    let tenant = state.tenants.get(&id)?;
    tenant.set_overrides(overrides).map_err(TenantError::Other)?;
    tracing::info!(tenant_id = tenant.id, config = ?tenant.overrides(), "tenant config changed");
    Ok(Json(tenant.status()).into_response())
}

/// Runs a compaction pass of the tenant now; answers with what it did once it is done
/// (`{"tenant_id", "pass": null}` when there was nothing to compact).
async fn compact_tenant(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> ApiResult {
    let tenant = state.tenants.get(&id)?;
    let pass = tenant.compact().await.map_err(TenantError::Other)?;
    Ok(Json(serde_json::json!({ "tenant_id": tenant.id, "pass": pass })).into_response())
}

/// The key space of a tenant: its keys as block ranges per relation fork, and the LSN range.
async fn get_keyspace(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> ApiResult {
    let tenant = state.tenants.get(&id)?;
    let timeline = Arc::clone(&tenant.timeline);
    // Read the durable LSN first: every key listed is durable at or below it.
    let last_durable_lsn = timeline.last_durable_lsn().0;
    let keys = tokio::task::spawn_blocking(move || timeline.keyspace())
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, format!("list the key space: {e}")))?;
    Ok(Json(keyspace_json(&tenant.id, last_durable_lsn, &keys)).into_response())
}

/// `{"tenant_id", "last_durable_lsn", "keys", "lsn_range": {"first", "all_keys_from", "last"} or
/// null, "relations": [{"spcnode", "dbnode", "relnode", "forknum", "blocks": [[first, last], ...]}]}`.
fn keyspace_json(tenant_id: &str, last_durable_lsn: u64, keys: &[(Key, Lsn)]) -> serde_json::Value {
    let mut relations: Vec<serde_json::Value> = Vec::new();
    let mut current: Option<(Key, Vec<[u32; 2]>)> = None;
    let flush = |relations: &mut Vec<serde_json::Value>, (rel, blocks): (Key, Vec<[u32; 2]>)| {
        relations.push(serde_json::json!({
            "spcnode": rel.spcnode, "dbnode": rel.dbnode, "relnode": rel.relnode, "forknum": rel.forknum,
            "blocks": blocks,
        }));
    };
    for (key, _) in keys {
        let same_fork = |rel: &Key| {
            (rel.spcnode, rel.dbnode, rel.relnode, rel.forknum)
                == (key.spcnode, key.dbnode, key.relnode, key.forknum)
        };
        match &mut current {
            Some((rel, blocks)) if same_fork(rel) => match blocks.last_mut() {
                Some(range) if range[1].checked_add(1) == Some(key.blknum) => range[1] = key.blknum,
                _ => blocks.push([key.blknum, key.blknum]),
            },
            _ => {
                if let Some(done) = current.take() {
                    flush(&mut relations, done);
                }
                current = Some((*key, vec![[key.blknum, key.blknum]]));
            }
        }
    }
    if let Some(done) = current.take() {
        flush(&mut relations, done);
    }
    let lsn_range = match (keys.iter().map(|k| k.1).min(), keys.iter().map(|k| k.1).max()) {
        (Some(first), Some(all_keys_from)) => serde_json::json!({
            "first": first.0, "all_keys_from": all_keys_from.0, "last": last_durable_lsn,
        }),
        _ => serde_json::Value::Null,
    };
    serde_json::json!({
        "tenant_id": tenant_id,
        "last_durable_lsn": last_durable_lsn,
        "keys": keys.len(),
        "lsn_range": lsn_range,
        "relations": relations,
    })
}

async fn metrics(State(state): State<Arc<AppState>>) -> ApiResult {
    let text = prometheus::TextEncoder::new()
        .encode_to_string(&state.registry.gather())
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, format!("encode metrics: {e}")))?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(relnode: u32, forknum: u8, blknum: u32) -> Key {
        Key { spcnode: 1663, dbnode: 1, relnode, forknum, blknum }
    }

    #[test]
    fn keyspace_is_block_ranges_per_relation_fork_and_the_lsn_range() {
        let keys = [
            (key(10, 0, 0), Lsn(30)),
            (key(10, 0, 1), Lsn(20)),
            (key(10, 0, 2), Lsn(40)),
            (key(10, 0, 7), Lsn(50)),
            (key(10, 1, 0), Lsn(60)),
            (key(11, 0, 5), Lsn(70)),
        ];
        let json = keyspace_json("t1", 99, &keys);
        assert_eq!(json["keys"], 6);
        assert_eq!(json["lsn_range"], serde_json::json!({"first": 20, "all_keys_from": 70, "last": 99}));
        let relations = json["relations"].as_array().unwrap();
        assert_eq!(relations.len(), 3);
        assert_eq!(relations[0]["relnode"], 10);
        assert_eq!(relations[0]["forknum"], 0);
        assert_eq!(relations[0]["blocks"], serde_json::json!([[0, 2], [7, 7]]));
        assert_eq!(relations[1]["forknum"], 1);
        assert_eq!(relations[2]["blocks"], serde_json::json!([[5, 5]]));

        let empty = keyspace_json("t1", 0, &[]);
        assert_eq!(empty["keys"], 0);
        assert!(empty["lsn_range"].is_null());
        assert_eq!(empty["relations"], serde_json::json!([]));
    }
}
