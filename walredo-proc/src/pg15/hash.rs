//! Redo of Hash index records (PostgreSQL 15's `hash_xlog.c`), for the record's target block:
//! every record type, each page it touches (the target block id says which part of the routine
//! runs). Page layouts and initialisations are in [`layout`].
//!
//! Blocks per record, as `hashpage.c`/`hashovfl.c`/`hashinsert.c`/`hash.c` register them (the
//! record's main data is the `xl_hash_*` struct of `hash_xlog.h`):
//! - INIT_META_PAGE: 0 the metapage (initialised). INIT_BITMAP_PAGE: 0 the bitmap page
//!   (initialised), 1 the metapage (the bitmap added to `hashm_mapp`).
//! - INSERT: 0 the page (its data the tuple), 1 the metapage (`hashm_ntuples` + 1).
//! - ADD_OVFL_PAGE: 0 the new overflow page (initialised; its data its bucket), 1 the page
//!   before it (`hasho_nextblkno`), 2 the bitmap page whose bit is set (data: the bit), 3 a new
//!   bitmap page (initialised), 4 the metapage (data: `hashm_firstfree`).
//! - SPLIT_ALLOCATE_PAGE: 0 the old bucket (flags), 1 the new bucket (initialised), 2 the
//!   metapage (data: the new masks and/or splitpoint, as the record's flags say).
//! - SPLIT_PAGE: 0 a full-page image, always (`REGBUF_FORCE_IMAGE`); the daemon stores it as the
//!   block's image, so the record itself never reaches redo unless something is wrong.
//! - SPLIT_COMPLETE: 0 the old bucket, 1 the new bucket (flags).
//! - MOVE_PAGE_CONTENTS: 0 the primary bucket page (only locked: unchanged), 1 the page tuples
//!   are moved to (data: their offsets, then the tuples), 2 the page they leave (data: offsets).
//! - SQUEEZE_PAGE: 0 the primary bucket page (unchanged), 1 the page tuples are moved to, 2 the
//!   freed overflow page (reinitialised, unused), 3 the page before it, 4 the page after it,
//!   5 the bitmap page (data: the bit to clear), 6 the metapage (data: `hashm_firstfree`).
//! - DELETE: 0 the primary bucket page (unchanged), 1 the page (data: the offsets deleted).
//! - SPLIT_CLEANUP: 0 the bucket. UPDATE_META_PAGE: 0 the metapage.
//! - VACUUM_ONE_PAGE: 0 the page (main data: the offsets after `xl_hash_vacuum_one_page`), 1 the
//!   metapage.
//!
//! **Each block's redo reads only that block's data and the main data** (besides other blocks'
//! numbers and presence, which the stored record always carries), so a record stored for a block
//! without the other blocks' data (the `pg15` encoding drops them past its length limit) redoes
//! that block in full.
//!
//! Where PostgreSQL PANICs or ERRORs (a tuple that does not fit, an offset past the line
//! pointers, a SPLIT_PAGE without its image) this returns an error; where it would read or write
//! past the record, the page or one of the metapage's arrays on corrupt input, this returns an
//! error too. Invariants: pure; never panics on any record or page.

pub mod layout;

#[cfg(test)]
mod tests;

use super::bufpage;
use super::{BlockRedo, RedoError, Target};
use crate::page::{maxalign, Page, PAGE_HEADER_SIZE};
use layout::{get_f64, get_u16, get_u32, meta, put_f64, put_u32, Opaque};

/// Record types (`info & 0xF0`).
pub const XLOG_HASH_INIT_META_PAGE: u8 = 0x00;
pub const XLOG_HASH_INIT_BITMAP_PAGE: u8 = 0x10;
pub const XLOG_HASH_INSERT: u8 = 0x20;
pub const XLOG_HASH_ADD_OVFL_PAGE: u8 = 0x30;
pub const XLOG_HASH_SPLIT_ALLOCATE_PAGE: u8 = 0x40;
pub const XLOG_HASH_SPLIT_PAGE: u8 = 0x50;
pub const XLOG_HASH_SPLIT_COMPLETE: u8 = 0x60;
pub const XLOG_HASH_MOVE_PAGE_CONTENTS: u8 = 0x70;
pub const XLOG_HASH_SQUEEZE_PAGE: u8 = 0x80;
pub const XLOG_HASH_DELETE: u8 = 0x90;
pub const XLOG_HASH_SPLIT_CLEANUP: u8 = 0xA0;
pub const XLOG_HASH_UPDATE_META_PAGE: u8 = 0xB0;
pub const XLOG_HASH_VACUUM_ONE_PAGE: u8 = 0xC0;

/// The names `hashdesc.c`'s `hash_identify` gives the record types, indexed by `info >> 4`.
pub const TYPE_NAMES: [&str; 13] = [
    "INIT_META_PAGE",
    "INIT_BITMAP_PAGE",
    "INSERT",
    "ADD_OVFL_PAGE",
    "SPLIT_ALLOCATE_PAGE",
    "SPLIT_PAGE",
    "SPLIT_COMPLETE",
    "MOVE_PAGE_CONTENTS",
    "SQUEEZE_PAGE",
    "DELETE",
    "SPLIT_CLEANUP",
    "UPDATE_META_PAGE",
    "VACUUM_ONE_PAGE",
];

/// `xl_hash_split_allocate_page.flags`.
const XLH_SPLIT_META_UPDATE_MASKS: u8 = 1 << 0;
const XLH_SPLIT_META_UPDATE_SPLITPOINT: u8 = 1 << 1;
/// `SizeOfHashVacuumOnePage`: `latestRemovedXid`, `ntuples`; the offsets follow.
const SIZE_OF_VACUUM_ONE_PAGE: usize = 8;
/// `INDEX_SIZE_MASK` of an index tuple's `t_info`.
const INDEX_SIZE_MASK: u16 = 0x1FFF;

/// Applies a Hash record to the page of its target block.
pub fn redo(target: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    let rec = Rec::new(target);
    match target.record.info & 0xF0 {
        XLOG_HASH_INIT_META_PAGE => rec.only(0).and_then(|()| rec.init_meta_page(page)),
        XLOG_HASH_INIT_BITMAP_PAGE => rec.init_bitmap_page(page),
        XLOG_HASH_INSERT => rec.insert(page),
        XLOG_HASH_ADD_OVFL_PAGE => rec.add_ovfl_page(page),
        XLOG_HASH_SPLIT_ALLOCATE_PAGE => rec.split_allocate_page(page),
        XLOG_HASH_SPLIT_PAGE => rec
            .only(0)
            .and_then(|()| Err(rec.malformed("Hash split record did not contain a full-page image"))),
        XLOG_HASH_SPLIT_COMPLETE => rec.split_complete(page),
        XLOG_HASH_MOVE_PAGE_CONTENTS => rec.move_page_contents(page),
        XLOG_HASH_SQUEEZE_PAGE => rec.squeeze_page(page),
        XLOG_HASH_DELETE => rec.delete(page),
        XLOG_HASH_SPLIT_CLEANUP => {
            rec.only(0).and_then(|()| rec.update_flag(page, |f| f & !layout::LH_BUCKET_NEEDS_SPLIT_CLEANUP))
        }
        XLOG_HASH_UPDATE_META_PAGE => rec.only(0).and_then(|()| {
            let ntuples = rec.main_f64(0)?;
            rec.put_meta_f64(page, meta::NTUPLES, ntuples)
        }),
        XLOG_HASH_VACUUM_ONE_PAGE => rec.vacuum_one_page(page),
        _ => Err(RedoError::Unsupported(target.type_name())),
    }
}

/// This module's redo of one block: [`BlockRedo`] with the helpers of Hash records.
type Rec<'t, 'r, 'a> = BlockRedo<'t, 'r, 'a, Hash>;

/// Marks [`Rec`]: the helpers below are Hash's alone.
pub enum Hash {}

impl Rec<'_, '_, '_> {
    fn main_f64(&self, at: usize) -> Result<f64, RedoError> {
        get_f64(self.main(), at).ok_or_else(|| self.malformed("main data too short"))
    }

    /// The block's data as the one `uint32` its writer registers (a bucket, a bit number, a
    /// block number).
    fn data_u32(&self) -> Result<u32, RedoError> {
        match self.data() {
            [a, b, c, d] => Ok(u32::from_le_bytes([*a, *b, *c, *d])),
            d => Err(self.malformed(&format!("block data of {} bytes, not a uint32", d.len()))),
        }
    }

    /// Block number of the record's block `id` (`XLogRecGetBlockTag`, which fails on a block the
    /// record does not reference).
    fn blkno(&self, id: u8) -> Result<u32, RedoError> {
        self.target
            .record
            .blocks
            .iter()
            .find(|b| b.id == id)
            .map(|b| b.blkno)
            .ok_or_else(|| self.malformed(&format!("no block {id}")))
    }

    fn opaque(&self, page: &Page) -> Result<Opaque, RedoError> {
        Opaque::read(page).ok_or_else(|| self.no_fit("no room for the hash special space"))
    }

    fn put_opaque(&self, page: &mut Page, op: &Opaque) -> Result<(), RedoError> {
        op.write(page).ok_or_else(|| self.no_fit("no room for the hash special space"))
    }

    /// Changes the page's special space with `f`, then sets its LSN.
    fn update_opaque(&self, page: &mut Page, f: impl FnOnce(&mut Opaque)) -> Result<(), RedoError> {
        let mut op = self.opaque(page)?;
        f(&mut op);
        self.put_opaque(page, &op)?;
        self.set_lsn(page);
        Ok(())
    }

    fn update_flag(&self, page: &mut Page, f: impl FnOnce(u16) -> u16) -> Result<(), RedoError> {
        self.update_opaque(page, |op| op.flag = f(op.flag))
    }

    /// A metapage field (`HashPageGetMeta` is the page right after its header, always inside it).
    fn meta_u32(&self, page: &Page, at: usize) -> Result<u32, RedoError> {
        get_u32(page, at).ok_or_else(|| self.no_fit("metapage field outside the page"))
    }

    fn put_meta_u32(&self, page: &mut Page, at: usize, v: u32) -> Result<(), RedoError> {
        put_u32(page, at, v).ok_or_else(|| self.no_fit("metapage field outside the page"))
    }

    /// Sets a metapage `double` and the LSN.
    fn put_meta_f64(&self, page: &mut Page, at: usize, v: f64) -> Result<(), RedoError> {
        put_f64(page, at, v).ok_or_else(|| self.no_fit("metapage field outside the page"))?;
        self.set_lsn(page);
        Ok(())
    }

    /// The byte offset of `hashm_spares[ovflpoint]`, which must be inside the array.
    fn spare_at(&self, ovflpoint: u32) -> Result<usize, RedoError> {
        if ovflpoint >= layout::HASH_MAX_SPLITPOINTS {
            return Err(self.no_fit(format!("splitpoint {ovflpoint} past hashm_spares")));
        }
        Ok(meta::SPARES + 4 * ovflpoint as usize)
    }

    /// `hashm_mapp[hashm_nmaps++] = blkno`.
    fn append_bitmap(&self, page: &mut Page, blkno: u32) -> Result<(), RedoError> {
        let nmaps = self.meta_u32(page, meta::NMAPS)?;
        if nmaps >= layout::HASH_MAX_BITMAPS {
            return Err(self.no_fit(format!("{nmaps} bitmap pages already: hashm_mapp is full")));
        }
        self.put_meta_u32(page, meta::MAPP + 4 * nmaps as usize, blkno)?;
        self.put_meta_u32(page, meta::NMAPS, nmaps + 1)
    }

    /// `hash_xlog_init_meta_page`.
    fn init_meta_page(&self, page: &mut Page) -> Result<(), RedoError> {
        // xl_hash_init_meta_page { num_tuples double, procid u32, ffactor u16 }
        let num_tuples = self.main_f64(0)?;
        let (procid, ffactor) = (self.main_u32(8)?, self.main_u16(12)?);
        if num_tuples.is_nan() {
            return Err(self.malformed("num_tuples is not a number"));
        }
        layout::init_metapage(page, num_tuples, procid, ffactor);
        self.set_lsn(page);
        Ok(())
    }

    /// `hash_xlog_init_bitmap_page`.
    fn init_bitmap_page(&self, page: &mut Page) -> Result<(), RedoError> {
        match self.id {
            0 => self.init_bitmap(page, self.main_u16(0)?),
            1 => {
                let num_buckets = self.meta_u32(page, meta::MAXBUCKET)?.wrapping_add(1);
                self.append_bitmap(page, num_buckets.wrapping_add(1))?;
                self.set_lsn(page);
                Ok(())
            }
            _ => Err(self.not_touched()),
        }
    }

    fn init_bitmap(&self, page: &mut Page, bmsize: u16) -> Result<(), RedoError> {
        layout::init_bitmap(page, bmsize)
            .ok_or_else(|| self.no_fit(format!("a bitmap of {bmsize} bytes")))?;
        self.set_lsn(page);
        Ok(())
    }

    /// `hash_xlog_insert`.
    fn insert(&self, page: &mut Page) -> Result<(), RedoError> {
        match self.id {
            0 => {
                let offnum = self.main_u16(0)?;
                self.add_item(page, self.data(), offnum)?;
                self.set_lsn(page);
                Ok(())
            }
            1 => {
                let ntuples = get_f64(page, meta::NTUPLES).unwrap_or_default();
                self.put_meta_f64(page, meta::NTUPLES, ntuples + 1.0)
            }
            _ => Err(self.not_touched()),
        }
    }

    /// `hash_xlog_add_ovfl_page`.
    fn add_ovfl_page(&self, page: &mut Page) -> Result<(), RedoError> {
        // xl_hash_add_ovfl_page { bmsize u16, bmpage_found bool }
        let bmsize = self.main_u16(0)?;
        let bmpage_found = self.main_bool(2)?;
        match self.id {
            0 => {
                let leftblk = self.blkno(1)?;
                let num_bucket = self.data_u32()?;
                layout::init_buf(page, layout::INVALID, num_bucket, layout::LH_OVERFLOW_PAGE);
                self.update_opaque(page, |op| op.prev = leftblk)
            }
            1 => {
                let rightblk = self.blkno(0)?;
                self.update_opaque(page, |op| op.next = rightblk)
            }
            2 => {
                let bit = self.data_u32()?;
                self.bitmap_bit(page, bit, true)
            }
            3 => self.init_bitmap(page, bmsize),
            4 => {
                let firstfree = self.data_u32()?;
                self.put_meta_u32(page, meta::FIRSTFREE, firstfree)?;
                if !bmpage_found {
                    let spare = self.spare_at(self.meta_u32(page, meta::OVFLPOINT)?)?;
                    let mut spares = self.meta_u32(page, spare)?.wrapping_add(1);
                    if self.has_block(3) {
                        self.append_bitmap(page, self.blkno(3)?)?;
                        spares = spares.wrapping_add(1);
                    }
                    self.put_meta_u32(page, spare, spares)?;
                }
                self.set_lsn(page);
                Ok(())
            }
            _ => Err(self.not_touched()),
        }
    }

    /// `SETBIT`/`CLRBIT` of bit `bit` of a bitmap page (`HashPageGetBitmap`), then the LSN.
    fn bitmap_bit(&self, page: &mut Page, bit: u32, set: bool) -> Result<(), RedoError> {
        let word = PAGE_HEADER_SIZE + 4 * (bit / 32) as usize;
        let mut v =
            get_u32(page, word).ok_or_else(|| self.no_fit(format!("bitmap bit {bit} outside the page")))?;
        if set {
            v |= 1 << (bit % 32);
        } else {
            v &= !(1 << (bit % 32));
        }
        put_u32(page, word, v).ok_or_else(|| self.no_fit("bitmap word outside the page"))?;
        self.set_lsn(page);
        Ok(())
    }

    /// `hash_xlog_split_allocate_page`.
    fn split_allocate_page(&self, page: &mut Page) -> Result<(), RedoError> {
        // xl_hash_split_allocate_page { new_bucket u32, old_bucket_flag u16, new_bucket_flag u16, flags u8 }
        let new_bucket = self.main_u32(0)?;
        let (old_flag, new_flag) = (self.main_u16(4)?, self.main_u16(6)?);
        let flags = *self.main().get(8).ok_or_else(|| self.malformed("main data too short"))?;
        match self.id {
            0 => self.update_opaque(page, |op| {
                op.flag = old_flag;
                op.prev = new_bucket;
            }),
            1 => {
                layout::init_buf(page, new_bucket, new_bucket, new_flag);
                self.set_lsn(page);
                Ok(())
            }
            2 => {
                let mut data = self.data();
                let mut take = || -> Result<u32, RedoError> {
                    let v = get_u32(data, 0).ok_or_else(|| self.malformed("metapage data cut short"))?;
                    data = &data[4..];
                    Ok(v)
                };
                let masks =
                    if flags & XLH_SPLIT_META_UPDATE_MASKS != 0 { Some((take()?, take()?)) } else { None };
                let split = if flags & XLH_SPLIT_META_UPDATE_SPLITPOINT != 0 {
                    Some((take()?, take()?))
                } else {
                    None
                };
                self.put_meta_u32(page, meta::MAXBUCKET, new_bucket)?;
                if let Some((lowmask, highmask)) = masks {
                    self.put_meta_u32(page, meta::LOWMASK, lowmask)?;
                    self.put_meta_u32(page, meta::HIGHMASK, highmask)?;
                }
                if let Some((ovflpoint, ovflpages)) = split {
                    let spare = self.spare_at(ovflpoint)?;
                    self.put_meta_u32(page, spare, ovflpages)?;
                    self.put_meta_u32(page, meta::OVFLPOINT, ovflpoint)?;
                }
                self.set_lsn(page);
                Ok(())
            }
            _ => Err(self.not_touched()),
        }
    }

    /// `hash_xlog_split_complete`.
    fn split_complete(&self, page: &mut Page) -> Result<(), RedoError> {
        // xl_hash_split_complete { old_bucket_flag u16, new_bucket_flag u16 }
        let flag = match self.id {
            0 => self.main_u16(0)?,
            1 => self.main_u16(2)?,
            _ => return Err(self.not_touched()),
        };
        self.update_flag(page, |_| flag)
    }

    /// `hash_xlog_move_page_contents`.
    fn move_page_contents(&self, page: &mut Page) -> Result<(), RedoError> {
        // xl_hash_move_page_contents { ntups u16, is_prim_bucket_same_wrt bool }
        let ntups = self.main_u16(0)?;
        match self.id {
            // Only cleanup-locked during replay.
            0 => Ok(()),
            1 => {
                self.add_moved_tuples(page, ntups)?;
                self.set_lsn(page);
                Ok(())
            }
            2 => self.delete_data_offsets(page),
            _ => Err(self.not_touched()),
        }
    }

    /// `hash_xlog_squeeze_page`.
    fn squeeze_page(&self, page: &mut Page) -> Result<(), RedoError> {
        // xl_hash_squeeze_page { prevblkno u32, nextblkno u32, ntups u16,
        // is_prim_bucket_same_wrt bool, is_prev_bucket_same_wrt bool }
        let (prevblkno, nextblkno) = (self.main_u32(0)?, self.main_u32(4)?);
        let ntups = self.main_u16(8)?;
        let is_prev_bucket_same_wrt = self.main_bool(11)?;
        match self.id {
            0 => Ok(()),
            1 => {
                self.add_moved_tuples(page, ntups)?;
                if is_prev_bucket_same_wrt {
                    let mut op = self.opaque(page)?;
                    op.next = nextblkno;
                    self.put_opaque(page, &op)?;
                }
                self.set_lsn(page);
                Ok(())
            }
            2 => {
                let unused = layout::LH_UNUSED_PAGE;
                layout::init_buf(page, layout::INVALID, layout::INVALID, unused);
                self.set_lsn(page);
                Ok(())
            }
            // PostgreSQL does not read block 3 when the write page is the previous page.
            3 if is_prev_bucket_same_wrt => Ok(()),
            3 => self.update_opaque(page, |op| op.next = nextblkno),
            4 => self.update_opaque(page, |op| op.prev = prevblkno),
            5 => {
                let bit = self.data_u32()?;
                self.bitmap_bit(page, bit, false)
            }
            6 => {
                let firstfree = self.data_u32()?;
                self.put_meta_u32(page, meta::FIRSTFREE, firstfree)?;
                self.set_lsn(page);
                Ok(())
            }
            _ => Err(self.not_touched()),
        }
    }

    /// The write page's part of MOVE_PAGE_CONTENTS and SQUEEZE_PAGE: the block's data is
    /// `ntups` target offsets, then the tuples (each `MAXALIGN(IndexTupleSize)` bytes), added
    /// in order at their offsets.
    fn add_moved_tuples(&self, page: &mut Page, ntups: u16) -> Result<(), RedoError> {
        if ntups == 0 {
            return Ok(());
        }
        let data = self.data();
        let n = usize::from(ntups);
        let offsets = data.get(..2 * n).ok_or_else(|| self.malformed("fewer offsets than ntups"))?;
        let mut rest = &data[2 * n..];
        let mut inserted = 0usize;
        while !rest.is_empty() {
            let size = usize::from(get_u16(rest, 6).unwrap_or_default() & INDEX_SIZE_MASK);
            let itemsz = maxalign(size);
            if size == 0 || itemsz > rest.len() {
                return Err(self.malformed("index tuple cut short"));
            }
            let at = offsets
                .get(2 * inserted..2 * inserted + 2)
                .ok_or_else(|| self.malformed("more tuples than ntups"))?;
            let offnum = u16::from_le_bytes([at[0], at[1]]);
            self.add_item(page, &rest[..itemsz], offnum)?;
            rest = &rest[itemsz..];
            inserted += 1;
        }
        if inserted != n {
            return Err(self.malformed(&format!("{inserted} tuples for ntups {ntups}")));
        }
        Ok(())
    }

    /// The page left by MOVE_PAGE_CONTENTS, or the page of DELETE: `PageIndexMultiDelete` of the
    /// offsets that are the block's data.
    fn delete_offsets(&self, page: &mut Page, offsets: &[u8]) -> Result<(), RedoError> {
        if offsets.len() % 2 != 0 {
            return Err(self.malformed("offsets of an odd number of bytes"));
        }
        let offs: Vec<u16> = offsets.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        if !offs.is_empty() {
            bufpage::page_index_multi_delete(page, &offs).map_err(|e| self.wrap(e))?;
        }
        Ok(())
    }

    fn delete_data_offsets(&self, page: &mut Page) -> Result<(), RedoError> {
        self.delete_offsets(page, self.data())?;
        self.set_lsn(page);
        Ok(())
    }

    /// `hash_xlog_delete`.
    fn delete(&self, page: &mut Page) -> Result<(), RedoError> {
        // xl_hash_delete { clear_dead_marking bool, is_primary_bucket_page bool }
        let clear_dead_marking = self.main_bool(0)?;
        match self.id {
            0 => Ok(()),
            1 => {
                self.delete_offsets(page, self.data())?;
                if clear_dead_marking {
                    let mut op = self.opaque(page)?;
                    op.flag &= !layout::LH_PAGE_HAS_DEAD_TUPLES;
                    self.put_opaque(page, &op)?;
                }
                self.set_lsn(page);
                Ok(())
            }
            _ => Err(self.not_touched()),
        }
    }

    /// `hash_xlog_vacuum_one_page`.
    fn vacuum_one_page(&self, page: &mut Page) -> Result<(), RedoError> {
        // xl_hash_vacuum_one_page { latestRemovedXid u32, ntuples int }, then the offsets
        let ntuples = self.main_u32(4)? as i32;
        match self.id {
            0 => {
                if self.main().len() > SIZE_OF_VACUUM_ONE_PAGE {
                    let n = usize::try_from(ntuples).map_err(|_| self.malformed("negative ntuples"))?;
                    let offsets = n
                        .checked_mul(2)
                        .and_then(|len| {
                            self.main().get(SIZE_OF_VACUUM_ONE_PAGE..SIZE_OF_VACUUM_ONE_PAGE + len)
                        })
                        .ok_or_else(|| self.malformed("fewer offsets than ntuples"))?;
                    self.delete_offsets(page, offsets)?;
                }
                self.update_flag(page, |f| f & !layout::LH_PAGE_HAS_DEAD_TUPLES)
            }
            1 => {
                let now = get_f64(page, meta::NTUPLES).unwrap_or_default();
                self.put_meta_f64(page, meta::NTUPLES, now - f64::from(ntuples))
            }
            _ => Err(self.not_touched()),
        }
    }

    fn add_item(&self, page: &mut Page, item: &[u8], offnum: u16) -> Result<(), RedoError> {
        bufpage::page_add_item(page, item, offnum, false, false).map_err(|e| self.wrap(e))?;
        Ok(())
    }
}
