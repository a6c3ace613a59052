//! The daemon's allocator, jemalloc ([`Allocator`]): its figures for `/metrics` ([`figures`])
//! and the background thread that hands freed memory back to the kernel ([`start_purging`]).
//! The binary makes it the global allocator and starts the thread. Tests and benchmarks that
//! link this crate keep the system's allocator (or their own: `tests/zero_copy.rs` counts
//! allocations), and the figures then count nothing.
//!
//! Why not glibc's: every request allocates and frees (a read's buffers, the redo request, the
//! 8 KiB reply, the reply frame), and a buffer is often freed on another executor thread than
//! the one that allocated it. glibc takes the lock of the arena a chunk came from to free it,
//! consolidates its fastbins at each allocation of 1 KiB or more, and keeps freed memory until
//! a `malloc_trim`. On 16 cores its arena locks left the machine 6-21% idle under a load that
//! wanted more CPU, and GetPage throughput swung between runs (130k-165k rps at 64 x 8);
//! jemalloc, side by side, served 166-168k rps at 7-8% idle for 0.92-0.95x glibc's daemon CPU
//! per request (docs/performance.md, "The allocator"). mimalloc was as fast, but kept freed
//! large blocks longer: the peak RSS of pipelined 12 MiB reconstructions (test_redo_memory.py)
//! went past the redo memory budget's bound, where jemalloc's, like glibc's, stays within it.
//!
//! jemalloc keeps a cache per thread, arenas spread over the threads, and returns freed pages
//! to the kernel as they age (10 s for dirty pages by default) from one background thread, so
//! an idle daemon gives back what a burst freed without a trim task of its own.

use tikv_jemalloc_ctl::{background_thread, epoch, max_background_threads, stats};

/// The daemon's allocator, for the binary's `#[global_allocator]`. The redo child is another
/// program and keeps the system's.
pub type Allocator = tikv_jemallocator::Jemalloc;

/// What jemalloc holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Figures {
    /// Bytes in allocations the daemon holds (`stats.allocated`).
    pub in_use: u64,
    /// Resident bytes the allocator holds beyond them (`stats.resident` less the above): freed
    /// pages not yet handed back, partly used pages, the allocator's own metadata.
    pub free: u64,
}

/// The allocator's figures (refreshing jemalloc's statistics takes its control lock and
/// merges every arena's: cheap at a scrape, not for a hot path). `None` if jemalloc refuses.
pub fn figures() -> Option<Figures> {
    epoch::advance().ok()?;
    let in_use = stats::allocated::read().ok()? as u64;
    let resident = stats::resident::read().ok()? as u64;
    Some(Figures { in_use, free: resident.saturating_sub(in_use) })
}

/// Starts jemalloc's background thread (one for all arenas): it hands pages freed some seconds
/// ago back to the kernel even while no thread allocates. Idempotent; a failure leaves the
/// purging to the allocating threads and is logged.
pub fn start_purging() {
    let started = max_background_threads::write(1).and_then(|()| background_thread::write(true));
    if let Err(e) = started {
        tracing::warn!("jemalloc's background purge thread did not start ({e}): freed memory goes back only as threads allocate");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    use std::alloc::{GlobalAlloc, Layout};

    /// The figures follow allocations (made through [`Allocator`] directly: the test binary
    /// keeps the system's allocator): 80 MiB of 8 KiB chunks, written, are in use while held;
    /// freeing every other one takes about 40 MiB off what is in use, and what stays resident
    /// of it counts as free until it is handed back.
    #[test]
    fn figures_follow_allocations() {
        const MIB: u64 = 1 << 20;
        let layout = Layout::from_size_align(8192, 8).unwrap();
        let before = figures().unwrap();
        let chunks: Vec<*mut u8> = (0..10_240)
            .map(|i| {
                // SAFETY: a valid layout of non-zero size; the chunk is written within it.
                unsafe {
                    let p = Allocator {}.alloc(layout);
                    assert!(!p.is_null());
                    p.write_bytes(i as u8 | 1, layout.size());
                    p
                }
            })
            .collect();
        let held = figures().unwrap();
        assert!(held.in_use >= before.in_use + 70 * MIB, "{before:?} -> {held:?}");
        for &p in chunks.iter().step_by(2) {
            // SAFETY: allocated above with the same allocator and layout, freed once.
            unsafe { Allocator {}.dealloc(p, layout) };
        }
        let freed = figures().unwrap();
        assert!(freed.in_use + 30 * MIB <= held.in_use, "{held:?} -> {freed:?}");
        assert!(freed.free >= held.free + 30 * MIB, "{held:?} -> {freed:?}");
        for &p in chunks.iter().skip(1).step_by(2) {
            // SAFETY: as above; these are the ones not freed yet.
            unsafe { Allocator {}.dealloc(p, layout) };
        }
    }

    #[test]
    fn the_background_thread_starts() {
        start_purging();
        assert!(background_thread::read().unwrap());
        assert_eq!(max_background_threads::read().unwrap(), 1);
    }
}
