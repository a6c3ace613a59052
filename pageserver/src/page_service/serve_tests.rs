//! The page service served in this process, with the io_uring writer's test hooks:
//! connections when the io_uring writer fails, and with clients that do not read.
//!
//! Each test serves one tenant holding a few cached pages (so every GetPage is a cache hit
//! answered by the connection's loop) with [`serve`] on a loopback port, and drives it with
//! the async [`Client`] on the same runtime.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use page_types::{BufferTag, Lsn, PAGE_SIZE};
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::client::{Client, ClientReader};
use super::io_choice::IoChoice;
use super::proto::{
    ClientMessage, ErrorCode, IngestValue, ServerMessage, ValueKind, LSN_LATEST, PROTOCOL_VERSION,
};
use super::{serve, uring, PageServiceConf, PageServiceIo, PageServiceMetrics};
use crate::config::PageServerConf;
use crate::page_cache::PageCache;
use crate::tenants::{Tenants, TenantsMetrics};
use crate::test_support::wait_for;
use crate::walredo::WalRedoMetrics;

const TENANT: &str = "served";
/// Keys ingested (each an image) and asked for.
const KEYS: u32 = 8;
const DEADLINE: Duration = Duration::from_secs(60);

/// A page service serving [`TENANT`] in this process.
struct Served {
    addr: std::net::SocketAddr,
    metrics: Arc<PageServiceMetrics>,
    choice: Arc<IoChoice>,
    tenants: Arc<Tenants>,
    cancel: CancellationToken,
    tracker: TaskTracker,
    _workdir: tempfile::TempDir,
}

fn key(n: u32) -> BufferTag {
    BufferTag { spcnode: 1663, dbnode: 5, relnode: 16400, forknum: 0, blknum: n }
}

fn image(n: u32) -> Bytes {
    Bytes::from(vec![n as u8 ^ 0x5a; PAGE_SIZE])
}

/// What [`Served::start_with`] varies.
struct Options {
    max_connections: usize,
    /// The daemon's sockets get send buffers of a few KiB (set on the listener, which its
    /// accepted sockets inherit): a client that does not read soon fills them.
    small_send_buffers: bool,
    /// `page_service_idle_timeout`, the write timeout too.
    idle_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options { max_connections: 1000, small_send_buffers: false, idle_timeout: Duration::from_secs(60) }
    }
}

impl Served {
    /// Serves with `page_service_io = mode` (the io_uring writer, if the mode may use it,
    /// started with its hooks), with [`KEYS`] pages ingested and read once (cached).
    async fn start(mode: PageServiceIo) -> Served {
        Served::start_with(mode, Options::default()).await
    }

    /// [`Served::start`], with `options`.
    async fn start_with(mode: PageServiceIo, options: Options) -> Served {
        let workdir = tempfile::tempdir().unwrap();
        let conf = PageServerConf::load(workdir.path(), &[]).unwrap();
        let registry = prometheus::Registry::new();
        let metrics = Arc::new(PageServiceMetrics::new(&registry).unwrap());
        let cancel = CancellationToken::new();
        let tenants = Arc::new(
            Tenants::load(
                &conf.workdir,
                &conf.tenants,
                Arc::new(PageCache::new(64 << 20, &registry).unwrap()),
                Arc::new(crate::storage::register_metrics(&registry).unwrap()),
                Arc::new(WalRedoMetrics::new(&registry).unwrap()),
                Arc::new(TenantsMetrics::new(&registry).unwrap()),
                cancel.clone(),
            )
            .await
            .unwrap(),
        );
        tenants.create(TENANT, Default::default()).await.unwrap();
        let rings = match mode {
            PageServiceIo::Epoll => None,
            _ => Some(uring::Rings::new(uring::probe().unwrap(), Arc::clone(&metrics))),
        };
        let choice = Arc::new(IoChoice::new(mode, rings, metrics.choice.clone()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        if options.small_send_buffers {
            nix::sys::socket::setsockopt(&listener, nix::sys::socket::sockopt::SndBuf, &4096).unwrap();
        }
        let addr = listener.local_addr().unwrap();
        let conf = PageServiceConf {
            max_connections: options.max_connections,
            idle_timeout: options.idle_timeout,
            abort: CancellationToken::new(),
            io: Arc::clone(&choice),
        };
        let tracker = TaskTracker::new();
        tokio::spawn(serve(
            listener,
            Arc::clone(&tenants),
            conf,
            Arc::clone(&metrics),
            cancel.clone(),
            tracker.clone(),
        ));
        let served = Served { addr, metrics, choice, tenants, cancel, tracker, _workdir: workdir };
        let mut client = served.client().await.unwrap();
        let values = (0..KEYS)
            .map(|n| IngestValue {
                key: key(n),
                lsn: 10 + u64::from(n),
                kind: ValueKind::Image,
                data: image(n),
            })
            .collect();
        client.ingest(values).await.unwrap();
        for n in 0..KEYS {
            assert_eq!(client.get_page(key(n), LSN_LATEST).await.unwrap().1, image(n));
        }
        served
    }

    async fn client(&self) -> anyhow::Result<Client> {
        Client::connect(self.addr, TENANT).await
    }

    fn hooks(&self) -> Arc<uring::Hooks> {
        self.choice.rings().expect("an io_uring writer").hooks()
    }

    async fn stop(self) {
        self.cancel.cancel();
        self.tracker.close();
        tokio::time::timeout(DEADLINE, self.tracker.wait()).await.expect("connections end");
        self.tenants.shutdown().await;
    }
}

/// The ring fails (its next `io_uring_enter` errs): new connections are served through
/// `writev` from then on, in `io_uring` mode too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_ring_leaves_connections_to_writev() {
    let served = Served::start(PageServiceIo::IoUring).await;
    let ring_sends = || served.metrics.uring_io.sends.get();
    assert!(ring_sends() > 0, "the io_uring writer sent the replies so far");
    served.hooks().fail_next_submit.store(true, Ordering::Relaxed);
    // The batch that wakes the ring meets the failure: its connection may be closed.
    if let Ok(mut client) = served.client().await {
        let _ = client.get_page(key(0), LSN_LATEST).await;
    }
    let deadline = Instant::now() + DEADLINE;
    wait_for("the ring to fail", DEADLINE, || served.choice.rings().unwrap().dead()).await;
    assert_eq!(served.metrics.uring_failed.get(), 1, "the failure shows");
    assert_eq!(served.metrics.choice.ring_chosen.get(), 0);
    // Connections made after the failure are served.
    for _ in 0..3 {
        let mut client = served.client().await.expect("Hello answered after the ring failed");
        for n in 0..KEYS {
            assert_eq!(client.get_page(key(n), LSN_LATEST).await.unwrap().1, image(n));
        }
    }
    // The writer counts a send after its `writev` returned, which can be after the client has
    // read the reply: the count is waited for, not read once.
    let replies = 3 * (u64::from(KEYS) + 1);
    let left = deadline.saturating_duration_since(Instant::now());
    wait_for("a send through writev for each reply", left, || served.metrics.epoll_io.sends.get() >= replies)
        .await;
    served.stop().await;
}

/// The requests of one connection run together in its task: a GetPage waiting for an LSN not
/// yet ingested does not hold up the one pipelined behind it, which reads its page (and so
/// puts it in the page cache) meanwhile; their replies still leave in request order once the
/// LSN comes. (Requests run one after another would leave the second page unread until the
/// first one's LSN arrived.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_does_not_hold_up_the_next_one_of_its_connection() {
    let served = Served::start(PageServiceIo::Epoll).await;
    let mut client = served.client().await.unwrap();
    let (fresh, ahead) = (key(KEYS), 1000);
    // A page nobody read yet, so not in the page cache.
    client
        .ingest(vec![IngestValue { key: fresh, lsn: 100, kind: ValueKind::Image, data: image(KEYS) }])
        .await
        .unwrap();
    let tenant = served.tenants.get(TENANT).unwrap();
    assert!(tenant.get_page_now(fresh, Lsn(LSN_LATEST)).page().is_none(), "not read yet");
    let (waiting, next) = (client.next_request_id(), client.next_request_id());
    client.send(&ClientMessage::GetPage { request_id: waiting, key: key(0), lsn: ahead });
    client.send(&ClientMessage::GetPage { request_id: next, key: fresh, lsn: LSN_LATEST });
    client.flush().await.unwrap();
    let started = Instant::now();
    while tenant.get_page_now(fresh, Lsn(LSN_LATEST)).page().is_none() {
        assert!(started.elapsed() < DEADLINE, "the second request did not run while the first waited");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The LSN comes (on another connection): both replies, in request order.
    let mut other = served.client().await.unwrap();
    other
        .ingest(vec![IngestValue { key: key(KEYS + 1), lsn: ahead, kind: ValueKind::Image, data: image(1) }])
        .await
        .unwrap();
    for (id, want) in [(waiting, image(0)), (next, image(KEYS))] {
        match tokio::time::timeout(DEADLINE, client.recv()).await.unwrap().unwrap() {
            ServerMessage::Page { request_id, page, .. } => {
                assert_eq!(request_id, id);
                assert_eq!(page, want);
            }
            other => panic!("expected the page of request {id}, got {}", super::client::describe(&other)),
        }
    }
    served.stop().await;
}

/// A connection whose last batches are still in the io_uring writer when its task ends (its
/// client pipelined a megabyte of GetPages and a bad frame, which closes the connection, and
/// reads nothing) keeps its slot of `max_connections` until the ring is done with them;
/// `pageserver_page_service_connections` counts that slot all along, never fewer than the
/// slots in use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connections_gauge_counts_a_slot_that_a_ring_holds_after_its_connection_ended() {
    const PAGES: u32 = 128;
    let options = Options { max_connections: 1, small_send_buffers: true, ..Options::default() };
    let served = Served::start_with(PageServiceIo::IoUring, options).await;
    // The one slot is free once the connection of `start` is over.
    let deadline = Instant::now() + DEADLINE;
    let (mut reader, mut write) = loop {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        // A receive window of a few KiB: the megabyte of replies waits in the daemon.
        socket.set_recv_buffer_size(4096).unwrap();
        let (read, mut write) = socket.connect(served.addr).await.unwrap().into_split();
        let mut reader = ClientReader::new(read);
        let mut hello = BytesMut::new();
        ClientMessage::Hello {
            version: PROTOCOL_VERSION,
            tenant_id: TENANT.into(),
            timeline_id: "main".into(),
        }
        .encode(&mut hello);
        write.write_all(&hello).await.unwrap();
        match reader.recv().await.unwrap() {
            ServerMessage::HelloOk { .. } => break (reader, write),
            refused => assert!(
                Instant::now() < deadline,
                "the slot of the first connection stayed taken: {}",
                super::client::describe(&refused)
            ),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // Fewer requests than a connection may have in flight (it reads them all), then a frame
    // longer than any: its error reply closes the connection. No FIN from the client.
    let mut requests = BytesMut::new();
    for n in 0..PAGES {
        let request =
            ClientMessage::GetPage { request_id: u64::from(n) + 1, key: key(n % KEYS), lsn: LSN_LATEST };
        request.encode(&mut requests);
    }
    requests.extend_from_slice(&u32::MAX.to_be_bytes());
    write.write_all(&requests).await.unwrap();
    wait_for("the connection's task to end", DEADLINE, || served.tracker.is_empty()).await;

    // Its replies wait in the ring, which holds the connection's socket and slot.
    assert_eq!(
        served.metrics.connections.get(),
        1,
        "the connections gauge reads below the slots in use (a ring holds the ended connection's)"
    );
    let refused = served.client().await.err().expect("the one slot is taken: a second connection is refused");
    assert!(format!("{refused:#}").contains("too_many_connections"), "{refused:#}");

    // The client reads: the ring sends the rest, then FIN, and lets the slot go.
    for n in 0..PAGES {
        match tokio::time::timeout(DEADLINE, reader.recv()).await.expect("the replies come").unwrap() {
            ServerMessage::Page { request_id, .. } => assert_eq!(request_id, u64::from(n) + 1),
            other => panic!("expected page {n}, got {}", super::client::describe(&other)),
        }
    }
    match tokio::time::timeout(DEADLINE, reader.recv()).await.expect("the last reply comes").unwrap() {
        ServerMessage::Error { code, .. } => assert_eq!(code, ErrorCode::FrameTooLarge),
        other => panic!("expected the bad frame's error, got {}", super::client::describe(&other)),
    }
    wait_for("the slot to be let go", DEADLINE, || served.metrics.connections.get() == 0).await;
    drop(write);
    let mut client = served.client().await.expect("the slot is free again");
    assert_eq!(client.get_page(key(0), LSN_LATEST).await.unwrap().1, image(0));
    drop(client);
    served.stop().await;
}

/// A client that sends its requests, then FIN (`shutdown(Write)`), and reads none of the
/// replies, is disconnected at the write timeout by either writer, as one that stops reading
/// without FIN is; the io_uring writer makes a few sends meanwhile, not a loop of them (every
/// poll of a half-closed socket completes at once, with `POLLRDHUP`, room or not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_sent_fin_and_reads_nothing_is_disconnected_at_the_write_timeout_by_either_writer() {
    const PAGES: u32 = 128;
    /// A few sends fill the socket, then one per look of the ring's reaper.
    const FEW_SENDS: u64 = 100;
    for mode in [PageServiceIo::Epoll, PageServiceIo::IoUring] {
        let idle_timeout = Duration::from_secs(1);
        let options = Options { small_send_buffers: true, idle_timeout, ..Options::default() };
        let served = Served::start_with(mode, options).await;
        wait_for("the connection of start to end", DEADLINE, || served.metrics.connections.get() == 0).await;
        let sends_before = served.metrics.uring_io.sends.get();

        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        // A receive window of a few KiB: the megabyte of replies waits in the daemon.
        socket.set_recv_buffer_size(4096).unwrap();
        let (read, mut write) = socket.connect(served.addr).await.unwrap().into_split();
        let mut reader = ClientReader::new(read);
        let mut requests = BytesMut::new();
        ClientMessage::Hello {
            version: PROTOCOL_VERSION,
            tenant_id: TENANT.into(),
            timeline_id: "main".into(),
        }
        .encode(&mut requests);
        write.write_all(&requests).await.unwrap();
        match reader.recv().await.unwrap() {
            ServerMessage::HelloOk { .. } => {}
            other => panic!("expected HelloOk, got {}", super::client::describe(&other)),
        }
        requests.clear();
        for n in 0..PAGES {
            let request =
                ClientMessage::GetPage { request_id: u64::from(n) + 1, key: key(n % KEYS), lsn: LSN_LATEST };
            request.encode(&mut requests);
        }
        // Before the requests: the daemon's write timeout cannot start earlier.
        let started = Instant::now();
        write.write_all(&requests).await.unwrap();
        write.shutdown().await.unwrap();

        let ring_sends = || served.metrics.uring_io.sends.get() - sends_before;
        // Waited for on this thread, not with the runtime's timer: a writer that resends in a
        // loop holds a worker thread and its ring's lock, which the other worker may then wait
        // for (the ring's reaper), and no worker would drive the timer.
        while served.metrics.connections.get() > 0
            && ring_sends() <= FEW_SENDS
            && started.elapsed() < DEADLINE
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let (sends, open, closed_after) = (ring_sends(), served.metrics.connections.get(), started.elapsed());
        // Whatever happened, the client resets the connection now (it leaves unread bytes),
        // which fails any send still going on.
        drop((reader, write));
        assert!(sends <= FEW_SENDS, "{mode:?}: {sends} sends to a full socket whose client sent FIN");
        assert_eq!(open, 0, "{mode:?}: the connection was not closed within {DEADLINE:?}");
        assert!(
            closed_after >= idle_timeout,
            "{mode:?}: closed after {closed_after:?}, before the write timeout: \
             a client that sent FIN may still read"
        );
        served.stop().await;
    }
}
