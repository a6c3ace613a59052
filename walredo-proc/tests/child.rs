//! The `walredo-proc` binary as a process: hello, pipelined requests answered in order from one
//! buffered read, error frames that leave the child serving, exit codes for EOF and for framing
//! violations.

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};

use walredo_proc::page::BLCKSZ;
use walredo_proc::protocol::{self, BufferTag, ErrorCode, Hello, ReplyKind, HEADER_LEN};
use walredo_proc::record::Record;

fn spawn(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_walredo-proc"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn walredo-proc")
}

/// Reads one reply frame: its kind and payload.
fn read_reply(child: &mut Child) -> (ReplyKind, Vec<u8>) {
    let stdout = child.stdout.as_mut().expect("stdout");
    let mut header = [0u8; HEADER_LEN];
    stdout.read_exact(&mut header).expect("read reply header");
    let kind = protocol::decode_reply_header(&header).expect("valid reply header");
    let mut payload = vec![0u8; kind.payload_len()];
    stdout.read_exact(&mut payload).expect("read reply payload");
    (kind, payload)
}

fn tag(blknum: u32) -> BufferTag {
    BufferTag { spcnode: 1663, dbnode: 1, relnode: 2, forknum: 0, blknum }
}

#[test]
fn child_says_hello_with_its_pid_and_sandbox_flag() {
    for (args, flags) in [(&[][..], protocol::HELLO_FLAG_SECCOMP), (&["--no-seccomp"][..], 0)] {
        let mut child = spawn(args);
        let (kind, payload) = read_reply(&mut child);
        assert_eq!(kind, ReplyKind::Hello);
        let hello = Hello::decode(&payload).expect("hello");
        assert_eq!(hello.pid, child.id());
        assert_eq!(hello.flags, flags);
        drop(child.stdin.take());
        assert!(child.wait().expect("wait").success(), "EOF between frames is a clean exit");
    }
}

#[test]
fn pipelined_requests_are_answered_in_order_and_an_error_frame_fails_only_its_request() {
    let mut child = spawn(&[]);
    read_reply(&mut child);
    let mut requests = Vec::new();
    for n in 0..50u32 {
        protocol::encode_begin(&mut requests, &tag(n));
        protocol::encode_apply(&mut requests, 0x10, &Record::InitPage { special_size: 0 });
        if n % 7 == 3 {
            // Does not apply: no tuple 9 on a fresh page.
            protocol::encode_apply(&mut requests, 0x20, &Record::DeleteTuple { offnum: 9 });
        } else {
            protocol::encode_apply(
                &mut requests,
                0x20,
                &Record::PutBytes { offset: 4000, data: &n.to_be_bytes() },
            );
        }
        protocol::encode_get_page(&mut requests, &tag(n));
    }
    // All 50 requests in one write: the child reads them in few reads and answers each.
    child.stdin.as_mut().expect("stdin").write_all(&requests).expect("write requests");
    for n in 0..50u32 {
        let (kind, payload) = read_reply(&mut child);
        if n % 7 == 3 {
            assert!(matches!(kind, ReplyKind::Error { .. }), "request {n}");
            let (code, message) = protocol::decode_error_payload(&payload);
            assert_eq!(code, ErrorCode::ApplyFailed);
            assert!(message.contains("0/20"), "{message}");
        } else {
            assert_eq!(kind, ReplyKind::Page, "request {n}");
            assert_eq!(payload.len(), BLCKSZ);
            assert_eq!(&payload[4000..4004], &n.to_be_bytes());
        }
    }
    drop(child.stdin.take());
    assert!(child.wait().expect("wait").success());
}

#[test]
fn framing_violation_ends_the_child_with_status_2_and_a_message() {
    for garbage in [&b"Z\0\0\0\x04"[..], b"G\0\0\0\x03", b"A\xff\xff\xff\xff"] {
        let mut child = spawn(&[]);
        read_reply(&mut child);
        child.stdin.as_mut().expect("stdin").write_all(garbage).expect("write");
        drop(child.stdin.take());
        let output = child.wait_with_output().expect("wait");
        assert_eq!(output.status.code(), Some(2), "{garbage:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("framing violation"), "{stderr}");
    }
}

#[test]
fn eof_inside_a_frame_is_an_error_exit() {
    let mut child = spawn(&[]);
    read_reply(&mut child);
    child.stdin.as_mut().expect("stdin").write_all(b"G\0\0\0\x15\0\0").expect("write");
    drop(child.stdin.take());
    let output = child.wait_with_output().expect("wait");
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("EOF inside a frame"));
}

#[test]
fn help_prints_usage_on_stdout_and_exits_0() {
    let output = Command::new(env!("CARGO_BIN_EXE_walredo-proc")).arg("--help").output().expect("run");
    assert!(output.status.success(), "{:?}", output.status);
    let usage = String::from_utf8_lossy(&output.stdout);
    assert!(usage.starts_with("usage: walredo-proc"), "{usage}");
    assert!(usage.contains("--no-seccomp"), "{usage}");
}

/// A build without the `testing` feature (what ships) refuses the test-only flags.
#[cfg(not(feature = "testing"))]
#[test]
fn test_only_flags_are_not_in_a_build_without_the_testing_feature() {
    for flag in
        ["--test-forbidden-syscall-on-ping", "--test-exec-mapping-on-ping", "--test-big-allocation-on-ping"]
    {
        let output = Command::new(env!("CARGO_BIN_EXE_walredo-proc")).arg(flag).output().expect("run");
        assert_eq!(output.status.code(), Some(2), "{flag}");
        assert!(String::from_utf8_lossy(&output.stderr).contains("unknown argument"), "{flag}");
        let help = Command::new(env!("CARGO_BIN_EXE_walredo-proc")).arg("--help").output().expect("run");
        assert!(!String::from_utf8_lossy(&help.stdout).contains(flag), "{flag} in --help");
    }
}
