//! Sealing, as steps of the committer that can each fail and be retried: the full active
//! segment becomes an immutable layer in place, and a new active segment takes its place.
//!
//! Steps (docs/storage-format.md says what recovery does after a crash at each):
//! 0. record the seal intent in the manifest;
//! 1. append the index block and footer after the last frame; 2. fdatasync;
//! 3. rename `active.seg` to the layer name; 4. fsync the directory;
//! 5. create a new `active.seg` (header, fsync, fsync directory);
//! 6. record the layer and the new active segment in the manifest (intent cleared).
//!
//! A step that fails leaves [`SealState`] where it was, and the next commit round starts over
//! from that step (after the retry interval). Rewriting the index of step 1 writes the same
//! bytes at the same offset, so a retry needs no cleanup. No value byte is copied, and readers
//! keep using the same open file (same inode).
//!
//! **Invariants:** frames are appended only in `SealState::Idle` (the manifest's `data_len` is
//! where the frames end while an intent is recorded); the in-memory state (layer count, index
//! files, active segment) changes only once step 6 is durable.

use std::sync::atomic::Ordering;
use std::sync::PoisonError;

use anyhow::{ensure, Context};

use super::{Committer, SealState};
use crate::storage::layer::{self, LayerName, Level};
use crate::storage::manifest::{LayerMeta, SealIntent};
use crate::storage::segment::{ActiveSegment, ACTIVE_NAME};

impl Committer {
    /// Runs the seal in progress to its end, or starts one if the segment is full. `Ok` means
    /// no seal is in progress any more: frames may be appended.
    pub(super) fn advance_seal(&mut self) -> anyhow::Result<()> {
        if matches!(self.seal, SealState::Idle) {
            let full = self.segment.len >= self.shared.conf.layer_size
                || self.segment.entries.len() >= crate::storage::MAX_ACTIVE_VALUES
                || self.shared.queue().seal_now;
            if !full || self.segment.entries.is_empty() {
                return Ok(());
            }
            self.seal = SealState::Intent(self.record_intent()?);
        }
        if let SealState::Intent(intent) = &self.seal {
            let intent = intent.clone();
            let written = self.write_layer(&intent)?;
            self.seal = SealState::Renamed { intent, index: written.index, crc: written.crc, next: None };
        }
        if let SealState::Renamed { intent, crc, next, .. } = &mut self.seal {
            let (intent, crc) = (intent.clone(), *crc);
            if next.is_none() {
                let id = self.shared.next_file_id.fetch_add(1, Ordering::Relaxed);
                *next =
                    Some(ActiveSegment::create(&self.shared.dir, &self.dir_file, id, &self.shared.metrics)?);
            }
            self.shared
                .update_manifest(&self.dir_file, |m| *m = m.with_seal_done(&intent, crc))
                .context("record sealed layer")?;
            if let SealState::Renamed { index, next: Some(next), .. } =
                std::mem::replace(&mut self.seal, SealState::Idle)
            {
                self.install(&intent, index, next);
            }
        }
        Ok(())
    }

    /// Step 0: the intent, with the layer's name (its generation is that of the manifest that
    /// records the intent) and final size (known in advance), made durable.
    fn record_intent(&mut self) -> anyhow::Result<SealIntent> {
        let entries = &self.segment.entries;
        let (first, last) = self.segment.lsn_range().context("seal an empty segment")?;
        let min = entries.iter().map(|e| e.key).min().context("seal an empty segment")?;
        let max = entries.iter().map(|e| e.key).max().context("seal an empty segment")?;
        let data_len = self.segment.len;
        let size = data_len + layer::index_and_footer_len(entries.len());
        let mut intent = None;
        self.shared
            .update_manifest(&self.dir_file, |m| {
                let name = LayerName::new(Level::Sealed, (min, max), first, last, m.generation + 1);
                let recorded = SealIntent { layer: LayerMeta::new(&name, size, None), data_len };
                m.sealing = Some(recorded.clone());
                intent = Some(recorded);
            })
            .context("record seal intent")?;
        intent.context("seal intent not recorded")
    }

    /// Steps 1 to 4: index and footer, fdatasync, rename, fsync of the directory. Returns the
    /// layer as written.
    fn write_layer(&mut self, intent: &SealIntent) -> anyhow::Result<layer::Written> {
        let m = &self.shared.metrics;
        let seg = &self.segment;
        ensure!(
            seg.len == intent.data_len,
            "active.seg has {} bytes, its seal intent {}",
            seg.len,
            intent.data_len
        );
        let written = layer::append_index_and_footer(&seg.file, intent.data_len, seg.crc, &seg.entries)?;
        let (len, file) = (written.len, &seg.file);
        ensure!(len == intent.layer.size, "sealed layer has {len} bytes, expected {}", intent.layer.size);
        m.fsync(|| file.sync_data()).context("fdatasync sealed layer")?;
        let dir = &self.shared.dir;
        std::fs::rename(dir.join(ACTIVE_NAME), dir.join(&intent.layer.name))
            .context("rename sealed layer")?;
        m.fsync(|| self.dir_file.sync_all()).context("fsync timeline directory")?;
        Ok(written)
    }

    /// After step 6: the layer is counted and the new active segment takes over.
    fn install(&mut self, intent: &SealIntent, index: layer::BlockIndex, next: ActiveSegment) {
        let len = intent.layer.size;
        self.shared.layers.fetch_add(1, Ordering::Relaxed);
        self.shared.metrics.layer_files.inc();
        tracing::info!(
            layer = %intent.layer.name, values = self.segment.entries.len(), bytes = len, "sealed layer"
        );
        self.shared.index.write().unwrap_or_else(PoisonError::into_inner).freeze_active(
            intent.layer.name.clone(),
            index,
            len,
            next.file_id,
            next.file.clone(),
        );
        self.shared.active_len.store(next.len, Ordering::Relaxed);
        self.segment = next;
        self.shared.queue().seal_now = false;
        self.shared.seals.send_modify(|n| *n += 1);
    }
}
