//! The commit pool: a fixed number of std threads, shared by every timeline of the process,
//! that run the timelines' commit rounds. Threads are O(1) in the number of tenants.
//!
//! Why threads and not async: a round blocks in `fdatasync` (milliseconds) and in file writes;
//! a few dedicated threads keep that off the async executor and bound how many fsyncs run at
//! once, like the one committer thread per timeline did before, without 1000 threads for 1000
//! tenants.
//!
//! Scheduling: a timeline with work (queued batches, a stop) is put in the run queue once (its
//! `scheduled` flag); a worker takes it, runs one round (every batch queued at that moment: one
//! group, one fsync), clears the flag, and puts it back at the end of the queue if more work
//! arrived meanwhile. So a timeline is run by one worker at a time (its groups stay in order),
//! batches that arrive during a round's fsync form the next group (group commit as before), and
//! busy timelines take turns.
//!
//! **Invariants:** the workers live as long as the process and never wait for anything but a
//! timeline's own I/O; a panic in a round stops that timeline only (its ingests fail), never
//! the worker.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};

use anyhow::Context;

/// What the pool runs: one timeline's committer ([`super::commit`]), scheduled by itself.
pub(super) trait Task: Send + Sync + 'static {
    /// Runs one round. The task's own scheduling guarantees one worker at a time runs it.
    fn run(self: Arc<Self>);
}

/// Worker threads of the pool: enough to keep a few fsyncs in flight on different timelines.
pub(crate) const COMMIT_THREADS: usize = 4;

/// The run queue of timelines with work.
pub(super) struct Pool {
    queue: Mutex<VecDeque<Arc<dyn Task>>>,
    ready: Condvar,
}

static POOL: OnceLock<Result<Arc<Pool>, String>> = OnceLock::new();

/// The process's pool, started on first use.
pub(super) fn get() -> anyhow::Result<Arc<Pool>> {
    let pool = POOL.get_or_init(|| start().map_err(|e| format!("{e:#}")));
    pool.clone().map_err(|e| anyhow::anyhow!("start storage commit pool: {e}"))
}

fn start() -> anyhow::Result<Arc<Pool>> {
    let pool = Arc::new(Pool { queue: Mutex::new(VecDeque::new()), ready: Condvar::new() });
    for i in 0..COMMIT_THREADS {
        let pool = Arc::clone(&pool);
        std::thread::Builder::new()
            .name(format!("storage-commit-{i}"))
            .spawn(move || pool.work())
            .context("spawn storage commit thread")?;
    }
    Ok(pool)
}

impl Pool {
    /// Queues `job` to run; the caller has set its `scheduled` flag.
    pub(super) fn push(&self, job: Arc<dyn Task>) {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner).push_back(job);
        self.ready.notify_one();
    }

    fn work(&self) {
        loop {
            let job = {
                let mut q = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
                loop {
                    if let Some(job) = q.pop_front() {
                        break job;
                    }
                    q = self.ready.wait(q).unwrap_or_else(PoisonError::into_inner);
                }
            };
            job.run();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use page_types::Lsn;

    use super::*;
    use crate::storage::test_support::*;

    /// Threads of this process whose name starts with `prefix`.
    fn threads_named(prefix: &str) -> usize {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter(|t| {
                let comm =
                    std::fs::read_to_string(t.as_ref().unwrap().path().join("comm")).unwrap_or_default();
                comm.starts_with(prefix)
            })
            .count()
    }

    #[tokio::test]
    async fn two_hundred_timelines_commit_on_the_pool_threads_only() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        let timelines: Vec<_> =
            (0..200).map(|i| open(&dir.path().join(format!("t{i}")), 1 << 30, &m)).collect();
        let ingests = timelines.iter().enumerate().map(|(i, tl)| {
            let values = (1..=3u64).map(|lsn| (key(i as u32), lsn, record(&format!("{i}@{lsn}")))).collect();
            tl.ingest(batch(values))
        });
        for r in join_in_order(ingests.collect()).await {
            assert_eq!(r.unwrap(), Lsn(3));
        }
        assert_eq!(threads_named("storage-commit"), COMMIT_THREADS);
        for (i, tl) in timelines.iter().enumerate() {
            let d = tl.get_reconstruct_data(key(i as u32), Lsn(3), NO_LIMITS).unwrap();
            assert_eq!(d.records.len(), 3);
        }
    }
}
