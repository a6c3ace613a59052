//! The page service: the TCP data path (docs/page-service-protocol.md).
//!
//! - [`proto`]: frames and messages (pure);
//! - [`client`]: an async client (pagebench, tests);
//! - this file: the server. Per connection, a reader task decodes requests and starts each
//!   one as a task of its own, and a writer task writes the replies in request order,
//!   gathering the replies that are ready into one vectored write (page bytes are written
//!   from the shared `Bytes`, never copied into a send buffer).
//!
//! Invariants:
//! - replies leave in the order the requests came, whatever order they finish in;
//! - ingest batches of one connection reach storage in the order sent (they are queued by the
//!   reader itself before the next frame is read);
//! - every bound is explicit: connections (`max_connections`), requests in flight per
//!   connection ([`MAX_IN_FLIGHT`]), frame size ([`proto::MAX_FRAME_LEN`]), replies per write;
//! - a bad frame gets an error reply and closes its own connection, nothing else.

pub mod client;
pub mod proto;

use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use prometheus::{Histogram, HistogramOpts, IntCounterVec, IntGauge, Opts, Registry};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::storage::{IngestError, WaitLsnError};
use crate::tenant::{GetPageError, Tenant};
use crate::tenants::Tenants;
use crate::walredo::RedoError;
use proto::{ClientMessage, DecodeError, ErrorCode, ServerMessage, PROTOCOL_VERSION};

/// Requests a connection may have in flight; the reader stops reading beyond that.
pub const MAX_IN_FLIGHT: usize = 256;
/// Most replies gathered into one write.
const MAX_REPLIES_PER_WRITE: usize = 64;
/// How long a new connection may take to send its Hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);

pub struct PageServiceMetrics {
    connections: IntGauge,
    requests: IntCounterVec,
    errors: IntCounterVec,
    get_page_seconds: Histogram,
    replies_per_write: Histogram,
}

impl PageServiceMetrics {
    pub fn new(registry: &Registry) -> anyhow::Result<PageServiceMetrics> {
        let connections =
            IntGauge::new("pageserver_page_service_connections", "Open page service connections")?;
        let requests = IntCounterVec::new(
            Opts::new("pageserver_page_service_requests_total", "Page service requests by type"),
            &["type"],
        )?;
        let errors = IntCounterVec::new(
            Opts::new("pageserver_page_service_errors_total", "Page service error replies by code"),
            &["code"],
        )?;
        let get_page_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "pageserver_page_service_get_page_seconds",
                "GetPage time, request read to reply ready",
            )
            .buckets(prometheus::exponential_buckets(5e-6, 2.0, 22)?),
        )?;
        let replies_per_write = Histogram::with_opts(
            HistogramOpts::new(
                "pageserver_page_service_replies_per_write",
                "Replies gathered into one socket write",
            )
            .buckets(prometheus::exponential_buckets(1.0, 2.0, 7)?),
        )?;
        registry.register(Box::new(connections.clone()))?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(errors.clone()))?;
        registry.register(Box::new(get_page_seconds.clone()))?;
        registry.register(Box::new(replies_per_write.clone()))?;
        Ok(PageServiceMetrics { connections, requests, errors, get_page_seconds, replies_per_write })
    }
}

/// Accepts connections until `cancel`; each runs on `tracker`. Connections stop reading when
/// `cancel` fires and finish the requests they have.
pub async fn serve(
    listener: TcpListener,
    tenants: Arc<Tenants>,
    max_connections: usize,
    metrics: Arc<PageServiceMetrics>,
    cancel: CancellationToken,
    tracker: TaskTracker,
) {
    let slots = Arc::new(Semaphore::new(max_connections));
    let mut next_id: u64 = 0;
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of fds and the like: back off briefly instead of spinning.
                tracing::warn!("failed to accept a page service connection: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        next_id += 1;
        let span = tracing::info_span!("connection", conn_id = next_id, %peer);
        let _ = stream.set_nodelay(true);
        match Arc::clone(&slots).try_acquire_owned() {
            Ok(slot) => {
                let (tenants, metrics, cancel) = (Arc::clone(&tenants), Arc::clone(&metrics), cancel.clone());
                tracker.spawn(
                    async move {
                        metrics.connections.inc();
                        if let Err(e) = handle_connection(stream, &tenants, &metrics, cancel).await {
                            tracing::debug!("connection ended: {e:#}");
                        }
                        metrics.connections.dec();
                        drop(slot);
                    }
                    .instrument(span),
                );
            }
            Err(_) => {
                metrics.errors.with_label_values(&[ErrorCode::TooManyConnections.name()]).inc();
                tracker.spawn(
                    async move {
                        tracing::warn!(max_connections, "refusing a connection: too many connections");
                        let message = format!("the daemon serves at most {max_connections} connections");
                        let _ = send_error_and_close(stream, ErrorCode::TooManyConnections, message).await;
                    }
                    .instrument(span),
                );
            }
        }
    }
}

async fn send_error_and_close(
    mut stream: TcpStream,
    code: ErrorCode,
    message: String,
) -> std::io::Result<()> {
    let mut out = BytesMut::new();
    ServerMessage::Error { request_id: 0, code, message }.encode(&mut out);
    stream.write_all(&out).await?;
    stream.shutdown().await
}

/// A reply on its way to the writer.
enum Pending {
    Ready(Reply),
    Task(JoinHandle<Reply>),
}

/// The bytes of one reply frame, and whether the connection closes after it.
struct Reply {
    chunks: Vec<Bytes>,
    close: bool,
}

impl Reply {
    fn message(message: &ServerMessage) -> Reply {
        let mut out = BytesMut::new();
        message.encode(&mut out);
        Reply { chunks: vec![out.freeze()], close: false }
    }

    fn error(metrics: &PageServiceMetrics, request_id: u64, code: ErrorCode, message: String) -> Reply {
        metrics.errors.with_label_values(&[code.name()]).inc();
        let mut reply = Reply::message(&ServerMessage::Error { request_id, code, message });
        reply.close = code.closes_connection();
        reply
    }

    fn page(request_id: u64, lsn: u64, page: Bytes) -> Reply {
        let mut header = BytesMut::with_capacity(proto::PAGE_REPLY_HEADER_LEN);
        proto::encode_page_header(&mut header, request_id, lsn, page.len());
        Reply { chunks: vec![header.freeze(), page], close: false }
    }
}

async fn handle_connection(
    stream: TcpStream,
    tenants: &Tenants,
    metrics: &Arc<PageServiceMetrics>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let (mut reader, writer) = stream.into_split();
    let (replies, queue) = mpsc::channel::<Pending>(MAX_IN_FLIGHT);
    let writer = tokio::spawn(write_replies(writer, queue, Arc::clone(metrics)).in_current_span());
    let mut buf = BytesMut::with_capacity(64 * 1024);

    let tenant = match hello(&mut reader, &mut buf, tenants, metrics, &cancel).await {
        Ok(tenant) => {
            let ok = ServerMessage::HelloOk {
                version: PROTOCOL_VERSION,
                last_durable_lsn: tenant.last_durable_lsn(),
            };
            let _ = replies.send(Pending::Ready(Reply::message(&ok))).await;
            Some(tenant)
        }
        Err(reply) => {
            let _ = replies.send(Pending::Ready(reply)).await;
            None
        }
    };
    if let Some(tenant) = tenant {
        let span = tracing::info_span!("tenant", tenant_id = tenant.id);
        read_requests(&mut reader, &mut buf, &tenant, metrics, &cancel, &replies).instrument(span).await;
    }
    drop(replies);
    writer.await.map_err(|e| anyhow::anyhow!("writer task failed: {e}"))?
}

/// Reads and checks the Hello; an `Err` is the reply that refuses the connection.
async fn hello(
    reader: &mut OwnedReadHalf,
    buf: &mut BytesMut,
    tenants: &Tenants,
    metrics: &PageServiceMetrics,
    cancel: &CancellationToken,
) -> Result<Arc<Tenant>, Reply> {
    let refuse = |code, message: String| Reply::error(metrics, 0, code, message);
    let frame = tokio::select! {
        () = cancel.cancelled() => return Err(refuse(ErrorCode::ShuttingDown, "the daemon is shutting down".into())),
        frame = tokio::time::timeout(HELLO_TIMEOUT, read_frame(reader, buf)) => frame,
    };
    let frame = match frame {
        Err(_) => return Err(refuse(ErrorCode::BadFrame, format!("no Hello within {HELLO_TIMEOUT:?}"))),
        Ok(Err(e)) => return Err(refuse(e.code(), e.to_string())),
        Ok(Ok(None)) => return Err(Reply { chunks: Vec::new(), close: true }),
        Ok(Ok(Some(frame))) => frame,
    };
    match proto::decode_client(frame) {
        Ok(ClientMessage::Hello { version, tenant_id }) => {
            if version != PROTOCOL_VERSION {
                return Err(refuse(
                    ErrorCode::UnsupportedVersion,
                    format!(
                        "protocol version {version} is not supported, this daemon speaks {PROTOCOL_VERSION}"
                    ),
                ));
            }
            tenants
                .get(&tenant_id)
                .ok_or_else(|| refuse(ErrorCode::NoSuchTenant, format!("no tenant {tenant_id}")))
        }
        Ok(_) => Err(refuse(ErrorCode::BadFrame, "the first message must be Hello".into())),
        Err(e) => Err(refuse(e.code(), e.to_string())),
    }
}

/// Reads requests until EOF, a bad frame, or shutdown; starts each and queues its reply.
async fn read_requests(
    reader: &mut OwnedReadHalf,
    buf: &mut BytesMut,
    tenant: &Arc<Tenant>,
    metrics: &Arc<PageServiceMetrics>,
    cancel: &CancellationToken,
    replies: &mpsc::Sender<Pending>,
) {
    loop {
        let frame = tokio::select! {
            () = cancel.cancelled() => Err(Reply::error(metrics, 0, ErrorCode::ShuttingDown, "the daemon is shutting down".into())),
            () = tenant.cancel.cancelled() => Err(Reply::error(metrics, 0, ErrorCode::ShuttingDown, "the tenant is shutting down".into())),
            frame = read_frame(reader, buf) => match frame {
                Ok(Some(frame)) => Ok(frame),
                Ok(None) => return,
                Err(e) => Err(Reply::error(metrics, 0, e.code(), e.to_string())),
            },
        };
        let pending = match frame.map(proto::decode_client) {
            Err(reply) => Pending::Ready(reply),
            Ok(Err(e)) => Pending::Ready(Reply::error(metrics, 0, e.code(), e.to_string())),
            Ok(Ok(ClientMessage::Hello { .. })) => Pending::Ready(Reply::error(
                metrics,
                0,
                ErrorCode::BadFrame,
                "Hello may come only once".into(),
            )),
            Ok(Ok(ClientMessage::GetPage { request_id, key, lsn })) => {
                metrics.requests.with_label_values(&["get_page"]).inc();
                let (tenant, metrics) = (Arc::clone(tenant), Arc::clone(metrics));
                Pending::Task(tokio::spawn(
                    async move {
                        let started = Instant::now();
                        let reply = match tenant.get_page(key, lsn).await {
                            Ok((lsn, page)) => Reply::page(request_id, lsn, page),
                            Err(e) => {
                                let code = get_page_error_code(&e);
                                Reply::error(&metrics, request_id, code, format!("{e:#}"))
                            }
                        };
                        metrics.get_page_seconds.observe(started.elapsed().as_secs_f64());
                        reply
                    }
                    .in_current_span(),
                ))
            }
            Ok(Ok(ClientMessage::Ingest { request_id, values })) => {
                metrics.requests.with_label_values(&["ingest"]).inc();
                // Queue it here, before reading on, so the batches of a connection keep their order.
                match tenant.submit_ingest(values).await {
                    Ok(durable) => {
                        let metrics = Arc::clone(metrics);
                        Pending::Task(tokio::spawn(async move {
                            match durable.await {
                                Ok(lsn) => {
                                    Reply::message(&ServerMessage::IngestOk { request_id, durable_lsn: lsn })
                                }
                                Err(e) => Reply::error(
                                    &metrics,
                                    request_id,
                                    ingest_error_code(&e),
                                    format!("{e:#}"),
                                ),
                            }
                        }))
                    }
                    Err(e) => Pending::Ready(Reply::error(
                        metrics,
                        request_id,
                        ingest_error_code(&e),
                        format!("{e:#}"),
                    )),
                }
            }
        };
        let closes = matches!(&pending, Pending::Ready(reply) if reply.close);
        if replies.send(pending).await.is_err() || closes {
            return;
        }
    }
}

fn get_page_error_code(e: &GetPageError) -> ErrorCode {
    match e {
        GetPageError::NotFound { .. } => ErrorCode::NotFound,
        GetPageError::WaitLsn(WaitLsnError::Timeout { .. }) => ErrorCode::LsnTimeout,
        GetPageError::WaitLsn(WaitLsnError::ShuttingDown { .. }) | GetPageError::ShuttingDown => {
            ErrorCode::ShuttingDown
        }
        GetPageError::Redo(RedoError::ShuttingDown) => ErrorCode::ShuttingDown,
        GetPageError::Redo(
            RedoError::Rejected { .. }
            | RedoError::Timeout(_)
            | RedoError::QueueTimeout(_)
            | RedoError::InvalidRequest(_),
        ) => {
            tracing::warn!("failed to reconstruct a page: {e:#}");
            ErrorCode::RedoFailed
        }
        GetPageError::Redo(RedoError::ProcessFailed(_)) | GetPageError::Internal(_) => {
            tracing::error!("failed to get a page: {e:#}");
            ErrorCode::Internal
        }
    }
}

fn ingest_error_code(e: &IngestError) -> ErrorCode {
    match e {
        IngestError::Invalid(_) | IngestError::LsnWentBackwards { .. } => ErrorCode::InvalidRequest,
        IngestError::ShuttingDown => ErrorCode::ShuttingDown,
        IngestError::Io(_) => {
            tracing::error!("failed to ingest: {e:#}");
            ErrorCode::Internal
        }
    }
}

/// Reads one whole frame: `Ok(None)` at EOF between frames. Cancel-safe: bytes read stay in
/// `buf` for the next call.
async fn read_frame(reader: &mut OwnedReadHalf, buf: &mut BytesMut) -> Result<Option<Bytes>, DecodeError> {
    loop {
        if let Some(len) = proto::frame_len(buf)? {
            return Ok(Some(buf.split_to(len).freeze()));
        }
        // Room for the whole frame once its length is known (bounded by MAX_FRAME_LEN).
        if buf.len() >= 4 {
            let want = 4 + u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
            buf.reserve(want.saturating_sub(buf.len()));
        } else {
            buf.reserve(64 * 1024);
        }
        match reader.read_buf(buf).await {
            Ok(0) if buf.is_empty() => return Ok(None),
            Ok(0) => {
                return Err(DecodeError::Malformed(format!(
                    "connection closed inside a frame ({} bytes of it)",
                    buf.len()
                )))
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!("read failed: {e}");
                return Ok(None);
            }
        }
    }
}

/// Writes replies in order, gathering those already done into one vectored write.
async fn write_replies(
    mut writer: OwnedWriteHalf,
    mut queue: mpsc::Receiver<Pending>,
    metrics: Arc<PageServiceMetrics>,
) -> anyhow::Result<()> {
    let mut waiting: VecDeque<Pending> = VecDeque::new();
    let mut chunks: Vec<Bytes> = Vec::new();
    loop {
        if waiting.is_empty() {
            match queue.recv().await {
                Some(pending) => waiting.push_back(pending),
                None => break,
            }
        }
        while let Ok(pending) = queue.try_recv() {
            waiting.push_back(pending);
        }
        // The oldest reply goes first, whenever it is done; then whatever is done behind it.
        let mut close = false;
        let mut replies = 0;
        while let Some(front) = waiting.front() {
            let ready = match front {
                Pending::Ready(_) => true,
                Pending::Task(task) => task.is_finished(),
            };
            if replies > 0 && (!ready || replies >= MAX_REPLIES_PER_WRITE) {
                break;
            }
            let reply = match waiting.pop_front() {
                Some(Pending::Ready(reply)) => reply,
                Some(Pending::Task(task)) => {
                    task.await.map_err(|e| anyhow::anyhow!("request task failed: {e}"))?
                }
                None => break,
            };
            replies += 1;
            chunks.extend(reply.chunks);
            if reply.close {
                close = true;
                break;
            }
        }
        metrics.replies_per_write.observe(replies as f64);
        write_all_vectored(&mut writer, &mut chunks).await?;
        if close {
            let _ = writer.shutdown().await;
            return Ok(());
        }
    }
    let _ = writer.shutdown().await;
    Ok(())
}

/// Writes every chunk, resuming mid-chunk after a partial write.
async fn write_all_vectored(writer: &mut OwnedWriteHalf, chunks: &mut Vec<Bytes>) -> std::io::Result<()> {
    let mut start = 0;
    while start < chunks.len() {
        let slices: Vec<IoSlice<'_>> = chunks[start..].iter().map(|c| IoSlice::new(c)).collect();
        let mut written = writer.write_vectored(&slices).await?;
        if written == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while written > 0 && start < chunks.len() {
            let chunk = &mut chunks[start];
            let n = written.min(chunk.len());
            chunk.advance(n);
            written -= n;
            if chunk.is_empty() {
                start += 1;
            }
        }
    }
    chunks.clear();
    Ok(())
}
