//! The timeline manifest (`manifest.json`): the durable list of the files a timeline consists
//! of, replaced atomically (temp file, fsync, rename, fsync directory) at every change of that
//! set.
//!
//! Why: without it, a deleted layer or `active.seg` was indistinguishable from "never
//! written", the timeline opened with older page versions and its last durable LSN went
//! backwards. With it, recovery checks the directory against the list and refuses to open on a
//! missing or unexpected file, naming it. It also records a seal in progress (`sealing`), written
//! before the seal's first byte, so recovery knows from durable state, not from file content a
//! client controls, whether `active.seg` may end in a layer index. And it is the one atomic step
//! by which a compactor will install and remove layers: a manifest write swaps one layer list
//! for another.
//!
//! Encoding: pretty-printed JSON, then a line `crc32c=XXXXXXXX` (the crc32c of every byte before
//! that line, 8 hex digits). LSNs are integers.
//!
//! **Invariants:** a manifest file is only ever replaced by rename, never written in place; its
//! `generation` grows by one with every write; nothing here decides policy (recovery and the
//! committer do), it only encodes, decodes and writes.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use anyhow::{bail, ensure, Context};
use serde::{Deserialize, Serialize};

use super::layer::{self, LayerName};
use super::{FsyncFailed, StorageMetrics};

/// File name of the manifest in a timeline directory.
pub(crate) const MANIFEST_NAME: &str = "manifest.json";
/// Temporary name a new manifest is written under before it is renamed over the old one.
pub(crate) const MANIFEST_TMP_NAME: &str = ".manifest.json.tmp";
/// Version of the manifest's JSON schema written: 2 adds the compaction fields (`gc_cutoff`,
/// `next_layer_id`, `compacting`, `deleting`); 3 adds each layer's `crc32c` and
/// `compacting.first_generation`, and no longer writes `next_layer_id` (layer names carry a
/// generation instead of an output number). Versions 1 and 2 still decode.
pub(crate) const MANIFEST_VERSION: u32 = 3;
const CRC_PREFIX: &str = "crc32c=";

/// The files of a timeline, as last made durable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Manifest {
    pub version: u32,
    /// Grows by one with every write; tells two manifests of one timeline apart.
    pub generation: u64,
    /// Sealed layers, in LSN order.
    pub layers: Vec<LayerMeta>,
    /// The active segment `active.seg`.
    pub active: ActiveMeta,
    /// A seal that was started (intent made durable) and not yet recorded as finished.
    pub sealing: Option<SealIntent>,
    /// GetPage below this LSN is refused: compaction may have dropped what it needs.
    #[serde(default)]
    pub gc_cutoff: u64,
    /// Version 2: the output number the next compaction output would have got. Read and
    /// dropped: outputs are named by generation now.
    #[serde(default, rename = "next_layer_id", skip_serializing)]
    pub _next_layer_id: u64,
    /// A compaction that may have written output files (see [`CompactIntent`]).
    #[serde(default)]
    pub compacting: Option<CompactIntent>,
    /// Files no longer part of the timeline (compaction inputs), to be deleted.
    #[serde(default)]
    pub deleting: Vec<String>,
}

/// A compaction in progress: unlisted compaction outputs it may have left are those with a
/// generation from `first_generation` on, or (a pass recorded by a build before version 3) an
/// output number from `first_layer_id` on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CompactIntent {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_layer_id: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_generation: Option<u64>,
}

/// One layer file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LayerMeta {
    pub name: String,
    pub first_lsn: u64,
    pub last_lsn: u64,
    /// File length in bytes.
    pub size: u64,
    /// The crc32c of the whole file; absent for layers written before version 3 of the
    /// manifest (and for a seal's layer until the seal is done).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32c: Option<u32>,
}

/// The identity of the active segment: which one in the timeline's sequence of active segments
/// it is, and the LSN every value in it is above (the last LSN of the layers before it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ActiveMeta {
    pub seq: u64,
    pub base_lsn: u64,
}

/// A seal in progress: `active.seg`, whose frames end at `data_len`, becomes `layer`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SealIntent {
    pub layer: LayerMeta,
    pub data_len: u64,
}

impl LayerMeta {
    /// The entry of the layer file named `name`.
    pub(crate) fn new(name: &LayerName, size: u64, crc32c: Option<u32>) -> LayerMeta {
        LayerMeta {
            name: layer::file_name(name),
            first_lsn: name.first.0,
            last_lsn: name.last.0,
            size,
            crc32c,
        }
    }
}

impl Manifest {
    /// The manifest of a timeline with no layers and its first active segment.
    pub(crate) fn empty() -> Manifest {
        Manifest {
            version: MANIFEST_VERSION,
            generation: 0,
            layers: Vec::new(),
            active: ActiveMeta { seq: 0, base_lsn: 0 },
            sealing: None,
            gc_cutoff: 0,
            _next_layer_id: 0,
            compacting: None,
            deleting: Vec::new(),
        }
    }

    /// The last LSN of the last layer (0/0 without layers).
    #[cfg(test)]
    pub(crate) fn layers_last_lsn(&self) -> super::Lsn {
        super::Lsn(self.layers.last().map_or(0, |l| l.last_lsn))
    }

    /// The manifest after `intent`'s seal finished, its layer's bytes having the crc32c `crc`:
    /// its layer appended, a new active segment above it, no seal in progress. `generation` is
    /// left for [`write`] to advance.
    pub(crate) fn with_seal_done(&self, intent: &SealIntent, crc: u32) -> Manifest {
        let mut next = self.clone();
        next.layers.push(LayerMeta { crc32c: Some(crc), ..intent.layer.clone() });
        next.active = ActiveMeta { seq: self.active.seq + 1, base_lsn: intent.layer.last_lsn };
        next.sealing = None;
        next
    }

    pub(crate) fn encode(&self) -> anyhow::Result<Vec<u8>> {
        let mut out = serde_json::to_vec_pretty(self).context("encode manifest")?;
        out.push(b'\n');
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(format!("{CRC_PREFIX}{crc:08x}\n").as_bytes());
        Ok(out)
    }

    pub(crate) fn decode(raw: &[u8]) -> anyhow::Result<Manifest> {
        let text = std::str::from_utf8(raw).context("manifest is not UTF-8")?;
        let body_end = text
            .trim_end_matches('\n')
            .rfind('\n')
            .map(|i| i + 1)
            .context("manifest has no checksum line")?;
        let (body, trailer) = text.split_at(body_end);
        let Some(hex) = trailer.trim_end_matches('\n').strip_prefix(CRC_PREFIX) else {
            bail!("manifest has no checksum line");
        };
        let crc = u32::from_str_radix(hex, 16).context("bad manifest checksum line")?;
        ensure!(crc == crc32c::crc32c(body.as_bytes()), "manifest checksum mismatch");
        let m: Manifest = serde_json::from_str(body).context("decode manifest")?;
        ensure!((1..=MANIFEST_VERSION).contains(&m.version), "unsupported manifest version {}", m.version);
        Ok(m)
    }
}

/// Reads the manifest of `dir`; `Ok(None)` if there is none (a version 1 directory).
pub(crate) fn read(dir: &Path) -> anyhow::Result<Option<Manifest>> {
    let path = dir.join(MANIFEST_NAME);
    match std::fs::read(&path) {
        Ok(raw) => Manifest::decode(&raw).with_context(|| format!("read {}", path.display())).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("read {}", path.display())),
    }
}

/// Makes `m` (with its generation advanced by one) the manifest of `dir`, atomically and
/// durably: written under a temporary name, fsynced, renamed over the old one, directory
/// fsynced. After a crash the directory holds the old manifest or the new one. On success, and
/// when only the last fsync failed ([`RenamedNotSynced`]), `m` is the new manifest (the one the
/// directory names); on any other error it is unchanged.
pub(crate) fn write(
    dir: &Path,
    dir_file: &File,
    m: &mut Manifest,
    metrics: &StorageMetrics,
) -> anyhow::Result<()> {
    write_with(dir, dir_file, m, metrics, false)
}

/// [`write`], with a test hook: `fail_sync` makes the directory fsync after the rename fail.
pub(crate) fn write_with(
    dir: &Path,
    dir_file: &File,
    m: &mut Manifest,
    metrics: &StorageMetrics,
    fail_sync: bool,
) -> anyhow::Result<()> {
    let mut next = m.clone();
    next.generation += 1;
    next.version = MANIFEST_VERSION;
    let raw = next.encode()?;
    let tmp = dir.join(MANIFEST_TMP_NAME);
    let written = (|| {
        let mut file = File::create(&tmp).context("create temporary manifest")?;
        file.write_all(&raw).context("write temporary manifest")?;
        metrics.fsync(|| file.sync_all()).context("fsync temporary manifest")
    })();
    if let Err(e) = written {
        // Nothing refers to the temporary file; a leftover is removed at the next open.
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, dir.join(MANIFEST_NAME)).context("rename manifest into place")?;
    let synced = metrics.fsync(|| match fail_sync {
        true => Err(std::io::Error::other("injected directory fsync failure")),
        false => dir_file.sync_all(),
    });
    *m = next;
    synced.map_err(|e| RenamedNotSynced(e).into())
}

/// The new manifest was renamed into place, then the directory fsync that makes the rename
/// durable failed: the directory names the new manifest now, and after a crash it may name
/// either. What the new manifest lists must stay, and so must what the old one lists. (An
/// error of [`write`] without this one left the old manifest in place.)
#[derive(Debug, thiserror::Error)]
#[error("fsync timeline directory after renaming the manifest into place (outcome unknown)")]
pub(crate) struct RenamedNotSynced(#[source] pub FsyncFailed);

impl RenamedNotSynced {
    /// Whether `e` says the manifest was renamed into place without being made durable.
    pub(crate) fn is_in(e: &anyhow::Error) -> bool {
        e.chain().any(|c| c.is::<RenamedNotSynced>())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use page_types::Lsn;

    use super::*;
    use crate::storage::layer::Level;
    use crate::storage::test_support::key;

    fn sample() -> Manifest {
        let name = |first, last, generation| {
            LayerName::new(Level::Sealed, (key(0), key(7)), first, last, generation)
        };
        let mut m = Manifest::empty();
        m.layers.push(LayerMeta::new(&name(Lsn(1), Lsn(0x20), 1), 4096, Some(0xdead_beef)));
        m.active = ActiveMeta { seq: 1, base_lsn: 0x20 };
        let layer = LayerMeta::new(&name(Lsn(0x21), Lsn(0x40), 3), 9000, None);
        m.sealing = Some(SealIntent { layer, data_len: 8000 });
        m
    }

    #[test]
    fn manifest_roundtrips_and_a_changed_byte_is_refused() {
        let m = sample();
        let raw = m.encode().unwrap();
        assert_eq!(Manifest::decode(&raw).unwrap(), m);
        let text = String::from_utf8(raw.clone()).unwrap();
        let tampered = text.replace("\"size\": 4096", "\"size\": 4097");
        assert_ne!(tampered, text);
        let err = Manifest::decode(tampered.as_bytes()).unwrap_err();
        assert!(format!("{err:#}").contains("checksum mismatch"), "{err:#}");
        assert!(Manifest::decode(&raw[..raw.len() - 12]).is_err());
        assert!(Manifest::decode(b"").is_err());
    }

    #[test]
    fn write_replaces_the_manifest_and_advances_the_generation() {
        let dir = tempfile::tempdir().unwrap();
        let dir_file = File::open(dir.path()).unwrap();
        let metrics = StorageMetrics::unregistered();
        assert_eq!(read(dir.path()).unwrap(), None);
        let mut m = Manifest::empty();
        write(dir.path(), &dir_file, &mut m, &metrics).unwrap();
        assert_eq!(m.generation, 1);
        let intent = sample().sealing.unwrap();
        let mut done = m.with_seal_done(&intent, 0x1234_5678);
        write(dir.path(), &dir_file, &mut done, &metrics).unwrap();
        let back = read(dir.path()).unwrap().unwrap();
        assert_eq!(back, done);
        assert_eq!((back.generation, back.active.seq, back.active.base_lsn), (2, 1, 0x40));
        assert_eq!(back.layers[0].crc32c, Some(0x1234_5678));
        assert!(!dir.path().join(MANIFEST_TMP_NAME).exists());
    }

    /// A version 2 manifest, as the build before version 3 wrote it with a pass in progress.
    #[test]
    fn version_2_decodes_and_is_written_as_version_3() {
        let body = r#"{
  "version": 2,
  "generation": 12,
  "layers": [
    { "name": "layer_0000000000000117_0000000000000162_0000000000000000.layer",
      "first_lsn": 279, "last_lsn": 354, "size": 68715 }
  ],
  "active": { "seq": 3, "base_lsn": 354 },
  "sealing": null,
  "gc_cutoff": 300,
  "next_layer_id": 3,
  "compacting": { "first_layer_id": 3 },
  "deleting": []
}
"#;
        let raw = format!("{body}{CRC_PREFIX}{:08x}\n", crc32c::crc32c(body.as_bytes()));
        let m = Manifest::decode(raw.as_bytes()).unwrap();
        assert_eq!((m.version, m.layers[0].crc32c, m._next_layer_id), (2, None, 3));
        assert_eq!(m.compacting, Some(CompactIntent { first_layer_id: Some(3), first_generation: None }));
        let text = String::from_utf8(m.encode().unwrap()).unwrap();
        assert!(
            !text.contains("next_layer_id") && !text.contains("crc32c\"") && text.contains("first_layer_id"),
            "{text}"
        );
        let again = Manifest::decode(text.as_bytes()).unwrap();
        assert_eq!(
            (again.layers.clone(), again.compacting.clone()),
            (m.layers.clone(), m.compacting.clone())
        );
    }
}
