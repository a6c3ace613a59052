//! Tests of the pipes of the kinds whose round trips can be dropped halfway through a write
//! (`async`, and `auto` on its yielding path), against fake children whose pipe ends the test
//! holds: no byte follows a partial frame, and a request dropped before its first byte breaks
//! nothing.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::process::{ChildStdin, ChildStdout};

use super::sync_pipes::SyncPipes;
use super::{async_pipes::AsyncPipes, Pipes, ProcessError};
use crate::walredo::pipeline::Patience;
use crate::walredo::priority::WriteTicket;
use crate::walredo::request::Request;
use crate::worker_controller::Wait;

/// The fake children never stall: the tests feed and drain them.
const PATIENCE: Patience = Patience { timeout: Duration::from_secs(30), stall: Duration::from_secs(30) };

/// The pipes under test, by name.
const YIELDING: [&str; 2] = ["async", "auto (yielding)"];

/// Pipes like a child's, of the kind named `kind`, whose other ends the test holds: (pipes,
/// requests read end, requests write end duplicate, replies write end).
fn fake_child(kind: &str) -> (Arc<Pipes>, OwnedFd, OwnedFd, OwnedFd) {
    let (requests_r, requests_w) = nix::unistd::pipe().expect("pipe");
    let (replies_r, replies_w) = nix::unistd::pipe().expect("pipe");
    for fd in [&requests_r, &requests_w] {
        let flags = nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_GETFL).expect("getfl");
        let flags = nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_SETFL(flags)).expect("setfl");
    }
    let requests_w_dup = requests_w.try_clone().expect("dup");
    let pipes = match kind {
        "async" => {
            let stdin = ChildStdin::from_std(std::process::ChildStdin::from(requests_w)).expect("stdin");
            let stdout = ChildStdout::from_std(std::process::ChildStdout::from(replies_r)).expect("stdout");
            Pipes::Async(AsyncPipes::new(stdin, stdout))
        }
        _ => {
            let pipes = SyncPipes::new(requests_w, replies_r).expect("sync pipes");
            pipes.set_wait(Wait::Yield);
            Pipes::Sync(pipes)
        }
    };
    (Arc::new(pipes), requests_r, requests_w_dup, replies_w)
}

/// Whether the pipe read by `fd` holds bytes.
fn has_bytes(fd: &OwnedFd) -> bool {
    let mut fds = [nix::poll::PollFd::new(fd.as_fd(), nix::poll::PollFlags::POLLIN)];
    nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO).is_ok_and(|n| n > 0)
}

/// Polls `future` once; whether it finished.
async fn poll_once<F: std::future::Future + Unpin>(future: &mut F) -> bool {
    std::future::poll_fn(|cx| std::task::Poll::Ready(std::pin::Pin::new(&mut *future).poll(cx).is_ready()))
        .await
}

/// A counter of `on_broken_write` calls, and the callback.
fn broken_counter() -> (Arc<AtomicUsize>, impl FnOnce() + Send) {
    let broken = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&broken);
    (broken, move || {
        counter.fetch_add(1, Ordering::Relaxed);
    })
}

#[tokio::test]
async fn no_byte_follows_a_request_whose_write_was_cut_short() {
    for kind in YIELDING {
        let (pipes, requests_r, _requests_w, _replies_w) = fake_child(kind);
        let (broken, on_broken) = broken_counter();
        let big = Arc::new(Request::frames(vec![b'1'; 4 << 20]));
        let mut first = Box::pin(pipes.round_trip(&big, WriteTicket::none(), PATIENCE, on_broken));
        // Poll until part of it is in the pipe (the first poll may only register the fd).
        let deadline = Instant::now() + Duration::from_secs(5);
        while !has_bytes(&requests_r) {
            assert!(!poll_once(&mut first).await, "{kind}: a 4 MiB write cannot fit in a pipe");
            assert!(Instant::now() < deadline, "{kind}: the request never reached the pipe");
            tokio::task::yield_now().await;
        }
        assert!(!poll_once(&mut first).await, "{kind}: a 4 MiB write cannot fit in a pipe");
        // A second request queues for the stdin lock behind the cut-short one.
        let second = tokio::spawn({
            let pipes = Arc::clone(&pipes);
            async move {
                pipes
                    .round_trip(
                        &Arc::new(Request::frames(b"second request".to_vec())),
                        WriteTicket::none(),
                        PATIENCE,
                        || {},
                    )
                    .await
            }
        });
        tokio::task::yield_now().await;
        drop(first);
        assert_eq!(broken.load(Ordering::Relaxed), 1, "{kind}: the cut-short write is reported");

        // Drain the pipe: only bytes of the first request may ever be there.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut buf = vec![0u8; 1 << 16];
        let mut drained = 0usize;
        while !second.is_finished() && Instant::now() < deadline {
            match nix::unistd::read(requests_r.as_fd(), &mut buf) {
                Ok(n) => {
                    assert!(
                        buf[..n].iter().all(|&b| b == b'1'),
                        "{kind}: bytes of another request follow a partial frame"
                    );
                    drained += n;
                }
                Err(nix::errno::Errno::EAGAIN) => tokio::task::yield_now().await,
                Err(e) => panic!("read: {e}"),
            }
        }
        assert!(drained > 0 && drained < big.len(), "{kind}: drained {drained}");
        let result = second.await.expect("task");
        assert!(matches!(result, Err(ProcessError::Io(_))), "{kind}: {result:?}");
    }
}

#[tokio::test]
async fn a_request_cancelled_before_writing_a_byte_does_not_break_the_stream() {
    for kind in YIELDING {
        let (pipes, requests_r, requests_w, _replies_w) = fake_child(kind);
        // Fill the pipe, as a busy child would leave it.
        let chunk = vec![0u8; 1 << 16];
        loop {
            match nix::unistd::write(requests_w.as_fd(), &chunk) {
                Ok(_) => {}
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => panic!("write: {e}"),
            }
        }
        let (broken, on_broken) = broken_counter();
        let frames = Arc::new(Request::frames(b"request".to_vec()));
        let mut request = Box::pin(pipes.round_trip(&frames, WriteTicket::none(), PATIENCE, on_broken));
        assert!(!poll_once(&mut request).await, "{kind}: the pipe is full");
        drop(request);
        assert_eq!(broken.load(Ordering::Relaxed), 0, "{kind}: nothing was written, nothing is broken");
        // The next request is written whole once the child reads: the stream is intact.
        let next = tokio::spawn({
            let pipes = Arc::clone(&pipes);
            async move {
                pipes
                    .round_trip(
                        &Arc::new(Request::frames(b"next".to_vec())),
                        WriteTicket::none(),
                        PATIENCE,
                        || {},
                    )
                    .await
            }
        });
        let mut buf = vec![0u8; 1 << 16];
        let mut tail = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !tail.ends_with(b"next") {
            assert!(Instant::now() < deadline, "{kind}: the next request never arrived");
            match nix::unistd::read(requests_r.as_fd(), &mut buf) {
                Ok(n) => {
                    tail.extend(buf[..n].iter().filter(|&&b| b != 0));
                }
                Err(nix::errno::Errno::EAGAIN) => tokio::task::yield_now().await,
                Err(e) => panic!("read: {e}"),
            }
        }
        assert_eq!(tail, b"next", "{kind}: only the next request follows the filler");
        next.abort();
    }
}
