//! The walredo wire protocol: framing and messages in both directions.
//!
//! The byte layouts are specified in docs/walredo-protocol.md; this module is their only
//! implementation, used by the child (to decode requests and encode replies) and by the daemon
//! (to encode requests and decode replies).
//!
//! Invariants:
//! - pure code: no I/O, no allocation beyond the caller's output buffers;
//! - every length read from the wire is checked against a hard limit before it is used, and no
//!   input makes a decoder panic: malformed input is a [`FrameError`].

use crate::page::{Page, BLCKSZ};
use crate::record::{Record, MAX_RECORD_LEN};

/// Version of this protocol, announced by the child in its hello.
pub const PROTOCOL_VERSION: u32 = 1;
/// Tag byte plus the length field.
pub const HEADER_LEN: usize = 5;
pub use page_types::BUFFER_TAG_LEN;
/// Largest value of a frame's length field (it counts itself): an `A` frame with the largest record.
pub const MAX_FRAME_LEN: usize = 4 + 8 + MAX_RECORD_LEN;
/// Longest error message carried by an `e` frame; longer messages are cut.
pub const MAX_ERROR_MESSAGE_LEN: usize = 1024;
/// Payload length of the hello frame.
pub const HELLO_LEN: usize = 16;
/// Hello flag: the child runs under its seccomp sandbox.
pub const HELLO_FLAG_SECCOMP: u32 = 1;
/// Hello flag: the child understands the `S` frame (a spin window).
pub const HELLO_FLAG_SPIN: u32 = 2;
/// Payload length of a well-formed `S` frame: the window in microseconds, a `u32`.
pub const SPIN_PAYLOAD_LEN: usize = 4;
/// Longest spin window an `S` frame may set, in microseconds. Spinning longer than this only
/// burns CPU: a request that comes later than that is rare enough to pay a wake-up.
pub const MAX_SPIN_US: u32 = 1000;

pub use page_types::BufferTag;

/// A message from the daemon to the child, borrowing from the read buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Request<'a> {
    /// `B`: begin a request for this block.
    Begin(BufferTag),
    /// `P`: the base image.
    PushPage { tag: BufferTag, page: &'a Page },
    /// `A`: apply one record at an LSN. The record bytes are decoded by the child, so that a bad
    /// record fails its request instead of breaking the framing.
    Apply { lsn: u64, record: &'a [u8] },
    /// `G`: finish the request and reply.
    GetPage(BufferTag),
    /// `H`: reply with a zero page.
    Ping,
    /// `S`: set the child's spin window (microseconds), or why the payload is not one. The
    /// child replies with a zero page (as to `H`) or, for a bad payload, a `bad_request` error.
    SetSpin(Result<u32, SpinError>),
}

/// Why an `S` frame carries no valid spin window. Its length field is trusted for framing
/// (it is within [`MAX_FRAME_LEN`]), so the frame is skipped and only it fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SpinError {
    #[error("spin window payload of {0} bytes, expected {SPIN_PAYLOAD_LEN}")]
    BadLength(usize),
    #[error("spin window of {0} us, at most {MAX_SPIN_US} us allowed")]
    AboveMax(u32),
}

/// A framing violation: after one, the reader cannot tell where the next frame starts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("unknown message tag {0:#04x}")]
    UnknownTag(u8),
    #[error("message '{tag}' has length {len}, allowed {min}..={max}")]
    BadLength { tag: char, len: u32, min: u32, max: u32 },
    #[error("hello: {0}")]
    BadHello(String),
}

/// Decodes the request frame at the start of `buf`.
///
/// Returns `Ok(None)` when `buf` does not yet hold the whole frame, else the request and the
/// number of bytes it took.
pub fn decode_request(buf: &[u8]) -> Result<Option<(Request<'_>, usize)>, FrameError> {
    let Some((tag, payload_len)) = peek_header(buf)? else {
        return Ok(None);
    };
    let (min, max) = match tag {
        b'B' | b'G' => (BUFFER_TAG_LEN, BUFFER_TAG_LEN),
        b'P' => (BUFFER_TAG_LEN + BLCKSZ, BUFFER_TAG_LEN + BLCKSZ),
        b'A' => (8 + 1, 8 + MAX_RECORD_LEN),
        b'H' => (0, 0),
        // Any length the header allows: a bad payload fails the frame alone (see `SpinError`).
        b'S' => (0, MAX_FRAME_LEN - 4),
        other => return Err(FrameError::UnknownTag(other)),
    };
    check_len(tag, payload_len, min, max)?;
    let total = HEADER_LEN + payload_len;
    let Some(payload) = buf.get(HEADER_LEN..total) else {
        return Ok(None);
    };
    let tag_at = |p: &[u8]| -> BufferTag {
        let bytes: &[u8; BUFFER_TAG_LEN] =
            p[..BUFFER_TAG_LEN].try_into().expect("length checked against the tag's minimum");
        BufferTag::decode(bytes)
    };
    let request = match tag {
        b'B' => Request::Begin(tag_at(payload)),
        b'G' => Request::GetPage(tag_at(payload)),
        b'P' => Request::PushPage {
            tag: tag_at(payload),
            page: payload[BUFFER_TAG_LEN..].try_into().expect("length checked to be a page"),
        },
        b'A' => Request::Apply {
            lsn: u64::from_be_bytes(payload[..8].try_into().expect("length checked to be >= 8")),
            record: &payload[8..],
        },
        b'S' => Request::SetSpin(decode_spin(payload)),
        _ => Request::Ping,
    };
    Ok(Some((request, total)))
}

fn decode_spin(payload: &[u8]) -> Result<u32, SpinError> {
    let bytes: [u8; SPIN_PAYLOAD_LEN] =
        payload.try_into().map_err(|_| SpinError::BadLength(payload.len()))?;
    let micros = u32::from_be_bytes(bytes);
    if micros > MAX_SPIN_US {
        return Err(SpinError::AboveMax(micros));
    }
    Ok(micros)
}

/// Reads the tag and payload length of the frame at the start of `buf`, if the header is there.
fn peek_header(buf: &[u8]) -> Result<Option<(u8, usize)>, FrameError> {
    let Some(header) = buf.get(..HEADER_LEN) else {
        return Ok(None);
    };
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
    if !(4..=MAX_FRAME_LEN as u32).contains(&len) {
        return Err(FrameError::BadLength { tag: header[0] as char, len, min: 4, max: MAX_FRAME_LEN as u32 });
    }
    Ok(Some((header[0], len as usize - 4)))
}

fn check_len(tag: u8, payload_len: usize, min: usize, max: usize) -> Result<(), FrameError> {
    if (min..=max).contains(&payload_len) {
        Ok(())
    } else {
        Err(FrameError::BadLength {
            tag: tag as char,
            len: (payload_len + 4) as u32,
            min: (min + 4) as u32,
            max: (max + 4) as u32,
        })
    }
}

fn put_header(out: &mut Vec<u8>, tag: u8, payload_len: usize) {
    out.push(tag);
    // Callers pass payloads bounded by MAX_FRAME_LEN, so this fits in u32.
    out.extend_from_slice(&((payload_len + 4) as u32).to_be_bytes());
}

/// Appends a `B` frame.
pub fn encode_begin(out: &mut Vec<u8>, tag: &BufferTag) {
    put_header(out, b'B', BUFFER_TAG_LEN);
    tag.encode(out);
}

/// Appends a `P` frame.
pub fn encode_push_page(out: &mut Vec<u8>, tag: &BufferTag, page: &Page) {
    encode_push_page_head(out, tag);
    out.extend_from_slice(page);
}

/// Appends a `P` frame up to its page: the frame is whole once the caller sends the page's
/// [`BLCKSZ`] bytes right after (a vectored write sends them from where they are).
pub fn encode_push_page_head(out: &mut Vec<u8>, tag: &BufferTag) {
    put_header(out, b'P', BUFFER_TAG_LEN + BLCKSZ);
    tag.encode(out);
}

/// Appends an `A` frame carrying already encoded record bytes.
///
/// The caller guarantees `1 <= record.len() <= MAX_RECORD_LEN` (see [`check_record_len`]).
pub fn encode_apply_raw(out: &mut Vec<u8>, lsn: u64, record: &[u8]) {
    encode_apply_head(out, lsn, record.len());
    out.extend_from_slice(record);
}

/// Appends an `A` frame up to its record: the frame is whole once the caller sends the
/// `record_len` bytes of the encoded record right after. The caller guarantees
/// `1 <= record_len <= MAX_RECORD_LEN` (see [`check_record_len`]).
pub fn encode_apply_head(out: &mut Vec<u8>, lsn: u64, record_len: usize) {
    put_header(out, b'A', 8 + record_len);
    out.extend_from_slice(&lsn.to_be_bytes());
}

/// Appends an `A` frame for a record.
pub fn encode_apply(out: &mut Vec<u8>, lsn: u64, record: &Record<'_>) {
    put_header(out, b'A', 8 + record.encoded_len());
    out.extend_from_slice(&lsn.to_be_bytes());
    record.encode(out);
}

/// Checks that encoded record bytes fit in an `A` frame.
pub fn check_record_len(record: &[u8]) -> Result<(), FrameError> {
    check_len(b'A', 8 + record.len(), 8 + 1, 8 + MAX_RECORD_LEN)
}

/// Appends a `G` frame.
pub fn encode_get_page(out: &mut Vec<u8>, tag: &BufferTag) {
    put_header(out, b'G', BUFFER_TAG_LEN);
    tag.encode(out);
}

/// Appends an `H` frame.
pub fn encode_ping(out: &mut Vec<u8>) {
    put_header(out, b'H', 0);
}

/// Appends an `S` frame setting the spin window to `micros` microseconds. Values above
/// [`MAX_SPIN_US`] are encoded as given (the child rejects them); callers clamp.
pub fn encode_set_spin(out: &mut Vec<u8>, micros: u32) {
    put_header(out, b'S', SPIN_PAYLOAD_LEN);
    out.extend_from_slice(&micros.to_be_bytes());
}

/// The child's greeting, its first frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub version: u32,
    pub pid: u32,
    pub max_record_len: u32,
    pub flags: u32,
}

impl Hello {
    /// Appends the `v` frame.
    pub fn encode(&self, out: &mut Vec<u8>) {
        put_header(out, b'v', HELLO_LEN);
        for v in [self.version, self.pid, self.max_record_len, self.flags] {
            out.extend_from_slice(&v.to_be_bytes());
        }
    }

    /// Decodes a `v` payload (see [`decode_reply_header`]) and checks the version.
    pub fn decode(payload: &[u8]) -> Result<Hello, FrameError> {
        let field = |i: usize| -> Result<u32, FrameError> {
            payload
                .get(i * 4..i * 4 + 4)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_be_bytes)
                .ok_or_else(|| FrameError::BadHello(format!("payload of {} bytes", payload.len())))
        };
        let hello = Hello { version: field(0)?, pid: field(1)?, max_record_len: field(2)?, flags: field(3)? };
        if hello.version != PROTOCOL_VERSION {
            return Err(FrameError::BadHello(format!(
                "child speaks protocol version {}, expected {PROTOCOL_VERSION}",
                hello.version
            )));
        }
        Ok(hello)
    }
}

/// The kind of a reply frame, known from its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyKind {
    /// `v`: a [`Hello`] of [`HELLO_LEN`] bytes follows.
    Hello,
    /// `p`: a page of [`BLCKSZ`] bytes follows.
    Page,
    /// `e`: an error code and message follow, `payload_len` bytes in all.
    Error { payload_len: usize },
}

impl ReplyKind {
    /// Bytes of payload following the header.
    pub fn payload_len(self) -> usize {
        match self {
            ReplyKind::Hello => HELLO_LEN,
            ReplyKind::Page => BLCKSZ,
            ReplyKind::Error { payload_len } => payload_len,
        }
    }
}

/// Decodes and checks a reply frame header.
pub fn decode_reply_header(header: &[u8; HEADER_LEN]) -> Result<ReplyKind, FrameError> {
    let (tag, payload_len) = peek_header(header)?.expect("header has HEADER_LEN bytes");
    match tag {
        b'v' => check_len(tag, payload_len, HELLO_LEN, HELLO_LEN).map(|()| ReplyKind::Hello),
        b'p' => check_len(tag, payload_len, BLCKSZ, BLCKSZ).map(|()| ReplyKind::Page),
        b'e' => check_len(tag, payload_len, 2, 2 + MAX_ERROR_MESSAGE_LEN)
            .map(|()| ReplyKind::Error { payload_len }),
        other => Err(FrameError::UnknownTag(other)),
    }
}

/// Why the child could not serve a request (the code of an `e` frame).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    /// Messages out of order: `P`/`A`/`G` without `B`, mismatched tags, a late `P`.
    BadRequest,
    /// A record that cannot be decoded.
    BadRecord,
    /// A record that does not fit the page state.
    ApplyFailed,
    /// A record of a family or type this child decodes but does not apply (yet): the message
    /// names its resource manager and record type.
    UnsupportedRecord,
    /// A code this version does not know (a newer child).
    Unknown(u16),
}

impl ErrorCode {
    pub fn to_u16(self) -> u16 {
        match self {
            ErrorCode::BadRequest => 1,
            ErrorCode::BadRecord => 2,
            ErrorCode::ApplyFailed => 3,
            ErrorCode::UnsupportedRecord => 4,
            ErrorCode::Unknown(code) => code,
        }
    }

    pub fn from_u16(code: u16) -> ErrorCode {
        match code {
            1 => ErrorCode::BadRequest,
            2 => ErrorCode::BadRecord,
            3 => ErrorCode::ApplyFailed,
            4 => ErrorCode::UnsupportedRecord,
            other => ErrorCode::Unknown(other),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::BadRecord => "bad_record",
            ErrorCode::ApplyFailed => "apply_failed",
            ErrorCode::UnsupportedRecord => "unsupported_record",
            ErrorCode::Unknown(_) => "unknown",
        }
    }
}

/// Appends the 5-byte header of a `p` reply; the page follows it.
pub fn encode_page_reply_header(out: &mut Vec<u8>) {
    put_header(out, b'p', BLCKSZ);
}

/// Appends an `e` reply, cutting the message to [`MAX_ERROR_MESSAGE_LEN`] on a char boundary.
pub fn encode_error_reply(out: &mut Vec<u8>, code: ErrorCode, message: &str) {
    let mut end = message.len().min(MAX_ERROR_MESSAGE_LEN);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    put_header(out, b'e', 2 + end);
    out.extend_from_slice(&code.to_u16().to_be_bytes());
    out.extend_from_slice(&message.as_bytes()[..end]);
}

/// Decodes an `e` payload; invalid UTF-8 in the message is replaced, not an error.
pub fn decode_error_payload(payload: &[u8]) -> (ErrorCode, String) {
    match payload {
        [hi, lo, message @ ..] => (
            ErrorCode::from_u16(u16::from_be_bytes([*hi, *lo])),
            String::from_utf8_lossy(message).into_owned(),
        ),
        // decode_reply_header guarantees at least two bytes; stay total anyway.
        _ => (ErrorCode::Unknown(0), String::from("(empty error frame)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tag() -> BufferTag {
        BufferTag { spcnode: 1663, dbnode: 5, relnode: 16384, forknum: 0, blknum: 7 }
    }

    #[test]
    fn buffer_tag_encodes_in_wire_order() {
        let mut out = Vec::new();
        tag().encode(&mut out);
        assert_eq!(out, [0, 0, 0, 6, 127, 0, 0, 0, 5, 0, 0, 64, 0, 0, 0, 0, 7]);
        let bytes: [u8; BUFFER_TAG_LEN] = out.as_slice().try_into().unwrap();
        assert_eq!(BufferTag::decode(&bytes), tag());
    }

    #[test]
    fn request_frames_round_trip() {
        let page: Box<Page> = Box::new([0xAB; BLCKSZ]);
        let mut out = Vec::new();
        encode_begin(&mut out, &tag());
        encode_push_page(&mut out, &tag(), &page);
        encode_apply(&mut out, 0x1_0000_0010, &Record::PutBytes { offset: 100, data: b"hi" });
        encode_get_page(&mut out, &tag());
        encode_ping(&mut out);

        let mut rest = out.as_slice();
        let mut seen = Vec::new();
        while !rest.is_empty() {
            let (request, used) = decode_request(rest).unwrap().unwrap();
            seen.push(format!("{request:?}").chars().take(12).collect::<String>());
            if let Request::Apply { lsn, record } = request {
                assert_eq!(lsn, 0x1_0000_0010);
                assert_eq!(Record::decode(record).unwrap(), Record::PutBytes { offset: 100, data: b"hi" });
            }
            rest = &rest[used..];
        }
        assert_eq!(seen.len(), 5);
        assert_eq!(out[0..5], [b'B', 0, 0, 0, 21]);
    }

    #[test]
    fn partial_frame_needs_more_bytes() {
        let mut out = Vec::new();
        encode_get_page(&mut out, &tag());
        for cut in 0..out.len() {
            assert_eq!(decode_request(&out[..cut]).unwrap(), None, "cut at {cut}");
        }
    }

    #[test]
    fn request_with_unknown_tag_or_bad_length_is_a_frame_error() {
        assert_eq!(decode_request(b"Z\0\0\0\x04"), Err(FrameError::UnknownTag(b'Z')));
        assert!(matches!(decode_request(b"G\0\0\0\x03"), Err(FrameError::BadLength { .. })));
        assert!(matches!(decode_request(b"H\0\0\0\x05x"), Err(FrameError::BadLength { .. })));
        assert!(matches!(decode_request(b"A\xff\xff\xff\xff"), Err(FrameError::BadLength { .. })));
        // An `A` frame must carry at least one record byte after the LSN.
        assert!(matches!(decode_request(b"A\0\0\0\x0c\0\0\0\0\0\0\0\0"), Err(FrameError::BadLength { .. })));
    }

    #[test]
    fn reply_headers_are_checked() {
        let mut out = Vec::new();
        encode_page_reply_header(&mut out);
        assert_eq!(decode_reply_header(out[..].try_into().unwrap()), Ok(ReplyKind::Page));
        assert!(decode_reply_header(b"p\0\0\0\x05").is_err());
        assert!(decode_reply_header(b"x\0\0\0\x04").is_err());
        assert!(decode_reply_header(b"e\0\0\0\x05").is_err());
    }

    #[test]
    fn error_reply_round_trips_and_cuts_long_messages() {
        let mut out = Vec::new();
        encode_error_reply(&mut out, ErrorCode::ApplyFailed, "page full");
        let kind = decode_reply_header(out[..5].try_into().unwrap()).unwrap();
        assert_eq!(kind, ReplyKind::Error { payload_len: 11 });
        assert_eq!(decode_error_payload(&out[5..]), (ErrorCode::ApplyFailed, "page full".to_string()));

        let long = "é".repeat(1000); // 2000 bytes, cut must land on a char boundary
        let mut out = Vec::new();
        encode_error_reply(&mut out, ErrorCode::BadRecord, &long);
        let (code, message) = decode_error_payload(&out[5..]);
        assert_eq!(code, ErrorCode::BadRecord);
        assert_eq!(message.len(), MAX_ERROR_MESSAGE_LEN);
        assert!(decode_reply_header(out[..5].try_into().unwrap()).is_ok());
    }

    #[test]
    fn hello_round_trips_and_rejects_other_versions() {
        let hello =
            Hello { version: PROTOCOL_VERSION, pid: 42, max_record_len: 16384, flags: HELLO_FLAG_SECCOMP };
        let mut out = Vec::new();
        hello.encode(&mut out);
        assert_eq!(decode_reply_header(out[..5].try_into().unwrap()), Ok(ReplyKind::Hello));
        assert_eq!(Hello::decode(&out[5..]), Ok(hello));
        let mut other = out.clone();
        other[8] = 2; // version's low byte
        assert!(matches!(Hello::decode(&other[5..]), Err(FrameError::BadHello(_))));
    }

    #[test]
    fn set_spin_frame_round_trips_up_to_the_cap() {
        for micros in [0, 1, 100, MAX_SPIN_US] {
            let mut out = Vec::new();
            encode_set_spin(&mut out, micros);
            assert_eq!(out.len(), HEADER_LEN + SPIN_PAYLOAD_LEN);
            assert_eq!(out[..5], [b'S', 0, 0, 0, 8]);
            assert_eq!(decode_request(&out), Ok(Some((Request::SetSpin(Ok(micros)), out.len()))));
            for cut in 0..out.len() {
                assert_eq!(decode_request(&out[..cut]), Ok(None), "cut at {cut}");
            }
        }
    }

    #[test]
    fn set_spin_above_the_cap_fails_the_frame_alone() {
        for micros in [MAX_SPIN_US + 1, u32::MAX] {
            let mut out = Vec::new();
            encode_set_spin(&mut out, micros);
            encode_ping(&mut out);
            let (request, used) = decode_request(&out).unwrap().unwrap();
            assert_eq!(request, Request::SetSpin(Err(SpinError::AboveMax(micros))));
            assert_eq!(used, HEADER_LEN + SPIN_PAYLOAD_LEN);
            assert_eq!(decode_request(&out[used..]), Ok(Some((Request::Ping, HEADER_LEN))));
        }
    }

    #[test]
    fn set_spin_with_a_payload_of_the_wrong_size_fails_the_frame_alone() {
        for payload_len in [0usize, 3, 5, 4096, MAX_FRAME_LEN - 4] {
            let mut out = vec![b'S'];
            out.extend_from_slice(&((payload_len + 4) as u32).to_be_bytes());
            out.resize(out.len() + payload_len, 0);
            encode_ping(&mut out);
            let (request, used) = decode_request(&out).unwrap().unwrap();
            assert_eq!(request, Request::SetSpin(Err(SpinError::BadLength(payload_len))));
            assert_eq!(used, HEADER_LEN + payload_len, "the whole frame is skipped");
            assert_eq!(decode_request(&out[used..]), Ok(Some((Request::Ping, HEADER_LEN))));
        }
        // Beyond the frame limit it is a framing violation, as for every tag.
        let too_long = [b'S', 0, 0, 0xff, 0xff];
        assert!(matches!(decode_request(&too_long), Err(FrameError::BadLength { .. })));
    }

    proptest! {
        #[test]
        fn decode_request_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut rest = bytes.as_slice();
            while let Ok(Some((_, used))) = decode_request(rest) {
                prop_assert!(used >= HEADER_LEN && used <= rest.len());
                rest = &rest[used..];
            }
        }

        #[test]
        fn decode_reply_header_never_panics(header in any::<[u8; HEADER_LEN]>(), payload in proptest::collection::vec(any::<u8>(), 0..40)) {
            if let Ok(kind) = decode_reply_header(&header) {
                prop_assert!(kind.payload_len() <= BLCKSZ);
            }
            let _ = Hello::decode(&payload);
            let _ = decode_error_payload(&payload);
        }
    }
}
