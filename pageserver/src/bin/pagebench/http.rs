//! A minimal HTTP/1.1 client for the few management calls `pagebench` makes (`POST /v1/tenant`,
//! `GET /v1/tenant`, `GET /v1/tenant/{id}/keyspace`; docs/http-api.md).
//!
//! Hand-written rather than a crate such as `ureq`: the tool sends one small JSON request to a
//! daemon on the same machine, with no TLS, redirects, proxies or keep-alive; forty lines of
//! tokio are less to audit and build than an HTTP client's dependency tree. The request says
//! `Connection: close`; the response is read up to its `Content-Length` (or to EOF without one),
//! bounded in size and time. Chunked responses are not decoded: the body is only shown to a
//! person in error messages.

use std::time::Duration;

use anyhow::{bail, Context};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest response read; the management API answers with small JSON documents.
const MAX_RESPONSE_LEN: usize = 1 << 20;
/// Longest time for the whole exchange.
const TIMEOUT: Duration = Duration::from_secs(30);

/// A response: status code and body text.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: String,
}

/// Sends `method path`, with a JSON body if given, to `addr` (HOST:PORT) and returns the
/// response.
///
/// Cancel-safe: the connection is dropped, and the request may or may not have reached the
/// daemon.
pub async fn request_json(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
) -> anyhow::Result<Response> {
    tokio::time::timeout(TIMEOUT, exchange(addr, method, path, body))
        .await
        .with_context(|| format!("{method} {path} on {addr}: no answer within {TIMEOUT:?}"))?
}

async fn exchange(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
) -> anyhow::Result<Response> {
    let body = match body {
        Some(body) => serde_json::to_vec(body).context("encode the request body")?,
        None => Vec::new(),
    };
    let mut stream = TcpStream::connect(addr).await.with_context(|| format!("connect to {addr}"))?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.context("send the request")?;
    stream.write_all(&body).await.context("send the request body")?;

    let mut buf = Vec::with_capacity(4096);
    let mut header_end = None;
    loop {
        if let Some(end) = header_end {
            if let Some(want) = content_length(&buf[..end])? {
                if buf.len() >= end + want {
                    buf.truncate(end + want);
                    break;
                }
            }
        }
        if buf.len() > MAX_RESPONSE_LEN {
            bail!("response longer than {MAX_RESPONSE_LEN} bytes");
        }
        let n = stream.read_buf(&mut buf).await.context("read the response")?;
        if header_end.is_none() {
            header_end = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|at| at + 4);
        }
        if n == 0 {
            break;
        }
    }
    let Some(end) = header_end else { bail!("the response ended inside its header") };
    let head = std::str::from_utf8(&buf[..end]).context("response header is not UTF-8")?;
    let status_line = head.lines().next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse::<u16>().ok())
        .with_context(|| format!("bad status line {status_line:?}"))?;
    Ok(Response { status, body: String::from_utf8_lossy(&buf[end..]).into_owned() })
}

/// The `Content-Length` of a response header, if it has one.
fn content_length(head: &[u8]) -> anyhow::Result<Option<usize>> {
    let head = String::from_utf8_lossy(head);
    for line in head.lines().skip(1) {
        if let Some((name, value)) = line.split_once(':') {
            if name.trim().eq_ignore_ascii_case("content-length") {
                let len = value.trim().parse().with_context(|| format!("bad Content-Length {value:?}"))?;
                return Ok(Some(len));
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;
    use tokio::sync::oneshot;

    /// Serves one canned response and hands back the request it got. Keeps the connection
    /// open afterwards: the client must stop at Content-Length, not wait for EOF.
    async fn serve_once(response: &'static [u8]) -> (String, oneshot::Receiver<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx) = oneshot::channel();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            while !request.ends_with(b"}") {
                stream.read_buf(&mut request).await.unwrap();
            }
            stream.write_all(response).await.unwrap();
            let _ = tx.send(request);
            tokio::time::sleep(Duration::from_secs(60)).await;
        });
        (addr, rx)
    }

    #[tokio::test]
    async fn response_is_read_up_to_content_length_without_waiting_for_eof() {
        let (addr, _request) =
            serve_once(b"HTTP/1.1 409 Conflict\r\ncontent-length: 22\r\n\r\n{\"error\": \"it exists\"}")
                .await;
        let response =
            request_json(&addr, "POST", "/v1/tenant", Some(&serde_json::json!({"id": "t1"}))).await.unwrap();
        assert_eq!(response.status, 409);
        assert_eq!(response.body, "{\"error\": \"it exists\"}");
    }

    #[tokio::test]
    async fn request_carries_method_path_length_and_json_body() {
        let (addr, request) = serve_once(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}").await;
        let response =
            request_json(&addr, "POST", "/v1/tenant", Some(&serde_json::json!({"id": "t1"}))).await.unwrap();
        assert_eq!((response.status, response.body.as_str()), (201, "{}"));
        let request = String::from_utf8(request.await.unwrap()).unwrap();
        assert!(request.starts_with("POST /v1/tenant HTTP/1.1\r\n"), "{request}");
        assert!(request.contains("Content-Length: 11\r\n"), "{request}");
        assert!(request.ends_with("\r\n\r\n{\"id\":\"t1\"}"), "{request}");
    }
}
