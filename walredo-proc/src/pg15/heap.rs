//! Redo of Heap and Heap2 records (PostgreSQL 15's `heapam.c`, `heap_redo` and `heap2_redo`),
//! for the record's target block. The visibility map's page of VISIBLE is
//! [`super::visibilitymap`]'s.
//!
//! Not applied yet: every type (each is `Unsupported`).

use super::redo::{RedoError, Target};
use crate::page::Page;

/// Heap (rmgr 10).
pub fn redo_heap(target: &Target<'_, '_>, _page: &mut Page) -> Result<(), RedoError> {
    Err(RedoError::Unsupported(target.type_name()))
}

/// Heap2 (rmgr 9).
pub fn redo_heap2(target: &Target<'_, '_>, _page: &mut Page) -> Result<(), RedoError> {
    Err(RedoError::Unsupported(target.type_name()))
}
