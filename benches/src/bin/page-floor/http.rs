//! The management API of `page-floor`: just what `pagebench get-page` asks before it starts.
//!
//! - `GET /v1/tenant/{id}/keyspace`, for any valid tenant id (1 to 64 of `[A-Za-z0-9_-]`): the
//!   key space (docs/http-api.md) of the data set `pagebench ingest --relations R --blocks B
//!   --chain-length C` loads, at its end LSN: relations 16384.. of database 1663/1, blocks
//!   `[0, B-1]` each, `all_keys_from` the LSN of the last image. pagebench's shape check
//!   (keyspace.rs, `check_shape`) wants exactly these keys and that end LSN, so the layout
//!   constants below repeat those of pagebench's dataset.rs; the integration test runs
//!   pagebench with shape flags against the floor to keep them in step;
//! - `GET /v1/tenant`: one tenant, `floor` (for `pagebench get-page --tenants all`);
//! - anything else: `404` (a bad tenant id: `400`).
//!
//! One blocking thread, one request per connection (`Connection: close`), each read and write
//! bounded by [`IO_TIMEOUT`], a request head by [`MAX_HEAD_LEN`] and a body (read and dropped,
//! so that the close does not reset the connection under the response) by [`MAX_BODY_LEN`]. A
//! slow client holds up the next one for at most that long: the API is asked once per
//! pagebench run, never on the request path.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use anyhow::{bail, Context};
use pageserver::page_service::proto::LSN_LATEST;

/// LSN of the data set's first value, and the step between values (pagebench's dataset.rs).
const FIRST_LSN: u64 = 0x0100_0000;
const LSN_STEP: u64 = 8;
/// Tablespace, database and first relation number of the data set (pagebench's dataset.rs).
const SPCNODE: u32 = 1663;
const DBNODE: u32 = 1;
const FIRST_RELNODE: u32 = 16384;
/// The tenant `GET /v1/tenant` lists.
const LISTED_TENANT: &str = "floor";

/// Longest wait for one read or write of a client.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest request head (request line and headers).
const MAX_HEAD_LEN: usize = 16 * 1024;
/// Longest request body read (and dropped).
const MAX_BODY_LEN: usize = 64 * 1024;
/// Pause after a failed `accept` (out of descriptors), so that the thread does not spin.
const ACCEPT_RETRY: Duration = Duration::from_millis(10);

/// The data set the floor pretends to hold: pagebench's layout for a shape, at its end.
#[derive(Debug, Clone)]
pub struct DataSet {
    relations: u32,
    blocks: u32,
    /// The last value's LSN: the last durable LSN, and what GetPage at "latest" serves.
    pub end_lsn: u64,
    /// The last image's LSN: from here on every page exists.
    all_keys_from: u64,
}

impl DataSet {
    pub fn new(relations: u32, blocks: u32, chain_length: u32) -> anyhow::Result<DataSet> {
        let pages = u64::from(relations) * u64::from(blocks);
        let values = pages.checked_mul(1 + u64::from(chain_length));
        let lsn_of_value = |value: u64| {
            value
                .checked_mul(LSN_STEP)
                .and_then(|offset| offset.checked_add(FIRST_LSN))
                .filter(|&lsn| lsn < LSN_LATEST)
        };
        let (Some(end_lsn), Some(all_keys_from)) = (
            values.and_then(|v| v.checked_sub(1)).and_then(lsn_of_value),
            pages.checked_sub(1).and_then(lsn_of_value),
        ) else {
            bail!("check the shape: {relations} relations x {blocks} blocks x (1 + {chain_length}) values overflow the LSN space");
        };
        Ok(DataSet { relations, blocks, end_lsn, all_keys_from })
    }

    /// The body of `GET /v1/tenant/{id}/keyspace`.
    pub fn keyspace_json(&self, tenant_id: &str) -> String {
        let relations: Vec<serde_json::Value> = (0..self.relations)
            .map(|r| {
                serde_json::json!({
                    "spcnode": SPCNODE, "dbnode": DBNODE, "relnode": FIRST_RELNODE + r, "forknum": 0,
                    "blocks": [[0, self.blocks - 1]],
                })
            })
            .collect();
        serde_json::json!({
            "tenant_id": tenant_id,
            "last_durable_lsn": self.end_lsn,
            "keys": u64::from(self.relations) * u64::from(self.blocks),
            "lsn_range": {"first": FIRST_LSN, "all_keys_from": self.all_keys_from, "last": self.end_lsn},
            "relations": relations,
        })
        .to_string()
    }
}

/// Answers requests for ever, one connection at a time.
pub fn serve(listener: TcpListener, data: &DataSet) -> anyhow::Result<()> {
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Err(e) = answer(stream, data) {
                    eprintln!("page-floor: failed to answer an HTTP request: {e:#}");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                eprintln!("page-floor: failed to accept an HTTP connection: {e}");
                std::thread::sleep(ACCEPT_RETRY);
            }
        }
    }
}

fn answer(mut stream: TcpStream, data: &DataSet) -> anyhow::Result<()> {
    stream.set_read_timeout(Some(IO_TIMEOUT)).context("set the read timeout")?;
    stream.set_write_timeout(Some(IO_TIMEOUT)).context("set the write timeout")?;
    let mut request = Vec::with_capacity(1024);
    let mut buf = [0u8; 4096];
    let head_end = loop {
        if let Some(at) = request.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        if request.len() > MAX_HEAD_LEN {
            return respond(&mut stream, 400, &error_json("request head too long"));
        }
        let n = stream.read(&mut buf).context("read the request")?;
        if n == 0 {
            bail!("read the request: the client closed the connection inside its head");
        }
        request.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&request[..head_end]).into_owned();
    let body_len = match content_length(&head) {
        Ok(len) if len <= MAX_BODY_LEN => len,
        _ => return respond(&mut stream, 400, &error_json("bad or too long Content-Length")),
    };
    let mut body_read = request.len() - head_end;
    while body_read < body_len {
        let n = stream.read(&mut buf).context("read the request body")?;
        if n == 0 {
            bail!("read the request body: the client closed the connection inside it");
        }
        body_read += n;
    }
    let request_line = head.lines().next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let (method, target) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    let (status, body) = route(method, target, data);
    respond(&mut stream, status, &body)
}

/// The status and JSON body for `method target`.
fn route(method: &str, target: &str, data: &DataSet) -> (u16, String) {
    let path = target.split(['?', '#']).next().unwrap_or_default();
    let segments: Vec<&str> = path.split('/').collect();
    match (method, segments.as_slice()) {
        ("GET", ["", "v1", "tenant", id, "keyspace"]) => match pageserver::tenants::validate_tenant_id(id) {
            Ok(()) => (200, data.keyspace_json(id)),
            Err(e) => (400, error_json(&e.to_string())),
        },
        ("GET", ["", "v1", "tenant"]) => {
            let tenant = serde_json::json!({
                "id": LISTED_TENANT, "state": "active", "last_durable_lsn": data.end_lsn,
            });
            (200, serde_json::json!([tenant]).to_string())
        }
        _ => (404, error_json(&format!("page-floor does not serve {method} {path}"))),
    }
}

fn error_json(message: &str) -> String {
    serde_json::json!({ "error": message }).to_string()
}

/// The `Content-Length` of a request head (0 without one).
fn content_length(head: &str) -> anyhow::Result<usize> {
    for line in head.lines().skip(1) {
        if let Some((name, value)) = line.split_once(':') {
            if name.trim().eq_ignore_ascii_case("content-length") {
                return value.trim().parse().with_context(|| format!("parse Content-Length {value:?}"));
            }
        }
    }
    Ok(0)
}

fn respond(stream: &mut TcpStream, status: u16, body: &str) -> anyhow::Result<()> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        _ => "Not Found",
    };
    let response = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).context("write the response")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyspace_is_pagebench_layout_at_the_end_lsn() {
        let data = DataSet::new(10, 1000, 10).unwrap();
        // 10 x 1000 pages, an image and 10 records each: values 0..110000, 8 LSNs apart.
        assert_eq!(data.end_lsn, FIRST_LSN + 109_999 * LSN_STEP);
        assert_eq!(data.all_keys_from, FIRST_LSN + 9_999 * LSN_STEP);
        let json: serde_json::Value = serde_json::from_str(&data.keyspace_json("bench")).unwrap();
        assert_eq!(json["keys"], 10_000);
        assert_eq!(json["last_durable_lsn"], data.end_lsn);
        assert_eq!(json["relations"].as_array().unwrap().len(), 10);
        assert_eq!(json["relations"][9]["relnode"], 16393);
        assert_eq!(json["relations"][9]["blocks"], serde_json::json!([[0, 999]]));
    }

    #[test]
    fn a_shape_beyond_the_lsn_space_is_refused() {
        // The flags' ranges keep clear of it (at most about 2^60); the check guards the arithmetic.
        assert!(DataSet::new(u32::MAX, u32::MAX, u32::MAX).is_err());
        assert!(DataSet::new(100_000, 100_000_000, 10_000).is_ok());
        assert_eq!(DataSet::new(1, 1, 0).unwrap().end_lsn, FIRST_LSN);
    }

    #[test]
    fn routes_answer_the_keyspace_of_any_valid_tenant_and_404_otherwise() {
        let data = DataSet::new(2, 3, 1).unwrap();
        assert_eq!(route("GET", "/v1/tenant/any-id_1/keyspace", &data).0, 200);
        assert_eq!(route("GET", "/v1/tenant/bad.id/keyspace", &data).0, 400);
        assert_eq!(route("GET", "/v1/tenant", &data).0, 200);
        assert_eq!(route("POST", "/v1/tenant", &data).0, 404);
        assert_eq!(route("GET", "/metrics", &data).0, 404);
        assert_eq!(route("GET", "/v1/tenant/t/keyspace/more", &data).0, 404);
    }
}
