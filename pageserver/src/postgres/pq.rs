//! A small client of PostgreSQL's replication protocol, over plain TCP: start-up with
//! `replication=true`, authentication (trust, cleartext, MD5, SCRAM-SHA-256), simple queries
//! (`IDENTIFY_SYSTEM`, `READ_REPLICATION_SLOT`, `CREATE_REPLICATION_SLOT`), and the CopyBoth
//! stream of `START_REPLICATION` (XLogData and keepalives in, standby status updates out), and
//! a base backup (`BASE_BACKUP`, PostgreSQL 15's syntax and its single-COPY stream).
//!
//! **A base backup** in PostgreSQL 15 (`basebackup.c`, `basebackup_copy.c`, the "copystream"
//! sink): a result set with the start position and timeline, a result set of tablespaces (the
//! main data directory last, with NULL oid and location), then ONE CopyOutResponse whose
//! CopyData messages start with a type byte: `n` a new archive (its name, `base.tar` or
//! `<oid>.tar`, and the tablespace's location, empty for the main directory), `d` archive data
//! (tar bytes, cut anywhere), `p` progress (int8 bytes sent so far), `m` the manifest begins
//! (its data follows as `d`; we ask for none); then CopyDone, a result set with the end
//! position and timeline, CommandComplete and ReadyForQuery. After it, the same connection
//! takes other commands (e.g. `START_REPLICATION`).
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
    /// The server is not PostgreSQL 15, the only version whose WAL and backups this reads.
    #[error("the server runs PostgreSQL {0:?}; only PostgreSQL 15 is supported")]
    UnsupportedVersion(String),
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
    /// Where a base backup's stream is.
    backup: BackupPhase,
}

/// Where a base backup's stream is, so that each call reads one message at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BackupPhase {
    /// No base backup in progress.
    Idle,
    /// In the COPY stream, archive data.
    Archives,
    /// In the COPY stream, after `m`: manifest data, dropped.
    Manifest,
    /// After CopyDone: the end position result set, until ReadyForQuery.
    Ending { end: Option<(Lsn, u32)> },
}

/// A tablespace of a base backup, as the server lists it before the archives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tablespace {
    /// Its oid; `None` for the main data directory (listed last).
    pub oid: Option<u32>,
    /// Its directory on the server; `None` for the main data directory.
    pub location: Option<String>,
    /// Its size in KiB, when the server estimated it (only with `PROGRESS`, which we do not
    /// ask for).
    pub size_kb: Option<u64>,
}

/// What a base backup's start tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseBackupStart {
    /// The backup's start: WAL from here on makes the files consistent (the redo point of the
    /// backup's checkpoint).
    pub start_lsn: Lsn,
    pub timeline: u32,
    pub tablespaces: Vec<Tablespace>,
}

/// A message of a base backup's stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackupMessage {
    /// A new tar archive begins: `base.tar` (location `None`) or `<oid>.tar` with the
    /// tablespace's location.
    Archive { name: String, location: Option<String> },
    /// The next bytes of the current archive.
    Data(Bytes),
    /// Bytes of all archives sent so far.
    Progress(u64),
    /// The backup is complete; the connection is ready for another command.
    End { end_lsn: Lsn, timeline: u32 },
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
            backup: BackupPhase::Idle,
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
    /// Fails unless the server is PostgreSQL 15.
    pub fn require_pg15(&self) -> Result<(), PqError> {
        if self.server_version.split('.').next() == Some("15") {
            Ok(())
        } else {
            Err(PqError::UnsupportedVersion(self.server_version.clone()))
        }
    }

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

    /// Starts a base backup, PostgreSQL 15's `BASE_BACKUP ( LABEL '...', CHECKPOINT 'fast',
    /// WAL false, MANIFEST 'no', WAIT true )`: a fast checkpoint, no WAL in the archives (it
    /// comes by streaming), no manifest, and the end waits until the WAL the backup needs is
    /// archived if archiving is on. Returns once the COPY stream begins; read it with
    /// [`ReplicationConn::next_backup_message`] until [`BackupMessage::End`].
    ///
    /// Not cancel-safe: dropped before it returns, it leaves the connection in the middle of
    /// the command; drop the connection.
    pub async fn base_backup(&mut self, label: &str) -> Result<BaseBackupStart, PqError> {
        if self.backup != BackupPhase::Idle {
            return Err(PqError::protocol("a base backup is already in progress on this connection"));
        }
        if label.contains('\0') {
            return Err(PqError::protocol("a backup label cannot contain NUL"));
        }
        let q = format!(
            "BASE_BACKUP ( LABEL '{}', CHECKPOINT 'fast', WAL false, MANIFEST 'no', WAIT true )",
            label.replace('\'', "''")
        );
        let mut out = BytesMut::new();
        postgres_protocol::message::frontend::query(&q, &mut out)?;
        self.send(&out).await?;
        // Result set 1: start position and timeline; result set 2: the tablespaces.
        let mut result_sets = 0;
        let mut start = None;
        let mut tablespaces = Vec::new();
        loop {
            let m = self.recv().await?;
            match m.tag {
                b'T' => result_sets += 1,
                b'D' => {
                    let row = data_row(m.body)?;
                    match result_sets {
                        1 => start = Some(lsn_and_timeline(&row, "the backup's start")?),
                        2 => tablespaces.push(tablespace_row(&row)?),
                        _ => return Err(PqError::protocol("BASE_BACKUP: a row outside its result sets")),
                    }
                }
                b'C' | b'N' | b'S' => {}
                b'H' => {
                    let (start_lsn, timeline) = start
                        .ok_or_else(|| PqError::protocol("BASE_BACKUP: COPY before the start position"))?;
                    self.backup = BackupPhase::Archives;
                    return Ok(BaseBackupStart { start_lsn, timeline, tablespaces });
                }
                b'E' => return Err(self.drain_after_error(server_error(m.body)).await),
                b'Z' => return Err(PqError::protocol("BASE_BACKUP ended before its COPY stream")),
                t => {
                    return Err(PqError::protocol(format!(
                        "unexpected message {:?} starting a base backup",
                        t as char
                    )))
                }
            }
        }
    }

    /// The next message of the base backup begun by [`ReplicationConn::base_backup`]. After
    /// [`BackupMessage::End`] the connection is ready for another command; after an error it
    /// is too when the error is the server's ([`PqError::Server`]: its ReadyForQuery was
    /// read), and is to be dropped otherwise.
    ///
    /// Cancel-safe: it takes one whole message at a time and keeps where the stream is.
    pub async fn next_backup_message(&mut self) -> Result<BackupMessage, PqError> {
        loop {
            let phase = self.backup;
            if phase == BackupPhase::Idle {
                return Err(PqError::protocol("no base backup in progress"));
            }
            let m = self.recv().await?;
            match (phase, m.tag) {
                (_, b'N' | b'S') => {}
                (_, b'E') => {
                    self.backup = BackupPhase::Idle;
                    return Err(self.drain_after_error(server_error(m.body)).await);
                }
                (BackupPhase::Archives | BackupPhase::Manifest, b'd') => {
                    let mut body = m.body;
                    let kind = body.first().copied().ok_or_else(|| PqError::protocol("empty CopyData"))?;
                    body.advance(1);
                    if phase == BackupPhase::Manifest {
                        if kind == b'd' || kind == b'p' {
                            continue;
                        }
                        return Err(PqError::protocol(format!(
                            "base backup message {:?} after the manifest",
                            kind as char
                        )));
                    }
                    match kind {
                        b'n' => {
                            let name = cstr(&mut body)?;
                            let location = cstr(&mut body)?;
                            if !body.is_empty() {
                                return Err(PqError::protocol("trailing bytes in a new-archive message"));
                            }
                            let location = (!location.is_empty()).then_some(location);
                            return Ok(BackupMessage::Archive { name, location });
                        }
                        b'd' => return Ok(BackupMessage::Data(body)),
                        b'p' => {
                            let done = get_u64(&mut body)?;
                            return Ok(BackupMessage::Progress(done));
                        }
                        b'm' => self.backup = BackupPhase::Manifest,
                        other => {
                            return Err(PqError::protocol(format!(
                                "unknown base backup message {:?}",
                                other as char
                            )))
                        }
                    }
                }
                (BackupPhase::Archives | BackupPhase::Manifest, b'c') => {
                    self.backup = BackupPhase::Ending { end: None };
                }
                (BackupPhase::Ending { end }, tag) => match tag {
                    b'T' | b'C' => {}
                    b'D' if end.is_none() => {
                        let row = data_row(m.body)?;
                        let end = lsn_and_timeline(&row, "the backup's end")?;
                        self.backup = BackupPhase::Ending { end: Some(end) };
                    }
                    b'Z' => {
                        self.backup = BackupPhase::Idle;
                        let (end_lsn, timeline) = end
                            .ok_or_else(|| PqError::protocol("BASE_BACKUP ended without its end position"))?;
                        return Ok(BackupMessage::End { end_lsn, timeline });
                    }
                    t => {
                        return Err(PqError::protocol(format!(
                            "unexpected message {:?} ending a base backup",
                            t as char
                        )))
                    }
                },
                (_, t) => {
                    return Err(PqError::protocol(format!(
                        "unexpected message {:?} in a base backup",
                        t as char
                    )))
                }
            }
        }
    }

    /// After an ErrorResponse: reads up to ReadyForQuery so that the connection takes the next
    /// command, and returns `error` (or the failure to read on).
    async fn drain_after_error(&mut self, error: PqError) -> PqError {
        loop {
            match self.recv().await {
                Ok(m) if m.tag == b'Z' => return error,
                Ok(_) => {}
                Err(_) => return error,
            }
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

/// A row of `recptr` (`X/X`) and `tli` (a number), as the start and end of a base backup.
fn lsn_and_timeline(row: &[Option<String>], what: &str) -> Result<(Lsn, u32), PqError> {
    let bad = || PqError::protocol(format!("bad row for {what}: {row:?}"));
    let lsn = row.first().cloned().flatten().and_then(|t| t.parse::<Lsn>().ok()).ok_or_else(bad)?;
    let tli = row.get(1).cloned().flatten().and_then(|t| t.parse::<u32>().ok()).ok_or_else(bad)?;
    Ok((lsn, tli))
}

/// A row of the tablespace list: oid, location, size in KiB (each may be NULL).
fn tablespace_row(row: &[Option<String>]) -> Result<Tablespace, PqError> {
    let bad = || PqError::protocol(format!("bad tablespace row {row:?}"));
    if row.len() != 3 {
        return Err(bad());
    }
    let col = |i: usize| row.get(i).cloned().flatten();
    let oid = col(0).map(|t| t.parse::<u32>()).transpose().map_err(|_| bad())?;
    let size_kb = col(2).map(|t| t.parse::<u64>()).transpose().map_err(|_| bad())?;
    Ok(Tablespace { oid, location: col(1), size_kb })
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

    /// Appends one backend message.
    fn msg(out: &mut BytesMut, tag: u8, body: &[u8]) {
        out.put_u8(tag);
        out.put_u32(body.len() as u32 + 4);
        out.put_slice(body);
    }

    fn row(cols: &[Option<&str>]) -> Vec<u8> {
        let mut b = BytesMut::new();
        b.put_u16(cols.len() as u16);
        for c in cols {
            match c {
                Some(t) => {
                    b.put_i32(t.len() as i32);
                    b.put_slice(t.as_bytes());
                }
                None => b.put_i32(-1),
            }
        }
        b.to_vec()
    }

    /// Reads one frontend message (the startup message has no tag).
    async fn read_frontend(s: &mut TcpStream, tagged: bool) -> Vec<u8> {
        if tagged {
            let _tag = s.read_u8().await.unwrap();
        }
        let len = s.read_u32().await.unwrap() as usize;
        let mut body = vec![0; len - 4];
        s.read_exact(&mut body).await.unwrap();
        body
    }

    /// A server that trusts, answers the first query with `script`, and the second with one
    /// row "ok".
    async fn fake_server(script: BytesMut) -> (ConnConfig, tokio::task::JoinHandle<Vec<u8>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            read_frontend(&mut s, false).await;
            let mut hello = BytesMut::new();
            msg(&mut hello, b'R', &0i32.to_be_bytes());
            msg(&mut hello, b'Z', b"I");
            s.write_all(&hello).await.unwrap();
            let query = read_frontend(&mut s, true).await;
            s.write_all(&script).await.unwrap();
            read_frontend(&mut s, true).await;
            let mut answer = BytesMut::new();
            msg(&mut answer, b'T', &[0, 1]);
            msg(&mut answer, b'D', &row(&[Some("ok")]));
            msg(&mut answer, b'C', b"SELECT\0");
            msg(&mut answer, b'Z', b"I");
            s.write_all(&answer).await.unwrap();
            query
        });
        let config = ConnConfig {
            host: "127.0.0.1".into(),
            port,
            user: "u".into(),
            password: None,
            dbname: None,
            application_name: "test".into(),
        };
        (config, server)
    }

    fn backup_start(script: &mut BytesMut) {
        msg(script, b'T', &[0, 2]);
        msg(script, b'D', &row(&[Some("0/2000028"), Some("1")]));
        msg(script, b'C', b"SELECT\0");
        msg(script, b'T', &[0, 3]);
        msg(script, b'D', &row(&[Some("16385"), Some("/srv/ts"), None]));
        msg(script, b'D', &row(&[None, None, None]));
        msg(script, b'C', b"SELECT\0");
        msg(script, b'H', &[0, 0, 0]);
    }

    #[tokio::test]
    async fn base_backup_stream_reads_in_order_and_leaves_the_connection_ready() {
        let mut script = BytesMut::new();
        backup_start(&mut script);
        msg(&mut script, b'd', b"nbase.tar\0\0");
        msg(&mut script, b'd', b"dtar bytes");
        msg(&mut script, b'N', b"SNOTICE\0Mhello\0\0");
        msg(&mut script, b'd', &[b'p', 0, 0, 0, 0, 0, 0, 4, 0]);
        msg(&mut script, b'd', b"n16385.tar\0/srv/ts\0");
        msg(&mut script, b'd', b"m");
        msg(&mut script, b'd', b"dmanifest, dropped");
        msg(&mut script, b'c', b"");
        msg(&mut script, b'T', &[0, 2]);
        msg(&mut script, b'D', &row(&[Some("0/2000100"), Some("1")]));
        msg(&mut script, b'C', b"SELECT\0");
        msg(&mut script, b'C', b"BASE_BACKUP\0");
        msg(&mut script, b'Z', b"I");
        let (config, server) = fake_server(script).await;
        let mut conn = ReplicationConn::connect(&config).await.unwrap();
        let start = conn.base_backup("it's mine").await.unwrap();
        assert_eq!(start.start_lsn, Lsn(0x2000028));
        assert_eq!(start.timeline, 1);
        assert_eq!(
            start.tablespaces,
            vec![
                Tablespace { oid: Some(16385), location: Some("/srv/ts".into()), size_kb: None },
                Tablespace { oid: None, location: None, size_kb: None },
            ]
        );
        let mut got = Vec::new();
        loop {
            let m = conn.next_backup_message().await.unwrap();
            let end = matches!(m, BackupMessage::End { .. });
            got.push(m);
            if end {
                break;
            }
        }
        assert_eq!(
            got,
            vec![
                BackupMessage::Archive { name: "base.tar".into(), location: None },
                BackupMessage::Data(Bytes::from_static(b"tar bytes")),
                BackupMessage::Progress(1024),
                BackupMessage::Archive { name: "16385.tar".into(), location: Some("/srv/ts".into()) },
                BackupMessage::End { end_lsn: Lsn(0x2000100), timeline: 1 },
            ]
        );
        assert!(conn.next_backup_message().await.is_err());
        // The connection takes the next command.
        assert_eq!(conn.simple_query("SELECT 'ok'").await.unwrap(), vec![vec![Some("ok".into())]]);
        let query = server.await.unwrap();
        assert_eq!(
            std::str::from_utf8(&query).unwrap(),
            "BASE_BACKUP ( LABEL 'it''s mine', CHECKPOINT 'fast', WAL false, MANIFEST 'no', WAIT true )\0"
        );
    }

    #[tokio::test]
    async fn base_backup_error_mid_stream_is_the_servers_and_the_connection_stays_usable() {
        let mut script = BytesMut::new();
        backup_start(&mut script);
        msg(&mut script, b'd', b"nbase.tar\0\0");
        msg(&mut script, b'E', b"SERROR\0C58P01\0Mcould not open file\0\0");
        msg(&mut script, b'Z', b"I");
        let (config, server) = fake_server(script).await;
        let mut conn = ReplicationConn::connect(&config).await.unwrap();
        conn.base_backup("x").await.unwrap();
        assert!(matches!(conn.next_backup_message().await, Ok(BackupMessage::Archive { .. })));
        let err = conn.next_backup_message().await.unwrap_err();
        assert!(matches!(err, PqError::Server { ref code, .. } if code == "58P01"), "{err}");
        assert_eq!(conn.simple_query("SELECT 'ok'").await.unwrap(), vec![vec![Some("ok".into())]]);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn base_backup_with_garbled_messages_is_a_protocol_error() {
        for bad in [&b"x"[..], b"nno-terminator", b"p\0\0", b""] {
            let mut script = BytesMut::new();
            backup_start(&mut script);
            msg(&mut script, b'd', bad);
            let (config, server) = fake_server(script).await;
            let mut conn = ReplicationConn::connect(&config).await.unwrap();
            conn.base_backup("x").await.unwrap();
            assert!(matches!(conn.next_backup_message().await, Err(PqError::Protocol(_))), "{bad:?}");
            drop(conn);
            server.abort();
        }
    }

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("slot"), "\"slot\"");
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    }
}
