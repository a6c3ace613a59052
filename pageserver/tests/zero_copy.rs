//! The page service replies to a cached GetPage without copying the page in user space, in both
//! reply writers (`page_service_io = "epoll"` and `"io_uring"`): proved by counting allocations.
//!
//! The daemon runs in this process (`server::run`), under a counting global allocator. A client
//! thread, excluded from the count, ingests page images for a few keys, reads each once (which
//! puts it in the page cache) and warms the connection up; then, with counting on, it sends
//! [`MEASURED_REPLIES`] GetPages for those keys, [`PIPELINE`] per write, and checks every reply
//! (request id, LSN, the page's bytes). During that window the daemon's threads must make no
//! allocation of a page's size or more, and allocate fewer than [`MAX_BYTES_PER_REPLY`] bytes
//! per reply in all: a page copied into a fresh buffer (`Bytes::copy_from_slice`, a `Vec`, a
//! send buffer that grows) would cost at least 8192 bytes per reply. With `epoll` a reply
//! allocates nothing at all (at most 0.05 allocations per reply are allowed), with the rings at
//! most one per reply (a batch's chunk and slot lists, kept by the ring until it is sent).
//!
//! What it cannot see: a copy into a buffer that already exists (a send buffer allocated once
//! and reused) allocates nothing; the assertion is about fresh buffers and total bytes. The
//! kernel's copy into socket buffers is outside its view too (ARCHITECTURE.md, "Deliberately
//! absent"). Its own test binary, so that no other test allocates while it counts; its two
//! tests share the counters and so take turns ([`SERIAL`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use page_types::{BufferTag, PAGE_SIZE};
use pageserver::config::PageServerConf;
use pageserver::page_service::proto::{
    self, ClientMessage, IngestValue, ServerMessage, ValueKind, LSN_LATEST, PAGE_REPLY_HEADER_LEN,
    PROTOCOL_VERSION,
};
use pageserver::page_service::uring;
use pageserver::server::PORTS_FILE;
use pageserver::test_support::walredo_proc_binary;
use tokio_util::sync::CancellationToken;

/// Keys ingested and read back (all of them fit in the default page cache).
const KEYS: usize = 32;
/// GetPages sent per write, and read back before the next write.
const PIPELINE: usize = 16;
/// GetPages before counting: the connection's buffers, queues and the writer reach the sizes
/// they keep.
const WARM_UP_REPLIES: usize = 400;
/// GetPages while counting.
const MEASURED_REPLIES: usize = 4000;
/// Bytes the daemon may allocate per reply while counting; a copied page needs `PAGE_SIZE`.
const MAX_BYTES_PER_REPLY: usize = 2048;
/// The message type of a Page reply (docs/page-service-protocol.md).
const PAGE_TYPE: u8 = 0x82;
/// Bytes of a Page reply frame.
const PAGE_REPLY_LEN: usize = PAGE_REPLY_HEADER_LEN + PAGE_SIZE;
/// The client's read buffer: a Page reply, or an Error with its message.
const FRAME_BUFFER_LEN: usize = 64 << 10;
/// How long the daemon gets to start and to stop.
const DAEMON_TIMEOUT: Duration = Duration::from_secs(60);
const TENANT: &str = "zero-copy";

// ---- the counting allocator ----

/// Counting is on (set and cleared by the client thread).
static MEASURING: AtomicBool = AtomicBool::new(false);
/// Allocations of at least `PAGE_SIZE` bytes while counting.
static BIG_ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
/// The largest allocation while counting.
static LARGEST: AtomicUsize = AtomicUsize::new(0);
/// Allocations, and their bytes, while counting.
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
static ALLOCATED_BYTES: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's allocations are not counted (the client's).
    static EXCLUDED: Cell<bool> = const { Cell::new(false) };
}

/// `System`, counting what the daemon's threads allocate while [`MEASURING`]. Allocates nothing
/// itself: atomics, and a thread-local without a destructor.
struct Counting;

impl Counting {
    fn count(size: usize) {
        if !MEASURING.load(Ordering::Relaxed) {
            return;
        }
        // During a thread's teardown the thread-local may be gone: count it then.
        if EXCLUDED.try_with(Cell::get).unwrap_or(false) {
            return;
        }
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        ALLOCATED_BYTES.fetch_add(size, Ordering::Relaxed);
        if size >= PAGE_SIZE {
            BIG_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        LARGEST.fetch_max(size, Ordering::Relaxed);
    }
}

// SAFETY: every call is passed to `System` unchanged; counting touches only atomics and a
// `Cell<bool>`.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Counting::count(layout.size());
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Counting::count(layout.size());
        // SAFETY: the caller's contract for `alloc_zeroed`, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            Counting::count(new_size);
        }
        // SAFETY: the caller's contract for `realloc`, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// What the daemon allocated during one counting window.
#[derive(Debug, Clone, Copy)]
struct Counts {
    big: usize,
    largest: usize,
    allocations: usize,
    bytes: usize,
}

fn start_counting() {
    for counter in [&BIG_ALLOCATIONS, &LARGEST, &ALLOCATIONS, &ALLOCATED_BYTES] {
        counter.store(0, Ordering::Relaxed);
    }
    MEASURING.store(true, Ordering::SeqCst);
}

fn stop_counting() -> Counts {
    MEASURING.store(false, Ordering::SeqCst);
    Counts {
        big: BIG_ALLOCATIONS.load(Ordering::Relaxed),
        largest: LARGEST.load(Ordering::Relaxed),
        allocations: ALLOCATIONS.load(Ordering::Relaxed),
        bytes: ALLOCATED_BYTES.load(Ordering::Relaxed),
    }
}

/// The two tests share the counters: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

// ---- the daemon ----

/// The daemon running in this process, on a runtime of its own.
struct Daemon {
    runtime: tokio::runtime::Runtime,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
    pg: SocketAddr,
    http: SocketAddr,
    _workdir: tempfile::TempDir,
}

impl Daemon {
    fn start(page_service_io: &str) -> Daemon {
        let workdir = tempfile::tempdir().expect("create a workdir");
        let binary = walredo_proc_binary().to_str().expect("a UTF-8 path").to_string();
        let overrides = [
            r#"listen_pg_addr="127.0.0.1:0""#.to_string(),
            r#"listen_http_addr="127.0.0.1:0""#.to_string(),
            format!("page_service_io={}", toml::Value::String(page_service_io.to_string())),
            format!("walredo_proc_path={}", toml::Value::String(binary)),
        ];
        let conf = PageServerConf::load(workdir.path(), &overrides).expect("load the settings");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("build the daemon's runtime");
        let shutdown = CancellationToken::new();
        let task = runtime.spawn(pageserver::server::run(conf, shutdown.clone()));
        let (pg, http) = wait_for_ports(workdir.path(), &task);
        Daemon { runtime, shutdown, task, pg, http, _workdir: workdir }
    }

    /// Stops the daemon and checks that `run` returned `Ok`.
    fn stop(self) {
        let Daemon { runtime, shutdown, task, _workdir: workdir, .. } = self;
        shutdown.cancel();
        let result = runtime.block_on(async move {
            tokio::time::timeout(DAEMON_TIMEOUT, task).await.expect("the daemon stops in time")
        });
        result.expect("the daemon's task did not panic").expect("the daemon stopped cleanly");
        drop(runtime);
        drop(workdir);
    }
}

/// The page service and API addresses from the ports file, once the daemon wrote it.
fn wait_for_ports(
    workdir: &Path,
    task: &tokio::task::JoinHandle<anyhow::Result<()>>,
) -> (SocketAddr, SocketAddr) {
    let path = workdir.join(PORTS_FILE);
    let deadline = Instant::now() + DAEMON_TIMEOUT;
    loop {
        // Written to a temporary name and renamed: once there, it is whole.
        if let Ok(text) = std::fs::read_to_string(&path) {
            let ports: serde_json::Value = serde_json::from_str(&text).expect("the ports file is JSON");
            let addr = |name: &str| -> SocketAddr {
                ports[name].as_str().and_then(|s| s.parse().ok()).expect("an address in the ports file")
            };
            return (addr("pg"), addr("http"));
        }
        assert!(!task.is_finished(), "the daemon stopped before it wrote {PORTS_FILE}");
        assert!(Instant::now() < deadline, "the daemon wrote no {PORTS_FILE} within {DAEMON_TIMEOUT:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One HTTP/1.1 request to the management API: the status code and the body.
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).expect("connect to the management API");
    stream.set_read_timeout(Some(DAEMON_TIMEOUT)).expect("set a read timeout");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).expect("send the request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read the response");
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {response:?}"));
    let body = response.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).unwrap_or_default();
    (status, body)
}

/// A counter of the daemon's `/metrics`, by its name with labels.
fn metric(http_addr: SocketAddr, series: &str) -> f64 {
    let (status, text) = http(http_addr, "GET", "/metrics", "");
    assert_eq!(status, 200, "GET /metrics: {text}");
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no series {series} in /metrics"))
}

// ---- the client ----

fn key(n: usize) -> BufferTag {
    BufferTag { spcnode: 1663, dbnode: 5, relnode: 16384, forknum: 0, blknum: n as u32 }
}

/// The image of key `n`: different for every key and every byte position.
fn image(n: usize) -> Bytes {
    (0..PAGE_SIZE).map(|i| (i as u8).wrapping_mul(31).wrapping_add(n as u8)).collect::<Vec<u8>>().into()
}

/// A blocking page service connection that reads whole frames into one buffer.
struct Connection {
    stream: TcpStream,
    /// One frame at a time; allocated once, with room for a Page reply or an Error.
    frame: Vec<u8>,
}

impl Connection {
    fn connect(addr: SocketAddr) -> Connection {
        let stream = TcpStream::connect(addr).expect("connect to the page service");
        stream.set_read_timeout(Some(DAEMON_TIMEOUT)).expect("set a read timeout");
        stream.set_nodelay(true).expect("set TCP_NODELAY");
        Connection { stream, frame: vec![0; FRAME_BUFFER_LEN] }
    }

    fn send(&mut self, out: &[u8]) {
        self.stream.write_all(out).expect("write to the page service");
    }

    /// Reads one frame into the buffer and returns its length (length field included).
    fn read_frame(&mut self) -> usize {
        self.stream.read_exact(&mut self.frame[..4]).expect("read a reply's length");
        let len = u32::from_be_bytes([self.frame[0], self.frame[1], self.frame[2], self.frame[3]]) as usize;
        assert!(4 + len <= self.frame.len(), "a reply of {len} bytes, more than any this test expects");
        self.stream.read_exact(&mut self.frame[4..4 + len]).expect("read a reply");
        4 + len
    }

    /// Reads and decodes one reply (a copy of its bytes: not for the counted path).
    fn recv(&mut self) -> ServerMessage {
        let len = self.read_frame();
        proto::decode_server(Bytes::copy_from_slice(&self.frame[..len])).expect("decode a reply")
    }

    /// Reads a Page reply for `request_id` at `lsn` and checks it holds `page`, in place.
    fn expect_page(&mut self, request_id: u64, lsn: u64, page: &[u8]) {
        let len = self.read_frame();
        let frame = &self.frame[..len];
        if len != PAGE_REPLY_LEN || frame[4] != PAGE_TYPE {
            let reply = proto::decode_server(Bytes::copy_from_slice(frame));
            panic!("GetPage {request_id}: expected a Page reply, got {reply:?}");
        }
        let field = |at: usize| u64::from_be_bytes(frame[at..at + 8].try_into().expect("8 bytes"));
        assert_eq!(field(5), request_id, "the reply's request id");
        assert_eq!(field(13), lsn, "the reply's LSN");
        assert!(
            &frame[PAGE_REPLY_HEADER_LEN..] == page,
            "GetPage {request_id}: the page differs from the image"
        );
    }
}

/// Sends `count` GetPages at "latest", [`PIPELINE`] per write, cycling through the keys, and
/// checks every reply. `out` is the write buffer, reused.
fn get_pages(
    conn: &mut Connection,
    out: &mut BytesMut,
    images: &[Bytes],
    lsn: u64,
    first_id: u64,
    count: usize,
) {
    let mut sent = 0;
    while sent < count {
        let round = PIPELINE.min(count - sent);
        out.clear();
        for i in sent..sent + round {
            let request_id = first_id + i as u64;
            ClientMessage::GetPage { request_id, key: key(i % KEYS), lsn: LSN_LATEST }.encode(out);
        }
        conn.send(out);
        for i in sent..sent + round {
            conn.expect_page(first_id + i as u64, lsn, &images[i % KEYS]);
        }
        sent += round;
    }
}

/// The client's whole session; returns what the daemon allocated while counting.
fn client(pg: SocketAddr) -> Counts {
    EXCLUDED.with(|excluded| excluded.set(true));
    let mut conn = Connection::connect(pg);
    let mut out = BytesMut::with_capacity(64 << 10);
    ClientMessage::Hello {
        version: PROTOCOL_VERSION,
        tenant_id: TENANT.to_string(),
        timeline_id: "main".into(),
    }
    .encode(&mut out);
    conn.send(&out);
    match conn.recv() {
        ServerMessage::HelloOk { .. } => {}
        other => panic!("Hello: expected HelloOk, got {other:?}"),
    }

    let images: Vec<Bytes> = (0..KEYS).map(image).collect();
    let values = (0..KEYS)
        .map(|n| IngestValue {
            key: key(n),
            lsn: 16 + n as u64,
            kind: ValueKind::Image,
            data: images[n].clone(),
        })
        .collect();
    out.clear();
    ClientMessage::Ingest { request_id: 1, values }.encode(&mut out);
    conn.send(&out);
    let lsn = match conn.recv() {
        ServerMessage::IngestOk { request_id: 1, durable_lsn } => durable_lsn,
        other => panic!("Ingest: expected IngestOk, got {other:?}"),
    };
    assert_eq!(lsn, 16 + KEYS as u64 - 1, "the ingest's durable LSN is its last value's");

    // Each key read once, which puts its page in the page cache; then the warm-up.
    get_pages(&mut conn, &mut out, &images, lsn, 100, KEYS);
    get_pages(&mut conn, &mut out, &images, lsn, 1_000, WARM_UP_REPLIES);

    start_counting();
    get_pages(&mut conn, &mut out, &images, lsn, 100_000, MEASURED_REPLIES);
    stop_counting()
}

/// Runs the daemon with `page_service_io`, measures and asserts (the module's doc).
fn replies_from_cache_copy_no_page(page_service_io: &str, max_allocations_per_reply: f64) {
    let _serial = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let daemon = Daemon::start(page_service_io);
    let (status, body) = http(daemon.http, "POST", "/v1/tenant", &format!(r#"{{"id": "{TENANT}"}}"#));
    assert!((200..300).contains(&status), "POST /v1/tenant answered {status}: {body}");

    let pg = daemon.pg;
    let counts = std::thread::Builder::new()
        .name("zero-copy-client".to_string())
        .spawn(move || client(pg))
        .expect("spawn the client thread")
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic));

    // The mode asked for is the one that wrote the replies (io_uring falls back to epoll when
    // the kernel refuses a ring).
    let sent = metric(
        daemon.http,
        &format!(r#"pageserver_page_service_sent_bytes_total{{io="{page_service_io}"}}"#),
    );
    assert!(
        sent >= (MEASURED_REPLIES * PAGE_REPLY_LEN) as f64,
        "{page_service_io}: the replies were not written by the {page_service_io} writer ({sent} bytes)"
    );
    daemon.stop();

    let per_reply = counts.bytes as f64 / MEASURED_REPLIES as f64;
    eprintln!(
        "page_service_io={page_service_io}: {MEASURED_REPLIES} cached GetPage replies: {} allocations of \
         >= {PAGE_SIZE} bytes (largest {} bytes), {:.2} allocations and {per_reply:.1} bytes allocated per reply",
        counts.big,
        counts.largest,
        counts.allocations as f64 / MEASURED_REPLIES as f64,
    );
    assert_eq!(
        counts.big, 0,
        "{page_service_io}: {} allocations of a page's size or more (largest {} bytes) while serving cached pages",
        counts.big, counts.largest
    );
    assert!(
        per_reply < MAX_BYTES_PER_REPLY as f64,
        "{page_service_io}: {per_reply:.1} bytes allocated per reply, allowed < {MAX_BYTES_PER_REPLY}"
    );
    let allocations = counts.allocations as f64 / MEASURED_REPLIES as f64;
    assert!(
        allocations <= max_allocations_per_reply,
        "{page_service_io}: {allocations:.2} allocations per reply, allowed <= {max_allocations_per_reply}"
    );
}

#[test]
fn cached_get_page_replies_copy_no_page_with_epoll() {
    // A cached page's reply allocates nothing: its header goes into a buffer its connection's
    // replies share, the lists a write is made of are kept, the version lookup makes no list.
    replies_from_cache_copy_no_page("epoll", 0.05);
}

#[test]
fn cached_get_page_replies_copy_no_page_with_io_uring() {
    // Fails rather than skips where the kernel refuses a ring: the daemon would fall back to
    // epoll and this test would measure nothing of the io_uring writer.
    if let Err(why) = uring::probe() {
        panic!("io_uring is not available here ({why}): the io_uring writer cannot be measured");
    }
    // The ring keeps a batch's chunk and slot lists until it is sent: one of each per batch.
    replies_from_cache_copy_no_page("io_uring", 1.0);
}
