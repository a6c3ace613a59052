//! The management API's listener: at most [`HTTP_MAX_CONNECTIONS`] connections at once (the
//! next waits in the kernel's listen backlog, holding no descriptor of ours), and each closed
//! when no byte moves either way for [`HTTP_IDLE_TIMEOUT`] while no request of it is being
//! handled: an idle keep-alive connection, or a client stalling in its request headers or not
//! reading its response.
//!
//! A request being handled is not idle, however long its handler takes (a compaction pass of
//! a large tenant takes minutes): the server wraps its service in [`TrackRequests`], which
//! counts the connection's requests in its handler, and the stream's deadline only moves on
//! while one is. The clock runs again once the handler has answered, so a client that does not
//! read the answer is cut off as before.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

use crate::fds::HTTP_MAX_CONNECTIONS;

/// An HTTP connection on which no byte moved for this long is closed.
pub const HTTP_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// A [`TcpListener`] with a connection cap and an idle timeout per connection.
pub struct HttpListener {
    listener: TcpListener,
    slots: Arc<Semaphore>,
    idle_timeout: Duration,
}

impl HttpListener {
    pub fn new(listener: TcpListener) -> HttpListener {
        HttpListener::with_idle_timeout(listener, HTTP_IDLE_TIMEOUT)
    }

    /// With another idle timeout than [`HTTP_IDLE_TIMEOUT`]: for tests, which cannot wait for
    /// the real one.
    pub(crate) fn with_idle_timeout(listener: TcpListener, idle_timeout: Duration) -> HttpListener {
        HttpListener { listener, slots: Arc::new(Semaphore::new(HTTP_MAX_CONNECTIONS)), idle_timeout }
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
                    return (IdleTimeoutStream::new(stream, slot, self.idle_timeout), peer);
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

/// A TCP stream that fails with `TimedOut` once no byte moved for its timeout while none of
/// its requests was being handled, and frees its connection slot when dropped.
pub struct IdleTimeoutStream {
    stream: TcpStream,
    timeout: Duration,
    deadline: Pin<Box<Sleep>>,
    in_request: InRequest,
    _slot: OwnedSemaphorePermit,
}

impl IdleTimeoutStream {
    fn new(stream: TcpStream, slot: OwnedSemaphorePermit, timeout: Duration) -> IdleTimeoutStream {
        let deadline = Box::pin(tokio::time::sleep(timeout));
        IdleTimeoutStream { stream, timeout, deadline, in_request: InRequest::default(), _slot: slot }
    }

    /// The count of this connection's requests in their handler, for [`TrackRequests`].
    pub fn in_request(&self) -> InRequest {
        self.in_request.clone()
    }

    /// After an I/O poll: progress moves the deadline; no progress past the deadline fails,
    /// unless a request is being handled (then the deadline moves on).
    fn check<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match poll {
            Poll::Ready(result) => {
                let next = Instant::now() + self.timeout;
                self.deadline.as_mut().reset(next);
                Poll::Ready(result)
            }
            Poll::Pending => loop {
                match self.deadline.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(()) if self.in_request.busy() => {
                        // Polled again at once: it registers the waker for the new deadline.
                        let next = Instant::now() + self.timeout;
                        self.deadline.as_mut().reset(next);
                    }
                    Poll::Ready(()) => {
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("no byte moved for {:?}", self.timeout),
                        )))
                    }
                }
            },
        }
    }
}

/// How many requests of one connection are in their handler now (HTTP/1: at most one).
#[derive(Debug, Clone, Default)]
pub struct InRequest(Arc<AtomicUsize>);

impl InRequest {
    fn busy(&self) -> bool {
        self.0.load(Ordering::Relaxed) > 0
    }

    /// Counts a request in until the guard is dropped.
    fn enter(&self) -> impl Drop + Send + 'static {
        struct Guard(Arc<AtomicUsize>);
        impl Drop for Guard {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.0.fetch_add(1, Ordering::Relaxed);
        Guard(Arc::clone(&self.0))
    }
}

/// A hyper service that counts its requests in [`InRequest`] from the call until the handler's
/// future ends (answered, failed or dropped), so that the connection's idle timeout does not
/// cut a request that is still being handled.
pub struct TrackRequests<S> {
    inner: S,
    in_request: InRequest,
}

impl<S> TrackRequests<S> {
    pub fn new(inner: S, in_request: InRequest) -> TrackRequests<S> {
        TrackRequests { inner, in_request }
    }
}

impl<S, R> hyper::service::Service<R> for TrackRequests<S>
where
    S: hyper::service::Service<R>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn call(&self, request: R) -> Self::Future {
        let guard = self.in_request.enter();
        let handled = self.inner.call(request);
        Box::pin(async move {
            let answer = handled.await;
            drop(guard);
            answer
        })
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use axum::serve::Listener;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_stream_on_which_no_byte_moves_fails_and_frees_its_slot() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let slots = Arc::new(Semaphore::new(1));
        let slot = Arc::clone(&slots).try_acquire_owned().unwrap();
        let mut stream = IdleTimeoutStream::new(server, slot, Duration::from_millis(200));

        client.write_all(b"x").await.unwrap();
        let mut byte = [0u8; 1];
        stream.read_exact(&mut byte).await.unwrap();
        let err = stream.read(&mut byte).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        drop(stream);
        assert_eq!(slots.available_permits(), 1);
    }

    #[tokio::test]
    async fn a_stream_is_not_idle_while_a_request_is_handled_and_is_once_it_is_answered() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let _client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let slot = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        let timeout = Duration::from_millis(100);
        let mut stream = IdleTimeoutStream::new(server, slot, timeout);

        let handling = stream.in_request().enter();
        let mut byte = [0u8; 1];
        // Ten idle timeouts with no byte moving: the read is still waiting, not failed.
        let waited = tokio::time::timeout(timeout * 10, stream.read(&mut byte)).await;
        assert!(waited.is_err(), "a stream with a request in its handler timed out: {waited:?}");
        drop(handling);
        let err = tokio::time::timeout(timeout * 50, stream.read(&mut byte)).await.unwrap().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    #[tokio::test]
    async fn the_listener_accepts_no_more_than_its_cap_until_one_closes() {
        let mut listener = HttpListener::new(TcpListener::bind("127.0.0.1:0").await.unwrap());
        let addr = listener.local_addr().unwrap();
        let mut clients = Vec::new();
        let mut accepted = Vec::new();
        for _ in 0..HTTP_MAX_CONNECTIONS {
            clients.push(TcpStream::connect(addr).await.unwrap());
            accepted.push(listener.accept().await.0);
        }
        clients.push(TcpStream::connect(addr).await.unwrap());
        // The next one stays in the backlog while the cap is reached ...
        assert!(tokio::time::timeout(Duration::from_millis(200), listener.accept()).await.is_err());
        // ... and is accepted once a connection closes.
        accepted.pop();
        tokio::time::timeout(Duration::from_secs(5), listener.accept()).await.unwrap();
    }
}
