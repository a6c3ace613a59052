//! From a decoded WAL record to the values a tenant stores: for each block reference, a page
//! image if the record carries one to apply (`BKPIMAGE_APPLY`), else the record itself in the
//! `pg15` family's encoding, for that block (what the redo child needs to redo it). Both at the
//! record's end LSN, PostgreSQL's page LSN after redo, so that GetPage at LSN X sees every record
//! that ended at or before X.
//!
//! Check-only images (`wal_consistency_checking`, without `BKPIMAGE_APPLY`) are not stored:
//! the block gets the record, as if there were no image.
//!
//! Invariant: pure; a record that cannot be stored (an image that does not restore, a record
//! too long for the family's encoding) is an error naming its LSN, never a value dropped.

use bytes::Bytes;
use page_types::wal::DecodedRecord;
use page_types::{BufferTag, Lsn};
use walredo_proc::pg15::{BlockHeader, Pg15Record, FLAG_HAD_IMAGE, FLAG_HAS_DATA, FLAG_WILL_INIT};

use crate::storage::Value;

/// Why a record could not become values.
#[derive(Debug, thiserror::Error)]
pub enum ValueError {
    #[error("record at {lsn}: block {block}: {source}")]
    Image { lsn: Lsn, block: u8, source: page_types::wal::ImageError },
    #[error("record at {lsn} ({kind}): {source}")]
    Encode { lsn: Lsn, kind: String, source: walredo_proc::pg15::Pg15Error },
}

/// What redo does after restoring an image: `pd_lsn` becomes the record's end LSN, unless the
/// page is new (all zeros up to `pd_upper`, which PostgreSQL leaves as it is).
fn set_page_lsn(page: &mut [u8], lsn: Lsn) {
    let pd_upper = page.get(14..16).map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
    if pd_upper == 0 {
        return;
    }
    if let Some(header) = page.get_mut(..8) {
        header[..4].copy_from_slice(&((lsn.0 >> 32) as u32).to_le_bytes());
        header[4..].copy_from_slice(&(lsn.0 as u32).to_le_bytes());
    }
}

/// The page key of a block reference.
pub fn key_of(block: &page_types::wal::BlockRef) -> BufferTag {
    BufferTag {
        spcnode: block.rel.spcnode,
        dbnode: block.rel.dbnode,
        relnode: block.rel.relnode,
        forknum: block.fork,
        blknum: block.blkno,
    }
}

/// Appends the values of `record` to `out`, in block id order.
pub fn record_values(
    record: &DecodedRecord,
    out: &mut Vec<(BufferTag, Lsn, Value)>,
) -> Result<(), ValueError> {
    let lsn = record.end_lsn;
    let headers: Vec<BlockHeader<'_>> = record
        .blocks
        .iter()
        .map(|b| BlockHeader {
            id: b.id,
            flags: (if b.will_init { FLAG_WILL_INIT } else { 0 })
                | (if b.has_data { FLAG_HAS_DATA } else { 0 })
                | (if b.image.is_some() { FLAG_HAD_IMAGE } else { 0 }),
            fork: b.fork,
            spcnode: b.rel.spcnode,
            dbnode: b.rel.dbnode,
            relnode: b.rel.relnode,
            blkno: b.blkno,
            data: &b.data,
        })
        .collect();
    for block in &record.blocks {
        let value = match &block.image {
            Some(image) if image.apply => {
                let mut page = image.restore_page().map_err(|source| ValueError::Image {
                    lsn: record.lsn,
                    block: block.id,
                    source,
                })?;
                set_page_lsn(&mut page, lsn);
                Value::Image(Bytes::from(page))
            }
            _ => {
                let encoded = Pg15Record {
                    rmid: record.rmid,
                    info: record.info,
                    xid: record.xid,
                    lsn: record.lsn.0,
                    end_lsn: record.end_lsn.0,
                    target: block.id,
                    blocks: headers.clone(),
                    main_data: &record.main_data,
                };
                let mut bytes = Vec::new();
                encoded.encode(&mut bytes).map_err(|source| ValueError::Encode {
                    lsn: record.lsn,
                    kind: encoded.type_name(),
                    source,
                })?;
                Value::Record(Bytes::from(bytes))
            }
        };
        out.push((key_of(block), lsn, value));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use page_types::wal::{BlockImage, BlockRef, ImageCompression, RelFileNode};
    use walredo_proc::pg15::FLAG_DATA_INCLUDED;

    fn block(id: u8, image: Option<(bool, u16)>) -> BlockRef {
        let image = image.map(|(apply, pd_upper)| {
            let mut page = vec![0u8; 8192];
            page[14..16].copy_from_slice(&pd_upper.to_le_bytes());
            page[100] = id;
            BlockImage {
                bytes: Bytes::from(page),
                hole_offset: 0,
                hole_length: 0,
                compression: ImageCompression::None,
                apply,
            }
        });
        BlockRef {
            id,
            rel: RelFileNode { spcnode: 1663, dbnode: 5, relnode: 16384 },
            fork: 0,
            blkno: u32::from(id) * 10,
            will_init: false,
            has_data: true,
            data: Bytes::from(vec![id; 3]),
            image,
        }
    }

    fn record(blocks: Vec<BlockRef>) -> DecodedRecord {
        DecodedRecord {
            lsn: Lsn(0x1_0000_0028),
            end_lsn: Lsn(0x1_0000_2068),
            xid: 9,
            prev: Lsn(0x1_0000_0000),
            info: 0x20,
            rmid: 10,
            blocks,
            main_data: Bytes::from_static(b"main"),
            origin: None,
            toplevel_xid: None,
        }
    }

    #[test]
    fn applied_images_become_images_at_the_end_lsn_and_the_rest_records_for_their_block() {
        let rec = record(vec![block(0, Some((true, 512))), block(1, None), block(2, Some((false, 512)))]);
        let mut out = Vec::new();
        record_values(&rec, &mut out).unwrap();
        assert_eq!(out.len(), 3);
        assert!(out.iter().all(|(_, lsn, _)| *lsn == rec.end_lsn));
        assert_eq!(out[1].0.blknum, 10);
        let Value::Image(page) = &out[0].2 else { panic!("block 0 carries an applied image") };
        // pd_lsn is the record's end, as redo leaves it: xlogid then xrecoff.
        assert_eq!(&page[..8], &[1, 0, 0, 0, 0x68, 0x20, 0, 0]);
        assert_eq!(page[100], 0);
        for (i, (_, _, value)) in out.iter().enumerate().skip(1) {
            let Value::Record(bytes) = value else { panic!("block {i} is a record") };
            let r = Pg15Record::decode(bytes).unwrap();
            assert_eq!((r.target, r.rmid, r.info, r.main_data), (i as u8, 10, 0x20, &b"main"[..]));
            let target = r.blocks.iter().find(|b| b.id == r.target).unwrap();
            assert_eq!(target.data, &[i as u8; 3][..]);
            assert!(target.flags & FLAG_DATA_INCLUDED != 0);
        }
        // A check-only image (no BKPIMAGE_APPLY) is not stored; its block gets the record.
        let Value::Record(bytes) = &out[2].2 else { panic!() };
        assert!(Pg15Record::decode(bytes).unwrap().blocks[2].flags & FLAG_HAD_IMAGE != 0);
    }

    #[test]
    fn a_new_page_keeps_its_zero_lsn_and_a_broken_image_is_an_error_naming_the_record() {
        let mut out = Vec::new();
        record_values(&record(vec![block(0, Some((true, 0)))]), &mut out).unwrap();
        let Value::Image(page) = &out[0].2 else { panic!() };
        assert_eq!(&page[..8], &[0; 8]);
        let mut bad = block(0, Some((true, 512)));
        if let Some(image) = bad.image.as_mut() {
            image.bytes = Bytes::from_static(b"short");
        }
        let err = record_values(&record(vec![bad]), &mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("1/28"), "{err}");
    }
}
