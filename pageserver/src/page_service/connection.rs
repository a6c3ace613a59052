//! One page service connection: one task and one loop ([`Connection::serve`]) that reads and
//! decodes requests, runs them (in the connection's task, or a task of their own for a
//! GetPage that may block its thread), and sends the replies in request order
//! ([`super::writer::Replies`]). Here: the wire <-> domain conversions (frames to tenant calls,
//! errors to codes).
//!
//! Invariants: replies leave in request order; the ingest batches of a connection reach
//! storage in the order sent (the loop queues each before taking the next frame); a bad frame
//! gets an error reply and closes its own connection only; nothing in the loop wakes its own
//! task.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use page_types::Lsn;
use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::io_choice::IoChoice;
use super::proto::{
    self, ClientMessage, DecodeError, ErrorCode, ServerMessage, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};
use super::writer::{OutgoingReply, Pending, Queued, Replies, SocketWriter};
use super::{ConnectionSlot, PageServiceMetrics, HELLO_TIMEOUT, MAX_IN_FLIGHT};
use crate::storage::{IngestError, WaitLsnError};
use crate::tenant::{GetPageError, PageNow, Tenant};
use crate::tenants::{TenantError, Tenants, TimelineError};
use crate::util::Signal;
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
/// One task per connection, and one loop in it ([`Connection::serve`]): it reads requests,
/// runs them (a GetPage that may block its thread while others of the connection are in
/// flight gets a task of its own), and writes the replies in request order. Nothing in it
/// wakes its own task: a wake-up is a socket, a redo child, a timer or another task (a
/// self-wake makes tokio hand the task to another worker thread: a thread hop per request).
///
/// `connection_slot` (of `max_connections`) is freed once nothing holds the socket any more:
/// when this returns, or later, once an io_uring writer is done with the batches it was handed
/// (a client that does not read keeps them there up to the write timeout), so that the
/// daemon's sockets stay within `max_connections`.
///
/// `stop` (shutdown begins): the reader stops and the requests in flight are answered. `abort`
/// (shutdown's grace is over): the connection is dropped at once, whatever it was writing.
///
/// Cancel-safe in that sense: dropping it closes the connection; requests that run in its own
/// task are dropped with it (cancel-safe themselves), those on tasks of their own finish there
/// and their replies are dropped.
pub(crate) async fn handle_connection(
    stream: TcpStream,
    connection_slot: ConnectionSlot,
    tenants: &Tenants,
    metrics: &Arc<PageServiceMetrics>,
    conf: ConnectionConf,
    stop: Arc<Signal>,
    abort: CancellationToken,
) -> anyhow::Result<()> {
    // Shared by the connection and, while a batch is with it, an io_uring ring, which so keeps
    // the descriptor open until its operations on it are over.
    let stream = Arc::new(stream);
    let mut writer = SocketWriter::new(
        Arc::clone(&stream),
        Arc::new(connection_slot),
        Arc::clone(&conf.io),
        conf.idle_timeout,
    );
    let served = async {
        // Small until Hello: a connection that never says it costs little.
        let mut buf = BytesMut::with_capacity(proto::MAX_HELLO_FRAME_LEN as usize + 4);
        let mut replies = Replies::new();
        match hello(&stream, &mut buf, tenants, metrics, &stop).await {
            Ok((tenant, version)) => {
                let ok = ServerMessage::HelloOk { version, last_durable_lsn: tenant.last_durable_lsn().0 };
                replies.push(Queued { pending: Pending::Ready(OutgoingReply::message(&ok)), slot: None });
                let span = tracing::info_span!("tenant", tenant_id = tenant.id);
                let connection = Connection { tenant: &tenant, metrics, stop: &stop, conf: &conf };
                connection.serve(&stream, &mut buf, &mut writer, replies).instrument(span).await
            }
            Err(reply) => {
                replies.push(Queued { pending: Pending::Ready(reply), slot: None });
                while replies.front_done() {
                    if replies.write_next(&mut writer, metrics, conf.idle_timeout).await? {
                        return Ok(());
                    }
                }
                writer.finish(metrics).await?;
                Ok(())
            }
        }
    };
    tokio::select! {
        served = served => served,
        () = abort.cancelled() => Err(anyhow::anyhow!("closed at shutdown before its replies were written")),
    }
}

/// Reads and checks the Hello: the timeline it names (`main` for a version 1 Hello) and the
/// version, which HelloOk repeats; an `Err` is the reply that refuses the connection.
async fn hello(
    reader: &TcpStream,
    buf: &mut BytesMut,
    tenants: &Tenants,
    metrics: &PageServiceMetrics,
    stop: &Arc<Signal>,
) -> Result<(Arc<Tenant>, u32), OutgoingReply> {
    let refuse = |code, message: String| OutgoingReply::error(metrics, 0, code, message);
    let mut stop = stop.watch();
    let frame = tokio::select! {
        () = stop.raised() => return Err(refuse(ErrorCode::ShuttingDown, "the daemon is shutting down".into())),
        frame = tokio::time::timeout(HELLO_TIMEOUT, read_frame(reader, buf, proto::MAX_HELLO_FRAME_LEN)) => frame,
    };
    let frame = match frame {
        Err(_) => return Err(refuse(ErrorCode::BadFrame, format!("no Hello within {HELLO_TIMEOUT:?}"))),
        Ok(Err(e)) => return Err(refuse(e.code(), e.to_string())),
        Ok(Ok(None)) => return Err(OutgoingReply::close()),
        Ok(Ok(Some(frame))) => frame,
    };
    match proto::decode_client(frame) {
        Ok(ClientMessage::Hello { version, tenant_id, timeline_id }) => {
            if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) {
                return Err(refuse(
                    ErrorCode::UnsupportedVersion,
                    format!(
                        "protocol version {version} is not supported, this daemon speaks \
                         {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"
                    ),
                ));
            }
            let tenant = tenants.timeline(&tenant_id, &timeline_id).map_err(|e| match e {
                TimelineError::Tenant(TenantError::NotFound(_)) => {
                    refuse(ErrorCode::NoSuchTenant, format!("no tenant {tenant_id}"))
                }
                e @ TimelineError::NotFound { .. } => refuse(ErrorCode::NoSuchTenant, e.to_string()),
                TimelineError::Tenant(e @ TenantError::Broken { .. }) => {
                    refuse(ErrorCode::TenantBroken, e.to_string())
                }
                other => refuse(ErrorCode::Internal, other.to_string()),
            })?;
            Ok((tenant, version))
        }
        Ok(_) => Err(refuse(ErrorCode::BadFrame, "the first message must be Hello".into())),
        Err(e) => Err(refuse(e.code(), e.to_string())),
    }
}

/// What the request loop of a connection works with.
struct Connection<'a> {
    tenant: &'a Arc<Tenant>,
    metrics: &'a Arc<PageServiceMetrics>,
    stop: &'a Arc<Signal>,
    conf: &'a ConnectionConf,
}

impl Connection<'_> {
    /// The connection's loop: takes the requests whose frames are whole in `buf` while an
    /// in-flight slot is free, takes the outcomes of the requests done, writes the replies that
    /// can go, and only when none of that is left to do, waits for the socket, a request, a
    /// free slot, shutdown or the idle timer. Reading ends at EOF, a bad frame, idleness or
    /// shutdown (the last three with an error reply, which closes the connection); the loop
    /// ends once every reply is written.
    async fn serve(
        &self,
        stream: &TcpStream,
        buf: &mut BytesMut,
        writer: &mut SocketWriter,
        mut replies: Replies,
    ) -> anyhow::Result<()> {
        let (tenant, metrics, idle_timeout) = (self.tenant, self.metrics, self.conf.idle_timeout);
        // Every request holds a slot from the frame's read until its reply is written: no frame
        // is taken without one, so a connection never has more in flight.
        let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
        let mut reading = true;
        let mut last_read = Instant::now();
        let idle = tokio::time::sleep(idle_timeout);
        tokio::pin!(idle);
        let (mut stop, mut tenant_stop) = (self.stop.watch(), tenant.stopping.watch());
        loop {
            while reading {
                let frame = match proto::frame_len_max(buf, proto::MAX_FRAME_LEN) {
                    Ok(Some(len)) => len,
                    Ok(None) => break,
                    Err(e) => {
                        reading =
                            replies.push(closing(OutgoingReply::error(metrics, 0, e.code(), e.to_string())));
                        break;
                    }
                };
                let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else { break };
                let pending = self.dispatch(buf.split_to(frame).freeze(), alone(&slots)).await;
                reading = replies.push(Queued { pending, slot: Some(slot) });
            }
            replies.collect_done()?;
            if replies.front_done() {
                if replies.write_next(writer, metrics, idle_timeout).await? {
                    return Ok(());
                }
                continue;
            }
            if !reading && replies.is_empty() {
                writer.finish(metrics).await?;
                return Ok(());
            }
            // Room for the whole next frame once its length is known (bounded by the frame limit).
            if reading {
                reserve_frame(buf, proto::MAX_FRAME_LEN);
            }
            let slot_free = slots.available_permits() > 0;
            let refuse = |code, why: &str| closing(OutgoingReply::error(metrics, 0, code, why.into()));
            tokio::select! {
                biased;
                done = replies.next_done(), if replies.running() => done?,
                () = stop.raised(), if reading => {
                    reading = replies.push(refuse(ErrorCode::ShuttingDown, "the daemon is shutting down"));
                }
                () = tenant_stop.raised(), if reading => {
                    reading = replies.push(refuse(ErrorCode::ShuttingDown, "the tenant is shutting down"));
                }
                read = read_some(stream, buf), if reading && slot_free => match read {
                    Ok(0) if buf.is_empty() => reading = false,
                    Ok(0) => {
                        let why = format!("connection closed inside a frame ({} bytes of it)", buf.len());
                        reading = replies.push(refuse(ErrorCode::BadFrame, &why));
                    }
                    Ok(_) => last_read = Instant::now(),
                    Err(e) => {
                        tracing::debug!("read failed: {e}");
                        reading = false;
                    }
                },
                // A slot freed by the io_uring writer (the connection's own writes free theirs
                // in this loop).
                slot = slots.acquire(), if reading && !slot_free => drop(slot),
                () = &mut idle, if reading => {
                    let quiet_until = last_read + idle_timeout;
                    if slots.available_permits() == MAX_IN_FLIGHT && Instant::now() >= quiet_until {
                        let why = format!(
                            "no request for {idle_timeout:?} with none in flight (page_service_idle_timeout)"
                        );
                        reading = replies.push(refuse(ErrorCode::IdleTimeout, &why));
                    } else {
                        idle.as_mut().reset(quiet_until.max(Instant::now() + idle_timeout / 4).into());
                    }
                }
                else => anyhow::bail!("the oldest reply is neither done nor running, and nothing is read"),
            }
        }
    }

    /// Starts a request (or takes the reply for a frame that was no request) and returns its
    /// reply on its way; `alone`: no other request of the connection holds a slot.
    async fn dispatch(&self, frame: Bytes, alone: bool) -> Pending {
        let (tenant, metrics) = (self.tenant, self.metrics);
        match proto::decode_client(frame) {
            Err(e) => Pending::Ready(OutgoingReply::error(metrics, 0, e.code(), e.to_string())),
            Ok(ClientMessage::Hello { .. }) => Pending::Ready(OutgoingReply::error(
                metrics,
                0,
                ErrorCode::BadFrame,
                "Hello may come only once".into(),
            )),
            Ok(ClientMessage::GetPage { request_id, key, lsn }) => {
                metrics.get_page_requests.inc();
                let started = Instant::now();
                // A page cache hit is answered here, without a task of its own.
                match tenant.get_page_now(key, Lsn(lsn)) {
                    PageNow::Page(lsn, page) => {
                        let reply = OutgoingReply::page(request_id, lsn.0, page);
                        metrics.get_page_seconds.observe(started.elapsed().as_secs_f64());
                        Pending::Ready(reply)
                    }
                    PageNow::Later(read) => {
                        // In the connection's own task (no task to spawn, no wake-up from another
                        // thread), unless it may block its thread while other requests of the
                        // connection are in flight: those would wait behind it.
                        let inline = alone || !tenant.get_page_may_block();
                        let (tenant, metrics) = (Arc::clone(tenant), Arc::clone(metrics));
                        let request = async move {
                            let reply = match tenant.get_page_later(read).await {
                                Ok((lsn, page)) => OutgoingReply::page(request_id, lsn.0, page),
                                Err(e) => {
                                    let code = get_page_error_code(&e);
                                    OutgoingReply::error(&metrics, request_id, code, format!("{e:#}"))
                                }
                            };
                            metrics.get_page_seconds.observe(started.elapsed().as_secs_f64());
                            reply
                        };
                        if inline {
                            // Polled by the connection's task, inside its spans already (entering
                            // them again at every poll was 1-2% of the daemon's CPU at 64 x 8).
                            Pending::Inline(Box::pin(request))
                        } else {
                            Pending::Task(tokio::spawn(request.in_current_span()))
                        }
                    }
                }
            }
            Ok(ClientMessage::GetRelSize { request_id, rel, fork, lsn }) => {
                rel_request(tenant, metrics, request_id, true, move |tenant| async move {
                    tenant.get_rel_size(rel, fork, Lsn(lsn)).await
                })
            }
            Ok(ClientMessage::GetRelExists { request_id, rel, fork, lsn }) => {
                rel_request(tenant, metrics, request_id, false, move |tenant| async move {
                    tenant.get_rel_size(rel, fork, Lsn(lsn)).await
                })
            }
            Ok(ClientMessage::Ingest { request_id, values }) => {
                metrics.ingest_requests.inc();
                match proto::reserved_lsn(&values) {
                    Some((i, why)) => Pending::Ready(OutgoingReply::error(
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
}

/// Whether the request holding one of `slots` is the only one of its connection that holds one
/// (in flight, or with its reply not yet written).
fn alone(slots: &Semaphore) -> bool {
    slots.available_permits() + 1 >= MAX_IN_FLIGHT
}

/// A reply that ends the connection, not for a request of its own: it holds no slot.
fn closing(reply: OutgoingReply) -> Queued {
    Queued { pending: Pending::Ready(reply), slot: None }
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
                    Ok(lsn) => {
                        OutgoingReply::message(&ServerMessage::IngestOk { request_id, durable_lsn: lsn.0 })
                    }
                    Err(e) => {
                        OutgoingReply::error(&metrics, request_id, ingest_error_code(&e), format!("{e:#}"))
                    }
                }
            }))
        }
        Err(e) => {
            Pending::Ready(OutgoingReply::error(metrics, request_id, ingest_error_code(&e), format!("{e:#}")))
        }
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
                Ok((lsn, blocks)) if !size => OutgoingReply::message(&ServerMessage::RelExists {
                    request_id,
                    lsn: lsn.0,
                    exists: blocks.is_some(),
                }),
                Ok((lsn, Some(blocks))) => {
                    OutgoingReply::message(&ServerMessage::RelSize { request_id, lsn: lsn.0, blocks })
                }
                Ok((lsn, None)) => OutgoingReply::error(
                    &metrics,
                    request_id,
                    ErrorCode::NotFound,
                    format!("the relation fork does not exist at LSN {lsn}"),
                ),
                Err(e) => {
                    OutgoingReply::error(&metrics, request_id, get_page_error_code(&e), format!("{e:#}"))
                }
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
        GetPageError::ImportIncomplete => ErrorCode::ImportIncomplete,
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
        IngestError::Invalid(_)
        | IngestError::LsnWentBackwards { .. }
        | IngestError::NotContiguous { .. } => ErrorCode::InvalidRequest,
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
        reserve_frame(buf, max_len);
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

/// Makes room in `buf` for the whole frame at its start once its length is known (a length
/// above `max_len` is refused before this), else for a first read.
fn reserve_frame(buf: &mut BytesMut, max_len: u32) {
    if buf.len() >= 4 {
        let want = 4 + u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        buf.reserve(want.saturating_sub(buf.len()));
    } else {
        buf.reserve((4 + max_len as usize).min(64 * 1024));
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
