//! The pageserver daemon's library: everything the `pageserver` binary runs, callable from tests.
//! Its modules are layered (ARCHITECTURE.md, "Layers and imports"; `scripts/check_imports.py`):
//! each imports only modules of lower layers, listed here from the top.
//!
//! - [`server`]: `run(conf, shutdown)`, the daemon as a function;
//! - [`config`]: the settings file and `-c` overrides, composed from the parts' own settings;
//! - [`http`]: the management API and its listener;
//! - [`page_service`]: the TCP data path (GetPage, Ingest) and its wire protocol;
//! - [`tenant_series`]: per-tenant metrics, exported for the busiest tenants only;
//! - [`tenants`] / [`tenant`]: the tenants and the GetPage@LSN path (with the WAL receiver and
//!   the relation sizes the read path reads);
//! - [`compaction`]: the time-sliced background compactor of a tenant;
//! - [`walredo`]: the redo child process managers (sync, async and auto kinds) and their pools;
//! - [`ingest`]: PostgreSQL's base backups and WAL records to values (pure);
//! - [`storage`]: durable per-tenant storage (append log, immutable layers, layer map,
//!   compaction passes);
//! - [`page_cache`]: reconstructed pages, bounded in bytes;
//! - [`redo_budget`]: the daemon-wide memory budget of page reconstruction;
//! - [`process_metrics`]: the standard `process_*` metrics and `pageserver_build_info`;
//! - [`executor_metrics`]: the async runtime's figures (workers, busy time, parks);
//! - [`worker_controller`] / [`compaction_controller`]: pure policies (the redo pool's size
//!   and spinning; the compactor's CPU share);
//! - [`metrics`]: the per-tenant request series (histogram and failures);
//! - [`logging`]: log setup (plain or JSON, never panics) and the panic hook;
//! - [`fds`]: the descriptor limit and its split between connections and a reserve;
//! - [`util`]: small shared pieces (the poison-tolerant `lock`);
//! - [`postgres`]: the PostgreSQL protocol client (connection strings, replication, base backup);
//! - [`test_support`]: for tests and benchmarks: builds and finds the `walredo-proc` binary;
//!   waits for a condition in unit tests.

pub mod basebackup;
pub mod compaction;
pub mod compaction_controller;
pub mod config;
pub mod executor_metrics;
pub mod fds;
pub mod heap;
pub mod http;
pub mod ingest;
pub mod logging;
pub mod metrics;
pub mod page_cache;
pub mod page_service;
pub mod postgres;
pub mod process_metrics;
pub mod redo_budget;
pub mod remote;
pub mod server;
pub mod storage;
pub mod tenant;
pub mod tenant_series;
pub mod tenants;
pub mod test_support;
pub mod util;
pub mod walredo;
pub mod worker_controller;
