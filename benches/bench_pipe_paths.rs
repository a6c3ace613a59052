//! How a base page gets from a layer file into the redo child's pipe, on the daemon's side: the
//! cost that a zero-copy data path to the child would remove. Per iteration one 8 KiB page at a
//! pseudo-random offset of an 80 MB file in the kernel's page cache goes into a pipe that a
//! reader thread drains (as the child does):
//! - `copy`: `pread` into a buffer and one `writev` of a 64-byte header and the page (the
//!   daemon's request today: its frames' bytes and the image in one vectored write);
//! - `splice`: the page alone, `splice`d from the file into the pipe (the page cache's pages
//!   referenced, not copied): what a request that were nothing but its page would cost;
//! - `splice_framed`: a 32-byte `writev`, the `splice`d page, a 32-byte `writev` (a request's
//!   frames before and after its page; a `splice` into a pipe whose last buffer holds a few
//!   bytes is cut short, and is repeated until the page is in).
//!
//! `cargo bench -p benches --bench bench_pipe_paths`; each figure is the writer's time per page.
//!
//! ## Results (2026-11-27, 2-vCPU VM, `b576b3d` and this bench)
//!
//! Criterion's estimate (median of its interval), `--warm-up-time 1 --measurement-time 3`,
//! and a scratch program's thread CPU time per page in three alternated rounds before it:
//!
//! | variant | criterion | writer CPU (3 rounds) |
//! |---|---:|---|
//! | `copy` | 6.44, 6.06 us | 5.4, 6.5, 5.2 us |
//! | `splice` | 1.97, 2.22 us | 1.9, 2.0, 2.0 us |
//! | `splice_framed` | 4.96, 4.16 us | 4.9, 4.6, 5.7 us |
//!
//! Criterion ran twice, the scratch program three rounds of 200k pages per variant. The page
//! alone spliced costs a third of the copy; with the frames around it, which a request cannot do
//! without, 0.69-0.77x of the copy in criterion's runs and 0.86-1.09x in the scratch rounds: a
//! syscall here costs about as much as copying 8 KiB, and the framed splice makes three. At
//! most 2 us of the daemon's 25-30 per redo GetPage, so splicing the image is not worth its
//! machinery (the child checking the image's checksum, which the daemon would no longer see; a
//! file part in the writers); memory shared with the child pays only if it also saves syscalls
//! or copies at both ends (docs/performance.md, "The spin budget held back by CPU pressure").

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use nix::libc;

const PAGE: usize = 8192;
const PAGES: u64 = 10_000;

/// A pipe of 1 MiB whose read end a thread drains until the write end closes.
struct Drained {
    write: Option<OwnedFd>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Drained {
    fn new() -> Drained {
        let (read, write) = nix::unistd::pipe().expect("pipe");
        // SAFETY: a valid descriptor; F_SETPIPE_SZ takes an int.
        unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) };
        let reader = std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            // SAFETY: the buffer is valid for its length; the descriptor is owned by this thread.
            while unsafe { libc::read(read.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
        });
        Drained { write: Some(write), reader: Some(reader) }
    }

    fn fd(&self) -> i32 {
        self.write.as_ref().expect("open until dropped").as_raw_fd()
    }
}

impl Drop for Drained {
    fn drop(&mut self) {
        // Closing the write end ends the reader.
        self.write = None;
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

fn writev_all(fd: i32, parts: &[&[u8]]) {
    let iov: Vec<libc::iovec> =
        parts.iter().map(|p| libc::iovec { iov_base: p.as_ptr() as *mut _, iov_len: p.len() }).collect();
    let want: usize = parts.iter().map(|p| p.len()).sum();
    // SAFETY: the slices outlive the call; a blocking pipe takes all of a write of this size.
    let n = unsafe { libc::writev(fd, iov.as_ptr(), iov.len() as i32) };
    assert_eq!(n, want as isize, "writev");
}

fn splice_all(file: i32, offset: i64, pipe: i32) {
    let (mut at, mut left) = (offset, PAGE);
    while left > 0 {
        // SAFETY: valid descriptors; `at` is a valid offset pointer.
        let n = unsafe { libc::splice(file, &mut at, pipe, std::ptr::null_mut(), left, 0) };
        assert!(n > 0, "splice: {}", std::io::Error::last_os_error());
        left -= n as usize;
    }
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("layer");
    {
        let mut f = File::create(&path).expect("create");
        let page = vec![7u8; PAGE];
        for _ in 0..PAGES {
            f.write_all(&page).expect("write");
        }
    }
    let _ = std::fs::read(&path).expect("read into the page cache");
    let file = File::open(&path).expect("open");
    let fd = file.as_raw_fd();
    let mut next = {
        let mut x: u64 = 12345;
        move || {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) % PAGES) as i64 * PAGE as i64
        }
    };
    let header = [0u8; 64];
    let mut group = c.benchmark_group("pipe_paths");
    group.warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    {
        let pipe = Drained::new();
        let w = pipe.fd();
        let mut buf = vec![0u8; PAGE];
        group.bench_function("copy", |b| {
            b.iter(|| {
                // SAFETY: the buffer is valid for PAGE bytes.
                let n = unsafe { libc::pread(fd, buf.as_mut_ptr().cast(), PAGE, next()) };
                assert_eq!(n, PAGE as isize, "pread");
                writev_all(w, &[&header, &buf]);
            })
        });
    }
    {
        let pipe = Drained::new();
        let w = pipe.fd();
        group.bench_function("splice", |b| b.iter(|| splice_all(fd, next(), w)));
    }
    {
        let pipe = Drained::new();
        let w = pipe.fd();
        group.bench_function("splice_framed", |b| {
            b.iter(|| {
                writev_all(w, &[&header[..32]]);
                splice_all(fd, next(), w);
                writev_all(w, &[&header[..32]]);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
