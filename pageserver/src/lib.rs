//! The pageserver daemon's library: everything the `pageserver` binary runs, callable from tests.
//!
//! - [`server`]: `run(conf, shutdown)`, the daemon as a function;
//! - [`config`]: settings (file, overrides, defaults);
//! - [`tenants`] / [`tenant`]: the tenants and the GetPage@LSN path;
//! - [`tenant_series`]: per-tenant metrics, exported for the busiest tenants only;
//! - [`storage`]: durable per-tenant storage (append log, immutable layers, layer map,
//!   compaction passes);
//! - [`compaction`] / [`compaction_controller`]: the time-sliced background compactor of a
//!   tenant, and its pure CPU-share policy;
//! - [`page_cache`]: reconstructed pages, bounded in bytes;
//! - [`page_service`]: the TCP data path (GetPage, Ingest) and its wire protocol;
//! - [`http`]: the management API;
//! - [`logging`]: log setup (plain or JSON, never panics) and the panic hook;
//! - [`process_metrics`]: the standard `process_*` metrics and `pageserver_build_info`;
//! - [`walredo`]: the redo child process managers (sync, async and auto kinds) and their pools;
//! - [`worker_controller`]: the pure sizing policy for a pool of workers (the redo process
//!   pool's);
//! - [`test_support`]: for tests and benchmarks: builds and finds the `walredo-proc` binary.

pub mod compaction;
pub mod compaction_controller;
pub mod config;
pub mod http;
pub mod logging;
pub mod page_cache;
pub mod page_service;
pub mod process_metrics;
pub mod server;
pub mod storage;
pub mod tenant;
pub mod tenant_series;
pub mod tenants;
pub mod test_support;
pub mod walredo;
pub mod worker_controller;
