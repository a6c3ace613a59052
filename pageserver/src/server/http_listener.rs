//! The management API's listener: at most [`HTTP_MAX_CONNECTIONS`] connections at once (the
//! next waits in the kernel's listen backlog, holding no descriptor of ours), and each closed
//! when no byte moves either way for [`HTTP_IDLE_TIMEOUT`]: an idle keep-alive connection, or a
//! client stalling in its request headers or not reading its response. (A handler that takes
//! longer than that with no byte moving is cut too; none comes near it.)

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

use super::fds::HTTP_MAX_CONNECTIONS;

/// An HTTP connection on which no byte moved for this long is closed.
pub const HTTP_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// A [`TcpListener`] with a connection cap and an idle timeout per connection.
pub struct HttpListener {
    listener: TcpListener,
    slots: Arc<Semaphore>,
}

impl HttpListener {
    pub fn new(listener: TcpListener) -> HttpListener {
        HttpListener { listener, slots: Arc::new(Semaphore::new(HTTP_MAX_CONNECTIONS)) }
    }
}

impl axum::serve::Listener for HttpListener {
    type Io = IdleTimeoutStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok(slot) = Arc::clone(&self.slots).acquire_owned().await else {
                // Never closed; were it, accepting would make no sense either.
                std::future::pending::<()>().await;
                continue;
            };
            match self.listener.accept().await {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    return (IdleTimeoutStream::new(stream, slot, HTTP_IDLE_TIMEOUT), peer);
                }
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    tracing::warn!("failed to accept a management API connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}

/// A TCP stream that fails with `TimedOut` once no byte moved for its timeout, and frees its
/// connection slot when dropped.
pub struct IdleTimeoutStream {
    stream: TcpStream,
    timeout: Duration,
    deadline: Pin<Box<Sleep>>,
    _slot: OwnedSemaphorePermit,
}

impl IdleTimeoutStream {
    fn new(stream: TcpStream, slot: OwnedSemaphorePermit, timeout: Duration) -> IdleTimeoutStream {
        let deadline = Box::pin(tokio::time::sleep(timeout));
        IdleTimeoutStream { stream, timeout, deadline, _slot: slot }
    }

    /// After an I/O poll: progress moves the deadline; no progress past the deadline fails.
    fn check<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match poll {
            Poll::Ready(result) => {
                let next = Instant::now() + self.timeout;
                self.deadline.as_mut().reset(next);
                Poll::Ready(result)
            }
            Poll::Pending => match self.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no byte moved for {:?}", self.timeout),
                ))),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl AsyncRead for IdleTimeoutStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.stream).poll_read(cx, buf);
        this.check(cx, poll)
    }
}

impl AsyncWrite for IdleTimeoutStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.check(cx, poll)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.stream).poll_shutdown(cx);
        this.check(cx, poll)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.check(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}
