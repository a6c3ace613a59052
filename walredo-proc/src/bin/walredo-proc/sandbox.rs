//! The child's sandbox, entered before the first request is read.
//!
//! Trust model: the child is not trusted once it has seen a request (redo code is large and a
//! crafted record could take it over), so before reading any request it
//! 1. closes every inherited file descriptor above stderr,
//! 2. sets `no_new_privs` (no setuid gain through exec),
//! 3. limits its address space (`RLIMIT_AS`) to what it uses at start plus [`MEMORY_BUDGET`],
//!    and
//! 4. installs a seccomp allowlist: any other syscall kills the process with SIGSYS.
//!
//! The allowlist is what the serving loop needs and nothing more: reading stdin, writing stdout
//! and stderr, polling one fd (stdin, while spinning) and reading the monotonic clock (the spin
//! window), memory management for the allocator (without executable mappings: `mmap` with
//! `PROT_EXEC` is refused and `mprotect` is not allowed at all, so injected code has nowhere to
//! run), and exiting.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
};

/// Closes every file descriptor above 2 that the daemon may have leaked to us.
pub fn close_inherited_fds() -> Result<(), String> {
    // SAFETY: close_range only closes descriptors; nothing in this process uses fds above 2 yet.
    let rc = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    if rc == 0 {
        return Ok(());
    }
    // Kernels before 5.9 lack close_range: close one by one up to the descriptor limit.
    let (soft, _) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_err(|e| format!("getrlimit: {e}"))?;
    for fd in 3..soft.min(65536) as i32 {
        // SAFETY: as above; EBADF for unused descriptors is expected and ignored.
        unsafe { libc::close(fd) };
    }
    Ok(())
}

/// Sets `no_new_privs`, always on, also without seccomp.
pub fn set_no_new_privs() -> Result<(), String> {
    // SAFETY: prctl with PR_SET_NO_NEW_PRIVS takes plain integer arguments.
    let rc = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("prctl(PR_SET_NO_NEW_PRIVS): {}", std::io::Error::last_os_error()))
    }
}

/// Address space the child may map beyond what it has at start. The serving loop needs a
/// 256 KiB read buffer, two pages and a reply header (well under 1 MiB, whatever the request,
/// since every frame is at most `MAX_FRAME_LEN`); the rest is headroom for the allocator and the
/// stack.
pub const MEMORY_BUDGET: u64 = 64 << 20;
const _: () =
    assert!(MEMORY_BUDGET >= 64 * (crate::READ_BUF_LEN + walredo_proc::protocol::MAX_FRAME_LEN) as u64);

/// Sets `RLIMIT_AS` to the address space in use now plus [`MEMORY_BUDGET`], also without
/// seccomp: a compromised child cannot take the host's memory.
pub fn limit_memory() -> Result<(), String> {
    use nix::sys::resource::{setrlimit, Resource};
    let statm =
        std::fs::read_to_string("/proc/self/statm").map_err(|e| format!("read /proc/self/statm: {e}"))?;
    let pages: u64 = statm
        .split_whitespace()
        .next()
        .and_then(|field| field.parse().ok())
        .ok_or_else(|| format!("unexpected /proc/self/statm: {statm:?}"))?;
    // SAFETY: sysconf takes an integer and returns one.
    let page_size = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let limit = pages.saturating_mul(page_size).saturating_add(MEMORY_BUDGET);
    setrlimit(Resource::RLIMIT_AS, limit, limit).map_err(|e| format!("setrlimit(RLIMIT_AS, {limit}): {e}"))
}

/// Installs the seccomp allowlist for this process's only thread.
pub fn install_seccomp() -> Result<(), String> {
    // One rule per allowed value of argument `index` (rules are alternatives).
    let arg_is = |index: u8, values: &[u64]| -> Result<Vec<SeccompRule>, String> {
        values
            .iter()
            .map(|&value| {
                let condition =
                    SeccompCondition::new(index, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, value)
                        .map_err(|e| e.to_string())?;
                SeccompRule::new(vec![condition]).map_err(|e| e.to_string())
            })
            .collect()
    };
    let fd_is = |fds: &[u64]| arg_is(0, fds);
    let always = Vec::new;
    // The `prot` argument (index 2) has no PROT_EXEC bit.
    let no_exec = || -> Result<SeccompRule, String> {
        let condition = SeccompCondition::new(
            2,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::MaskedEq(libc::PROT_EXEC as u64),
            0,
        )
        .map_err(|e| e.to_string())?;
        SeccompRule::new(vec![condition]).map_err(|e| e.to_string())
    };
    let rules: BTreeMap<i64, Vec<SeccompRule>> = [
        // Requests arrive on stdin only.
        (libc::SYS_read, fd_is(&[0])?),
        // Replies go to stdout, log lines to stderr.
        (libc::SYS_write, fd_is(&[1, 2])?),
        (libc::SYS_writev, fd_is(&[1, 2])?),
        // Spinning: a zero-timeout poll of one fd (stdin) tells whether a request is there. It
        // can only wait, and only on fds the child has (0-2).
        (libc::SYS_ppoll, arg_is(1, &[1])?),
        // Spinning: the window is timed with `Instant::now`, CLOCK_MONOTONIC. The vDSO answers it
        // without a syscall when the clock source allows; this is the fallback when it does not.
        (libc::SYS_clock_gettime, arg_is(0, &[libc::CLOCK_MONOTONIC as u64])?),
        // The allocator grows and shrinks the heap.
        (libc::SYS_brk, always()),
        // Never executable: injected code must have no memory to run from.
        (libc::SYS_mmap, vec![no_exec()?]),
        (libc::SYS_munmap, always()),
        (libc::SYS_mremap, always()),
        (libc::SYS_madvise, always()),
        // std's runtime may touch the signal stack and mask at exit, and return from handlers.
        (libc::SYS_sigaltstack, always()),
        (libc::SYS_rt_sigprocmask, always()),
        (libc::SYS_rt_sigreturn, always()),
        // Locks in std (stderr) wait on futexes only when contended; cheap to allow.
        (libc::SYS_futex, always()),
        // Leaving: exit of the thread and of the process.
        (libc::SYS_exit, always()),
        (libc::SYS_exit_group, always()),
    ]
    .into_iter()
    .collect();
    let arch = std::env::consts::ARCH.try_into().map_err(|e| format!("seccomp arch: {e:?}"))?;
    let filter = SeccompFilter::new(rules, SeccompAction::KillProcess, SeccompAction::Allow, arch)
        .map_err(|e| format!("build seccomp filter: {e}"))?;
    let program: BpfProgram = filter.try_into().map_err(|e| format!("compile seccomp filter: {e:?}"))?;
    seccompiler::apply_filter(&program).map_err(|e| format!("install seccomp filter: {e}"))
}
