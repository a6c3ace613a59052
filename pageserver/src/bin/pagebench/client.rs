//! A tokio client for the page service (docs/page-service-protocol.md): pagebench's, and
//! compiled into the library's unit tests too (`page_service::serve_tests` drive the daemon
//! with it), where `super::proto` is the library's `page_service::proto` as here (pagebench's
//! root imports it). The daemon has no client: the library exports none.
//!
//! One [`Client`] is one connection to one tenant. [`Client::connect`] sends Hello and checks
//! HelloOk. After that the client pipelines: [`Client::send`] only encodes into a write buffer,
//! [`Client::flush`] writes the buffer out, and [`Client::recv`] reads one whole reply. The daemon
//! answers strictly in order, so the caller matches replies to requests by position (and can
//! check the echoed `request_id`). [`Client::into_split`] gives a [`ClientWriter`] and a
//! [`ClientReader`] that a sender task and a receiver task own separately, which is how a deep
//! pipeline is driven without the two directions waiting on each other.
//!
//! [`Client::get_page`] and [`Client::ingest`] are one-request-at-a-time conveniences on top.
//!
//! Invariants:
//! - the reader never allocates for a frame before its length was checked against
//!   [`proto::MAX_FRAME_LEN`] (through [`proto::frame_len`]);
//! - bytes read from the socket stay in the read buffer until a whole frame is there, so
//!   cancelling [`ClientReader::recv`] loses nothing;
//! - this module trusts nothing the daemon sends: a malformed frame or an early EOF is an error,
//!   never a panic.

use std::fmt;

use anyhow::{bail, Context};
use bytes::{Bytes, BytesMut};
use page_types::{BufferTag, Lsn};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpStream, ToSocketAddrs};

#[cfg(test)]
use super::proto::IngestValue;
use super::proto::{self, ClientMessage, ErrorCode, ServerMessage};

/// Initial capacity of the read buffer: a few Page replies.
const READ_BUFFER_CAPACITY: usize = 64 * 1024;
/// Free space made before each read.
const MIN_READ_SPACE: usize = 16 * 1024;

/// An Error reply from the daemon, as a Rust error: returned (inside `anyhow::Error`) by the
/// conveniences, so that callers can `downcast_ref::<ServerError>()` and branch on the code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("daemon answered {} ({}): {message}", code.name(), code.to_u16())]
pub struct ServerError {
    pub request_id: u64,
    pub code: ErrorCode,
    pub message: String,
}

/// The receiving half: reads whole frames from the daemon.
pub struct ClientReader<R> {
    stream: R,
    buf: BytesMut,
}

impl<R: AsyncRead + Unpin> ClientReader<R> {
    pub fn new(stream: R) -> Self {
        ClientReader { stream, buf: BytesMut::with_capacity(READ_BUFFER_CAPACITY) }
    }

    /// Reads and decodes one reply.
    ///
    /// Cancel-safe: bytes read before a cancellation stay in the read buffer and the next call
    /// continues the same frame. Errors (EOF, I/O, a frame that does not decode) leave the
    /// connection unusable: the caller drops it.
    pub async fn recv(&mut self) -> anyhow::Result<ServerMessage> {
        let frame = self.recv_frame().await?;
        proto::decode_server(frame).context("decode reply from the daemon")
    }

    /// Reads one whole frame (length field included) without decoding it. Cancel-safe, as
    /// [`ClientReader::recv`].
    pub async fn recv_frame(&mut self) -> anyhow::Result<Bytes> {
        loop {
            if let Some(len) = proto::frame_len(&self.buf).context("read reply length")? {
                return Ok(self.buf.split_to(len).freeze());
            }
            // Room for two whole Page replies per read; a new allocation only every few frames.
            self.buf.reserve(MIN_READ_SPACE);
            let n = self.stream.read_buf(&mut self.buf).await.context("read from the page service")?;
            if n == 0 {
                if self.buf.is_empty() {
                    bail!("the daemon closed the connection");
                }
                bail!(
                    "the daemon closed the connection inside a frame ({} bytes of it read)",
                    self.buf.len()
                );
            }
        }
    }
}

/// The sending half: encodes requests into a write buffer and flushes it.
pub struct ClientWriter<W> {
    stream: W,
    buf: BytesMut,
}

impl<W: AsyncWrite + Unpin> ClientWriter<W> {
    pub fn new(stream: W) -> Self {
        ClientWriter { stream, buf: BytesMut::with_capacity(4096) }
    }

    /// Appends a request to the write buffer; nothing is sent until [`ClientWriter::flush`].
    /// The caller keeps an Ingest within [`proto::MAX_FRAME_LEN`].
    pub fn send(&mut self, message: &ClientMessage) {
        message.encode(&mut self.buf);
    }

    /// Writes out everything buffered by [`ClientWriter::send`].
    ///
    /// Cancel-safe: the buffer is advanced past what was written, so after a cancellation the
    /// next `flush` writes exactly the rest (no byte is lost or written twice).
    pub async fn flush(&mut self) -> anyhow::Result<()> {
        self.stream.write_all_buf(&mut self.buf).await.context("write to the page service")?;
        self.stream.flush().await.context("flush to the page service")?;
        Ok(())
    }

    /// Shuts down the write direction (the daemon sees EOF after the last request). Not
    /// cancel-safe in a useful way: after a cancellation, drop the writer. For tests.
    #[cfg(test)]
    pub async fn shutdown(&mut self) -> anyhow::Result<()> {
        self.flush().await?;
        self.stream.shutdown().await.context("shut down the page service connection")
    }
}

/// One connection to the page service, for one tenant, after a successful Hello.
pub struct Client<R = OwnedReadHalf, W = OwnedWriteHalf> {
    reader: ClientReader<R>,
    writer: ClientWriter<W>,
    last_durable_lsn: u64,
    next_request_id: u64,
}

impl Client {
    /// Connects over TCP and says Hello for `tenant_id`. Fails on a refused Hello (for example
    /// `no_such_tenant` or `too_many_connections`, as a [`ServerError`]).
    ///
    /// Cancel-safe: a cancelled connect just drops the half-open connection.
    pub async fn connect(addr: impl ToSocketAddrs + fmt::Debug, tenant_id: &str) -> anyhow::Result<Client> {
        let stream = TcpStream::connect(&addr).await.with_context(|| format!("connect to {addr:?}"))?;
        // Requests are small and latency-sensitive: do not let Nagle hold them back.
        stream.set_nodelay(true).context("set TCP_NODELAY")?;
        let (read, write) = stream.into_split();
        Client::handshake(read, write, tenant_id).await
    }
}

impl<R: AsyncRead + Unpin, W: AsyncWrite + Unpin> Client<R, W> {
    /// Says Hello on an already connected pair of streams (the duplex of a test, or TCP).
    ///
    /// Cancel-safe in the same way as [`Client::connect`]: drop the streams afterwards.
    pub async fn handshake(read: R, write: W, tenant_id: &str) -> anyhow::Result<Client<R, W>> {
        let mut reader = ClientReader::new(read);
        let mut writer = ClientWriter::new(write);
        writer.send(&ClientMessage::Hello {
            version: proto::PROTOCOL_VERSION,
            tenant_id: tenant_id.to_string(),
            timeline_id: proto::DEFAULT_TIMELINE.to_string(),
        });
        writer.flush().await.context("send Hello")?;
        match reader.recv().await.context("read the reply to Hello")? {
            ServerMessage::HelloOk { version, last_durable_lsn } => {
                if version != proto::PROTOCOL_VERSION {
                    bail!(
                        "daemon speaks protocol version {version}, this client {}",
                        proto::PROTOCOL_VERSION
                    );
                }
                Ok(Client { reader, writer, last_durable_lsn, next_request_id: 1 })
            }
            ServerMessage::Error { request_id, code, message } => {
                Err(ServerError { request_id, code, message }).context("Hello refused")
            }
            other => bail!("expected HelloOk, got {}", describe(&other)),
        }
    }

    /// The tenant's last durable LSN as reported by HelloOk (not updated afterwards, except by
    /// [`Client::ingest`]).
    pub fn last_durable_lsn(&self) -> u64 {
        self.last_durable_lsn
    }

    /// A fresh request id (1, 2, ...) for callers that build their own messages.
    pub fn next_request_id(&mut self) -> u64 {
        let id = self.next_request_id;
        self.next_request_id += 1;
        id
    }

    /// See [`ClientWriter::send`].
    pub fn send(&mut self, message: &ClientMessage) {
        self.writer.send(message);
    }

    /// See [`ClientWriter::flush`]; cancel-safe.
    pub async fn flush(&mut self) -> anyhow::Result<()> {
        self.writer.flush().await
    }

    /// See [`ClientReader::recv`]; cancel-safe.
    pub async fn recv(&mut self) -> anyhow::Result<ServerMessage> {
        self.reader.recv().await
    }

    /// Splits into halves for a sender task and a receiver task.
    pub fn into_split(self) -> (ClientReader<R>, ClientWriter<W>) {
        (self.reader, self.writer)
    }

    /// Gets one page: returns the LSN served ("latest" resolved) and the 8 KiB page. An Error
    /// reply is returned as a [`ServerError`] inside the `anyhow::Error`.
    ///
    /// Not cancel-safe: a cancellation after the request was written leaves its reply unread,
    /// and the next request would read it. Drop the client after a cancellation.
    pub async fn get_page(&mut self, key: BufferTag, lsn: u64) -> anyhow::Result<(u64, Bytes)> {
        let request_id = self.next_request_id();
        self.send(&ClientMessage::GetPage { request_id, key, lsn });
        self.flush().await?;
        match self.recv().await? {
            ServerMessage::Page { request_id: got, lsn, page } if got == request_id => Ok((lsn, page)),
            ServerMessage::Error { request_id, code, message } => {
                Err(ServerError { request_id, code, message }.into())
            }
            other => bail!("expected Page for request {request_id}, got {}", describe(&other)),
        }
    }

    /// Ingests one batch and waits until it is durable; returns the durable LSN (the batch's last
    /// LSN). An Error reply is returned as a [`ServerError`].
    ///
    /// Not cancel-safe, for the same reason as [`Client::get_page`]; moreover the batch may or
    /// may not have been stored. For tests (pagebench pipelines its batches).
    #[cfg(test)]
    pub async fn ingest(&mut self, values: Vec<IngestValue>) -> anyhow::Result<u64> {
        let request_id = self.next_request_id();
        self.send(&ClientMessage::Ingest { request_id, values });
        self.flush().await?;
        match self.recv().await? {
            ServerMessage::IngestOk { request_id: got, durable_lsn } if got == request_id => {
                self.last_durable_lsn = durable_lsn;
                Ok(durable_lsn)
            }
            ServerMessage::Error { request_id, code, message } => {
                Err(ServerError { request_id, code, message }.into())
            }
            other => bail!("expected IngestOk for request {request_id}, got {}", describe(&other)),
        }
    }
}

/// A short description of a reply for error messages (never the page bytes).
pub fn describe(message: &ServerMessage) -> String {
    match message {
        ServerMessage::HelloOk { version, last_durable_lsn } => {
            format!("HelloOk(version {version}, last_durable_lsn {})", Lsn(*last_durable_lsn))
        }
        ServerMessage::Page { request_id, lsn, page } => {
            format!("Page(request {request_id}, lsn {}, {} bytes)", Lsn(*lsn), page.len())
        }
        ServerMessage::IngestOk { request_id, durable_lsn } => {
            format!("IngestOk(request {request_id}, durable_lsn {})", Lsn(*durable_lsn))
        }
        ServerMessage::Error { request_id, code, message } => {
            format!("Error(request {request_id}, {}: {message})", code.name())
        }
        ServerMessage::RelSize { request_id, lsn, blocks } => {
            format!("RelSize(request {request_id}, lsn {}, {blocks} blocks)", Lsn(*lsn))
        }
        ServerMessage::RelExists { request_id, lsn, exists } => {
            format!("RelExists(request {request_id}, lsn {}, {exists})", Lsn(*lsn))
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn describe_shows_lsns_like_postgres() {
        let hello = ServerMessage::HelloOk { version: 1, last_durable_lsn: 0x16B_3748 };
        assert_eq!(super::describe(&hello), "HelloOk(version 1, last_durable_lsn 0/16B3748)");
        let ok = ServerMessage::IngestOk { request_id: 3, durable_lsn: 0x2_0000_0010 };
        assert_eq!(super::describe(&ok), "IngestOk(request 3, durable_lsn 2/10)");
    }

    use super::*;
    use page_types::PAGE_SIZE;
    use proto::ValueKind;
    use tokio::io::{duplex, split, DuplexStream, ReadHalf, WriteHalf};

    fn key(blknum: u32) -> BufferTag {
        BufferTag { spcnode: 1663, dbnode: 1, relnode: 2, forknum: 0, blknum }
    }

    /// A fake daemon on the other end of a duplex: reads client frames with the real decoder.
    struct FakeServer {
        stream: DuplexStream,
        buf: BytesMut,
    }

    impl FakeServer {
        async fn read_message(&mut self) -> Option<ClientMessage> {
            loop {
                if let Some(len) = proto::frame_len(&self.buf).unwrap() {
                    return Some(proto::decode_client(self.buf.split_to(len).freeze()).unwrap());
                }
                if self.stream.read_buf(&mut self.buf).await.unwrap() == 0 {
                    return None;
                }
            }
        }

        async fn write(&mut self, message: &ServerMessage) {
            let mut out = BytesMut::new();
            message.encode(&mut out);
            self.stream.write_all(&out).await.unwrap();
        }

        async fn write_raw(&mut self, bytes: &[u8]) {
            self.stream.write_all(bytes).await.unwrap();
        }

        async fn expect_hello(&mut self, last_durable_lsn: u64) {
            let hello = self.read_message().await.unwrap();
            assert_eq!(
                hello,
                ClientMessage::Hello {
                    version: proto::PROTOCOL_VERSION,
                    tenant_id: "t1".into(),
                    timeline_id: "main".into()
                }
            );
            self.write(&ServerMessage::HelloOk { version: proto::PROTOCOL_VERSION, last_durable_lsn }).await;
        }
    }

    type TestClient = Client<ReadHalf<DuplexStream>, WriteHalf<DuplexStream>>;

    /// A client and a fake server joined by a duplex with a small buffer, so that frames are
    /// cut into many partial reads.
    fn pair(buffer: usize) -> (DuplexStream, FakeServer) {
        let (client_end, server_end) = duplex(buffer);
        (client_end, FakeServer { stream: server_end, buf: BytesMut::new() })
    }

    async fn connected(buffer: usize, last_durable_lsn: u64) -> (TestClient, FakeServer) {
        let (client_end, mut server) = pair(buffer);
        let (read, write) = split(client_end);
        let (client, ()) =
            tokio::join!(Client::handshake(read, write, "t1"), server.expect_hello(last_durable_lsn));
        (client.unwrap(), server)
    }

    fn page(fill: u8) -> Bytes {
        Bytes::from(vec![fill; PAGE_SIZE])
    }

    #[tokio::test]
    async fn hello_ok_exposes_last_durable_lsn() {
        let (client, _server) = connected(64, 4242).await;
        assert_eq!(client.last_durable_lsn(), 4242);
    }

    #[tokio::test]
    async fn refused_hello_is_a_server_error_with_its_code() {
        let (client_end, mut server) = pair(1024);
        let (read, write) = split(client_end);
        let serve = async {
            server.read_message().await.unwrap();
            let refusal = ServerMessage::Error {
                request_id: 0,
                code: ErrorCode::NoSuchTenant,
                message: "no tenant t1".into(),
            };
            server.write(&refusal).await;
        };
        let (result, ()) = tokio::join!(Client::handshake(read, write, "t1"), serve);
        let error = result.err().unwrap();
        let server_error = error.downcast_ref::<ServerError>().unwrap();
        assert_eq!(server_error.code, ErrorCode::NoSuchTenant);
    }

    #[tokio::test]
    async fn pipelined_pages_arrive_whole_and_in_order_through_a_tiny_pipe() {
        // 100-byte pipe: every 8 KiB Page reply arrives in dozens of pieces.
        let (client, mut server) = connected(100, 0).await;
        let (mut reader, mut writer) = client.into_split();
        let serve = async move {
            while let Some(ClientMessage::GetPage { request_id, key, lsn }) = server.read_message().await {
                let reply = ServerMessage::Page { request_id, lsn: lsn + 1, page: page(key.blknum as u8) };
                server.write(&reply).await;
            }
        };
        let send = async move {
            for i in 0..20u32 {
                writer.send(&ClientMessage::GetPage {
                    request_id: u64::from(i),
                    key: key(i),
                    lsn: u64::from(i),
                });
            }
            writer.flush().await.unwrap();
            writer.shutdown().await.unwrap();
        };
        let receive = async move {
            for i in 0..20u32 {
                match reader.recv().await.unwrap() {
                    ServerMessage::Page { request_id, lsn, page } => {
                        assert_eq!(request_id, u64::from(i));
                        assert_eq!(lsn, u64::from(i) + 1);
                        assert_eq!(page.len(), PAGE_SIZE);
                        assert!(page.iter().all(|&b| b == i as u8));
                    }
                    other => panic!("unexpected {}", describe(&other)),
                }
            }
        };
        tokio::join!(serve, send, receive);
    }

    #[tokio::test]
    async fn cancelled_recv_loses_no_bytes() {
        let (client, mut server) = connected(64 * 1024, 0).await;
        let (mut reader, _writer) = client.into_split();
        let mut frame = BytesMut::new();
        ServerMessage::Page { request_id: 9, lsn: 10, page: page(7) }.encode(&mut frame);
        // Half a frame, then a recv that is cancelled while waiting for the rest.
        server.write_raw(&frame[..5000]).await;
        let cancelled = tokio::time::timeout(std::time::Duration::from_millis(20), reader.recv()).await;
        assert!(cancelled.is_err(), "recv returned before the frame was whole");
        server.write_raw(&frame[5000..]).await;
        match reader.recv().await.unwrap() {
            ServerMessage::Page { request_id: 9, lsn: 10, page } => assert!(page.iter().all(|&b| b == 7)),
            other => panic!("unexpected {}", describe(&other)),
        }
    }

    #[tokio::test]
    async fn eof_inside_a_frame_is_an_error_naming_it() {
        let (client, mut server) = connected(1024, 0).await;
        let (mut reader, _writer) = client.into_split();
        server.write_raw(&[0, 0, 0, 17, 0x83, 1, 2]).await;
        drop(server);
        let error = reader.recv().await.unwrap_err();
        assert!(format!("{error:#}").contains("inside a frame"), "{error:#}");
    }

    #[tokio::test]
    async fn oversized_frame_length_is_refused_before_reading_the_payload() {
        let (client, mut server) = connected(1024, 0).await;
        let (mut reader, _writer) = client.into_split();
        // 16 MiB announced, nothing behind it: the reader must fail at once, not wait.
        server.write_raw(&[1, 0, 0, 0]).await;
        let error = reader.recv().await.unwrap_err();
        assert!(format!("{error:#}").contains("outside"), "{error:#}");
    }

    #[tokio::test]
    async fn get_page_returns_page_and_maps_error_replies() {
        let (mut client, mut server) = connected(1024, 0).await;
        let serve = async move {
            let Some(ClientMessage::GetPage { request_id, .. }) = server.read_message().await else {
                panic!()
            };
            server.write(&ServerMessage::Page { request_id, lsn: 77, page: page(1) }).await;
            let Some(ClientMessage::GetPage { request_id, .. }) = server.read_message().await else {
                panic!()
            };
            let error =
                ServerMessage::Error { request_id, code: ErrorCode::NotFound, message: "none".into() };
            server.write(&error).await;
        };
        let use_client = async move {
            let (lsn, got) = client.get_page(key(1), proto::LSN_LATEST).await.unwrap();
            assert_eq!((lsn, got.len()), (77, PAGE_SIZE));
            let error = client.get_page(key(2), 5).await.unwrap_err();
            assert_eq!(error.downcast_ref::<ServerError>().unwrap().code, ErrorCode::NotFound);
        };
        tokio::join!(serve, use_client);
    }

    #[tokio::test]
    async fn ingest_returns_durable_lsn_and_updates_it() {
        let (mut client, mut server) = connected(1024, 5).await;
        let serve = async move {
            let Some(ClientMessage::Ingest { request_id, values }) = server.read_message().await else {
                panic!()
            };
            assert_eq!(values.len(), 2);
            let durable_lsn = values.last().unwrap().lsn;
            server.write(&ServerMessage::IngestOk { request_id, durable_lsn }).await;
        };
        let use_client = async move {
            let values = vec![
                IngestValue { key: key(1), lsn: 10, kind: ValueKind::Image, data: page(0) },
                IngestValue {
                    key: key(1),
                    lsn: 11,
                    kind: ValueKind::Record,
                    data: Bytes::from_static(b"\x05"),
                },
            ];
            assert_eq!(client.ingest(values).await.unwrap(), 11);
            assert_eq!(client.last_durable_lsn(), 11);
        };
        tokio::join!(serve, use_client);
    }

    #[tokio::test]
    async fn reply_with_the_wrong_request_id_is_an_error() {
        let (mut client, mut server) = connected(1024, 0).await;
        let serve = async move {
            let Some(ClientMessage::GetPage { request_id, .. }) = server.read_message().await else {
                panic!()
            };
            server.write(&ServerMessage::Page { request_id: request_id + 100, lsn: 1, page: page(0) }).await;
        };
        let (result, ()) = tokio::join!(client.get_page(key(1), 1), serve);
        assert!(format!("{:#}", result.unwrap_err()).contains("expected Page"));
    }
}
