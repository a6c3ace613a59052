//! One page service connection: a reader that decodes requests, starts each as a task of its
//! own and queues its reply, and a writer ([`super::writer`]) that sends the replies in
//! request order. Here: the wire <-> domain conversions (frames to tenant calls, errors to
//! codes).
//!
//! Invariants: replies leave in request order; the ingest batches of a connection reach
//! storage in the order sent (the reader queues each before reading the next frame); a bad
//! frame gets an error reply and closes its own connection only.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::io_choice::IoChoice;
use super::proto::{self, ClientMessage, DecodeError, ErrorCode, ServerMessage, PROTOCOL_VERSION};
use super::writer::{write_replies, Pending, Queued, Reply, Writer};
use super::{PageServiceMetrics, HELLO_TIMEOUT, MAX_IN_FLIGHT};
use crate::storage::{IngestError, Lsn, WaitLsnError};
use crate::tenant::{GetPageError, Tenant};
use crate::tenants::{TenantError, Tenants};
use crate::walredo::RedoError;

/// Sends an Error without waiting (it fits in an empty socket buffer; if not, it is lost);
/// the caller then drops the stream, which closes it.
pub(super) fn refuse_now(stream: &TcpStream, code: ErrorCode, message: String) {
    let mut out = BytesMut::new();
    ServerMessage::Error { request_id: 0, code, message }.encode(&mut out);
    let _ = stream.try_write(&out);
}

/// Settings of a connection.
#[derive(Clone)]
pub(crate) struct ConnectionConf {
    /// A connection with nothing in flight that sends nothing this long is closed; a client
    /// that accepts no reply bytes this long is disconnected.
    pub idle_timeout: Duration,
    /// Which writer sends each batch.
    pub io: Arc<IoChoice>,
}

/// Serves one connection until the client leaves, a bad frame, a timeout, or shutdown.
///
/// `connection_slot` (of `max_connections`) is freed once nothing holds the socket any more:
/// when this returns, or later, once an io_uring writer is done with the batches it was handed
/// (a client that does not read keeps them there up to the write timeout), so that the
/// daemon's sockets stay within `max_connections`.
///
/// `stop` (shutdown begins): the reader stops and the requests in flight are answered. `abort`
/// (shutdown's grace is over): the connection is dropped at once, whatever it was writing.
///
/// Cancel-safe in that sense: dropping it closes the connection; requests already started
/// finish on their own tasks and their replies are dropped.
pub(crate) async fn handle_connection(
    stream: TcpStream,
    connection_slot: OwnedSemaphorePermit,
    tenants: &Tenants,
    metrics: &Arc<PageServiceMetrics>,
    conf: ConnectionConf,
    stop: CancellationToken,
    abort: CancellationToken,
) -> anyhow::Result<()> {
    // Shared by the reader and the writer (and, while a batch is with it, an io_uring writer
    // thread, which so keeps the descriptor open until its operations on it are over).
    let stream = Arc::new(stream);
    let writer =
        Writer::new(Arc::clone(&stream), Arc::new(connection_slot), Arc::clone(&conf.io), conf.idle_timeout);
    // Every request holds a slot from the frame's read until its reply is written: the reader
    // waits for a free slot before it reads on, so a connection never has more in flight.
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let (replies, queue) = mpsc::channel::<Queued>(MAX_IN_FLIGHT);
    let writer_gone = CancellationToken::new();
    let write = async {
        let written = write_replies(writer, queue, metrics, conf.idle_timeout).await;
        writer_gone.cancel();
        written
    };
    let read = async {
        // Owned here, so that the writer sees the end of the queue when the reader is done.
        let replies = replies;
        // Small until Hello: a connection that never says it costs little.
        let mut buf = BytesMut::with_capacity(proto::MAX_HELLO_FRAME_LEN as usize + 4);
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else { return };
        let tenant = match hello(&stream, &mut buf, tenants, metrics, &stop).await {
            Ok(tenant) => {
                let ok = ServerMessage::HelloOk {
                    version: PROTOCOL_VERSION,
                    last_durable_lsn: tenant.last_durable_lsn(),
                };
                let _ = replies.send(Queued { pending: Pending::Ready(Reply::message(&ok)), slot }).await;
                tenant
            }
            Err(reply) => {
                let _ = replies.send(Queued { pending: Pending::Ready(reply), slot }).await;
                return;
            }
        };
        let span = tracing::info_span!("tenant", tenant_id = tenant.id);
        let connection =
            Connection { tenant: &tenant, metrics, stop: &stop, writer_gone: &writer_gone, conf: &conf };
        connection.read_requests(&stream, &mut buf, &slots, &replies).instrument(span).await;
    };
    let both = async {
        let ((), written) = tokio::join!(read, write);
        written
    };
    tokio::select! {
        written = both => written,
        () = abort.cancelled() => Err(anyhow::anyhow!("closed at shutdown before its replies were written")),
    }
}

/// Reads and checks the Hello; an `Err` is the reply that refuses the connection.
async fn hello(
    reader: &TcpStream,
    buf: &mut BytesMut,
    tenants: &Tenants,
    metrics: &PageServiceMetrics,
    cancel: &CancellationToken,
) -> Result<Arc<Tenant>, Reply> {
    let refuse = |code, message: String| Reply::error(metrics, 0, code, message);
    let frame = tokio::select! {
        () = cancel.cancelled() => return Err(refuse(ErrorCode::ShuttingDown, "the daemon is shutting down".into())),
        frame = tokio::time::timeout(HELLO_TIMEOUT, read_frame(reader, buf, proto::MAX_HELLO_FRAME_LEN)) => frame,
    };
    let frame = match frame {
        Err(_) => return Err(refuse(ErrorCode::BadFrame, format!("no Hello within {HELLO_TIMEOUT:?}"))),
        Ok(Err(e)) => return Err(refuse(e.code(), e.to_string())),
        Ok(Ok(None)) => return Err(Reply::close()),
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
            tenants.get(&tenant_id).map_err(|e| match e {
                TenantError::NotFound(_) => refuse(ErrorCode::NoSuchTenant, format!("no tenant {tenant_id}")),
                TenantError::Broken { .. } => refuse(ErrorCode::TenantBroken, e.to_string()),
                other => refuse(ErrorCode::Internal, other.to_string()),
            })
        }
        Ok(_) => Err(refuse(ErrorCode::BadFrame, "the first message must be Hello".into())),
        Err(e) => Err(refuse(e.code(), e.to_string())),
    }
}

/// What the request loop of a connection works with.
struct Connection<'a> {
    tenant: &'a Arc<Tenant>,
    metrics: &'a Arc<PageServiceMetrics>,
    stop: &'a CancellationToken,
    writer_gone: &'a CancellationToken,
    conf: &'a ConnectionConf,
}

impl Connection<'_> {
    /// Reads requests until EOF, a bad frame, idleness, shutdown, or the writer's end; starts
    /// each and queues its reply. Waits for a free in-flight slot before reading each frame.
    async fn read_requests(
        &self,
        reader: &TcpStream,
        buf: &mut BytesMut,
        slots: &Arc<Semaphore>,
        replies: &mpsc::Sender<Queued>,
    ) {
        let (tenant, metrics) = (self.tenant, self.metrics);
        loop {
            // A whole frame already read and a slot free: taken without waiting (a pipelining
            // client sends several per read), so without the selects below.
            if let Some((slot, frame)) = self.buffered_frame(buf, slots) {
                let pending = self.dispatch(Ok(frame)).await;
                if !queue(replies, pending, slot).await {
                    return;
                }
                continue;
            }
            // Biased: once the writer is gone or shutdown began, no further frame is read.
            let slot = tokio::select! {
                biased;
                () = self.writer_gone.cancelled() => return,
                slot = Arc::clone(slots).acquire_owned() => match slot {
                    Ok(slot) => slot,
                    Err(_) => return,
                },
                () = self.stop.cancelled() => return,
            };
            let frame = tokio::select! {
                biased;
                () = self.writer_gone.cancelled() => return,
                () = self.stop.cancelled() => Err(Reply::error(metrics, 0, ErrorCode::ShuttingDown, "the daemon is shutting down".into())),
                () = tenant.cancel.cancelled() => Err(Reply::error(metrics, 0, ErrorCode::ShuttingDown, "the tenant is shutting down".into())),
                frame = self.read_request_frame(reader, buf, slots) => match frame {
                    FrameRead::Frame(frame) => Ok(frame),
                    FrameRead::Eof => return,
                    FrameRead::Idle => Err(Reply::error(metrics, 0, ErrorCode::IdleTimeout, format!(
                        "no request for {:?} with none in flight (page_service_idle_timeout)",
                        self.conf.idle_timeout
                    ))),
                    FrameRead::Bad(e) => Err(Reply::error(metrics, 0, e.code(), e.to_string())),
                },
            };
            let pending = self.dispatch(frame).await;
            if !queue(replies, pending, slot).await {
                return;
            }
        }
    }

    /// Starts a request (or takes the reply for a frame that was no request) and returns its
    /// reply on its way.
    async fn dispatch(&self, frame: Result<Bytes, Reply>) -> Pending {
        let (tenant, metrics) = (self.tenant, self.metrics);
        match frame.map(proto::decode_client) {
            Err(reply) => Pending::Ready(reply),
            Ok(Err(e)) => Pending::Ready(Reply::error(metrics, 0, e.code(), e.to_string())),
            Ok(Ok(ClientMessage::Hello { .. })) => Pending::Ready(Reply::error(
                metrics,
                0,
                ErrorCode::BadFrame,
                "Hello may come only once".into(),
            )),
            Ok(Ok(ClientMessage::GetPage { request_id, key, lsn })) => {
                metrics.get_page_requests.inc();
                let started = Instant::now();
                // A page cache hit is answered here, without a task of its own.
                if let Some((lsn, page)) = tenant.get_page_now(key, Lsn(lsn)) {
                    let reply = Reply::page(request_id, lsn.0, page);
                    metrics.get_page_seconds.observe(started.elapsed().as_secs_f64());
                    Pending::Ready(reply)
                } else {
                    let (tenant, metrics) = (Arc::clone(tenant), Arc::clone(metrics));
                    Pending::Task(tokio::spawn(
                        async move {
                            let reply = match tenant.get_page(key, Lsn(lsn)).await {
                                Ok((lsn, page)) => Reply::page(request_id, lsn.0, page),
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
            }
            Ok(Ok(ClientMessage::GetRelSize { request_id, rel, fork, lsn })) => {
                rel_request(tenant, metrics, request_id, true, move |tenant| async move {
                    tenant.get_rel_size(rel, fork, Lsn(lsn)).await
                })
            }
            Ok(Ok(ClientMessage::GetRelExists { request_id, rel, fork, lsn })) => {
                rel_request(tenant, metrics, request_id, false, move |tenant| async move {
                    tenant.get_rel_size(rel, fork, Lsn(lsn)).await
                })
            }
            Ok(Ok(ClientMessage::Ingest { request_id, values })) => {
                metrics.ingest_requests.inc();
                match proto::reserved_lsn(&values) {
                    Some((i, why)) => Pending::Ready(Reply::error(
                        metrics,
                        request_id,
                        ErrorCode::InvalidRequest,
                        format!("invalid ingest batch: value {i}: {why}"),
                    )),
                    // Queued here, before reading on, so the batches of a connection keep their order.
                    None => start_ingest(tenant, metrics, request_id, values).await,
                }
            }
        }
    }

    /// A whole frame already in `buf`, with a free slot for it, when nothing asks the reader to
    /// stop; `None` sends the reader the slow way (waiting, and every stop condition looked at).
    fn buffered_frame(
        &self,
        buf: &mut BytesMut,
        slots: &Arc<Semaphore>,
    ) -> Option<(OwnedSemaphorePermit, Bytes)> {
        if self.writer_gone.is_cancelled() || self.stop.is_cancelled() || self.tenant.cancel.is_cancelled() {
            return None;
        }
        let len = proto::frame_len_max(buf, proto::MAX_FRAME_LEN).ok()??;
        let slot = Arc::clone(slots).try_acquire_owned().ok()?;
        Some((slot, buf.split_to(len).freeze()))
    }

    /// Reads the next request frame; idle when the client sent nothing for the idle timeout
    /// while none of its requests is in flight (the caller holds one slot for this frame).
    /// Cancel-safe, as [`read_frame`].
    async fn read_request_frame(
        &self,
        reader: &TcpStream,
        buf: &mut BytesMut,
        slots: &Semaphore,
    ) -> FrameRead {
        loop {
            match tokio::time::timeout(self.conf.idle_timeout, read_frame(reader, buf, proto::MAX_FRAME_LEN))
                .await
            {
                Ok(Ok(Some(frame))) => return FrameRead::Frame(frame),
                Ok(Ok(None)) => return FrameRead::Eof,
                Ok(Err(e)) => return FrameRead::Bad(e),
                Err(_) if slots.available_permits() + 1 >= MAX_IN_FLIGHT => return FrameRead::Idle,
                Err(_) => {}
            }
        }
    }
}

/// Queues a reply for the writer; whether the reader goes on (not after a closing reply, nor
/// once the writer is gone).
async fn queue(replies: &mpsc::Sender<Queued>, pending: Pending, slot: OwnedSemaphorePermit) -> bool {
    let closes = matches!(&pending, Pending::Ready(reply) if reply.close);
    replies.send(Queued { pending, slot }).await.is_ok() && !closes
}

/// The outcome of reading a request frame.
enum FrameRead {
    Frame(Bytes),
    Eof,
    Idle,
    Bad(DecodeError),
}

/// Queues an Ingest batch; the reply comes once it is durable (or failed).
async fn start_ingest(
    tenant: &Tenant,
    metrics: &Arc<PageServiceMetrics>,
    request_id: u64,
    values: Vec<proto::IngestValue>,
) -> Pending {
    match tenant.submit_ingest(proto::to_batch(values)).await {
        Ok(durable) => {
            let metrics = Arc::clone(metrics);
            Pending::Task(tokio::spawn(async move {
                match durable.await {
                    Ok(lsn) => Reply::message(&ServerMessage::IngestOk { request_id, durable_lsn: lsn.0 }),
                    Err(e) => Reply::error(&metrics, request_id, ingest_error_code(&e), format!("{e:#}")),
                }
            }))
        }
        Err(e) => Pending::Ready(Reply::error(metrics, request_id, ingest_error_code(&e), format!("{e:#}"))),
    }
}

/// A GetRelSize (`size`) or GetRelExists, answered by its own task: a relation that does not
/// exist is `not_found` for GetRelSize and `false` for GetRelExists.
fn rel_request<F, Fut>(
    tenant: &Arc<Tenant>,
    metrics: &Arc<PageServiceMetrics>,
    request_id: u64,
    size: bool,
    read: F,
) -> Pending
where
    F: FnOnce(Arc<Tenant>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(Lsn, Option<u32>), GetPageError>> + Send,
{
    metrics.rel_requests.inc();
    let (tenant, metrics) = (Arc::clone(tenant), Arc::clone(metrics));
    Pending::Task(tokio::spawn(
        async move {
            match read(tenant).await {
                Ok((lsn, blocks)) if !size => Reply::message(&ServerMessage::RelExists {
                    request_id,
                    lsn: lsn.0,
                    exists: blocks.is_some(),
                }),
                Ok((lsn, Some(blocks))) => {
                    Reply::message(&ServerMessage::RelSize { request_id, lsn: lsn.0, blocks })
                }
                Ok((lsn, None)) => Reply::error(
                    &metrics,
                    request_id,
                    ErrorCode::NotFound,
                    format!("the relation fork does not exist at LSN {lsn}"),
                ),
                Err(e) => Reply::error(&metrics, request_id, get_page_error_code(&e), format!("{e:#}")),
            }
        }
        .in_current_span(),
    ))
}

fn get_page_error_code(e: &GetPageError) -> ErrorCode {
    match e {
        GetPageError::InvalidKey(_) => ErrorCode::InvalidRequest,
        GetPageError::NotFound { .. } => ErrorCode::NotFound,
        GetPageError::BelowGcCutoff { .. } => ErrorCode::BelowGcCutoff,
        GetPageError::WaitLsn(WaitLsnError::Timeout { .. }) => ErrorCode::LsnTimeout,
        GetPageError::WaitLsn(WaitLsnError::StorageUnavailable { .. }) => ErrorCode::StorageUnavailable,
        GetPageError::WaitLsn(WaitLsnError::ShuttingDown { .. }) | GetPageError::ShuttingDown => {
            ErrorCode::ShuttingDown
        }
        GetPageError::Redo(RedoError::ShuttingDown) => ErrorCode::ShuttingDown,
        GetPageError::Overloaded { .. } | GetPageError::Redo(RedoError::QueueTimeout(_)) => {
            tracing::warn!("failed to get a page: {e:#}");
            ErrorCode::Overloaded
        }
        GetPageError::Redo(RedoError::Rejected {
            code: walredo_proc::protocol::ErrorCode::UnsupportedRecord,
            ..
        }) => {
            // Expected until the child redoes that record type; the counter says how often.
            tracing::debug!("failed to reconstruct a page: {e:#}");
            ErrorCode::UnsupportedRecord
        }
        GetPageError::Redo(
            RedoError::Rejected { .. } | RedoError::Timeout(_) | RedoError::InvalidRequest(_),
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
        IngestError::StorageUnavailable { .. } => ErrorCode::StorageUnavailable,
        IngestError::Io(_) => {
            tracing::error!("failed to ingest: {e:#}");
            ErrorCode::Internal
        }
    }
}

/// Reads one whole frame of at most `max_len` (before Hello, [`proto::MAX_HELLO_FRAME_LEN`]):
/// `Ok(None)` at EOF between frames. Cancel-safe: bytes read stay in `buf` for the next call.
async fn read_frame(
    reader: &TcpStream,
    buf: &mut BytesMut,
    max_len: u32,
) -> Result<Option<Bytes>, DecodeError> {
    loop {
        if let Some(len) = proto::frame_len_max(buf, max_len)? {
            return Ok(Some(buf.split_to(len).freeze()));
        }
        // Room for the whole frame once its length is known (bounded by `max_len`).
        if buf.len() >= 4 {
            let want = 4 + u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
            buf.reserve(want.saturating_sub(buf.len()));
        } else {
            buf.reserve((4 + max_len as usize).min(64 * 1024));
        }
        match read_some(reader, buf).await {
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

/// Reads what the socket has into `buf` (waiting for some); 0 at EOF. Cancel-safe.
///
/// A read that leaves room in `buf` took everything the socket had: it clears the socket's
/// read readiness, so the next read waits for epoll instead of first trying a `recvfrom` that
/// would find nothing (one syscall per request less, as tokio's own `AsyncRead` does). Through
/// `try_io`, which clears only the readiness it saw before the read: bytes that arrive in
/// between set it again and are not missed.
async fn read_some(stream: &TcpStream, buf: &mut BytesMut) -> std::io::Result<usize> {
    loop {
        stream.readable().await?;
        let mut read = None;
        let outcome = stream.try_io(Interest::READABLE, || {
            let room = buf.capacity() - buf.len();
            let n = stream.try_read_buf(buf)?;
            read = Some(n);
            if n > 0 && n < room {
                // Not an error: the way to have `try_io` clear the readiness.
                Err(std::io::ErrorKind::WouldBlock.into())
            } else {
                Ok(n)
            }
        });
        match (read, outcome) {
            (Some(n), _) => return Ok(n),
            (None, Err(e)) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            (None, outcome) => return outcome,
        }
    }
}
