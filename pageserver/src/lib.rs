
pub mod storage;
