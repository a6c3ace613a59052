//! A small client of PostgreSQL's replication protocol, over plain TCP: start-up with
//! `replication=true`, authentication (trust, cleartext, MD5, SCRAM-SHA-256), simple queries
//! (`IDENTIFY_SYSTEM`, `READ_REPLICATION_SLOT`, `CREATE_REPLICATION_SLOT`), and the CopyBoth
//! stream of `START_REPLICATION` (XLogData and keepalives in, standby status updates out).
//!
//! Why our own: the upstream `tokio-postgres` has no CopyBoth (Neon keeps a fork for it), and
//! the part of the protocol used here is a dozen message types. The cryptography of
//! authentication is not ours to write: MD5 and SCRAM come from `postgres-protocol`, the
//! rust-postgres project's protocol crate.
//!
//! Trust model: the server is not trusted to be well-formed. Every message is bounded
//! ([`MAX_MESSAGE`]), every field is length-checked, and anything unexpected is an error that
//! ends this connection (the receiver reconnects), never a panic.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::connstr::ConnConfig;
use page_types::Lsn;

/// Largest message accepted from the server (XLogData carries at most 128 KiB of WAL; a base
/// backup's CopyData chunks are smaller still).
pub const MAX_MESSAGE: usize = 16 << 20;

/// PostgreSQL's epoch (2000-01-01) in Unix seconds: replication timestamps count from it.
const PG_EPOCH_UNIX_SECS: u64 = 946_684_800;

/// What went wrong with the connection or the server.
#[derive(Debug, thiserror::Error)]
pub enum PqError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// An ErrorResponse: the server refused (SQLSTATE and message).
    #[error("server error {code}: {message}")]
    Server { code: String, message: String },
    #[error("protocol: {0}")]
    Protocol(String),
}

impl PqError {
    fn protocol(what: impl Into<String>) -> PqError {
        PqError::Protocol(what.into())
    }
}

/// One message from the server: its tag and body.
struct Message {
    tag: u8,
    body: Bytes,
}

/// A replication connection after start-up.
pub struct ReplicationConn {
    stream: TcpStream,
    read: BytesMut,
    /// `server_version` as the server reported it at start-up.
    pub server_version: String,
}

/// What `IDENTIFY_SYSTEM` answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemId {
    pub system_id: String,
    pub timeline: u32,
    pub xlog_pos: Lsn,
}

/// A message of the replication stream.
#[derive(Debug)]
pub enum ReplicationMessage {
    /// WAL bytes starting at `start`; `wal_end` is the server's current end of WAL.
    XLogData { start: Lsn, wal_end: Lsn, data: Bytes },
    /// A keepalive; `reply` asks for a status update now.
    Keepalive { wal_end: Lsn, reply: bool },
    /// The server ended the stream (CopyDone, or a CommandComplete as it shuts down).
    End,
}

impl ReplicationConn {
    /// Connects and authenticates as `config` says, as a physical replication connection.
    ///
    /// Cancel-safe: dropping it closes the socket.
    pub async fn connect(config: &ConnConfig) -> Result<ReplicationConn, PqError> {
        let stream = TcpStream::connect((config.host.as_str(), config.port)).await?;
        stream.set_nodelay(true)?;
        let mut conn = ReplicationConn {
            stream,
            read: BytesMut::with_capacity(64 << 10),
            server_version: String::new(),
        };
        let mut out = BytesMut::new();
        let mut params: Vec<(&str, &str)> = vec![
            ("user", &config.user),
            ("replication", "true"),
            ("application_name", &config.application_name),
        ];
        if let Some(db) = &config.dbname {
            params.push(("database", db));
        }
        postgres_protocol::message::frontend::startup_message(params, &mut out)?;
        conn.send(&out).await?;
        conn.authenticate(config).await?;
        // ParameterStatus and BackendKeyData until ReadyForQuery.
        loop {
            let m = conn.recv().await?;
            match m.tag {
                b'S' => {
                    let mut body = m.body;
                    let name = cstr(&mut body)?;
                    let value = cstr(&mut body)?;
                    if name == "server_version" {
                        conn.server_version = value;
                    }
                }
                b'K' | b'N' => {}
                b'Z' => return Ok(conn),
                b'E' => return Err(server_error(m.body)),
                t => {
                    return Err(PqError::protocol(format!(
                        "unexpected message {:?} after authentication",
                        t as char
                    )))
                }
            }
        }
    }

    async fn authenticate(&mut self, config: &ConnConfig) -> Result<(), PqError> {
        let password = || {
            config.password.as_deref().ok_or_else(|| {
                PqError::protocol("the server asks for a password and the connection string has none")
            })
        };
        let mut scram: Option<ScramSha256> = None;
        loop {
            let m = self.recv().await?;
            match m.tag {
                b'R' => {}
                b'E' => return Err(server_error(m.body)),
                t => {
                    return Err(PqError::protocol(format!(
                        "unexpected message {:?} during authentication",
                        t as char
                    )))
                }
            }
            let mut body = m.body;
            let kind = get_i32(&mut body)?;
            let mut out = BytesMut::new();
            match kind {
                0 => return Ok(()),
                3 => {
                    postgres_protocol::message::frontend::password_message(password()?.as_bytes(), &mut out)?
                }
                5 => {
                    let salt: [u8; 4] = body
                        .get(..4)
                        .and_then(|s| s.try_into().ok())
                        .ok_or_else(|| PqError::protocol("short MD5 salt"))?;
                    let hash = postgres_protocol::authentication::md5_hash(
                        config.user.as_bytes(),
                        password()?.as_bytes(),
                        salt,
                    );
                    postgres_protocol::message::frontend::password_message(hash.as_bytes(), &mut out)?;
                }
                10 => {
                    // AuthenticationSASL: a list of mechanisms.
                    let mut mechanisms = Vec::new();
                    while body.first().is_some_and(|b| *b != 0) {
                        mechanisms.push(cstr(&mut body)?);
                    }
                    if !mechanisms.iter().any(|m| m == "SCRAM-SHA-256") {
                        return Err(PqError::protocol(format!(
                            "no supported SASL mechanism in {mechanisms:?}"
                        )));
                    }
                    let s = ScramSha256::new(password()?.as_bytes(), ChannelBinding::unsupported());
                    postgres_protocol::message::frontend::sasl_initial_response(
                        "SCRAM-SHA-256",
                        s.message(),
                        &mut out,
                    )?;
                    scram = Some(s);
                }
                11 => {
                    let s =
                        scram.as_mut().ok_or_else(|| PqError::protocol("SASL continue before SASL start"))?;
                    s.update(&body)?;
                    postgres_protocol::message::frontend::sasl_response(s.message(), &mut out)?;
                }
                12 => {
                    let s =
                        scram.as_mut().ok_or_else(|| PqError::protocol("SASL final before SASL start"))?;
                    s.finish(&body)?;
                    continue;
                }
                other => return Err(PqError::protocol(format!("unsupported authentication method {other}"))),
            }
            self.send(&out).await?;
        }
    }

    /// Runs a simple query and returns its rows (text columns; NULL as `None`).
    pub async fn simple_query(&mut self, query: &str) -> Result<Vec<Vec<Option<String>>>, PqError> {
        let mut out = BytesMut::new();
        postgres_protocol::message::frontend::query(query, &mut out)?;
        self.send(&out).await?;
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            let m = self.recv().await?;
            match m.tag {
                b'T' | b'C' | b'N' | b'S' | b'I' => {}
                b'D' => rows.push(data_row(m.body)?),
                b'E' => error = Some(server_error(m.body)),
                b'Z' => return error.map_or(Ok(rows), Err),
                t => {
                    return Err(PqError::protocol(format!(
                        "unexpected message {:?} answering a query",
                        t as char
                    )))
                }
            }
        }
    }

    /// `IDENTIFY_SYSTEM`.
    pub async fn identify_system(&mut self) -> Result<SystemId, PqError> {
        let rows = self.simple_query("IDENTIFY_SYSTEM").await?;
        let row = rows.first().ok_or_else(|| PqError::protocol("IDENTIFY_SYSTEM returned no row"))?;
        let col = |i: usize| {
            row.get(i).cloned().flatten().ok_or_else(|| PqError::protocol("IDENTIFY_SYSTEM: missing column"))
        };
        Ok(SystemId {
            system_id: col(0)?,
            timeline: col(1)?.parse().map_err(|_| PqError::protocol("IDENTIFY_SYSTEM: bad timeline"))?,
            xlog_pos: col(2)?.parse().map_err(|_| PqError::protocol("IDENTIFY_SYSTEM: bad xlogpos"))?,
        })
    }

    /// `SHOW wal_segment_size` (e.g. `16MB`) in bytes.
    pub async fn wal_segment_size(&mut self) -> Result<u64, PqError> {
        let rows = self.simple_query("SHOW wal_segment_size").await?;
        let text = rows.first().and_then(|r| r.first()).cloned().flatten().unwrap_or_default();
        let digits: String = text.chars().take_while(char::is_ascii_digit).collect();
        let bad = || PqError::protocol(format!("wal_segment_size {text:?}"));
        let n: u64 = digits.parse().map_err(|_| bad())?;
        let bytes = match &text[digits.len()..] {
            "MB" => n.checked_mul(1 << 20),
            "GB" => n.checked_mul(1 << 30),
            _ => None,
        }
        .ok_or_else(bad)?;
        if !bytes.is_power_of_two() {
            return Err(bad());
        }
        Ok(bytes)
    }

    /// Creates the physical slot `slot` (reserving WAL from now on) unless it exists; returns
    /// whether it created it.
    pub async fn ensure_physical_slot(&mut self, slot: &str) -> Result<bool, PqError> {
        let rows = self.simple_query(&format!("READ_REPLICATION_SLOT {}", quote_ident(slot))).await?;
        // One row whose slot_type is NULL when there is no such slot.
        if let Some(Some(kind)) = rows.first().and_then(|row| row.first()) {
            if kind != "physical" {
                return Err(PqError::protocol(format!("slot {slot:?} exists and is {kind}, not physical")));
            }
            return Ok(false);
        }
        self.simple_query(&format!("CREATE_REPLICATION_SLOT {} PHYSICAL RESERVE_WAL", quote_ident(slot)))
            .await?;
        Ok(true)
    }

    /// `START_REPLICATION SLOT slot PHYSICAL start TIMELINE tli`: the connection becomes a
    /// CopyBoth stream ([`ReplicationConn::next_message`], [`ReplicationConn::send_status`]).
    pub async fn start_replication(&mut self, slot: &str, start: Lsn, timeline: u32) -> Result<(), PqError> {
        let mut out = BytesMut::new();
        let q = format!("START_REPLICATION SLOT {} PHYSICAL {start} TIMELINE {timeline}", quote_ident(slot));
        postgres_protocol::message::frontend::query(&q, &mut out)?;
        self.send(&out).await?;
        loop {
            let m = self.recv().await?;
            match m.tag {
                b'W' => return Ok(()),
                b'N' | b'S' => {}
                b'E' => {
                    let e = server_error(m.body);
                    // ReadyForQuery follows an error; the connection is dropped anyway.
                    return Err(e);
                }
                t => {
                    return Err(PqError::protocol(format!(
                        "unexpected message {:?} starting replication",
                        t as char
                    )))
                }
            }
        }
    }

    /// The next message of the replication stream.
    ///
    /// Cancel-safe: a message is taken out of the buffer only once whole.
    pub async fn next_message(&mut self) -> Result<ReplicationMessage, PqError> {
        loop {
            let m = self.recv().await?;
            match m.tag {
                b'd' => {}
                b'c' | b'C' => return Ok(ReplicationMessage::End),
                b'N' | b'S' => continue,
                b'E' => return Err(server_error(m.body)),
                t => {
                    return Err(PqError::protocol(format!(
                        "unexpected message {:?} in the replication stream",
                        t as char
                    )))
                }
            }
            let mut body = m.body;
            let kind = body.first().copied().ok_or_else(|| PqError::protocol("empty CopyData"))?;
            body.advance(1);
            return match kind {
                b'w' => {
                    let start = Lsn(get_u64(&mut body)?);
                    let wal_end = Lsn(get_u64(&mut body)?);
                    let _send_time = get_u64(&mut body)?;
                    Ok(ReplicationMessage::XLogData { start, wal_end, data: body })
                }
                b'k' => {
                    let wal_end = Lsn(get_u64(&mut body)?);
                    let _send_time = get_u64(&mut body)?;
                    let reply =
                        body.first().copied().ok_or_else(|| PqError::protocol("short keepalive"))? != 0;
                    Ok(ReplicationMessage::Keepalive { wal_end, reply })
                }
                other => Err(PqError::protocol(format!("unknown replication message {:?}", other as char))),
            };
        }
    }

    /// A standby status update: `written` received, `flushed` and `applied` durable (the slot
    /// keeps everything from `flushed` on).
    pub async fn send_status(&mut self, written: Lsn, flushed: Lsn, applied: Lsn) -> Result<(), PqError> {
        let mut msg = BytesMut::with_capacity(40);
        msg.put_u8(b'd');
        msg.put_u32(4 + 1 + 8 * 4 + 1);
        msg.put_u8(b'r');
        msg.put_u64(written.0);
        msg.put_u64(flushed.0);
        msg.put_u64(applied.0);
        msg.put_u64(pg_now());
        msg.put_u8(0);
        self.send(&msg).await
    }

    async fn send(&mut self, bytes: &[u8]) -> Result<(), PqError> {
        self.stream.write_all(bytes).await?;
        Ok(())
    }

    /// The next whole message. Cancel-safe: bytes read stay in the buffer.
    async fn recv(&mut self) -> Result<Message, PqError> {
        loop {
            if self.read.len() >= 5 {
                let len =
                    u32::from_be_bytes([self.read[1], self.read[2], self.read[3], self.read[4]]) as usize;
                if !(4..=MAX_MESSAGE).contains(&len) {
                    return Err(PqError::protocol(format!("message length {len} out of bounds")));
                }
                if self.read.len() > len {
                    let mut frame = self.read.split_to(len + 1);
                    let tag = frame[0];
                    frame.advance(5);
                    return Ok(Message { tag, body: frame.freeze() });
                }
                self.read.reserve(len + 1 - self.read.len());
            } else {
                self.read.reserve(64 << 10);
            }
            let n = self.stream.read_buf(&mut self.read).await?;
            if n == 0 {
                return Err(PqError::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
        }
    }
}

/// Microseconds since PostgreSQL's epoch.
fn pg_now() -> u64 {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    now.saturating_sub(Duration::from_secs(PG_EPOCH_UNIX_SECS)).as_micros() as u64
}

/// A replication command's identifier, double-quoted.
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

fn cstr(body: &mut Bytes) -> Result<String, PqError> {
    let end = body.iter().position(|b| *b == 0).ok_or_else(|| PqError::protocol("unterminated string"))?;
    let s = String::from_utf8_lossy(&body[..end]).into_owned();
    body.advance(end + 1);
    Ok(s)
}

fn get_i32(body: &mut Bytes) -> Result<i32, PqError> {
    if body.len() < 4 {
        return Err(PqError::protocol("short message"));
    }
    Ok(body.get_i32())
}

fn get_u64(body: &mut Bytes) -> Result<u64, PqError> {
    if body.len() < 8 {
        return Err(PqError::protocol("short message"));
    }
    Ok(body.get_u64())
}

fn data_row(mut body: Bytes) -> Result<Vec<Option<String>>, PqError> {
    if body.len() < 2 {
        return Err(PqError::protocol("short DataRow"));
    }
    let n = body.get_u16();
    let mut row = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let len = get_i32(&mut body)?;
        if len < 0 {
            row.push(None);
            continue;
        }
        let len = len as usize;
        if body.len() < len {
            return Err(PqError::protocol("DataRow column past the message"));
        }
        row.push(Some(String::from_utf8_lossy(&body.split_to(len)).into_owned()));
    }
    Ok(row)
}

/// An ErrorResponse's SQLSTATE and message.
fn server_error(mut body: Bytes) -> PqError {
    let (mut code, mut message) = (String::new(), String::new());
    while let Some(&field) = body.first() {
        if field == 0 {
            break;
        }
        body.advance(1);
        let Ok(value) = cstr(&mut body) else { break };
        match field {
            b'C' => code = value,
            b'M' => message = value,
            _ => {}
        }
    }
    PqError::Server { code, message }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn data_rows_and_errors_parse_and_bad_ones_are_errors() {
        let mut row = BytesMut::new();
        row.put_u16(3);
        row.put_i32(2);
        row.put_slice(b"15");
        row.put_i32(-1);
        row.put_i32(0);
        assert_eq!(data_row(row.freeze()).unwrap(), vec![Some("15".into()), None, Some(String::new())]);
        let mut bad = BytesMut::new();
        bad.put_u16(1);
        bad.put_i32(100);
        assert!(data_row(bad.freeze()).is_err());
        let err = server_error(Bytes::from_static(b"SERROR\0C42710\0Mslot exists\0\0"));
        assert!(
            matches!(err, PqError::Server { ref code, ref message } if code == "42710" && message == "slot exists")
        );
        // Truncated: no panic, what was read is kept.
        assert!(matches!(server_error(Bytes::from_static(b"C4271")), PqError::Server { .. }));
    }

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("slot"), "\"slot\"");
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    }
}
