//! The daemon-wide redo memory budget (`walredo_memory_budget`): bytes read for page
//! reconstruction and not yet done with, shared by every tenant's GetPage requests and by the
//! compactors' page images.
//!
//! Invariant: bytes reserved <= the budget, except that one request larger than the whole
//! budget takes all of it (it runs alone rather than never).

use std::sync::Arc;
use std::time::Duration;

use prometheus::IntGauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Why no room was reserved.
#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    #[error("the daemon is shutting down")]
    ShuttingDown,
    #[error(
        "the daemon's redo memory budget (walredo_memory_budget) had no room for this request's {bytes} bytes within {waited:?}"
    )]
    Overloaded { bytes: u64, waited: Duration },
}

/// Default of `walredo_memory_budget`.
pub const DEFAULT_REDO_MEMORY_BUDGET: u64 = 256 << 20;

/// The daemon-wide budget of bytes read for page reconstruction and not yet done with: a
/// GetPage reserves what it will read (image and records, known from the index) before reading,
/// and holds it until its page is built. A request larger than the whole budget takes all of it,
/// so it runs alone rather than never. Counted in KiB (the semaphore's permits are `u32`).
pub struct RedoBudget {
    kib: Arc<Semaphore>,
    total_kib: u32,
    /// Longest wait for room (`wal_redo_timeout`); then the request fails `Overloaded`.
    wait: Duration,
    /// `pageserver_walredo_memory_budget_used_bytes`.
    used: IntGauge,
}

/// Bytes reserved in the [`RedoBudget`], given back on drop.
#[derive(Debug)]
pub struct Reservation {
    _permit: OwnedSemaphorePermit,
    bytes: i64,
    used: IntGauge,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.used.sub(self.bytes);
    }
}

impl RedoBudget {
    pub fn new(bytes: u64, wait: Duration, used: IntGauge) -> RedoBudget {
        let total_kib =
            u32::try_from(bytes.div_ceil(1024).clamp(1, Semaphore::MAX_PERMITS as u64)).unwrap_or(u32::MAX);
        RedoBudget { kib: Arc::new(Semaphore::new(total_kib as usize)), total_kib, wait, used }
    }

    /// Reserves `bytes` (at most the whole budget), waiting for room up to the budget's wait.
    ///
    /// Cancel-safe: dropped while waiting, nothing is reserved.
    pub async fn reserve(&self, bytes: u64) -> Result<Reservation, BudgetError> {
        let kib = u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX).clamp(1, self.total_kib);
        match tokio::time::timeout(self.wait, Arc::clone(&self.kib).acquire_many_owned(kib)).await {
            Ok(Ok(permit)) => {
                let bytes = i64::from(kib) * 1024;
                self.used.add(bytes);
                Ok(Reservation { _permit: permit, bytes, used: self.used.clone() })
            }
            Ok(Err(_)) => Err(BudgetError::ShuttingDown),
            Err(_) => Err(BudgetError::Overloaded { bytes, waited: self.wait }),
        }
    }

    /// Bytes reserved now.
    pub fn in_use(&self) -> u64 {
        u64::from(self.total_kib).saturating_sub(self.kib.available_permits() as u64) * 1024
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn redo_budget_makes_requests_wait_then_refuses_them_as_overloaded() {
        let budget =
            RedoBudget::new(1 << 20, Duration::from_millis(50), IntGauge::new("used", "used").unwrap());
        let big = budget.reserve(600 << 10).await.unwrap();
        assert_eq!(budget.in_use(), 600 << 10);
        // Does not fit next to `big`: waits, then is refused.
        let err = budget.reserve(600 << 10).await.unwrap_err();
        assert!(matches!(err, BudgetError::Overloaded { bytes, .. } if bytes == 600 << 10), "{err}");
        // Fits next to it.
        let small = budget.reserve(8192).await.unwrap();
        drop((big, small));
        assert_eq!(budget.in_use(), 0);
    }

    #[tokio::test]
    async fn redo_budget_gives_a_request_larger_than_itself_the_whole_budget() {
        let budget =
            RedoBudget::new(1 << 20, Duration::from_millis(50), IntGauge::new("used", "used").unwrap());
        let huge = budget.reserve(12 << 20).await.unwrap();
        assert_eq!(budget.in_use(), 1 << 20);
        assert!(budget.reserve(1).await.is_err());
        drop(huge);
        let waiting = tokio::spawn({
            let budget = Arc::new(budget);
            async move { budget.reserve(1 << 20).await.map(drop) }
        });
        waiting.await.unwrap().unwrap();
    }
}
