//! The page service wire protocol (docs/page-service-protocol.md): frames and messages in both
//! directions, encode and decode.
//!
//! Pure code: no I/O. Used by the server ([`super`]) and by `pagebench`'s client
//! (`bin/pagebench/client.rs`, which the server's tests compile in too). Decoding takes the payload as `Bytes`, so the data of ingested values is sliced
//! out of the read buffer, not copied.
//!
//! Invariant: no input makes a decoder panic; every length is checked against what is there
//! and against [`MAX_FRAME_LEN`] before use.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use page_types::keys::RelTag;
use page_types::{BufferTag, Lsn, BUFFER_TAG_LEN, PAGE_SIZE};

use crate::storage::{IngestBatch, Value};

/// The newest protocol version: 2, whose Hello names a timeline. Version 1 (a Hello without
/// one, for the tenant's `main`) is still spoken.
pub const PROTOCOL_VERSION: u32 = 2;
/// The oldest protocol version the daemon speaks.
pub const MIN_PROTOCOL_VERSION: u32 = 1;
/// The timeline a version 1 Hello means.
pub const DEFAULT_TIMELINE: &str = "main";
/// Largest `len` of a frame (type and payload).
pub const MAX_FRAME_LEN: u32 = 8 << 20;
/// Largest `len` of a frame before Hello: a Hello is under 100 bytes, and a connection that has
/// not said who it is gets no room for more.
pub const MAX_HELLO_FRAME_LEN: u32 = 4096;
/// GetPage at this LSN means "the latest durable LSN" ([`Lsn::LATEST`]).
pub const LSN_LATEST: u64 = Lsn::LATEST.0;

/// The first value of an Ingest at a reserved LSN, with the reason: 0 lies below every
/// tenant's start, and [`LSN_LATEST`] is GetPage's "latest" sentinel (a value stored there would
/// put every later batch "below" it and freeze the tenant's ingest for good).
pub fn reserved_lsn(values: &[IngestValue]) -> Option<(usize, &'static str)> {
    let (i, lsn) = values.iter().map(|v| Lsn(v.lsn)).enumerate().find(|(_, lsn)| lsn.is_reserved())?;
    let why = if lsn == Lsn::LATEST {
        "LSN \"latest\" (0xFFFFFFFFFFFFFFFF) is reserved for GetPage"
    } else {
        "LSN 0/0 is reserved: it lies below every tenant's first LSN"
    };
    Some((i, why))
}

/// The storage form of an Ingest's values (wire -> domain; the LSNs are checked by storage).
pub fn to_batch(values: Vec<IngestValue>) -> IngestBatch {
    let values = values
        .into_iter()
        .map(|v| {
            let value = match v.kind {
                ValueKind::Image => Value::Image(v.data),
                ValueKind::Record => Value::Record(v.data),
            };
            (v.key, Lsn(v.lsn), value)
        })
        .collect();
    IngestBatch { values }
}

/// Longest tenant id.
pub const MAX_TENANT_ID_LEN: usize = 64;

const HELLO: u8 = 0x01;
const GET_PAGE: u8 = 0x02;
const INGEST: u8 = 0x03;
const GET_REL_SIZE: u8 = 0x04;
const GET_REL_EXISTS: u8 = 0x05;
const HELLO_OK: u8 = 0x81;
const PAGE: u8 = 0x82;
const INGEST_OK: u8 = 0x83;
const ERROR: u8 = 0x84;
const REL_SIZE: u8 = 0x85;
const REL_EXISTS: u8 = 0x86;
/// Size of the wire form of a relation fork: forknum, spcnode, dbnode, relnode.
const REL_FORK_LEN: usize = 13;

/// Bytes of a Page reply before the page: len, type, request id, lsn.
pub const PAGE_REPLY_HEADER_LEN: usize = 4 + 1 + 8 + 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    Image,
    Record,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IngestValue {
    pub key: BufferTag,
    pub lsn: u64,
    pub kind: ValueKind,
    pub data: Bytes,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientMessage {
    Hello {
        version: u32,
        tenant_id: String,
        /// Sent from version 2 on; a version 1 Hello means [`DEFAULT_TIMELINE`].
        timeline_id: String,
    },
    GetPage {
        request_id: u64,
        key: BufferTag,
        lsn: u64,
    },
    Ingest {
        request_id: u64,
        values: Vec<IngestValue>,
    },
    /// The number of blocks of a relation fork at an LSN.
    GetRelSize {
        request_id: u64,
        rel: RelTag,
        fork: u8,
        lsn: u64,
    },
    /// Whether a relation fork exists at an LSN.
    GetRelExists {
        request_id: u64,
        rel: RelTag,
        fork: u8,
        lsn: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerMessage {
    HelloOk { version: u32, last_durable_lsn: u64 },
    Page { request_id: u64, lsn: u64, page: Bytes },
    IngestOk { request_id: u64, durable_lsn: u64 },
    Error { request_id: u64, code: ErrorCode, message: String },
    RelSize { request_id: u64, lsn: u64, blocks: u32 },
    RelExists { request_id: u64, lsn: u64, exists: bool },
}

/// Error codes of the Error reply; see the table in the protocol doc.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    BadFrame,
    FrameTooLarge,
    UnsupportedVersion,
    NoSuchTenant,
    TooManyConnections,
    NotFound,
    LsnTimeout,
    InvalidRequest,
    RedoFailed,
    ShuttingDown,
    Internal,
    TenantBroken,
    IdleTimeout,
    Overloaded,
    StorageUnavailable,
    /// GetPage below the tenant's GC cutoff: that page version was garbage-collected.
    BelowGcCutoff,
    /// GetPage whose page needs a record the redo child does not apply yet (the message names
    /// its resource manager and record type).
    UnsupportedRecord,
    /// A read of a tenant whose initial import (a base backup of its PostgreSQL) is not
    /// complete: its pages are partial and fuzzy until it is.
    ImportIncomplete,
    /// A code this version does not know.
    Unknown(u16),
}

impl ErrorCode {
    pub fn to_u16(self) -> u16 {
        match self {
            ErrorCode::BadFrame => 1,
            ErrorCode::FrameTooLarge => 2,
            ErrorCode::UnsupportedVersion => 3,
            ErrorCode::NoSuchTenant => 4,
            ErrorCode::TooManyConnections => 5,
            ErrorCode::NotFound => 6,
            ErrorCode::LsnTimeout => 7,
            ErrorCode::InvalidRequest => 8,
            ErrorCode::RedoFailed => 9,
            ErrorCode::ShuttingDown => 10,
            ErrorCode::Internal => 11,
            ErrorCode::TenantBroken => 12,
            ErrorCode::IdleTimeout => 13,
            ErrorCode::Overloaded => 14,
            ErrorCode::StorageUnavailable => 15,
            ErrorCode::BelowGcCutoff => 16,
            ErrorCode::UnsupportedRecord => 17,
            ErrorCode::ImportIncomplete => 18,
            ErrorCode::Unknown(code) => code,
        }
    }

    pub fn from_u16(code: u16) -> ErrorCode {
        match code {
            1 => ErrorCode::BadFrame,
            2 => ErrorCode::FrameTooLarge,
            3 => ErrorCode::UnsupportedVersion,
            4 => ErrorCode::NoSuchTenant,
            5 => ErrorCode::TooManyConnections,
            6 => ErrorCode::NotFound,
            7 => ErrorCode::LsnTimeout,
            8 => ErrorCode::InvalidRequest,
            9 => ErrorCode::RedoFailed,
            10 => ErrorCode::ShuttingDown,
            11 => ErrorCode::Internal,
            12 => ErrorCode::TenantBroken,
            13 => ErrorCode::IdleTimeout,
            14 => ErrorCode::Overloaded,
            15 => ErrorCode::StorageUnavailable,
            16 => ErrorCode::BelowGcCutoff,
            17 => ErrorCode::UnsupportedRecord,
            18 => ErrorCode::ImportIncomplete,
            other => ErrorCode::Unknown(other),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::BadFrame => "bad_frame",
            ErrorCode::FrameTooLarge => "frame_too_large",
            ErrorCode::UnsupportedVersion => "unsupported_version",
            ErrorCode::NoSuchTenant => "no_such_tenant",
            ErrorCode::TooManyConnections => "too_many_connections",
            ErrorCode::NotFound => "not_found",
            ErrorCode::LsnTimeout => "lsn_timeout",
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::RedoFailed => "redo_failed",
            ErrorCode::ShuttingDown => "shutting_down",
            ErrorCode::Internal => "internal",
            ErrorCode::TenantBroken => "tenant_broken",
            ErrorCode::IdleTimeout => "idle_timeout",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::StorageUnavailable => "storage_unavailable",
            ErrorCode::BelowGcCutoff => "below_gc_cutoff",
            ErrorCode::UnsupportedRecord => "unsupported_record",
            ErrorCode::ImportIncomplete => "import_incomplete",
            ErrorCode::Unknown(_) => "unknown",
        }
    }

    /// Whether the daemon closes the connection after sending this error.
    pub fn closes_connection(self) -> bool {
        matches!(
            self,
            ErrorCode::BadFrame
                | ErrorCode::FrameTooLarge
                | ErrorCode::UnsupportedVersion
                | ErrorCode::NoSuchTenant
                | ErrorCode::TooManyConnections
                | ErrorCode::ShuttingDown
                | ErrorCode::TenantBroken
                | ErrorCode::IdleTimeout
        )
    }
}

/// A frame that cannot be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("frame length {0} is outside 1..={MAX_FRAME_LEN}")]
    TooLarge(u32),
    #[error("frame length {0} is more than the {MAX_HELLO_FRAME_LEN} allowed before Hello")]
    TooLargeBeforeHello(u32),
    #[error("malformed frame: {0}")]
    Malformed(String),
}

impl DecodeError {
    pub fn code(&self) -> ErrorCode {
        match self {
            DecodeError::TooLarge(_) | DecodeError::TooLargeBeforeHello(_) => ErrorCode::FrameTooLarge,
            DecodeError::Malformed(_) => ErrorCode::BadFrame,
        }
    }
}

fn malformed<T>(what: impl Into<String>) -> Result<T, DecodeError> {
    Err(DecodeError::Malformed(what.into()))
}

/// Looks at the start of `buf`: `Ok(Some(n))` when a whole frame of `n` bytes (length field
/// included) is there, `Ok(None)` when more bytes are needed. Checks the length first, so an
/// oversized frame is refused before its payload is read.
pub fn frame_len(buf: &[u8]) -> Result<Option<usize>, DecodeError> {
    let Some(len) = buf.get(..4) else { return Ok(None) };
    let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]);
    if len == 0 || len > MAX_FRAME_LEN {
        return Err(DecodeError::TooLarge(len));
    }
    let total = 4 + len as usize;
    Ok((buf.len() >= total).then_some(total))
}

/// [`frame_len`] with a lower limit than [`MAX_FRAME_LEN`] (before Hello:
/// [`MAX_HELLO_FRAME_LEN`]), also checked from the length alone.
pub fn frame_len_max(buf: &[u8], max: u32) -> Result<Option<usize>, DecodeError> {
    if let Some(len) = buf.get(..4) {
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]);
        if len > max && max < MAX_FRAME_LEN {
            return Err(DecodeError::TooLargeBeforeHello(len));
        }
    }
    frame_len(buf)
}

/// Splits a whole frame (as measured by [`frame_len`]) into its type and payload.
fn split_frame(mut frame: Bytes) -> Result<(u8, Bytes), DecodeError> {
    if frame.len() < 5 {
        return malformed("frame shorter than its header");
    }
    frame.advance(4);
    let ty = frame.get_u8();
    Ok((ty, frame))
}

/// A cursor over a payload that reports short reads as errors instead of panicking.
struct Reader {
    payload: Bytes,
    what: &'static str,
}

impl Reader {
    fn need(&self, n: usize) -> Result<(), DecodeError> {
        if self.payload.remaining() < n {
            return malformed(format!("{} payload too short", self.what));
        }
        Ok(())
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        self.need(1)?;
        Ok(self.payload.get_u8())
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        self.need(2)?;
        Ok(self.payload.get_u16())
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        self.need(4)?;
        Ok(self.payload.get_u32())
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        self.need(8)?;
        Ok(self.payload.get_u64())
    }
    fn bytes(&mut self, n: usize) -> Result<Bytes, DecodeError> {
        self.need(n)?;
        Ok(self.payload.split_to(n))
    }
    fn key(&mut self) -> Result<BufferTag, DecodeError> {
        let raw = self.bytes(BUFFER_TAG_LEN)?;
        let raw: &[u8; BUFFER_TAG_LEN] =
            raw.as_ref().try_into().expect("split_to gave exactly that many bytes");
        Ok(BufferTag::decode(raw))
    }
    fn rel_fork(&mut self) -> Result<(RelTag, u8), DecodeError> {
        let fork = self.u8()?;
        let rel = RelTag { spcnode: self.u32()?, dbnode: self.u32()?, relnode: self.u32()? };
        Ok((rel, fork))
    }
    fn finish(self) -> Result<(), DecodeError> {
        if self.payload.has_remaining() {
            return malformed(format!("{} payload has {} extra bytes", self.what, self.payload.remaining()));
        }
        Ok(())
    }
}

/// Decodes a whole frame sent by a client.
pub fn decode_client(frame: Bytes) -> Result<ClientMessage, DecodeError> {
    let (ty, payload) = split_frame(frame)?;
    match ty {
        HELLO => {
            let mut r = Reader { payload, what: "Hello" };
            let version = r.u32()?;
            let len = r.u16()? as usize;
            if len == 0 || len > MAX_TENANT_ID_LEN {
                return malformed(format!("tenant id of {len} bytes, allowed 1..={MAX_TENANT_ID_LEN}"));
            }
            let raw = r.bytes(len)?;
            let tenant_id =
                String::from_utf8(raw.to_vec()).or_else(|_| malformed("tenant id is not UTF-8"))?;
            let timeline_id = if version >= 2 {
                let len = r.u16()? as usize;
                if len == 0 || len > MAX_TENANT_ID_LEN {
                    return malformed(format!("timeline id of {len} bytes, allowed 1..={MAX_TENANT_ID_LEN}"));
                }
                let raw = r.bytes(len)?;
                String::from_utf8(raw.to_vec()).or_else(|_| malformed("timeline id is not UTF-8"))?
            } else {
                DEFAULT_TIMELINE.to_string()
            };
            r.finish()?;
            Ok(ClientMessage::Hello { version, tenant_id, timeline_id })
        }
        GET_PAGE => {
            let mut r = Reader { payload, what: "GetPage" };
            let message = ClientMessage::GetPage { request_id: r.u64()?, key: r.key()?, lsn: r.u64()? };
            r.finish()?;
            Ok(message)
        }
        INGEST => {
            let mut r = Reader { payload, what: "Ingest" };
            let request_id = r.u64()?;
            let count = r.u32()? as usize;
            // Each value takes at least 30 bytes: a count beyond that is a lie, not an allocation.
            const MIN_VALUE_LEN: usize = BUFFER_TAG_LEN + 8 + 1 + 4;
            if count > r.payload.remaining() / MIN_VALUE_LEN {
                return malformed(format!("Ingest claims {count} values in {} bytes", r.payload.remaining()));
            }
            let mut values = Vec::with_capacity(count);
            for _ in 0..count {
                let key = r.key()?;
                let lsn = r.u64()?;
                let kind = match r.u8()? {
                    0 => ValueKind::Image,
                    1 => ValueKind::Record,
                    other => return malformed(format!("value kind {other}, expected 0 or 1")),
                };
                let len = r.u32()? as usize;
                let data = r.bytes(len)?;
                values.push(IngestValue { key, lsn, kind, data });
            }
            r.finish()?;
            Ok(ClientMessage::Ingest { request_id, values })
        }
        GET_REL_SIZE | GET_REL_EXISTS => {
            let mut r =
                Reader { payload, what: if ty == GET_REL_SIZE { "GetRelSize" } else { "GetRelExists" } };
            let request_id = r.u64()?;
            let (rel, fork) = r.rel_fork()?;
            let lsn = r.u64()?;
            r.finish()?;
            Ok(if ty == GET_REL_SIZE {
                ClientMessage::GetRelSize { request_id, rel, fork, lsn }
            } else {
                ClientMessage::GetRelExists { request_id, rel, fork, lsn }
            })
        }
        other => malformed(format!("unknown message type {other:#04x}")),
    }
}

/// Decodes a whole frame sent by the daemon.
pub fn decode_server(frame: Bytes) -> Result<ServerMessage, DecodeError> {
    let (ty, payload) = split_frame(frame)?;
    match ty {
        HELLO_OK => {
            let mut r = Reader { payload, what: "HelloOk" };
            let message = ServerMessage::HelloOk { version: r.u32()?, last_durable_lsn: r.u64()? };
            r.finish()?;
            Ok(message)
        }
        PAGE => {
            let mut r = Reader { payload, what: "Page" };
            let message =
                ServerMessage::Page { request_id: r.u64()?, lsn: r.u64()?, page: r.bytes(PAGE_SIZE)? };
            r.finish()?;
            Ok(message)
        }
        INGEST_OK => {
            let mut r = Reader { payload, what: "IngestOk" };
            let message = ServerMessage::IngestOk { request_id: r.u64()?, durable_lsn: r.u64()? };
            r.finish()?;
            Ok(message)
        }
        ERROR => {
            let mut r = Reader { payload, what: "Error" };
            let request_id = r.u64()?;
            let code = ErrorCode::from_u16(r.u16()?);
            let message = String::from_utf8_lossy(&r.payload).into_owned();
            Ok(ServerMessage::Error { request_id, code, message })
        }
        REL_SIZE => {
            let mut r = Reader { payload, what: "RelSize" };
            let message = ServerMessage::RelSize { request_id: r.u64()?, lsn: r.u64()?, blocks: r.u32()? };
            r.finish()?;
            Ok(message)
        }
        REL_EXISTS => {
            let mut r = Reader { payload, what: "RelExists" };
            let (request_id, lsn) = (r.u64()?, r.u64()?);
            let exists = match r.u8()? {
                0 => false,
                1 => true,
                other => return malformed(format!("RelExists answer {other}, expected 0 or 1")),
            };
            r.finish()?;
            Ok(ServerMessage::RelExists { request_id, lsn, exists })
        }
        other => malformed(format!("unknown message type {other:#04x}")),
    }
}

fn put_frame(out: &mut BytesMut, ty: u8, payload_len: usize, body: impl FnOnce(&mut BytesMut)) {
    out.reserve(5 + payload_len);
    out.put_u32((1 + payload_len) as u32);
    out.put_u8(ty);
    let before = out.len();
    body(out);
    debug_assert_eq!(out.len() - before, payload_len, "payload length of message type {ty:#04x}");
}

fn put_rel_fork(out: &mut BytesMut, rel: &RelTag, fork: u8) {
    out.put_u8(fork);
    out.put_u32(rel.spcnode);
    out.put_u32(rel.dbnode);
    out.put_u32(rel.relnode);
}

fn put_key(out: &mut BytesMut, key: &BufferTag) {
    let mut raw = Vec::with_capacity(BUFFER_TAG_LEN);
    key.encode(&mut raw);
    out.put_slice(&raw);
}

impl ClientMessage {
    /// Appends the frame. The caller keeps an Ingest within [`MAX_FRAME_LEN`].
    pub fn encode(&self, out: &mut BytesMut) {
        match self {
            ClientMessage::Hello { version, tenant_id, timeline_id } => {
                let timeline = (*version >= 2).then_some(timeline_id);
                let len = 4 + 2 + tenant_id.len() + timeline.map_or(0, |t| 2 + t.len());
                put_frame(out, HELLO, len, |out| {
                    out.put_u32(*version);
                    out.put_u16(tenant_id.len() as u16);
                    out.put_slice(tenant_id.as_bytes());
                    if let Some(timeline) = timeline {
                        out.put_u16(timeline.len() as u16);
                        out.put_slice(timeline.as_bytes());
                    }
                });
            }
            ClientMessage::GetPage { request_id, key, lsn } => {
                put_frame(out, GET_PAGE, 8 + BUFFER_TAG_LEN + 8, |out| {
                    out.put_u64(*request_id);
                    put_key(out, key);
                    out.put_u64(*lsn);
                });
            }
            ClientMessage::Ingest { request_id, values } => {
                let len =
                    8 + 4 + values.iter().map(|v| BUFFER_TAG_LEN + 8 + 1 + 4 + v.data.len()).sum::<usize>();
                put_frame(out, INGEST, len, |out| {
                    out.put_u64(*request_id);
                    out.put_u32(values.len() as u32);
                    for value in values {
                        put_key(out, &value.key);
                        out.put_u64(value.lsn);
                        out.put_u8(match value.kind {
                            ValueKind::Image => 0,
                            ValueKind::Record => 1,
                        });
                        out.put_u32(value.data.len() as u32);
                        out.put_slice(&value.data);
                    }
                });
            }
            ClientMessage::GetRelSize { request_id, rel, fork, lsn }
            | ClientMessage::GetRelExists { request_id, rel, fork, lsn } => {
                let ty = if matches!(self, ClientMessage::GetRelSize { .. }) {
                    GET_REL_SIZE
                } else {
                    GET_REL_EXISTS
                };
                put_frame(out, ty, 8 + REL_FORK_LEN + 8, |out| {
                    out.put_u64(*request_id);
                    put_rel_fork(out, rel, *fork);
                    out.put_u64(*lsn);
                });
            }
        }
    }
}

impl ServerMessage {
    /// Appends the frame. For a Page, prefer [`encode_page_header`] and send the page bytes
    /// from their own buffer (no copy).
    pub fn encode(&self, out: &mut BytesMut) {
        match self {
            ServerMessage::HelloOk { version, last_durable_lsn } => put_frame(out, HELLO_OK, 12, |out| {
                out.put_u32(*version);
                out.put_u64(*last_durable_lsn);
            }),
            ServerMessage::Page { request_id, lsn, page } => {
                encode_page_header(out, *request_id, *lsn, page.len());
                out.put_slice(page);
            }
            ServerMessage::IngestOk { request_id, durable_lsn } => put_frame(out, INGEST_OK, 16, |out| {
                out.put_u64(*request_id);
                out.put_u64(*durable_lsn);
            }),
            ServerMessage::Error { request_id, code, message } => {
                put_frame(out, ERROR, 8 + 2 + message.len(), |out| {
                    out.put_u64(*request_id);
                    out.put_u16(code.to_u16());
                    out.put_slice(message.as_bytes());
                });
            }
            ServerMessage::RelSize { request_id, lsn, blocks } => put_frame(out, REL_SIZE, 20, |out| {
                out.put_u64(*request_id);
                out.put_u64(*lsn);
                out.put_u32(*blocks);
            }),
            ServerMessage::RelExists { request_id, lsn, exists } => put_frame(out, REL_EXISTS, 17, |out| {
                out.put_u64(*request_id);
                out.put_u64(*lsn);
                out.put_u8(u8::from(*exists));
            }),
        }
    }
}

/// Appends the [`PAGE_REPLY_HEADER_LEN`] bytes that precede a page of `page_len` bytes.
pub fn encode_page_header(out: &mut BytesMut, request_id: u64, lsn: u64, page_len: usize) {
    out.reserve(PAGE_REPLY_HEADER_LEN);
    out.put_u32((1 + 16 + page_len) as u32);
    out.put_u8(PAGE);
    out.put_u64(request_id);
    out.put_u64(lsn);
}

#[cfg(test)]
mod tests {
    #[test]
    fn request_lsn_displays_like_postgres_and_latest_by_name() {
        assert_eq!(super::Lsn(0x16B_3748).to_string(), "0/16B3748");
        assert_eq!(super::Lsn(0x1_0000_0002).to_string(), "1/2");
        assert_eq!(super::Lsn(super::LSN_LATEST).to_string(), "latest");
    }

    use super::*;
    use proptest::prelude::*;

    fn key() -> BufferTag {
        BufferTag { spcnode: 1663, dbnode: 2, relnode: 3, forknum: 1, blknum: 9 }
    }

    fn round_trip_client(message: ClientMessage) {
        let mut out = BytesMut::new();
        message.encode(&mut out);
        assert_eq!(frame_len(&out).unwrap(), Some(out.len()));
        assert_eq!(decode_client(out.freeze()).unwrap(), message);
    }

    fn round_trip_server(message: ServerMessage) {
        let mut out = BytesMut::new();
        message.encode(&mut out);
        assert_eq!(frame_len(&out).unwrap(), Some(out.len()));
        assert_eq!(decode_server(out.freeze()).unwrap(), message);
    }

    #[test]
    fn every_message_round_trips() {
        round_trip_client(ClientMessage::Hello {
            version: 1,
            tenant_id: "t-1".into(),
            timeline_id: "main".into(),
        });
        round_trip_client(ClientMessage::Hello {
            version: 2,
            tenant_id: "t-1".into(),
            timeline_id: "b-2".into(),
        });
        round_trip_client(ClientMessage::GetPage { request_id: 7, key: key(), lsn: LSN_LATEST });
        round_trip_client(ClientMessage::Ingest {
            request_id: 8,
            values: vec![
                IngestValue {
                    key: key(),
                    lsn: 10,
                    kind: ValueKind::Image,
                    data: Bytes::from(vec![1; PAGE_SIZE]),
                },
                IngestValue {
                    key: key(),
                    lsn: 11,
                    kind: ValueKind::Record,
                    data: Bytes::from_static(b"\x05"),
                },
            ],
        });
        round_trip_server(ServerMessage::HelloOk { version: 1, last_durable_lsn: 99 });
        round_trip_server(ServerMessage::Page {
            request_id: 1,
            lsn: 2,
            page: Bytes::from(vec![3; PAGE_SIZE]),
        });
        round_trip_server(ServerMessage::IngestOk { request_id: 4, durable_lsn: 5 });
        round_trip_server(ServerMessage::Error {
            request_id: 6,
            code: ErrorCode::NotFound,
            message: "no".into(),
        });
        let rel = RelTag { spcnode: 1663, dbnode: 5, relnode: 16384 };
        round_trip_client(ClientMessage::GetRelSize { request_id: 9, rel, fork: 2, lsn: 77 });
        round_trip_client(ClientMessage::GetRelExists { request_id: 10, rel, fork: 0, lsn: LSN_LATEST });
        round_trip_server(ServerMessage::RelSize { request_id: 9, lsn: 77, blocks: 131_073 });
        round_trip_server(ServerMessage::RelExists { request_id: 10, lsn: 78, exists: true });
        round_trip_server(ServerMessage::RelExists { request_id: 10, lsn: 78, exists: false });
    }

    #[test]
    fn relation_requests_have_the_documented_layout_and_bad_answers_are_refused() {
        let mut out = BytesMut::new();
        let rel = RelTag { spcnode: 1663, dbnode: 5, relnode: 16384 };
        ClientMessage::GetRelSize { request_id: 1, rel, fork: 2, lsn: 3 }.encode(&mut out);
        let mut want = vec![0, 0, 0, 30, 0x04, 0, 0, 0, 0, 0, 0, 0, 1, 2];
        want.extend([0, 0, 6, 127, 0, 0, 0, 5, 0, 0, 0x40, 0]);
        want.extend([0, 0, 0, 0, 0, 0, 0, 3]);
        assert_eq!(&out[..], &want[..]);
        let mut answer = BytesMut::new();
        ServerMessage::RelExists { request_id: 1, lsn: 2, exists: true }.encode(&mut answer);
        let last = answer.len() - 1;
        answer[last] = 2;
        assert!(decode_server(answer.freeze()).is_err());
    }

    #[test]
    fn get_page_has_the_documented_layout() {
        let mut out = BytesMut::new();
        ClientMessage::GetPage { request_id: 1, key: key(), lsn: 2 }.encode(&mut out);
        let mut want = vec![0, 0, 0, 34, 0x02, 0, 0, 0, 0, 0, 0, 0, 1];
        want.extend([1, 0, 0, 6, 127, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 9]);
        want.extend([0, 0, 0, 0, 0, 0, 0, 2]);
        assert_eq!(&out[..], &want[..]);
    }

    #[test]
    fn oversized_and_empty_frames_are_refused_from_the_length_alone() {
        assert_eq!(frame_len(&[0, 0x80, 0, 1]), Err(DecodeError::TooLarge(MAX_FRAME_LEN + 1)));
        assert_eq!(frame_len(&[0, 0, 0, 0]), Err(DecodeError::TooLarge(0)));
        assert_eq!(frame_len(&[0, 0, 0]), Ok(None));
        assert_eq!(frame_len(&[0, 0, 0, 2, 1]), Ok(None));
        assert_eq!(
            frame_len_max(&[0, 0, 0x10, 1], MAX_HELLO_FRAME_LEN),
            Err(DecodeError::TooLargeBeforeHello(4097))
        );
        assert_eq!(frame_len_max(&[0, 0, 0x10, 0], MAX_HELLO_FRAME_LEN), Ok(None));
        assert_eq!(
            frame_len_max(&[0, 0x80, 0, 1], MAX_FRAME_LEN),
            Err(DecodeError::TooLarge(MAX_FRAME_LEN + 1))
        );
    }

    #[test]
    fn malformed_client_frames_are_errors() {
        let bad = |bytes: &'static [u8]| decode_client(Bytes::from_static(bytes)).unwrap_err();
        assert!(matches!(bad(b"\0\0\0\x01\x7f"), DecodeError::Malformed(_)));
        assert!(matches!(bad(b"\0\0\0\x03\x02\0\0"), DecodeError::Malformed(_)));
        // An Ingest claiming a billion values in a few bytes does not allocate for them.
        assert!(matches!(bad(b"\0\0\0\x0e\x03\0\0\0\0\0\0\0\x01\x40\0\0\0\0"), DecodeError::Malformed(_)));
        // Hello with an empty tenant id.
        assert!(matches!(bad(b"\0\0\0\x07\x01\0\0\0\x01\0\0"), DecodeError::Malformed(_)));
        // Version 2 without a timeline id, with an empty one, and version 1 with one.
        assert!(matches!(bad(b"\0\0\0\x08\x01\0\0\0\x02\0\x01t"), DecodeError::Malformed(_)));
        assert!(matches!(bad(b"\0\0\0\x0a\x01\0\0\0\x02\0\x01t\0\0"), DecodeError::Malformed(_)));
        assert!(matches!(bad(b"\0\0\0\x0b\x01\0\0\0\x01\0\x01t\0\x01b"), DecodeError::Malformed(_)));
    }

    #[test]
    fn only_lsn_zero_and_latest_are_reserved_for_ingest() {
        let value =
            |lsn| IngestValue { key: key(), lsn, kind: ValueKind::Record, data: Bytes::from_static(b"x") };
        assert_eq!(reserved_lsn(&[value(1), value(LSN_LATEST - 1)]), None);
        assert_eq!(reserved_lsn(&[value(5), value(LSN_LATEST)]).map(|(i, _)| i), Some(1));
        assert_eq!(reserved_lsn(&[value(0), value(5)]).map(|(i, _)| i), Some(0));
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_frames_never_panics(ty in any::<u8>(), payload in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut frame = BytesMut::new();
            frame.put_u32(1 + payload.len() as u32);
            frame.put_u8(ty);
            frame.put_slice(&payload);
            let frame = frame.freeze();
            let _ = decode_client(frame.clone());
            let _ = decode_server(frame);
        }
    }
}
