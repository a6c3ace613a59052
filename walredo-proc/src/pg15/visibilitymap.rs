//! The visibility map's pages (PostgreSQL 15's `visibilitymap.c`): the bits of VISIBLE on the
//! map page, and the derived [`VmClear`] of heap records.
//!
//! Not applied yet (each is `Unsupported`).

use super::redo::RedoError;
use super::VmClear;
use crate::page::Page;

pub fn apply_clear(clear: &VmClear, _page: &mut Page) -> Result<(), RedoError> {
    Err(RedoError::Unsupported(clear.type_name()))
}
