//! The WAL receiver's room under the tenant: what a tenant needs to follow a PostgreSQL 15
//! primary over physical replication.
//!
//! Built so far: [`connstr`] (libpq keyword/value connection strings) and [`pq`] (the
//! replication protocol client: start-up, authentication, `IDENTIFY_SYSTEM`, slots and the
//! `START_REPLICATION` stream), which `pagectl receivewal` drives today. The receiver task of a
//! tenant (initial import, streaming ingest, status) is not built yet (ARCHITECTURE.md).
//!
//! Layer: under `tenant`; it may use `storage`, `walredo` and `page_types::wal`, never
//! `tenants`, `page_service` or `http`.

pub mod connstr;
pub mod pq;
