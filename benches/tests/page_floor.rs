//! `page-floor` as its users see it: the page service protocol spoken directly (pipelining,
//! partial frames, the errors that close a connection and only it), its HTTP key space, its
//! `ports.json`, and a short `pagebench get-page` run against it.
//!
//! The pagebench test needs `pagebench` built in the same target directory and profile
//! (`cargo build -p pageserver --bin pagebench`): `cargo test -p benches` builds only this
//! crate's binaries. It fails, rather than skips, when pagebench is missing.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use page_types::BufferTag;
use pageserver::page_service::proto::{
    self, ClientMessage, ErrorCode, ServerMessage, LSN_LATEST, PROTOCOL_VERSION,
};

/// The LSN "latest" resolves to with the default shape (10 x 1000 pages, chain length 10): the
/// end of pagebench's data set, value 109999 at 8 LSNs per value from 0x0100_0000.
const END_LSN: u64 = 0x0100_0000 + 109_999 * 8;
/// Longest wait for the floor to start, or for one reply.
const TIMEOUT: Duration = Duration::from_secs(30);

/// A running floor; killed on drop.
struct Floor {
    child: Child,
    pg: String,
    http: String,
}

impl Floor {
    fn start(extra: &[&str]) -> Floor {
        let mut child = Command::new(env!("CARGO_BIN_EXE_page-floor"))
            .args(["--listen-pg", "127.0.0.1:0", "--listen-http", "127.0.0.1:0"])
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start page-floor");
        let stdout = child.stdout.take().expect("stdout is piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = match rx.recv_timeout(TIMEOUT) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                panic!("page-floor printed no addresses within {TIMEOUT:?}");
            }
        };
        let addrs: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("page-floor's first line {line:?} is not JSON: {e}"));
        let addr =
            |name: &str| addrs[name].as_str().unwrap_or_else(|| panic!("no {name} in {line}")).to_string();
        Floor { pg: addr("pg"), http: addr("http"), child }
    }

    fn connect(&self) -> TcpStream {
        let stream = TcpStream::connect(&self.pg).expect("connect to the page service");
        stream.set_read_timeout(Some(TIMEOUT)).expect("set a read timeout");
        stream
    }

    /// A connection past Hello.
    fn hello(&self) -> TcpStream {
        let mut stream = self.connect();
        send(
            &mut stream,
            &[ClientMessage::Hello {
                version: PROTOCOL_VERSION,
                tenant_id: "bench".into(),
                timeline_id: "main".into(),
            }],
        );
        match recv(&mut stream) {
            ServerMessage::HelloOk { version, last_durable_lsn } => {
                assert_eq!((version, last_durable_lsn), (PROTOCOL_VERSION, END_LSN));
            }
            other => panic!("expected HelloOk, got {other:?}"),
        }
        stream
    }

    fn http_get(&self, path: &str) -> (u16, String) {
        let mut stream = TcpStream::connect(&self.http).expect("connect to the HTTP address");
        stream.set_read_timeout(Some(TIMEOUT)).expect("set a read timeout");
        write!(stream, "GET {path} HTTP/1.1\r\nHost: floor\r\nConnection: close\r\n\r\n").expect("send");
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("read the response to its end");
        let (head, body) = response.split_once("\r\n\r\n").expect("a head and a body");
        let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("a status code");
        (status, body.to_string())
    }
}

impl Drop for Floor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn key(blknum: u32) -> BufferTag {
    BufferTag { spcnode: 1663, dbnode: 1, relnode: 16384, forknum: 0, blknum }
}

/// Writes the messages in one write.
fn send(stream: &mut TcpStream, messages: &[ClientMessage]) {
    let mut out = BytesMut::new();
    for message in messages {
        message.encode(&mut out);
    }
    stream.write_all(&out).expect("write requests");
}

fn recv(stream: &mut TcpStream) -> ServerMessage {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).expect("read a frame length");
    let mut frame = len.to_vec();
    frame.resize(4 + u32::from_be_bytes(len) as usize, 0);
    stream.read_exact(&mut frame[4..]).expect("read a frame");
    proto::decode_server(Bytes::from(frame)).expect("decode a reply")
}

/// Reads until EOF; fails on data or a timeout.
fn assert_closed(stream: &mut TcpStream) {
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).expect("the connection ends with EOF, not a reset or a timeout");
    assert!(rest.is_empty(), "{} bytes after the Error", rest.len());
}

fn expect_error(stream: &mut TcpStream, code: ErrorCode) {
    match recv(stream) {
        ServerMessage::Error { code: got, .. } => assert_eq!(got, code),
        other => panic!("expected an Error {code:?}, got {other:?}"),
    }
}

#[test]
fn pipelined_get_pages_are_answered_in_order_and_a_bad_frame_closes_only_its_connection() {
    let floor = Floor::start(&[]);
    let mut stream = floor.hello();
    let mut other = floor.hello();
    send(
        &mut stream,
        &[
            ClientMessage::GetPage { request_id: 7, key: key(0), lsn: LSN_LATEST },
            ClientMessage::GetPage { request_id: 8, key: key(999), lsn: LSN_LATEST },
            ClientMessage::GetPage { request_id: 9, key: key(5), lsn: 0x0100_1234 },
        ],
    );
    for (id, lsn) in [(7, END_LSN), (8, END_LSN), (9, 0x0100_1234)] {
        match recv(&mut stream) {
            ServerMessage::Page { request_id, lsn: served, page } => {
                assert_eq!((request_id, served, page.len()), (id, lsn, 8192));
            }
            other => panic!("expected the page of request {id}, got {other:?}"),
        }
    }

    // Type 0x7f: no such message.
    stream.write_all(&[0, 0, 0, 1, 0x7f]).expect("write a malformed frame");
    expect_error(&mut stream, ErrorCode::BadFrame);
    assert_closed(&mut stream);

    send(&mut other, &[ClientMessage::GetPage { request_id: 1, key: key(1), lsn: LSN_LATEST }]);
    assert!(matches!(recv(&mut other), ServerMessage::Page { request_id: 1, .. }));
}

#[test]
fn a_frame_written_a_byte_at_a_time_is_answered_once_whole() {
    let floor = Floor::start(&[]);
    let mut stream = floor.hello();
    stream.set_nodelay(true).expect("set nodelay");
    let mut frame = BytesMut::new();
    ClientMessage::GetPage { request_id: 42, key: key(3), lsn: LSN_LATEST }.encode(&mut frame);
    for byte in frame.iter() {
        stream.write_all(&[*byte]).expect("write one byte");
    }
    assert!(matches!(recv(&mut stream), ServerMessage::Page { request_id: 42, .. }));
}

#[test]
fn ingest_a_second_hello_and_requests_before_hello_get_an_error_and_a_close() {
    let floor = Floor::start(&[]);

    let mut stream = floor.hello();
    let value = proto::IngestValue {
        key: key(0),
        lsn: 0x0200_0000,
        kind: proto::ValueKind::Record,
        data: Bytes::from_static(b"x"),
    };
    send(&mut stream, &[ClientMessage::Ingest { request_id: 3, values: vec![value] }]);
    match recv(&mut stream) {
        ServerMessage::Error { request_id, code, .. } => {
            assert_eq!((request_id, code), (3, ErrorCode::InvalidRequest));
        }
        other => panic!("expected an Error, got {other:?}"),
    }
    assert_closed(&mut stream);

    let mut stream = floor.hello();
    send(
        &mut stream,
        &[ClientMessage::Hello {
            version: PROTOCOL_VERSION,
            tenant_id: "again".into(),
            timeline_id: "main".into(),
        }],
    );
    expect_error(&mut stream, ErrorCode::BadFrame);
    assert_closed(&mut stream);

    let mut stream = floor.connect();
    send(&mut stream, &[ClientMessage::GetPage { request_id: 1, key: key(0), lsn: LSN_LATEST }]);
    expect_error(&mut stream, ErrorCode::BadFrame);
    assert_closed(&mut stream);

    let mut stream = floor.connect();
    send(
        &mut stream,
        &[ClientMessage::Hello {
            version: PROTOCOL_VERSION + 1,
            tenant_id: "t".into(),
            timeline_id: "main".into(),
        }],
    );
    expect_error(&mut stream, ErrorCode::UnsupportedVersion);
    assert_closed(&mut stream);

    // Longer than the 4 KiB allowed before Hello: refused from the length alone.
    let mut stream = floor.connect();
    stream.write_all(&[0, 0, 0x10, 1, 0x01]).expect("write a long frame's start");
    expect_error(&mut stream, ErrorCode::FrameTooLarge);
    assert_closed(&mut stream);
}

#[test]
fn http_serves_the_key_space_of_any_tenant_and_ports_json_names_the_addresses() {
    let workdir = tempfile::tempdir().expect("create a temp dir");
    let dir = workdir.path().join("floor");
    let floor = Floor::start(&["--workdir", dir.to_str().expect("UTF-8 temp path")]);

    let ports: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("ports.json")).expect("read ports.json"))
            .expect("ports.json is JSON");
    assert_eq!(ports, serde_json::json!({"pg": floor.pg, "http": floor.http}));

    let (status, body) = floor.http_get("/v1/tenant/any-tenant/keyspace");
    assert_eq!(status, 200, "{body}");
    let keyspace: serde_json::Value = serde_json::from_str(&body).expect("the key space is JSON");
    assert_eq!(keyspace["tenant_id"], "any-tenant");
    assert_eq!(keyspace["keys"], 10_000);
    assert_eq!(keyspace["last_durable_lsn"], END_LSN);
    assert_eq!(keyspace["lsn_range"]["last"], END_LSN);
    assert_eq!(keyspace["relations"].as_array().map(Vec::len), Some(10));

    assert_eq!(floor.http_get("/metrics").0, 404);
    assert_eq!(floor.http_get("/v1/tenant/no%2Fsuch/keyspace").0, 400);
}

/// `pagebench` of the same target directory and profile as the floor.
fn pagebench() -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_page-floor"))
        .with_file_name(format!("pagebench{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.exists(),
        "{} does not exist: build it first with `cargo build -p pageserver --bin pagebench` \
         (the same profile as this test; `cargo test -p benches` builds only this crate's binaries)",
        path.display()
    );
    path
}

#[test]
fn pagebench_get_page_runs_against_the_floor_without_errors() {
    let pagebench = pagebench();
    let floor = Floor::start(&[]);
    // The shape flags make pagebench check the key space against its own data set layout.
    let mut child = Command::new(&pagebench)
        .args(["get-page", "--page-service", &floor.pg, "--http", &floor.http, "--tenant", "bench"])
        .args(["--relations", "10", "--blocks", "1000", "--chain-length", "10", "--lsn", "latest"])
        .args(["--connections", "2", "--depth", "4", "--duration", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start pagebench");
    let (mut stdout, mut stderr) = (child.stdout.take().expect("piped"), child.stderr.take().expect("piped"));
    let out = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let err = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for pagebench") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("pagebench did not finish its 2 s run within 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (stdout, stderr) = (out.join().expect("stdout reader"), err.join().expect("stderr reader"));
    assert!(status.success(), "pagebench failed ({status}):\n{stderr}");
    let last = stdout.lines().last().unwrap_or_default();
    let summary: serde_json::Value = serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("last line {last:?} is not JSON: {e}\n{stderr}"));
    assert!(summary["requests"].as_u64().is_some_and(|n| n > 0), "{summary}");
    assert_eq!(summary["errors"], 0, "{summary}");
}
