//! From what a PostgreSQL 15 primary sends to the values a tenant stores: the pure steps of
//! ingest, with no I/O and no tenant of their own (the WAL receiver drives them and stores
//! their values; `pagectl` drives them without storing).
//!
//! - [`tar`]: an incremental reader of a base backup's tar archives;
//! - [`import`]: a base backup's archives to values (relation blocks, sizes, SLRU pages,
//!   `pg_control`, relation maps), in bounded batches;
//! - [`wal_values`]: a decoded WAL record to values (images, `pg15` records, visibility-map
//!   clears, relation sizes and drops, CLOG and MultiXact pages), and [`wal_values::RelSizes`], the
//!   receiver's cache of relation sizes; with the parts it calls on: [`xact`] (a transaction's
//!   end as its record says it), [`slru`] (the CLOG's values), [`multixact`] (the MultiXact
//!   SLRUs' values), [`twophase`] (prepared transactions' state files) and [`counters`] (the
//!   checkpoint counters, which the receiver keeps and stores once per batch).
//!
//! Invariant: pure, no I/O (each file's doc gives its own invariants). Layer: above `storage` (it speaks its `Value`), below `tenant`; it reads nothing
//! back from a timeline (that is `tenant::rel_sizes`).

pub mod counters;
pub mod import;
pub mod multixact;
pub mod slru;
pub mod tar;
pub mod twophase;
pub mod wal_values;
pub mod xact;
