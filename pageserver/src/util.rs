//! Small pieces that modules of every layer share, and that belong to none of them.
//!
//! Invariant: depends on nothing in this crate (the bottom layer of ARCHITECTURE.md's table).

use std::sync::{Mutex, MutexGuard};

/// Locks a std mutex, taking the guard even if a panicking thread poisoned it: the data behind
/// every mutex of this crate stays consistent between statements (no invariant is broken across
/// a call that can panic), so a panic elsewhere must not turn into panics here.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
