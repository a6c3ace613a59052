//! The heap as glibc's allocator keeps it: what the daemon holds and what the allocator keeps
//! free for reuse ([`figures`], for `/metrics`), and handing free memory back to the kernel
//! ([`return_freed_memory`]).
//!
//! Why: glibc keeps freed chunks in its arenas (one per thread that contended, up to 8 per
//! core) for reuse and gives their pages back only at the top of a heap. A burst of
//! allocations (an ingest, a compaction pass, the reads filling the block cache, spread over
//! every executor thread) leaves the resident memory at its high-water mark: at 20 GB on 16
//! cores about 130 MiB beyond the caches (docs/performance.md). `malloc_trim` hands the free
//! chunks' whole pages back.
//!
//! **Invariant:** a trim runs only after the free heap grew by [`TRIM_GROWTH`] since the last
//! one (freed and not reused): memory the daemon keeps reusing is left alone, and an idle
//! daemon does not trim (a trim walks every free chunk under its arena's lock).

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// What the allocator holds, over all arenas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Figures {
    /// Bytes in chunks the daemon holds (mapped chunks included).
    pub in_use: u64,
    /// Bytes in free chunks the allocator keeps for reuse (resident where they were touched
    /// and not trimmed since).
    pub free: u64,
}

/// The allocator's figures (glibc's `mallinfo2`, which takes each arena's lock in turn: cheap
/// at a scrape, not for a hot path). `None` where the allocator is not glibc's.
pub fn figures() -> Option<Figures> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 takes no arguments and returns a struct by value.
        let info = unsafe { libc::mallinfo2() };
        Some(Figures { in_use: (info.uordblks + info.hblkhd) as u64, free: info.fordblks as u64 })
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

/// How often [`return_freed_memory`] looks at the free heap.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(10);
/// Growth of the free heap since the last trim (or its low point since) that makes a trim.
pub const TRIM_GROWTH: u64 = 16 << 20;

/// Whether to trim now, given the free heap now and the baseline (the free heap after the last
/// trim, lowered to any smaller figure seen since: what was freed and then reused again no
/// longer counts). Updates the baseline.
fn due(free: u64, baseline: &mut u64) -> bool {
    if free < *baseline {
        *baseline = free;
    }
    free >= *baseline + TRIM_GROWTH
}

/// Every [`CHECK_INTERVAL`] until `cancel`: hands the pages of free heap chunks back to the
/// kernel (`malloc_trim`, on the blocking pool) when the free heap grew by [`TRIM_GROWTH`].
pub async fn return_freed_memory(cancel: CancellationToken) {
    let Some(start) = figures() else {
        return;
    };
    let mut baseline = start.free;
    loop {
        tokio::select! {
            () = tokio::time::sleep(CHECK_INTERVAL) => {}
            () = cancel.cancelled() => return,
        }
        let Some(now) = figures() else {
            return;
        };
        if !due(now.free, &mut baseline) {
            continue;
        }
        let trimmed = tokio::task::spawn_blocking(move || {
            let began = Instant::now();
            trim();
            began.elapsed()
        })
        .await;
        match trimmed {
            Ok(took) => tracing::debug!(free = now.free, in_use = now.in_use, ?took, "handed free heap back"),
            Err(e) => tracing::warn!("heap trim task failed: {e}"),
        }
        baseline = figures().map_or(now.free, |f| f.free);
    }
}

/// Hands the whole pages of free heap chunks, in every arena, back to the kernel.
fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointers; it only walks glibc's own arenas, under their
    // locks, and returns free pages to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_trim_is_due_only_when_the_free_heap_grew_past_its_low_point() {
        const MIB: u64 = 1 << 20;
        let mut baseline = 100 * MIB;
        assert!(!due(110 * MIB, &mut baseline));
        // Reused down to 60 MiB: growth counts from there.
        assert!(!due(60 * MIB, &mut baseline));
        assert_eq!(baseline, 60 * MIB);
        assert!(!due(75 * MIB, &mut baseline));
        assert!(due(76 * MIB, &mut baseline));
    }

    /// The figures follow allocations: 80 MiB of 8 KiB chunks are in use; freeing every other
    /// one leaves about 40 MiB free in the arena (the chunks between them keep it from being
    /// given back). Margins allow for the other tests' threads.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn figures_follow_allocations() {
        const MIB: u64 = 1 << 20;
        let before = figures().unwrap();
        let mut chunks: Vec<Option<Box<[u8]>>> =
            (0..10_240).map(|i| Some(vec![i as u8; 8192].into_boxed_slice())).collect();
        let held = figures().unwrap();
        assert!(held.in_use >= before.in_use + 70 * MIB, "{before:?} -> {held:?}");
        for chunk in chunks.iter_mut().step_by(2) {
            *chunk = None;
        }
        let freed = figures().unwrap();
        assert!(freed.in_use + 30 * MIB <= held.in_use, "{held:?} -> {freed:?}");
        assert!(freed.free >= before.free + 30 * MIB, "{before:?} -> {freed:?}");
        // A trim hands the free chunks' whole pages back: of each free 8 KiB chunk between two
        // held ones, the one page that lies inside it (about 20 of the 40 MiB here).
        let resident = rss();
        trim();
        assert!(rss() + 12 * MIB <= resident, "{resident} -> {}", rss());
        drop(chunks);
    }

    fn rss() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .unwrap()
            .trim()
            .trim_end_matches(" kB")
            .parse()
            .unwrap();
        kib * 1024
    }
}
