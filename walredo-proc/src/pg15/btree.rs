//! Redo of Btree records (PostgreSQL 15's `nbtxlog.c`), for the record's target block.
//!
//! Not applied yet: every type (each is `Unsupported`).

use super::redo::{RedoError, Target};
use crate::page::Page;

pub fn redo(target: &Target<'_, '_>, _page: &mut Page) -> Result<(), RedoError> {
    Err(RedoError::Unsupported(target.type_name()))
}
