//! The child's request state machine: turns decoded requests into replies.
//!
//! Pure code (no I/O), so that it can be tested without a process. One redo request is
//! `B [P] A* G`; the state between `B` and `G` is the page being built and the first error seen.
//! An error fails only the request it belongs to: it is reported at `G` and the next `B` starts
//! clean.
//!
//! It also holds the spin window set by `S` (how long the I/O loop busy-polls stdin before it
//! blocks), which is independent of any redo request: `S` never touches the request in
//! progress.

use std::time::Duration;

use page_types::Lsn;
use walredo_proc::page::{Page, BLCKSZ};
use walredo_proc::pg15;
use walredo_proc::pg15::redo::RedoError;
use walredo_proc::protocol::{BufferTag, ErrorCode, Request};
use walredo_proc::record::Record;

static ZERO_PAGE: Page = [0; BLCKSZ];

/// What the child answers a request with (the reply frame it writes), if anything.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer<'a> {
    Page(&'a Page),
    Error(ErrorCode, String),
}

pub struct RedoState {
    /// The block of the request in progress, set by `B`.
    tag: Option<BufferTag>,
    page: Box<Page>,
    /// Whether the page was pushed (`P`) or a record applied; a `P` after either is out of order.
    started: bool,
    /// The first error of the request in progress; later records are skipped.
    failed: Option<(ErrorCode, String)>,
    /// The spin window set by the last valid `S` (0 until then: block at once).
    spin_us: u32,
}

impl RedoState {
    pub fn new() -> RedoState {
        RedoState { tag: None, page: Box::new([0; BLCKSZ]), started: false, failed: None, spin_us: 0 }
    }

    /// How long to busy-poll stdin for the next request before blocking; zero: block at once.
    pub fn spin(&self) -> Duration {
        Duration::from_micros(u64::from(self.spin_us))
    }

    /// Handles one request; returns the reply for `G` and `H`, nothing for the others.
    pub fn handle(&mut self, request: Request<'_>) -> Option<Answer<'_>> {
        match request {
            Request::Begin(tag) => {
                self.tag = Some(tag);
                self.page.fill(0);
                self.started = false;
                self.failed = None;
                None
            }
            Request::PushPage { tag, page } => {
                if let Some(problem) = self.check_tag("P", tag) {
                    self.fail(ErrorCode::BadRequest, problem);
                } else if self.started {
                    self.fail(ErrorCode::BadRequest, "P after P or A".to_string());
                } else {
                    self.page.copy_from_slice(page);
                    self.started = true;
                }
                None
            }
            Request::Apply { lsn, record } => {
                if self.tag.is_none() {
                    self.fail(ErrorCode::BadRequest, "A without B".to_string());
                } else if self.failed.is_none() {
                    self.started = true;
                    // The PostgreSQL families.
                    if let Some(applied) = pg15::redo::apply(record, &mut self.page) {
                        if let Err(e) = applied {
                            let code = match e {
                                RedoError::Unsupported(_) => ErrorCode::UnsupportedRecord,
                                RedoError::Malformed(_) => ErrorCode::BadRecord,
                                RedoError::DoesNotFit(_) => ErrorCode::ApplyFailed,
                            };
                            self.fail(code, format!("record at LSN {}: {e}", Lsn(lsn)));
                        }
                        return None;
                    }
                    match Record::decode(record) {
                        Err(e) => self.fail(ErrorCode::BadRecord, format!("record at LSN {}: {e}", Lsn(lsn))),
                        Ok(record) => {
                            if let Err(e) = record.apply(&mut self.page, lsn) {
                                let kind = record.kind_name();
                                self.fail(ErrorCode::ApplyFailed, format!("{kind} at LSN {}: {e}", Lsn(lsn)));
                            }
                        }
                    }
                }
                None
            }
            Request::GetPage(tag) => {
                let problem = self.check_tag("G", tag);
                self.tag = None;
                let failed = self.failed.take();
                Some(match (problem, failed) {
                    (Some(problem), _) => Answer::Error(ErrorCode::BadRequest, problem),
                    (None, Some((code, message))) => Answer::Error(code, message),
                    (None, None) => Answer::Page(&self.page),
                })
            }
            Request::Ping => Some(Answer::Page(&ZERO_PAGE)),
            Request::SetSpin(Ok(micros)) => {
                self.spin_us = micros;
                Some(Answer::Page(&ZERO_PAGE))
            }
            // The window stays as it was.
            Request::SetSpin(Err(e)) => Some(Answer::Error(ErrorCode::BadRequest, format!("S: {e}"))),
        }
    }

    fn check_tag(&self, what: &str, tag: BufferTag) -> Option<String> {
        match self.tag {
            None => Some(format!("{what} without B")),
            Some(begun) if begun != tag => Some(format!("{what} for {tag} inside the request for {begun}")),
            Some(_) => None,
        }
    }

    fn fail(&mut self, code: ErrorCode, message: String) {
        if self.failed.is_none() {
            self.failed = Some((code, message));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(blknum: u32) -> BufferTag {
        BufferTag { spcnode: 1663, dbnode: 1, relnode: 2, forknum: 0, blknum }
    }

    fn record_bytes(record: Record<'_>) -> Vec<u8> {
        let mut out = Vec::new();
        record.encode(&mut out);
        out
    }

    #[test]
    fn request_without_base_page_applies_records_to_a_zero_page() {
        let mut state = RedoState::new();
        let put = record_bytes(Record::PutBytes { offset: 100, data: b"abc" });
        assert_eq!(state.handle(Request::Begin(tag(1))), None);
        assert_eq!(state.handle(Request::Apply { lsn: 0x10, record: &put }), None);
        let Some(Answer::Page(page)) = state.handle(Request::GetPage(tag(1))) else {
            panic!("expected a page")
        };
        assert_eq!(&page[100..103], b"abc");
        assert_eq!(walredo_proc::page::page_lsn(page), 0x10);
    }

    #[test]
    fn failed_record_fails_only_its_request() {
        let mut state = RedoState::new();
        let bad = record_bytes(Record::PutBytes { offset: 8190, data: b"abcdef" });
        state.handle(Request::Begin(tag(1)));
        state.handle(Request::Apply { lsn: 0x20, record: &bad });
        let Some(Answer::Error(code, message)) = state.handle(Request::GetPage(tag(1))) else {
            panic!("expected an error")
        };
        assert_eq!(code, ErrorCode::ApplyFailed);
        assert!(message.contains("0/20"), "{message}");

        state.handle(Request::Begin(tag(2)));
        assert!(matches!(state.handle(Request::GetPage(tag(2))), Some(Answer::Page(_))));
    }

    #[test]
    fn a_pg15_record_fails_its_request_as_unsupported_naming_its_type_and_a_broken_one_as_bad() {
        let block = pg15::BlockHeader {
            id: 0,
            flags: pg15::FLAG_HAS_DATA,
            fork: 0,
            spcnode: 1663,
            dbnode: 5,
            relnode: 16384,
            blkno: 0,
            data: b"tuple",
        };
        let rec = pg15::Pg15Record {
            rmid: 10,
            info: 0x30,
            xid: 7,
            lsn: 0x28,
            end_lsn: 0x68,
            target: 0,
            blocks: vec![block],
            main_data: b"\x01\x00\x00",
        };
        let mut bytes = Vec::new();
        rec.encode(&mut bytes).unwrap();
        let mut state = RedoState::new();
        state.handle(Request::Begin(tag(1)));
        state.handle(Request::Apply { lsn: 0x68, record: &bytes });
        let Some(Answer::Error(code, message)) = state.handle(Request::GetPage(tag(1))) else {
            panic!("expected an error")
        };
        assert_eq!(code, ErrorCode::UnsupportedRecord);
        assert!(message.contains("Heap TRUNCATE") && message.contains("0/68"), "{message}");
        state.handle(Request::Begin(tag(2)));
        state.handle(Request::Apply { lsn: 0x68, record: &bytes[..bytes.len() - 1] });
        assert!(matches!(
            state.handle(Request::GetPage(tag(2))),
            Some(Answer::Error(ErrorCode::BadRecord, _))
        ));
        // The child serves on.
        state.handle(Request::Begin(tag(3)));
        assert!(matches!(state.handle(Request::GetPage(tag(3))), Some(Answer::Page(_))));
    }

    #[test]
    fn undecodable_record_is_bad_record() {
        let mut state = RedoState::new();
        state.handle(Request::Begin(tag(1)));
        state.handle(Request::Apply { lsn: 1, record: &[0x7f] });
        assert!(matches!(
            state.handle(Request::GetPage(tag(1))),
            Some(Answer::Error(ErrorCode::BadRecord, _))
        ));
    }

    #[test]
    fn out_of_order_messages_are_bad_requests() {
        let mut state = RedoState::new();
        assert!(matches!(
            state.handle(Request::GetPage(tag(1))),
            Some(Answer::Error(ErrorCode::BadRequest, _))
        ));
        state.handle(Request::Begin(tag(1)));
        assert!(matches!(
            state.handle(Request::GetPage(tag(2))),
            Some(Answer::Error(ErrorCode::BadRequest, _))
        ));
        let page = [0u8; BLCKSZ];
        state.handle(Request::Begin(tag(1)));
        state.handle(Request::PushPage { tag: tag(1), page: &page });
        state.handle(Request::PushPage { tag: tag(1), page: &page });
        assert!(matches!(
            state.handle(Request::GetPage(tag(1))),
            Some(Answer::Error(ErrorCode::BadRequest, _))
        ));
    }

    #[test]
    fn set_spin_sets_the_window_without_touching_the_request_in_progress() {
        let mut state = RedoState::new();
        assert_eq!(state.spin(), Duration::ZERO);
        let put = record_bytes(Record::PutBytes { offset: 100, data: b"abc" });
        state.handle(Request::Begin(tag(1)));
        assert_eq!(state.handle(Request::SetSpin(Ok(250))), Some(Answer::Page(&ZERO_PAGE)));
        assert_eq!(state.spin(), Duration::from_micros(250));
        state.handle(Request::Apply { lsn: 0x10, record: &put });
        let Some(Answer::Page(page)) = state.handle(Request::GetPage(tag(1))) else {
            panic!("the request around S must still succeed")
        };
        assert_eq!(&page[100..103], b"abc");
        assert_eq!(state.handle(Request::SetSpin(Ok(0))), Some(Answer::Page(&ZERO_PAGE)));
        assert_eq!(state.spin(), Duration::ZERO);
    }

    #[test]
    fn bad_set_spin_is_a_bad_request_and_keeps_the_window() {
        use walredo_proc::protocol::SpinError;
        let mut state = RedoState::new();
        state.handle(Request::SetSpin(Ok(100)));
        for error in [SpinError::AboveMax(5000), SpinError::BadLength(3)] {
            let Some(Answer::Error(code, message)) = state.handle(Request::SetSpin(Err(error))) else {
                panic!("expected an error for {error:?}")
            };
            assert_eq!(code, ErrorCode::BadRequest);
            assert!(message.starts_with("S: "), "{message}");
            assert_eq!(state.spin(), Duration::from_micros(100));
        }
    }

    #[test]
    fn ping_replies_with_a_zero_page() {
        let mut state = RedoState::new();
        assert_eq!(state.handle(Request::Ping), Some(Answer::Page(&ZERO_PAGE)));
    }
}
