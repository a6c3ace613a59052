//! The WAL redo child's library: everything both ends of the redo pipe share, and nothing else.
//!
//! - [`protocol`]: framing and the messages in both directions (encode and decode, hard limits).
//! - [`page`]: the PostgreSQL page layout (header fields, line pointers).
//! - [`record`]: the versioned record set, its encoding and its apply functions.
//! - [`pg15`]: PostgreSQL 15 WAL records stored per block, and their redo (one module per
//!   resource manager) and page masks.
//!
//! **Invariant:** this library does no I/O, spawns nothing and never panics on input: every
//! length it reads is checked against a limit before it is used. The daemon links it; the
//! sandbox lives in the binary (`src/bin/walredo-proc/`), so the daemon never links the sandbox code.

pub mod page;
pub mod pg15;
pub mod protocol;
pub mod record;
