//! The management API (docs/http-api.md): tenants, tenant config, metrics.
//!
//! Handlers are thin: they parse, call [`Tenants`]/[`crate::tenant::Tenant`], and map errors to
//! status codes. Every error body is `{"error": "..."}`, unknown routes (404) and wrong methods
//! (405, with `Allow`) included.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::serve::Listener;
use axum::{Json, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use page_types::{BufferTag, Lsn};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::basebackup::{self, BackupError};
use crate::compaction::CompactError;
use crate::process_metrics::{GIT_COMMIT, VERSION};
use crate::tenant::wal_receiver::WalSource;
use crate::tenant::{GetPageError, Tenant, TenantConfOverrides};
use crate::tenants::{TenantError, Tenants, TimelineError};

pub mod listener;

use listener::TrackRequests;

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
            TenantError::NoRemoteStorage => StatusCode::BAD_REQUEST,
            TenantError::NotInBucket(_) => StatusCode::NOT_FOUND,
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
    mut listener: listener::HttpListener,
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
        .route("/v1/tenant/{id}/attach", post(attach_tenant))
        .route("/v1/tenant/{id}/detach", post(detach_tenant))
        .route("/v1/tenant/{id}/keyspace", get(get_keyspace))
        .route("/v1/tenant/{id}/compact", post(compact_tenant))
        .route("/v1/tenant/{id}/wal_source", put(put_wal_source).delete(delete_wal_source))
        .route("/v1/tenant/{id}/timeline", get(list_timelines).post(create_timeline))
        .route("/v1/tenant/{id}/timeline/{timeline}", get(get_timeline).delete(delete_timeline))
        .route("/v1/tenant/{id}/timeline/{timeline}/basebackup", get(get_basebackup))
        .route("/v1/tenant/{id}/timeline/{timeline}/keyspace", get(get_timeline_keyspace))
        .route("/v1/tenant/{id}/timeline/{timeline}/compact", post(compact_timeline))
        .route(
            "/v1/tenant/{id}/timeline/{timeline}/wal_source",
            put(put_timeline_wal_source).delete(delete_timeline_wal_source),
        )
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
        // A request in its handler keeps the connection from timing out as idle.
        let service = TrackRequests::new(TowerToHyperService::new(app.clone()), io.in_request());
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

async fn attach_tenant(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> ApiResult {
    let tenant = state.tenants.attach(&id).await?;
    Ok((StatusCode::CREATED, Json(tenant.status())).into_response())
}

async fn detach_tenant(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> ApiResult {
    state.tenants.detach(&id).await?;
    Ok(Json(serde_json::json!({})).into_response())
}

async fn put_tenant_config(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: Result<Json<TenantConfOverrides>, JsonRejection>,
) -> ApiResult {
    let Json(overrides) = body?;
    let tenant = state.tenants.get(&id)?;
    tenant.set_overrides(overrides.clone()).map_err(TenantError::Other)?;
    for branch in state.tenants.timelines(&id)?.iter().skip(1) {
        branch.apply_overrides(overrides.clone());
    }
    tracing::info!(tenant_id = tenant.id, config = ?tenant.overrides(), "tenant config changed");
    Ok(Json(tenant.status()).into_response())
}

/// Attaches the tenant to a PostgreSQL 15 primary (docs/http-api.md); answers the source's
/// status. A bad connection string or slot name is 400; the connection itself is made by the
/// receiver, whose errors show in the status.
async fn put_wal_source(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: Result<Json<WalSource>, JsonRejection>,
) -> ApiResult {
    let Json(source) = body?;
    attach(state.tenants.get(&id)?, source).await
}

/// [`put_wal_source`] of one timeline: a branch's is the PostgreSQL started on its base backup.
async fn put_timeline_wal_source(
    State(state): State<Arc<AppState>>,
    Path((id, timeline)): Path<(String, String)>,
    body: Result<Json<WalSource>, JsonRejection>,
) -> ApiResult {
    let Json(source) = body?;
    attach(state.tenants.timeline(&id, &timeline)?, source).await
}

async fn attach(tenant: Arc<Tenant>, source: WalSource) -> ApiResult {
    source.validate().map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("invalid WAL source: {e}")))?;
    if tenant.cancel.is_cancelled() {
        return Err(TenantError::ShuttingDown.into());
    }
    let status = tenant.attach_wal_source(source).await.map_err(TenantError::Other)?;
    Ok(Json(status).into_response())
}

/// Detaches the tenant from its WAL source (what was stored stays); 404 if it has none.
async fn delete_wal_source(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> ApiResult {
    detach(state.tenants.get(&id)?).await
}

async fn delete_timeline_wal_source(
    State(state): State<Arc<AppState>>,
    Path((id, timeline)): Path<(String, String)>,
) -> ApiResult {
    detach(state.tenants.timeline(&id, &timeline)?).await
}

async fn detach(tenant: Arc<Tenant>) -> ApiResult {
    if !tenant.detach_wal_source().await.map_err(TenantError::Other)? {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("timeline {} of tenant {} has no WAL source", tenant.timeline_id, tenant.id),
        ));
    }
    let body =
        serde_json::json!({ "tenant_id": tenant.id, "timeline_id": tenant.timeline_id, "wal_source": null });
    Ok(Json(body).into_response())
}

/// Runs a compaction pass of the tenant now; answers with what it did once it is done
/// (`{"tenant_id", "pass": null}` when there was nothing to compact), however long that takes:
/// the connection is not idle meanwhile. A client that goes away does not stop the pass. If a
/// pass asked for earlier waits already behind the running one, `429` with `Retry-After` at
/// once: a tenant's compact calls hold at most two API connections.
async fn compact_tenant(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> ApiResult {
    compact(state.tenants.get(&id)?).await
}

/// [`compact_tenant`] of one timeline; the answer names it.
async fn compact_timeline(
    State(state): State<Arc<AppState>>,
    Path((id, timeline)): Path<(String, String)>,
) -> ApiResult {
    compact(state.tenants.timeline(&id, &timeline)?).await
}

async fn compact(tenant: Arc<Tenant>) -> ApiResult {
    let pass = match tenant.compact().await {
        Ok(pass) => pass,
        Err(e @ CompactError::Busy { retry_after }) => {
            let mut refused = ApiError(StatusCode::TOO_MANY_REQUESTS, e.to_string()).into_response();
            refused.headers_mut().insert(header::RETRY_AFTER, retry_after.as_secs().into());
            return Ok(refused);
        }
        Err(e @ CompactError::ShuttingDown) => {
            return Err(ApiError(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))
        }
        // Logged by the compactor.
        Err(e @ CompactError::Failed(_)) => {
            return Err(ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
        }
    };
    let body = serde_json::json!({ "tenant_id": tenant.id, "timeline_id": tenant.timeline_id, "pass": pass });
    Ok(Json(body).into_response())
}

impl From<TimelineError> for ApiError {
    fn from(e: TimelineError) -> ApiError {
        let status = match e {
            TimelineError::Tenant(e) => return e.into(),
            TimelineError::NotFound { .. } => StatusCode::NOT_FOUND,
            TimelineError::Exists { .. } | TimelineError::Refused(_) => StatusCode::CONFLICT,
            TimelineError::BelowGcCutoff { .. } => StatusCode::GONE,
            TimelineError::Invalid(_) => StatusCode::BAD_REQUEST,
        };
        ApiError(status, e.to_string())
    }
}

async fn list_timelines(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> ApiResult {
    let statuses: Vec<_> = state.tenants.timelines(&id)?.iter().map(|t| t.timeline_status()).collect();
    Ok(Json(statuses).into_response())
}

/// An LSN as JSON: PostgreSQL's text (`"0/16B3748"`) or the integer the API shows.
#[derive(Deserialize)]
#[serde(untagged)]
enum LsnParam {
    Number(u64),
    Text(String),
}

impl LsnParam {
    fn lsn(&self, what: &str) -> Result<Lsn, ApiError> {
        match self {
            LsnParam::Number(n) => Ok(Lsn(*n)),
            LsnParam::Text(text) => {
                text.parse::<Lsn>().map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("{what}: {e}")))
            }
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateTimeline {
    new_timeline_id: String,
    ancestor_timeline_id: String,
    ancestor_start_lsn: Option<LsnParam>,
}

/// Branches a timeline (docs/http-api.md): 201 with the new timeline's status.
async fn create_timeline(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: Result<Json<CreateTimeline>, JsonRejection>,
) -> ApiResult {
    let Json(request) = body?;
    let lsn = request.ancestor_start_lsn.as_ref().map(|l| l.lsn("ancestor_start_lsn")).transpose()?;
    let branch = state
        .tenants
        .create_branch(&id, &request.new_timeline_id, &request.ancestor_timeline_id, lsn)
        .await?;
    Ok((StatusCode::CREATED, Json(branch.timeline_status())).into_response())
}

async fn get_timeline(
    State(state): State<Arc<AppState>>,
    Path((id, timeline)): Path<(String, String)>,
) -> ApiResult {
    Ok(Json(state.tenants.timeline(&id, &timeline)?.timeline_status()).into_response())
}

async fn delete_timeline(
    State(state): State<Arc<AppState>>,
    Path((id, timeline)): Path<(String, String)>,
) -> ApiResult {
    state.tenants.delete_branch(&id, &timeline).await?;
    Ok(Json(serde_json::json!({})).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BasebackupQuery {
    lsn: Option<String>,
    #[serde(default)]
    standby: bool,
}

/// A base backup of the tenant's timeline at `lsn` (default: its last durable LSN), streamed as
/// a tar as it is built (`basebackup`); `standby=true` adds `standby.signal`. What can fail
/// before the first byte is an error status; a page that fails later cuts the stream short.
async fn get_basebackup(
    State(state): State<Arc<AppState>>,
    Path((id, timeline)): Path<(String, String)>,
    query: Result<Query<BasebackupQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult {
    let Query(query) = query.map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.body_text()))?;
    let tenant = state.tenants.timeline(&id, &timeline)?;
    let lsn = match query.lsn.as_deref() {
        None => Lsn::LATEST,
        Some(text) => {
            text.parse::<Lsn>().map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("lsn: {e}")))?
        }
    };
    let contents = basebackup::prepare(&tenant, lsn).await.map_err(backup_error)?;
    let (lsn, start_lsn) = (contents.lsn, contents.start_lsn);
    tracing::info!(tenant_id = tenant.id, %lsn, %start_lsn, forks = contents.forks(), "base backup begins");
    let (tx, rx) = tokio::sync::mpsc::channel(basebackup::CHUNKS_IN_FLIGHT);
    let standby = query.standby;
    tokio::spawn(async move {
        match basebackup::send(&tenant, contents, standby, &tx).await {
            Ok(bytes) => tracing::info!(tenant_id = tenant.id, %lsn, bytes, "base backup sent"),
            Err(BackupError::Gone) => {
                tracing::info!(tenant_id = tenant.id, %lsn, "base backup: the client went away")
            }
            Err(e) => {
                tracing::error!(tenant_id = tenant.id, %lsn, "base backup failed, its stream is cut short: {e:#}");
                let _ = tx.send(Err(std::io::Error::other(e.to_string()))).await;
            }
        }
    });
    let body =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|chunk| (chunk, rx)) });
    let mut response = axum::body::Body::from_stream(body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/x-tar"));
    for (name, value) in [("x-basebackup-lsn", lsn), ("x-basebackup-start-lsn", start_lsn)] {
        if let Ok(value) = header::HeaderValue::from_str(&value.to_string()) {
            headers.insert(name, value);
        }
    }
    Ok(response)
}

/// The status of a base backup refused before its first byte.
fn backup_error(e: BackupError) -> ApiError {
    let status = match &e {
        BackupError::Lsn(GetPageError::BelowGcCutoff { .. }) => StatusCode::GONE,
        BackupError::Lsn(GetPageError::ShuttingDown) => StatusCode::SERVICE_UNAVAILABLE,
        BackupError::Lsn(_) | BackupError::NoControlFile { .. } | BackupError::NoConfigFile { .. } => {
            StatusCode::CONFLICT
        }
        BackupError::Tablespace { .. } => StatusCode::UNPROCESSABLE_ENTITY,
        BackupError::Page { .. } | BackupError::Internal(_) | BackupError::Gone => {
            tracing::error!("base backup refused: {e:#}");
            StatusCode::INTERNAL_SERVER_ERROR
        }
    };
    ApiError(status, e.to_string())
}

/// The key space of a tenant: its keys as block ranges per relation fork, and the LSN range.
async fn get_keyspace(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> ApiResult {
    keyspace(state.tenants.get(&id)?).await
}

/// [`get_keyspace`] of one timeline: a branch's keys are its own and those its ancestor has at
/// or below the branch point.
async fn get_timeline_keyspace(
    State(state): State<Arc<AppState>>,
    Path((id, timeline)): Path<(String, String)>,
) -> ApiResult {
    keyspace(state.tenants.timeline(&id, &timeline)?).await
}

async fn keyspace(tenant: Arc<Tenant>) -> ApiResult {
    let timeline = Arc::clone(&tenant.timeline);
    // Read the durable LSN first: every key listed is durable at or below it.
    let last_durable_lsn = timeline.last_durable_lsn();
    let keys = tokio::task::spawn_blocking(move || timeline.keyspace())
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, format!("list the key space: {e}")))?
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, format!("list the key space: {e:#}")))?;
    Ok(Json(keyspace_json(&tenant.id, last_durable_lsn, &keys)).into_response())
}

/// `{"tenant_id", "last_durable_lsn", "keys", "lsn_range": {"first", "all_keys_from", "last"} or
/// null, "relations": [{"spcnode", "dbnode", "relnode", "forknum", "blocks": [[first, last], ...]}]}`.
fn keyspace_json(tenant_id: &str, last_durable_lsn: Lsn, keys: &[(BufferTag, Lsn)]) -> serde_json::Value {
    let mut relations: Vec<serde_json::Value> = Vec::new();
    let mut current: Option<(BufferTag, Vec<[u32; 2]>)> = None;
    let flush = |relations: &mut Vec<serde_json::Value>, (rel, blocks): (BufferTag, Vec<[u32; 2]>)| {
        relations.push(serde_json::json!({
            "spcnode": rel.spcnode, "dbnode": rel.dbnode, "relnode": rel.relnode, "forknum": rel.forknum,
            "blocks": blocks,
        }));
    };
    for (key, _) in keys {
        let same_fork = |rel: &BufferTag| {
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
            "first": first, "all_keys_from": all_keys_from, "last": last_durable_lsn,
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
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::config::PageServerConf;
    use crate::page_cache::PageCache;
    use crate::storage::{IngestBatch, Value};
    use crate::tenant::TenantConfOverrides;
    use crate::tenants::TenantsMetrics;
    use crate::walredo::WalRedoMetrics;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The management API of a daemon with `settings`, on a port of its own, whose connections
    /// are closed after `idle_timeout` without a byte moving.
    struct Api {
        addr: std::net::SocketAddr,
        tenants: Arc<Tenants>,
        cancel: CancellationToken,
        served: tokio::task::JoinHandle<anyhow::Result<()>>,
        _workdir: tempfile::TempDir,
    }

    impl Api {
        async fn start(settings: &[(&str, toml::Value)], idle_timeout: Duration) -> Api {
            let workdir = tempfile::tempdir().unwrap();
            let mut table = toml::Table::new();
            // No redo in these tests: the child is never started.
            table.insert("walredo_proc_path".into(), "/bin/false".into());
            for (k, v) in settings {
                table.insert(k.to_string(), v.clone());
            }
            let conf = PageServerConf::from_table(workdir.path(), table).unwrap();
            let registry = prometheus::Registry::new();
            let cache = Arc::new(PageCache::new(0, &registry).unwrap());
            let storage = Arc::new(crate::storage::register_metrics(&registry).unwrap());
            let walredo = Arc::new(WalRedoMetrics::new(&registry).unwrap());
            let metrics = Arc::new(TenantsMetrics::new(&registry).unwrap());
            let tenants_cancel = CancellationToken::new();
            let tenants = Tenants::load(
                &conf.workdir,
                &conf.tenants,
                cache,
                storage,
                walredo,
                metrics,
                tenants_cancel.clone(),
            )
            .await
            .unwrap();
            let tenants = Arc::new(tenants);
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let listener = listener::HttpListener::with_idle_timeout(listener, idle_timeout);
            let cancel = CancellationToken::new();
            let served = tokio::spawn(serve(listener, Arc::clone(&tenants), registry, cancel.clone()));
            Api { addr, tenants, cancel, served, _workdir: workdir }
        }

        async fn stop(self) {
            self.cancel.cancel();
            self.served.await.unwrap().unwrap();
            self.tenants.shutdown().await;
        }
    }

    /// Sends `request` (`METHOD /path`, no body) on a connection of its own and returns the
    /// whole answer (status line, headers, body), or what arrived before the server closed.
    async fn send(addr: std::net::SocketAddr, request: &str) -> String {
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head =
            format!("{request} HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        conn.write_all(head.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(120), conn.read_to_end(&mut answer)).await;
        assert!(read.is_ok(), "no answer to {request} within 120 s");
        String::from_utf8_lossy(&answer).into_owned()
    }

    /// A tenant `t` with `keys` keys of `versions` records each, sealed into layers (the
    /// active segment is sealed by the pass).
    async fn tenant_with_records(api: &Api, keys: u32, versions: u64) {
        let tenant = api.tenants.create("t", TenantConfOverrides::default()).await.unwrap();
        for v in 0..versions {
            let values = (0..keys)
                .map(|k| {
                    let key = BufferTag { spcnode: 1663, dbnode: 1, relnode: 1, forknum: 0, blknum: k };
                    let record = Value::Record(bytes::Bytes::from(vec![k as u8; 100]));
                    (key, Lsn(1 + v * u64::from(keys) + u64::from(k)), record)
                })
                .collect();
            tenant.submit_ingest(IngestBatch { values }).await.unwrap().await.unwrap();
        }
    }

    /// Settings under which a pass is slow: at most 10% of a CPU (several seconds for the
    /// 10,000 values here, in a debug build), and no images (no redo).
    fn slow_compaction() -> Vec<(&'static str, toml::Value)> {
        vec![
            ("compaction", "off".into()),
            ("compaction_cpu_floor", 0.1.into()),
            ("compaction_cpu_cap", 0.1.into()),
            ("compaction_image_threshold", 65536.into()),
            ("layer_size", "64 KiB".into()),
        ]
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn compact_call_whose_pass_outlasts_the_idle_timeout_answers_when_the_pass_is_done() {
        let idle = Duration::from_millis(200);
        let api = Api::start(&slow_compaction(), idle).await;
        tenant_with_records(&api, 2000, 5).await;
        let start = Instant::now();
        let answer = send(api.addr, "POST /v1/tenant/t/compact").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "after {:?}: {answer:?}", start.elapsed());
        let body = answer.split("\r\n\r\n").nth(1).unwrap();
        let reply: serde_json::Value = serde_json::from_str(body).unwrap();
        let seconds = reply["pass"]["seconds"].as_f64().unwrap();
        // The test means something only if the pass took longer than the idle timeout.
        assert!(seconds > 2.0 * idle.as_secs_f64(), "the pass took only {seconds} s");
        assert_eq!(reply["pass"]["keys"], 2000);
        api.stop().await;
    }

    fn key(relnode: u32, forknum: u8, blknum: u32) -> BufferTag {
        BufferTag { spcnode: 1663, dbnode: 1, relnode, forknum, blknum }
    }

    /// The tenant status of `t` as the API answers it.
    async fn tenant_status(addr: std::net::SocketAddr) -> serde_json::Value {
        let answer = send(addr, "GET /v1/tenant/t").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
        serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap()).unwrap()
    }

    /// Polls the tenant status until `condition` holds, failing the test after a minute.
    async fn wait_for_status(
        addr: std::net::SocketAddr,
        what: &str,
        condition: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        // Generous: a pass held to a 10% CPU share goes slower still on a machine busy with
        // other tests (its slices are wall time); the wait ends as soon as the condition holds.
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let status = tenant_status(addr).await;
            if condition(&status) {
                return status;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}: {status}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn compact_call_whose_client_goes_away_leaves_the_pass_running_and_its_progress_shown() {
        let api = Api::start(&slow_compaction(), listener::HTTP_IDLE_TIMEOUT).await;
        tenant_with_records(&api, 2000, 5).await;
        let mut client = tokio::net::TcpStream::connect(api.addr).await.unwrap();
        let head = "POST /v1/tenant/t/compact HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\n\r\n";
        client.write_all(head.as_bytes()).await.unwrap();

        let status = wait_for_status(api.addr, "the pass to show progress", |s| {
            s["compaction"]["current_pass"]["values_read"].as_u64().is_some_and(|v| v > 0)
        })
        .await;
        let p = &status["compaction"]["current_pass"];
        assert_eq!(p["requested"], true, "{p}");
        assert_eq!(p["input_values"], 10_000, "{p}");
        assert!(p["values_read"].as_u64().unwrap() < 10_000, "the pass was already done: {p}");
        assert!(p["started_at"].as_str().unwrap().ends_with('Z'), "{p}");
        assert!(status["compaction"]["running"].as_bool().unwrap(), "{status}");

        // The client goes away; the pass goes on to its end.
        drop(client);
        let status = wait_for_status(api.addr, "the pass to end", |s| s["compaction"]["passes"] == 1).await;
        let c = &status["compaction"];
        assert!(c["current_pass"].is_null(), "{c}");
        assert_eq!(c["last_pass"]["values_read"], 10_000, "{c}");
        assert_eq!(c["failed_passes"], 0, "{c}");
        api.stop().await;
    }

    /// The answers of `calls`, each as [`send`] returns it, once they are all in.
    async fn answers(calls: Vec<tokio::task::JoinHandle<String>>) -> Vec<String> {
        let mut answers = Vec::new();
        for call in calls {
            answers.push(call.await.unwrap());
        }
        answers
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn compact_call_while_a_pass_runs_and_another_is_queued_is_refused_with_429_at_once() {
        // Every key's chain (16 short records: the chain cap at this threshold) asks the pass
        // for an image; its redo waits for its turn behind a GetPage that never leaves the
        // queue (until `held` is dropped, or the redo timeout).
        let settings = [
            ("compaction", "off".into()),
            ("compaction_image_threshold", 4.into()),
            ("wal_redo_timeout", "60 s".into()),
            ("layer_size", "64 KiB".into()),
        ];
        let api = Api::start(&settings, listener::HTTP_IDLE_TIMEOUT).await;
        tenant_with_records(&api, 4, 16).await;
        let tenant = api.tenants.get("t").unwrap();
        let held = tenant.walredo.hold_foreground_queue();
        let addr = api.addr;
        let compact = move || tokio::spawn(async move { send(addr, "POST /v1/tenant/t/compact").await });

        let running = compact();
        wait_for_status(addr, "the requested pass to run", |s| {
            s["compaction"]["current_pass"]["requested"] == true
        })
        .await;
        // One more call queues its pass behind the running one; the next finds the queue full.
        // Which of the two is which depends on which handler runs first.
        let (second, third) = (compact(), compact());
        let deadline = Instant::now() + Duration::from_secs(30);
        while !second.is_finished() && !third.is_finished() {
            assert!(
                Instant::now() < deadline,
                "no compact call was answered while a pass ran and another waited behind it"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (refused, queued) = if second.is_finished() { (second, third) } else { (third, second) };
        let refused = refused.await.unwrap();
        assert!(refused.starts_with("HTTP/1.1 429"), "{refused:?}");
        assert!(refused.to_ascii_lowercase().contains("\r\nretry-after: "), "{refused:?}");
        assert!(refused.contains("retry later"), "{refused:?}");

        // The held pass goes on: both calls in the queue get their passes.
        drop(held);
        for answer in answers(vec![running, queued]).await {
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
        }
        let status = tenant_status(addr).await;
        assert_eq!(status["compaction"]["passes"], 2, "{status}");
        // The passes asked for their images (which wait behind `held`; then the redo fails:
        // these tests start no child).
        assert_eq!(status["compaction"]["last_pass"]["image_failures"], 4, "{status}");
        api.stop().await;
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
        let json = keyspace_json("t1", Lsn(99), &keys);
        assert_eq!(json["keys"], 6);
        assert_eq!(json["lsn_range"], serde_json::json!({"first": 20, "all_keys_from": 70, "last": 99}));
        let relations = json["relations"].as_array().unwrap();
        assert_eq!(relations.len(), 3);
        assert_eq!(relations[0]["relnode"], 10);
        assert_eq!(relations[0]["forknum"], 0);
        assert_eq!(relations[0]["blocks"], serde_json::json!([[0, 2], [7, 7]]));
        assert_eq!(relations[1]["forknum"], 1);
        assert_eq!(relations[2]["blocks"], serde_json::json!([[5, 5]]));

        let empty = keyspace_json("t1", Lsn(0), &[]);
        assert_eq!(empty["keys"], 0);
        assert!(empty["lsn_range"].is_null());
        assert_eq!(empty["relations"], serde_json::json!([]));
    }
}
