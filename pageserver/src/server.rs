//! The daemon as a library call: [`run`] starts everything the settings describe and returns
//! when `shutdown` fires and everything has stopped cleanly.
//!
//! `ports.json` is written best-effort, after the listeners are bound: a daemon that cannot
//! write it (a full disk) logs a WARN and serves anyway.
//!
//! Shutdown order: stop accepting; connections stop reading and finish the requests they have
//! (a GetPage still waiting for ingest to reach its LSN gets `shutting_down`), for at most
//! [`SHUTDOWN_GRACE`], after which the rest are closed (a client that never reads its replies
//! cannot hold up shutdown); the management
//! API stops; every tenant makes its queued ingests durable and stops its redo child. Then `run`
//! returns `Ok`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::PageServerConf;
use crate::page_cache::PageCache;
use crate::page_service::io_choice::{self, IoChoice};
use crate::page_service::{self, PageServiceConf, PageServiceMetrics, PageServiceSettings};
use crate::page_service::{uring, PageServiceIo};
use crate::storage;
use crate::tenant_series::TenantSeriesCollector;
use crate::tenants::{Tenants, TenantsMetrics};
use crate::walredo::WalRedoMetrics;

use crate::fds;
use crate::http::listener::HttpListener;

/// File in the workdir naming the addresses the daemon listens on (JSON).
pub const PORTS_FILE: &str = "ports.json";
/// How long page service connections get, once shutdown begins, to answer the requests they
/// have before they are closed regardless.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// File in the workdir locked while a daemon runs there.
pub const LOCK_FILE: &str = "pageserver.lock";

/// Runs the daemon until `shutdown` fires, then stops it cleanly.
///
/// Not cancel-safe: dropping it midway leaves tenants running and children unreaped. Cancel
/// `shutdown` instead and await the result.
pub async fn run(conf: PageServerConf, shutdown: CancellationToken) -> anyhow::Result<()> {
    std::fs::create_dir_all(&conf.workdir)
        .with_context(|| format!("create workdir {}", conf.workdir.display()))?;
    let _lock = lock_workdir(&conf)?;
    let fd_limit = fds::raise_limit();
    anyhow::ensure!(
        conf.tenants.walredo.binary.is_file(),
        "the walredo child {} does not exist (setting walredo_proc_path)",
        conf.tenants.walredo.binary.display()
    );

    let registry = prometheus::Registry::new();
    let walredo_metrics = Arc::new(WalRedoMetrics::new(&registry)?);
    let storage_metrics = Arc::new(storage::register_metrics(&registry)?);
    let page_service_metrics = Arc::new(PageServiceMetrics::new(&registry)?);
    let cache = Arc::new(PageCache::new(conf.page_cache_size, &registry)?);
    let tenants_metrics = Arc::new(TenantsMetrics::new(&registry)?);
    crate::process_metrics::register(&registry)?;
    crate::executor_metrics::register(&registry, tokio::runtime::Handle::current())?;
    let tenants_cancel = CancellationToken::new();
    let tenants = Arc::new(
        Tenants::load(
            &conf.workdir,
            &conf.tenants,
            cache,
            storage_metrics,
            walredo_metrics,
            tenants_metrics,
            tenants_cancel.clone(),
        )
        .await
        .context("load tenants")?,
    );
    registry.register(Box::new(TenantSeriesCollector::new(Arc::downgrade(&tenants))?))?;
    tenants.start_evictor();

    let pg_listener = tokio::net::TcpListener::bind(conf.listen_pg_addr)
        .await
        .with_context(|| format!("bind listen_pg_addr {}", conf.listen_pg_addr))?;
    let http_listener = tokio::net::TcpListener::bind(conf.listen_http_addr)
        .await
        .with_context(|| format!("bind listen_http_addr {}", conf.listen_http_addr))?;
    let (pg_addr, http_addr) = (pg_listener.local_addr()?, http_listener.local_addr()?);
    write_ports_file(&conf, pg_addr, http_addr).await;
    tracing::info!(
        workdir = %conf.workdir.display(),
        tenants = tenants.len(),
        walredo_process_kind = conf.tenants.walredo.process_kind.as_str(),
        "pageserver started"
    );
    tracing::info!("page service listening on {pg_addr}");
    tracing::info!("management API listening on http://{http_addr}");

    let connections_cancel = CancellationToken::new();
    let connections_abort = CancellationToken::new();
    let connections = TaskTracker::new();
    let page_service_conf = PageServiceConf {
        max_connections: page_service_connections(&conf.page_service, fd_limit),
        idle_timeout: conf.page_service.idle_timeout,
        abort: connections_abort.clone(),
        io: Arc::new(IoChoice::new(
            conf.page_service.io,
            start_rings(conf.page_service.io, &page_service_metrics),
            page_service_metrics.choice.clone(),
        )),
    };
    let page_service = tokio::spawn(page_service::serve(
        pg_listener,
        Arc::clone(&tenants),
        page_service_conf,
        page_service_metrics,
        connections_cancel.clone(),
        connections.clone(),
    ));
    let http_cancel = CancellationToken::new();
    let http_listener = HttpListener::new(http_listener);
    let http =
        tokio::spawn(crate::http::serve(http_listener, Arc::clone(&tenants), registry, http_cancel.clone()));

    shutdown.cancelled().await;
    tracing::info!("shutting down: no new connections, finishing requests in flight");
    connections_cancel.cancel();
    // Requests waiting for an LSN that may never come end now (shutting_down); the rest finish.
    tenants_cancel.cancel();
    page_service.await.context("page service task")?;
    connections.close();
    if tokio::time::timeout(SHUTDOWN_GRACE, connections.wait()).await.is_err() {
        tracing::warn!(
            "{} page service connections still open {SHUTDOWN_GRACE:?} into shutdown (clients not reading their replies): closing them",
            connections.len()
        );
        connections_abort.cancel();
        connections.wait().await;
    }
    http_cancel.cancel();
    match http.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!("management API stopped with an error: {e:#}"),
        Err(e) => tracing::warn!("management API task failed: {e}"),
    }
    tracing::info!("stopping tenants: making ingest durable, stopping redo processes");
    tenants.shutdown().await;
    tracing::info!("pageserver stopped");
    Ok(())
}

/// `max_connections`, lowered (with a WARN) when the descriptor limit leaves less room.
fn page_service_connections(settings: &PageServiceSettings, fd_limit: Option<u64>) -> usize {
    let (Some(limit), Some(open)) = (fd_limit, fds::open_now()) else { return settings.max_connections };
    let connections = fds::page_service_connections(settings.max_connections, limit, open);
    if connections < settings.max_connections {
        tracing::warn!(
            max_connections = settings.max_connections,
            fd_limit = limit,
            fds_open = open,
            fds_reserved = fds::reserve(limit),
            http_connections = fds::HTTP_MAX_CONNECTIONS,
            "page service connections capped at {connections}: the file descriptor limit leaves no room for more"
        );
    }
    connections
}

/// Takes an exclusive lock on the workdir, so that two daemons never share one.
fn lock_workdir(conf: &PageServerConf) -> anyhow::Result<nix::fcntl::Flock<std::fs::File>> {
    let path = conf.workdir.join(LOCK_FILE);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("open {}", path.display()))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(|(_, errno)| {
        anyhow::anyhow!("another pageserver is running in {} ({errno})", conf.workdir.display())
    })
}

/// Writes `ports.json`, best-effort: the daemon serves even when it cannot (a full disk must not
/// stop it from serving reads). On failure it logs a WARN (the addresses are in the log lines
/// that follow) and removes any `ports.json` of an earlier run, so that no stale addresses are
/// read; removing needs no space.
async fn write_ports_file(conf: &PageServerConf, pg: SocketAddr, http: SocketAddr) {
    let text = serde_json::json!({ "pg": pg.to_string(), "http": http.to_string() }).to_string();
    let workdir = conf.workdir.clone();
    let written = tokio::task::spawn_blocking(move || {
        storage::durable_write(&workdir, PORTS_FILE, text.as_bytes()).inspect_err(|_| {
            for stale in [PORTS_FILE.to_string(), format!(".{PORTS_FILE}.tmp")] {
                let _ = std::fs::remove_file(workdir.join(stale));
            }
        })
    })
    .await;
    match written {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!("failed to write {PORTS_FILE}, serving without it: {e:#}"),
        Err(e) => tracing::warn!("failed to write {PORTS_FILE}, serving without it: {e}"),
    }
}

/// The io_uring writer of the page service, if `io` may use it and the kernel allows a
/// ring; logs which way replies are written.
fn start_rings(io: PageServiceIo, metrics: &Arc<PageServiceMetrics>) -> Option<uring::Rings> {
    if io == PageServiceIo::Epoll {
        tracing::info!(page_service_io = io.as_str(), "page service replies: writev per connection");
        return None;
    }
    let started = uring::probe().map(|support| (uring::Rings::new(support, Arc::clone(metrics)), support));
    let (rings, support) = match started {
        Ok(started) => started,
        Err(e) => {
            tracing::warn!(
                page_service_io = io.as_str(),
                "io_uring is not available ({e:#}): page service replies fall back to writev per connection"
            );
            return None;
        }
    };
    let zero_copy = if support.zero_copy {
        format!(
            "batches of {} bytes and more to remote peers go zero-copy if a probe shows it works",
            uring::ZERO_COPY_MIN
        )
    } else {
        "no zero-copy sends (the kernel lacks SENDMSG_ZC or IORING_SEND_ZC_REPORT_USAGE)".to_string()
    };
    if io == PageServiceIo::Auto {
        tracing::info!(
            page_service_io = io.as_str(),
            io_uring_sync_cancel = support.sync_cancel,
            "page service replies: writev per connection, and io_uring (a ring per executor \
             thread) while it measures better when {} or more connections write; {zero_copy}",
            io_choice::PROBE_FROM,
        );
    } else {
        tracing::info!(
            page_service_io = io.as_str(),
            io_uring_sync_cancel = support.sync_cancel,
            "page service replies: io_uring, a ring per executor thread; {zero_copy}"
        );
    }
    Some(rings)
}
