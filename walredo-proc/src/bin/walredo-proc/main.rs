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
//!
//! Spin-then-park: with a spin window `W` set by the daemon (`S`, at most
//! `protocol::MAX_SPIN_US`), once the child has served what it read it busy-polls stdin for up
//! to `W` (a zero-timeout `ppoll`, then a few `spin_loop` hints, again) before its blocking
//! `read`, so a request that comes within `W` costs no wake-up (tens of microseconds across
//! vCPUs here). With `W = 0` (the start) it blocks in `read` at once, as it always did: stdin
//! stays a blocking fd, so an idle child sleeps in the kernel whatever the window, after at most
//! `W` of spinning.

mod sandbox;
mod serve;

use std::io::IoSlice;
use std::os::fd::{AsFd, BorrowedFd};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use walredo_proc::protocol::{self, decode_request, Hello, PROTOCOL_VERSION};
use walredo_proc::record::MAX_RECORD_LEN;

use serve::{Answer, RedoState};

/// Read buffer: room for many pipelined requests, and always for the largest frame.
const READ_BUF_LEN: usize = 256 * 1024;
const _: () = assert!(READ_BUF_LEN >= 2 * protocol::MAX_FRAME_LEN);

/// `spin_loop` hints between two polls of stdin while spinning: a poll is a syscall (a few
/// hundred nanoseconds), the hints keep the loop from hammering the kernel in between and cost
/// well under a microsecond of latency.
const SPIN_HINTS_PER_POLL: u32 = 16;

const USAGE: &str = "usage: walredo-proc [--no-seccomp]
The WAL redo child of the pageserver: requests on stdin, replies on stdout (docs/walredo-protocol.md).
It is started by the pageserver, not by hand.
  --no-seccomp  debugging only: run without the seccomp allowlist
  --version     print the protocol version and exit
  --help        print this and exit";

#[cfg(feature = "testing")]
const TEST_USAGE: &str = "test-only flags (cargo feature `testing`), each acting on a ping:
  --test-forbidden-syscall-on-ping   make a syscall outside the allowlist (openat)
  --test-exec-mapping-on-ping        map executable memory
  --test-big-allocation-on-ping      try to reserve 1 GiB; exit with status 3 when refused
  --test-stderr-flood-on-ping        write 100000 lines to stderr, then answer
  --test-slow-redo-ms=N              sleep N ms before each redo reply (with --no-seccomp)";

/// What a ping makes a test build do instead of answering.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PingHook {
    None,
    #[cfg(feature = "testing")]
    ForbiddenSyscall,
    #[cfg(feature = "testing")]
    ExecMapping,
    #[cfg(feature = "testing")]
    BigAllocation,
    #[cfg(feature = "testing")]
    StderrFlood,
}

struct Options {
    seccomp: bool,
    ping_hook: PingHook,
    /// Test builds: sleep this long before each redo reply (needs `--no-seccomp`).
    slow_redo: Option<std::time::Duration>,
}

fn main() -> ExitCode {
    let mut options = Options { seccomp: true, ping_hook: PingHook::None, slow_redo: None };
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--no-seccomp" => options.seccomp = false,
            #[cfg(feature = "testing")]
            "--test-forbidden-syscall-on-ping" => options.ping_hook = PingHook::ForbiddenSyscall,
            #[cfg(feature = "testing")]
            "--test-exec-mapping-on-ping" => options.ping_hook = PingHook::ExecMapping,
            #[cfg(feature = "testing")]
            "--test-big-allocation-on-ping" => options.ping_hook = PingHook::BigAllocation,
            #[cfg(feature = "testing")]
            "--test-stderr-flood-on-ping" => options.ping_hook = PingHook::StderrFlood,
            #[cfg(feature = "testing")]
            arg if arg.starts_with("--test-slow-redo-ms=") => {
                match arg["--test-slow-redo-ms=".len()..].parse() {
                    Ok(ms) => options.slow_redo = Some(std::time::Duration::from_millis(ms)),
                    Err(e) => {
                        eprintln!("walredo-proc: bad {arg:?}: {e}");
                        return ExitCode::from(2);
                    }
                }
            }
            "--version" => {
                println!("walredo-proc protocol {PROTOCOL_VERSION}");
                return ExitCode::SUCCESS;
            }
            "--help" | "-h" => {
                println!("{USAGE}");
                #[cfg(feature = "testing")]
                println!("{TEST_USAGE}");
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
    sandbox::limit_memory()?;
    if options.seccomp {
        sandbox::install_seccomp()?;
    } else {
        eprintln!("walredo-proc: running WITHOUT seccomp (--no-seccomp)");
    }

    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    let (input, output) = (stdin.as_fd(), stdout.as_fd());

    let mut hello = Vec::new();
    let seccomp_flag = if options.seccomp { protocol::HELLO_FLAG_SECCOMP } else { 0 };
    let flags = seccomp_flag | protocol::HELLO_FLAG_SPIN;
    Hello { version: PROTOCOL_VERSION, pid, max_record_len: MAX_RECORD_LEN as u32, flags }.encode(&mut hello);
    write_all(output, &[IoSlice::new(&hello)])?;

    let mut state = RedoState::new();
    let mut buf = vec![0u8; READ_BUF_LEN];
    let mut filled = 0;
    let mut reply_header = Vec::with_capacity(protocol::HEADER_LEN + protocol::MAX_ERROR_MESSAGE_LEN + 2);
    loop {
        spin_for_input(input, state.spin())?;
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
            if options.ping_hook != PingHook::None && request == protocol::Request::Ping {
                run_ping_hook(options.ping_hook);
            }
            if let (Some(delay), protocol::Request::GetPage(_)) = (options.slow_redo, &request) {
                std::thread::sleep(delay);
            }
            if let Some(reply) = state.handle(request) {
                reply_header.clear();
                match reply {
                    Answer::Page(page) => {
                        protocol::encode_page_reply_header(&mut reply_header);
                        write_all(output, &[IoSlice::new(&reply_header), IoSlice::new(page)])?;
                    }
                    Answer::Error(code, message) => {
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

/// Busy-polls `fd` until it has input (or EOF, or an error to report) or `window` has passed;
/// either way the caller's blocking `read` follows, and returns at once if input came.
fn spin_for_input(fd: BorrowedFd<'_>, window: Duration) -> Result<(), String> {
    if window.is_zero() {
        return Ok(());
    }
    let until = Instant::now() + window;
    loop {
        if has_input(fd)? || Instant::now() >= until {
            return Ok(());
        }
        for _ in 0..SPIN_HINTS_PER_POLL {
            std::hint::spin_loop();
        }
    }
}

/// Whether a `read` of `fd` would return at once (data, EOF or an error), without waiting.
fn has_input(fd: BorrowedFd<'_>) -> Result<bool, String> {
    use nix::poll::{PollFd, PollFlags};
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    match nix::poll::ppoll(&mut fds, Some(nix::sys::time::TimeSpec::new(0, 0)), None) {
        Ok(ready) => Ok(ready > 0),
        Err(nix::errno::Errno::EINTR) => Ok(false),
        Err(e) => Err(format!("poll stdin: {e}")),
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

/// Misbehaves on purpose, for the sandbox tests of a `testing` build.
#[cfg(feature = "testing")]
fn run_ping_hook(hook: PingHook) {
    match hook {
        PingHook::None => {}
        PingHook::ForbiddenSyscall => {
            eprintln!("walredo-proc: making a forbidden syscall (openat) on purpose, for a test");
            // SAFETY: a plain open of a constant C string; under seccomp it never returns.
            let fd = unsafe { libc::open(c"/etc/hostname".as_ptr(), libc::O_RDONLY) };
            eprintln!("walredo-proc: the forbidden syscall returned {fd}: no sandbox?");
        }
        PingHook::ExecMapping => {
            eprintln!("walredo-proc: mapping executable memory on purpose, for a test");
            // SAFETY: an anonymous private mapping, never touched or unmapped; under seccomp the
            // call never returns.
            let addr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_EXEC,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            eprintln!("walredo-proc: the executable mapping returned {addr:?}: no sandbox?");
        }
        PingHook::StderrFlood => {
            let line = [
                b"flood line of a test build, long enough to count in bytes too: ".as_slice(),
                &[b'x'; 64],
                b"\n",
            ]
            .concat();
            for _ in 0..100_000 {
                if write_all(std::io::stderr().as_fd(), &[IoSlice::new(&line)]).is_err() {
                    break;
                }
            }
        }
        PingHook::BigAllocation => {
            let mut big: Vec<u8> = Vec::new();
            match big.try_reserve_exact(1 << 30) {
                Err(e) => {
                    eprintln!("walredo-proc: reserving 1 GiB failed as the memory limit wants: {e}");
                    std::process::exit(3);
                }
                Ok(()) => eprintln!("walredo-proc: reserved 1 GiB: no memory limit?"),
            }
        }
    }
}

#[cfg(not(feature = "testing"))]
fn run_ping_hook(_: PingHook) {}
