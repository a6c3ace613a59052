//! A timeline's index in the bucket (`index_part.json-<GEN>`, docs/storage-format.md): every
//! layer with the generation of its object, its size and crc32c; what the layers cover; the
//! timeline's metadata, as a node needs it to serve the timeline with no other file.

use anyhow::Context;
use page_types::Lsn;
use serde::{Deserialize, Serialize};

use super::Generation;
use crate::storage::{LayerFile, LayerFiles};

/// The object name's stem; the object is `<stem>-<GEN>`.
pub(super) const INDEX_NAME: &str = "index_part.json";
/// Version of the index's JSON schema written (and the only one read).
pub const INDEX_VERSION: u32 = 1;

/// `index_part.json-<GEN>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexPart {
    pub version: u32,
    /// The generation of the node that wrote this index.
    pub generation: Generation,
    /// The generation of the local manifest the layers were listed by: every layer name carries
    /// one at most this (a copy's manifest starts above it).
    pub manifest_generation: u64,
    /// In the manifest's order (the layer map's runs, oldest first).
    pub layers: Vec<IndexLayer>,
    /// The layers' last LSN: what was durable at or below it is in the layers.
    pub disk_consistent_lsn: Lsn,
    /// GetPage below this LSN is refused.
    pub gc_cutoff: Lsn,
    pub metadata: TimelineMetadata,
}

/// One layer of an [`IndexPart`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexLayer {
    /// The layer's file name (and its object's, before `-<GEN>`).
    pub name: String,
    /// The generation its object carries.
    pub generation: Generation,
    pub size: u64,
    pub crc32c: u32,
    pub first_lsn: Lsn,
    pub last_lsn: Lsn,
}

/// What a node needs besides the layers to serve a timeline (the files of its directory), as
/// opaque values: storage and this module do not interpret them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimelineMetadata {
    /// A branch's ancestor and branch point; `None` for `main`.
    #[serde(default)]
    pub ancestor: Option<AncestorMeta>,
    /// The tenant's overrides (`tenant.toml`, as written).
    #[serde(default)]
    pub tenant_conf: String,
    /// The timeline's WAL source file (`wal_source.json`), its position at most what the
    /// layers cover ([`super::MetadataFn`]).
    #[serde(default)]
    pub wal_source: Option<serde_json::Value>,
}

/// A branch's ancestor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AncestorMeta {
    pub timeline: String,
    pub lsn: Lsn,
}

impl IndexPart {
    pub fn encode(&self) -> anyhow::Result<Vec<u8>> {
        serde_json::to_vec_pretty(self).context("encode index_part.json")
    }

    /// Decodes and checks an index: its version, layers with unique names,
    /// `disk_consistent_lsn` the layers' last LSN.
    pub fn decode(raw: &[u8]) -> anyhow::Result<IndexPart> {
        let index: IndexPart = serde_json::from_slice(raw).context("not an index_part.json")?;
        anyhow::ensure!(index.version == INDEX_VERSION, "unsupported index version {}", index.version);
        let mut names = std::collections::HashSet::new();
        for l in &index.layers {
            anyhow::ensure!(names.insert(&l.name), "layer {} is listed twice", l.name);
            anyhow::ensure!(l.first_lsn <= l.last_lsn, "layer {} ends before it begins", l.name);
        }
        let last = index.layers.iter().map(|l| l.last_lsn).max().unwrap_or(Lsn(0));
        anyhow::ensure!(
            index.disk_consistent_lsn == last,
            "disk_consistent_lsn {} is not the layers' last LSN {last}",
            index.disk_consistent_lsn
        );
        Ok(index)
    }

    /// The layer files the index lists, as storage takes them ([`crate::storage::create_from_copy`]).
    pub fn layer_files(&self) -> LayerFiles {
        LayerFiles {
            generation: self.manifest_generation,
            layers: self
                .layers
                .iter()
                .map(|l| LayerFile {
                    name: l.name.clone(),
                    first_lsn: l.first_lsn,
                    last_lsn: l.last_lsn,
                    size: l.size,
                    crc32c: Some(l.crc32c),
                })
                .collect(),
            gc_cutoff: self.gc_cutoff,
        }
    }
}
