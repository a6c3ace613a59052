//! File descriptors: the daemon raises its soft `RLIMIT_NOFILE` to the hard limit at start and
//! splits what it may open between page service connections and a reserve for the rest.
//!
//! The reserve is for what grows while the daemon runs: new layer files and segments of the
//! tenants' storage, redo children's pipes (3 per child), new tenants, and management API
//! connections (capped separately, [`HTTP_MAX_CONNECTIONS`]). Page service connections get
//! what remains after the descriptors open once tenants are loaded, the reserve and the API's
//! share; `max_connections` is lowered to that, with a WARN saying so. Without this, a flood
//! of connections that never say Hello could take every descriptor and make the next seal of
//! some tenant fail with EMFILE.
//!
//! Invariant: nothing here fails the start; an unreadable limit leaves the setting as it is.

use nix::sys::resource::{getrlimit, setrlimit, Resource};

/// Management API connections at once; more wait in the listen backlog.
pub const HTTP_MAX_CONNECTIONS: usize = 64;
/// The smallest reserve; otherwise a quarter of the limit.
const MIN_RESERVE: u64 = 64;

/// Raises the soft descriptor limit to the hard one; returns the soft limit in force.
pub fn raise_limit() -> Option<u64> {
    let (soft, hard) = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok(limits) => limits,
        Err(e) => {
            tracing::warn!("failed to read the file descriptor limit: {e}");
            return None;
        }
    };
    if soft >= hard {
        return Some(soft);
    }
    match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
        Ok(()) => {
            tracing::info!(from = soft, to = hard, "raised the file descriptor limit to the hard limit");
            Some(hard)
        }
        Err(e) => {
            tracing::warn!(soft, hard, "failed to raise the file descriptor limit: {e}");
            Some(soft)
        }
    }
}

/// Descriptors open in this process now; `None` if `/proc/self/fd` cannot be read.
pub fn open_now() -> Option<u64> {
    // One of the entries is the directory being read.
    std::fs::read_dir("/proc/self/fd").ok().map(|entries| (entries.count() as u64).saturating_sub(1))
}

/// The reserve for storage, children and new tenants under a limit of `limit`.
pub fn reserve(limit: u64) -> u64 {
    (limit / 4).max(MIN_RESERVE)
}

/// How many page service connections fit: `max_connections`, or fewer when the descriptors
/// left after `open`, the reserve and the management API's share do not cover it (at least 1).
pub fn page_service_connections(max_connections: usize, limit: u64, open: u64) -> usize {
    let left =
        limit.saturating_sub(open).saturating_sub(reserve(limit)).saturating_sub(HTTP_MAX_CONNECTIONS as u64);
    let left = usize::try_from(left).unwrap_or(usize::MAX);
    max_connections.min(left).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_get_what_the_reserve_and_the_api_leave() {
        // 1024 (a common default): 256 reserved, 64 for the API, 24 open.
        assert_eq!(page_service_connections(1000, 1024, 24), 680);
        assert_eq!(page_service_connections(100, 1024, 24), 100);
        assert_eq!(page_service_connections(1000, 1 << 20, 24), 1000);
        // Too few descriptors for anything: one connection still.
        assert_eq!(page_service_connections(1000, 100, 90), 1);
        assert_eq!(reserve(100), MIN_RESERVE);
    }
}
