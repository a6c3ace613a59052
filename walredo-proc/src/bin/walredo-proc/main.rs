//! `walredo-proc`: the WAL redo child process.
//!
//! Reads requests on stdin and answers on stdout (docs/walredo-protocol.md), logs to stderr.
//! Start-up: close inherited fds, set `no_new_privs`, install the seccomp allowlist, send the
//! hello; then serve until EOF.
//!
//! Trust model: the child is not trusted once it has seen a request, so the sandbox is in place
//! before the first read of stdin. The daemon must also not trust anything the child sends.
//!
//! I/O: reads are buffered (one `read` takes as many queued messages as fit in the buffer); each
//! reply is one `writev` (header and page). An error frame fails one request and the loop goes
//! on; a framing violation ends the process with status 2, because the stream can no longer be
//! parsed; EOF between frames ends it with status 0.

mod sandbox;
mod serve;

use std::io::IoSlice;
use std::os::fd::{AsFd, BorrowedFd};
use std::process::ExitCode;

use walredo_proc::protocol::{self, decode_request, Hello, PROTOCOL_VERSION};
use walredo_proc::record::MAX_RECORD_LEN;

use serve::{RedoState, Reply};

/// Read buffer: room for many pipelined requests, and always for the largest frame.
const READ_BUF_LEN: usize = 256 * 1024;
const _: () = assert!(READ_BUF_LEN >= 2 * protocol::MAX_FRAME_LEN);

const USAGE: &str = "usage: walredo-proc [--no-seccomp] [--test-forbidden-syscall-on-ping]
  --no-seccomp                      debugging only: run without the seccomp allowlist
  --test-forbidden-syscall-on-ping  for tests only: make a forbidden syscall when pinged";

struct Options {
    seccomp: bool,
    /// For tests: prove that the sandbox kills the process on a syscall outside the allowlist.
    forbidden_syscall_on_ping: bool,
}

fn main() -> ExitCode {
    let mut options = Options { seccomp: true, forbidden_syscall_on_ping: false };
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--no-seccomp" => options.seccomp = false,
            "--test-forbidden-syscall-on-ping" => options.forbidden_syscall_on_ping = true,
            "--version" => {
                println!("walredo-proc protocol {PROTOCOL_VERSION}");
                return ExitCode::SUCCESS;
            }
            _ => {
                eprintln!("walredo-proc: unknown argument {arg:?}\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    match run(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("walredo-proc: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(options: &Options) -> Result<(), String> {
    // Ask for the pid before the sandbox: getpid is not on the allowlist.
    let pid = std::process::id();
    sandbox::close_inherited_fds()?;
    sandbox::set_no_new_privs()?;
    if options.seccomp {
        sandbox::install_seccomp()?;
    } else {
        eprintln!("walredo-proc: running WITHOUT seccomp (--no-seccomp)");
    }

    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    let (input, output) = (stdin.as_fd(), stdout.as_fd());

    let mut hello = Vec::new();
    let flags = if options.seccomp { protocol::HELLO_FLAG_SECCOMP } else { 0 };
    Hello { version: PROTOCOL_VERSION, pid, max_record_len: MAX_RECORD_LEN as u32, flags }.encode(&mut hello);
    write_all(output, &[IoSlice::new(&hello)])?;

    let mut state = RedoState::new();
    let mut buf = vec![0u8; READ_BUF_LEN];
    let mut filled = 0;
    let mut reply_header = Vec::with_capacity(protocol::HEADER_LEN + protocol::MAX_ERROR_MESSAGE_LEN + 2);
    loop {
        let n = read_retrying(input, &mut buf[filled..])?;
        if n == 0 {
            if filled == 0 {
                return Ok(());
            }
            return Err(format!("EOF inside a frame ({filled} bytes of it read)"));
        }
        filled += n;

        let mut start = 0;
        while let Some((request, used)) =
            decode_request(&buf[start..filled]).map_err(|e| format!("framing violation: {e}"))?
        {
            if options.forbidden_syscall_on_ping && request == protocol::Request::Ping {
                forbidden_syscall();
            }
            if let Some(reply) = state.handle(request) {
                reply_header.clear();
                match reply {
                    Reply::Page(page) => {
                        protocol::encode_page_reply_header(&mut reply_header);
                        write_all(output, &[IoSlice::new(&reply_header), IoSlice::new(page)])?;
                    }
                    Reply::Error(code, message) => {
                        protocol::encode_error_reply(&mut reply_header, code, &message);
                        write_all(output, &[IoSlice::new(&reply_header)])?;
                    }
                }
            }
            start += used;
        }
        // Keep the incomplete frame at the front; the buffer always has room for a whole one.
        buf.copy_within(start..filled, 0);
        filled -= start;
    }
}

fn read_retrying(fd: BorrowedFd<'_>, buf: &mut [u8]) -> Result<usize, String> {
    loop {
        match nix::unistd::read(fd, buf) {
            Err(nix::errno::Errno::EINTR) => continue,
            other => return other.map_err(|e| format!("read stdin: {e}")),
        }
    }
}

/// Writes all of `parts` with as few `writev` calls as the pipe allows (one, normally).
fn write_all(fd: BorrowedFd<'_>, parts: &[IoSlice<'_>]) -> Result<(), String> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut written = 0;
    while written < total {
        // Rebuild the slices past what is written already (rare: only after a partial write).
        let mut skip = written;
        let mut rest: Vec<IoSlice<'_>> = Vec::with_capacity(parts.len());
        for part in parts {
            if skip >= part.len() {
                skip -= part.len();
            } else {
                rest.push(IoSlice::new(&part[skip..]));
                skip = 0;
            }
        }
        match nix::sys::uio::writev(fd, &rest) {
            Ok(n) => written += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(format!("write stdout: {e}")),
        }
    }
    Ok(())
}

/// Opens a file, which the sandbox forbids: the kernel kills the process with SIGSYS.
fn forbidden_syscall() {
    eprintln!("walredo-proc: making a forbidden syscall (openat) on purpose, for a test");
    // SAFETY: a plain open of a constant C string; under seccomp it never returns.
    let fd = unsafe { libc::open(c"/etc/hostname".as_ptr(), libc::O_RDONLY) };
    eprintln!("walredo-proc: the forbidden syscall returned {fd}: no sandbox?");
}
