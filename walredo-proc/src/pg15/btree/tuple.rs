//! Btree index tuples as PostgreSQL 15's `nbtree.h` lays them out, and the posting-list
//! operations redo repeats: `_bt_swap_posting` (an insert into a posting list),
//! `_bt_update_posting` (VACUUM/DELETE removing some of a posting list's TIDs),
//! `_bt_form_posting` and the deduplication state of `nbtdedup.c` (`_bt_dedup_start_pending`,
//! `_bt_dedup_save_htid`, `_bt_dedup_finish_pending`).
//!
//! An index tuple is `IndexTupleData` (`t_tid`: block id as two `u16` (high, low), offset
//! `u16`; `t_info` `u16`: size in the low 13 bits, `INDEX_ALT_TID_MASK` 0x2000) followed by its
//! key. A posting-list tuple has `INDEX_ALT_TID_MASK` set and `BT_IS_POSTING` in the TID's offset
//! field; the TID's offset field's low 12 bits count its TIDs and the TID's block number is the
//! byte offset of the TID array inside the tuple.
//!
//! Invariants: pure, works on byte slices; nothing panics on any bytes (every read is checked,
//! a tuple that is not what the operation needs is an error).

use crate::pg15::RedoError;

/// `sizeof(IndexTupleData)`.
pub const INDEX_TUPLE_HEADER: usize = 8;
/// `sizeof(ItemPointerData)`.
pub const TID_SIZE: usize = 6;
const INDEX_SIZE_MASK: u16 = 0x1FFF;
const INDEX_ALT_TID_MASK: u16 = 0x2000;
const BT_OFFSET_MASK: u16 = 0x0FFF;
const BT_IS_POSTING: u16 = 0x2000;
/// `BTMaxItemSize(page)` for 8 KiB pages: the largest tuple a btree page takes, and the
/// `maxpostingsize` deduplication uses in redo.
pub const BT_MAX_ITEM_SIZE: usize = 2712;

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    let s = b.get(at..at.checked_add(2)?)?;
    Some(u16::from_le_bytes([s[0], s[1]]))
}

fn put_u16(b: &mut [u8], at: usize, v: u16) -> Option<()> {
    b.get_mut(at..at.checked_add(2)?)?.copy_from_slice(&v.to_le_bytes());
    Some(())
}

fn short(what: &str) -> RedoError {
    RedoError::DoesNotFit(format!("btree tuple shorter than its {what}"))
}

/// `t_info`.
pub fn t_info(tup: &[u8]) -> Result<u16, RedoError> {
    u16_at(tup, 6).ok_or_else(|| short("header"))
}

/// `IndexTupleSize`: the size `t_info` says.
pub fn tuple_size(tup: &[u8]) -> Result<usize, RedoError> {
    Ok(usize::from(t_info(tup)? & INDEX_SIZE_MASK))
}

/// The block number of `t_tid` (`ItemPointerGetBlockNumberNoCheck`): a pivot's downlink or top
/// parent, a posting tuple's posting offset.
pub fn tid_block(tup: &[u8]) -> Result<u32, RedoError> {
    let (hi, lo) = (u16_at(tup, 0), u16_at(tup, 2));
    match (hi, lo) {
        (Some(hi), Some(lo)) => Ok((u32::from(hi) << 16) | u32::from(lo)),
        _ => Err(short("header")),
    }
}

/// `ItemPointerSetBlockNumber(&tup->t_tid, block)`.
pub fn set_tid_block(tup: &mut [u8], block: u32) -> Result<(), RedoError> {
    put_u16(tup, 0, (block >> 16) as u16)
        .and_then(|()| put_u16(tup, 2, block as u16))
        .ok_or_else(|| short("header"))
}

fn tid_offset(tup: &[u8]) -> Result<u16, RedoError> {
    u16_at(tup, 4).ok_or_else(|| short("header"))
}

/// `BTreeTupleIsPosting`.
pub fn is_posting(tup: &[u8]) -> Result<bool, RedoError> {
    Ok(t_info(tup)? & INDEX_ALT_TID_MASK != 0 && tid_offset(tup)? & BT_IS_POSTING != 0)
}

/// A posting tuple's TID array (`BTreeTupleGetPosting`, `BTreeTupleGetNPosting` TIDs);
/// an error for a tuple that is not a posting tuple or whose array is past its end.
fn posting_list(tup: &[u8]) -> Result<(usize, &[u8]), RedoError> {
    if !is_posting(tup)? {
        return Err(RedoError::DoesNotFit("btree tuple is not a posting list".into()));
    }
    let n = usize::from(tid_offset(tup)? & BT_OFFSET_MASK);
    let start = usize::try_from(tid_block(tup)?).map_err(|_| short("posting list"))?;
    let end = n
        .checked_mul(TID_SIZE)
        .and_then(|len| start.checked_add(len))
        .ok_or_else(|| short("posting list"))?;
    let tids = tup.get(start..end).ok_or_else(|| short("posting list"))?;
    Ok((start, tids))
}

/// A tuple's heap TIDs: its posting list, or its own `t_tid`.
fn heap_tids(tup: &[u8]) -> Result<&[u8], RedoError> {
    if is_posting(tup)? {
        Ok(posting_list(tup)?.1)
    } else {
        tup.get(..TID_SIZE).ok_or_else(|| short("header"))
    }
}

/// `_bt_swap_posting`: `newitem` (the new item as logged) gets the posting list's last TID,
/// and the returned copy of `oposting` has `newitem`'s original TID at `postingoff`, the TIDs
/// after it shifted right by one (the last one dropped). PostgreSQL ERRORs unless
/// `0 < postingoff < nhtids`; so does this.
pub fn swap_posting(newitem: &mut [u8], oposting: &[u8], postingoff: u16) -> Result<Vec<u8>, RedoError> {
    let (start, tids) = posting_list(oposting)?;
    let nhtids = tids.len() / TID_SIZE;
    let off = usize::from(postingoff);
    if !(off > 0 && off < nhtids) {
        return Err(RedoError::DoesNotFit(format!(
            "posting list tuple with {nhtids} items cannot be split at offset {off}"
        )));
    }
    if newitem.len() < TID_SIZE {
        return Err(short("header"));
    }
    let mut nposting = oposting.to_vec();
    let at = start + off * TID_SIZE;
    let end = start + nhtids * TID_SIZE;
    // Shift TIDs off..nhtids-1 one place right, losing the last one.
    nposting.copy_within(at..end - TID_SIZE, at + TID_SIZE);
    nposting[at..at + TID_SIZE].copy_from_slice(&newitem[..TID_SIZE]);
    newitem[..TID_SIZE].copy_from_slice(&tids[(nhtids - 1) * TID_SIZE..]);
    Ok(nposting)
}

/// `_bt_form_posting`: a tuple with `base`'s key and the TIDs `htids` (`6 * n` bytes), as a
/// posting list when there are several, else as a plain tuple.
pub fn form_posting(base: &[u8], htids: &[u8]) -> Result<Vec<u8>, RedoError> {
    let keysize = if is_posting(base)? { posting_list(base)?.0 } else { tuple_size(base)? };
    build_posting(base, keysize, htids)
}

fn build_posting(base: &[u8], keysize: usize, htids: &[u8]) -> Result<Vec<u8>, RedoError> {
    let nhtids = htids.len() / TID_SIZE;
    if nhtids == 0 || htids.len() % TID_SIZE != 0 {
        return Err(RedoError::DoesNotFit("btree posting list without TIDs".into()));
    }
    let key = base.get(..keysize).filter(|k| k.len() >= INDEX_TUPLE_HEADER).ok_or_else(|| short("key"))?;
    let newsize = if nhtids > 1 { crate::page::maxalign(keysize + htids.len()) } else { keysize };
    let size_bits = u16::try_from(newsize)
        .ok()
        .filter(|s| *s <= INDEX_SIZE_MASK)
        .ok_or_else(|| RedoError::DoesNotFit(format!("btree posting list tuple of {newsize} bytes")))?;
    let mut itup = vec![0u8; newsize];
    itup[..keysize].copy_from_slice(key);
    let mut info = (t_info(&itup)? & !INDEX_SIZE_MASK) | size_bits;
    if nhtids > 1 {
        // BTreeTupleSetPosting: the TID's offset holds the count, its block the array offset.
        let (n, ks) = (u16::try_from(nhtids), u32::try_from(keysize));
        let (Ok(n), Ok(ks)) = (n, ks) else {
            return Err(RedoError::DoesNotFit("btree posting list too long".into()));
        };
        if n > BT_OFFSET_MASK {
            return Err(RedoError::DoesNotFit("btree posting list too long".into()));
        }
        info |= INDEX_ALT_TID_MASK;
        put_u16(&mut itup, 6, info).ok_or_else(|| short("header"))?;
        put_u16(&mut itup, 4, n | BT_IS_POSTING).ok_or_else(|| short("header"))?;
        set_tid_block(&mut itup, ks)?;
        itup[keysize..keysize + htids.len()].copy_from_slice(htids);
    } else {
        info &= !INDEX_ALT_TID_MASK;
        put_u16(&mut itup, 6, info).ok_or_else(|| short("header"))?;
        itup[..TID_SIZE].copy_from_slice(htids);
    }
    Ok(itup)
}

/// `_bt_update_posting`: `orig` (a posting tuple) without the TIDs at the (ascending) posting
/// list positions `deletetids`.
pub fn update_posting(orig: &[u8], deletetids: &[u16]) -> Result<Vec<u8>, RedoError> {
    let (keysize, tids) = posting_list(orig)?;
    let n = tids.len() / TID_SIZE;
    let mut kept = Vec::with_capacity(tids.len());
    let mut d = 0;
    for (i, tid) in tids.chunks_exact(TID_SIZE).enumerate() {
        if deletetids.get(d).is_some_and(|&del| usize::from(del) == i) {
            d += 1;
            continue;
        }
        kept.extend_from_slice(tid);
    }
    if d != deletetids.len() || kept.is_empty() {
        return Err(RedoError::DoesNotFit(format!(
            "btree update deletes {:?} of a posting list of {n} TIDs",
            deletetids
        )));
    }
    build_posting(orig, keysize, &kept)
}

/// One deduplication interval of an `xl_btree_dedup` record (`BTDedupInterval`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interval {
    pub baseoff: u16,
    pub nitems: u16,
}

/// `BTDedupStateData`, the parts redo uses: the pending posting list.
pub struct DedupState<'p> {
    base: &'p [u8],
    pub baseoff: u16,
    basetupsize: usize,
    htids: Vec<u8>,
    pub nitems: u16,
    pub nintervals: usize,
}

impl<'p> DedupState<'p> {
    /// `_bt_dedup_start_pending`.
    pub fn start(base: &'p [u8], baseoff: u16, nintervals: usize) -> Result<DedupState<'p>, RedoError> {
        let basetupsize = if is_posting(base)? { posting_list(base)?.0 } else { tuple_size(base)? };
        let htids = heap_tids(base)?.to_vec();
        Ok(DedupState { base, baseoff, basetupsize, htids, nitems: 1, nintervals })
    }

    /// `_bt_dedup_save_htid`: false (nothing saved) if the merged tuple would pass
    /// [`BT_MAX_ITEM_SIZE`].
    pub fn save_htid(&mut self, itup: &[u8]) -> Result<bool, RedoError> {
        let tids = heap_tids(itup)?;
        let merged = crate::page::maxalign(self.basetupsize + self.htids.len() + tids.len());
        if merged > BT_MAX_ITEM_SIZE {
            return Ok(false);
        }
        self.nitems += 1;
        self.htids.extend_from_slice(tids);
        Ok(true)
    }

    /// `_bt_dedup_finish_pending`'s tuple: the base tuple as it is (its `IndexTupleSize`
    /// bytes) when alone, else a new posting list, which counts as one more interval.
    pub fn finish(&mut self) -> Result<Vec<u8>, RedoError> {
        if self.nitems == 1 {
            let size = tuple_size(self.base)?;
            return self.base.get(..size).map(<[u8]>::to_vec).ok_or_else(|| short("size"));
        }
        let out = form_posting(self.base, &self.htids)?;
        self.nintervals += 1;
        Ok(out)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use super::*;

    /// A plain leaf tuple: TID (block, offset) and an 8-byte key, 16 bytes.
    pub(crate) fn leaf_tuple(block: u32, off: u16, key: u64) -> Vec<u8> {
        let mut t = vec![0u8; 16];
        t[0..2].copy_from_slice(&((block >> 16) as u16).to_le_bytes());
        t[2..4].copy_from_slice(&(block as u16).to_le_bytes());
        t[4..6].copy_from_slice(&off.to_le_bytes());
        t[6..8].copy_from_slice(&16u16.to_le_bytes());
        t[8..16].copy_from_slice(&key.to_le_bytes());
        t
    }

    fn tid(block: u32, off: u16) -> Vec<u8> {
        leaf_tuple(block, off, 0)[..6].to_vec()
    }

    pub(crate) fn posting(key: u64, tids: &[(u32, u16)]) -> Vec<u8> {
        let all: Vec<u8> = tids.iter().flat_map(|&(b, o)| tid(b, o)).collect();
        form_posting(&leaf_tuple(0, 1, key), &all).unwrap()
    }

    #[test]
    fn form_posting_with_three_tids_lays_out_header_key_and_aligned_array() {
        let p = posting(7, &[(1, 1), (1, 2), (2, 5)]);
        assert_eq!(p.len(), 40, "maxalign(16 + 18)");
        assert_eq!(tuple_size(&p).unwrap(), 40);
        assert_eq!(t_info(&p).unwrap() & INDEX_ALT_TID_MASK, INDEX_ALT_TID_MASK);
        assert_eq!(u16_at(&p, 4), Some(3 | BT_IS_POSTING));
        assert_eq!(tid_block(&p).unwrap(), 16);
        assert_eq!(&p[16..22], &tid(1, 1)[..]);
        assert_eq!(&p[28..34], &tid(2, 5)[..]);
        assert_eq!(&p[34..], &[0; 6]);
        assert_eq!(form_posting(&leaf_tuple(0, 1, 7), &tid(3, 3)).unwrap(), leaf_tuple(3, 3, 7));
    }

    #[test]
    fn swap_posting_in_the_middle_shifts_tids_and_gives_newitem_the_last() {
        let old = posting(7, &[(1, 1), (1, 3), (1, 5)]);
        let mut newitem = leaf_tuple(1, 2, 7);
        let np = swap_posting(&mut newitem, &old, 1).unwrap();
        assert_eq!(np, posting(7, &[(1, 1), (1, 2), (1, 3)]));
        assert_eq!(newitem, leaf_tuple(1, 5, 7));
        assert!(swap_posting(&mut leaf_tuple(1, 2, 7), &old, 0).is_err());
        assert!(swap_posting(&mut leaf_tuple(1, 2, 7), &old, 3).is_err());
        assert!(swap_posting(&mut leaf_tuple(1, 2, 7), &leaf_tuple(1, 1, 7), 1).is_err());
    }

    #[test]
    fn update_posting_down_to_one_tid_gives_a_plain_tuple() {
        let old = posting(9, &[(4, 1), (4, 2), (4, 3)]);
        assert_eq!(update_posting(&old, &[1]).unwrap(), posting(9, &[(4, 1), (4, 3)]));
        assert_eq!(update_posting(&old, &[0, 2]).unwrap(), leaf_tuple(4, 2, 9));
        assert!(update_posting(&old, &[0, 1, 2]).is_err(), "nothing left");
        assert!(update_posting(&old, &[2, 0]).is_err(), "not ascending");
        assert!(update_posting(&old, &[5]).is_err());
    }

    #[test]
    fn dedup_state_merges_until_the_size_limit() {
        let a = leaf_tuple(1, 1, 5);
        let b = posting(5, &[(1, 2), (1, 3)]);
        let mut st = DedupState::start(&a, 2, 0).unwrap();
        assert!(st.save_htid(&b).unwrap());
        assert_eq!(st.finish().unwrap(), posting(5, &[(1, 1), (1, 2), (1, 3)]));
        assert_eq!(st.nintervals, 1);
        let mut alone = DedupState::start(&a, 2, 0).unwrap();
        assert_eq!(alone.finish().unwrap(), a);
        assert_eq!(alone.nintervals, 0);
        let many: Vec<(u32, u16)> = (0..450).map(|i| (1, i)).collect();
        let big = posting(5, &many);
        let mut full = DedupState::start(&big, 2, 0).unwrap();
        assert!(!full.save_htid(&a).unwrap(), "16 + 451 * 6 > 2712");
    }

    #[test]
    fn short_or_garbled_tuples_are_errors() {
        assert!(t_info(&[1, 2, 3]).is_err());
        assert!(DedupState::start(&[0; 4], 1, 0).is_err());
        let mut bad = posting(1, &[(1, 1), (1, 2)]);
        bad[0..4].copy_from_slice(&[0xff; 4]);
        assert!(update_posting(&bad, &[0]).is_err());
        assert!(form_posting(&leaf_tuple(0, 0, 0), &[1, 2, 3]).is_err());
    }
}
