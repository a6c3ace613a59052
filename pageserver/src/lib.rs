//! The pageserver daemon's library.
//!
//! - [`storage`]: durable per-tenant storage (append log, immutable layers, index).
//! - [`walredo`]: the redo child process managers (sync and async kinds).
//! - [`test_support`]: for tests and benchmarks: builds and finds the `walredo-proc` binary.

pub mod storage;
pub mod test_support;
pub mod walredo;
