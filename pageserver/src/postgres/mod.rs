//! The PostgreSQL protocol client: what the daemon and the operator tool speak to a PostgreSQL
//! 15 server with, and nothing of what they do with the answers.
//!
//! - [`connstr`]: libpq keyword/value connection strings (pure);
//! - [`pq`]: the replication protocol client over plain TCP (start-up, authentication, simple
//!   queries, `START_REPLICATION`'s CopyBoth stream, `BASE_BACKUP`).
//!
//! Used by the WAL receiver (`tenant::wal_receiver`) and by `pagectl receivewal` and
//! `pagectl basebackup`, through this public interface only.
//!
//! Invariant: it knows nothing of storage, tenants or the key space: it hands bytes and LSNs to
//! its caller (layer 0 of ARCHITECTURE.md's "Layers and imports": it imports no module of the
//! crate). Trust model: the server is not trusted to be well-formed (see [`pq`]).

pub mod connstr;
pub mod pq;
