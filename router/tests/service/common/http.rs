//! A raw HTTP/1.1 client that sees the chunks as framed on the wire.

use super::*;

/// An HTTP response as received: status, headers (lower-case names), the body's chunks as
/// framed on the wire (one element if not chunked).
#[derive(Debug)]
pub struct Got {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub chunks: Vec<Vec<u8>>,
}

impl Got {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
    pub fn body(&self) -> Vec<u8> {
        self.chunks.concat()
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body()).expect("JSON body")
    }
}

/// One HTTP/1.1 request over a fresh connection (`Connection: close`).
pub async fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&[u8]>) -> Got {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let body = body.unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.expect("write");
    s.write_all(body).await.expect("write");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut raw))
        .await
        .expect("response in time")
        .expect("read");
    parse_response(&raw)
}

pub fn parse_response(raw: &[u8]) -> Got {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("end of head");
    let head = std::str::from_utf8(&raw[..end]).expect("utf-8 head");
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut rest = &raw[end + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let mut chunks = Vec::new();
    if chunked {
        loop {
            let nl = rest
                .windows(2)
                .position(|w| w == b"\r\n")
                .expect("size line");
            let size = std::str::from_utf8(&rest[..nl]).expect("size");
            let n = usize::from_str_radix(size.trim(), 16).expect("hex size");
            rest = &rest[nl + 2..];
            if n == 0 {
                break;
            }
            chunks.push(rest[..n].to_vec());
            rest = &rest[n + 2..];
        }
    } else {
        chunks.push(rest.to_vec());
    }
    Got {
        status,
        headers,
        chunks,
    }
}

/// One HTTP/1.1 request with these header lines, a `Content-Length` and, unless they hold
/// a `Connection`, `Connection: close` (nothing else is added); its answer read to the
/// connection's end within `wait` (`None` if not).
pub async fn http_with(
    addr: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    wait: Duration,
) -> Option<Got> {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut head = format!(
        "{method} {target} HTTP/1.1\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("connection"))
    {
        head.push_str("Connection: close\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).await.expect("write");
    s.write_all(body).await.expect("write");
    let mut raw = Vec::new();
    match tokio::time::timeout(wait, s.read_to_end(&mut raw)).await {
        Ok(Ok(_)) => Some(parse_response(&raw)),
        _ => None,
    }
}

/// POSTs the JSON `body` to the router's `/v1/completions` and returns its answer, read to
/// the end within `wait`; panics if none came.
pub async fn complete(addr: SocketAddr, body: &str, wait: Duration) -> Got {
    http_with(
        addr,
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json")],
        body.as_bytes(),
        wait,
    )
    .await
    .expect("answered")
}

/// GETs `target` from `addr` and returns the answer, read to the end within `wait`; panics
/// if none came.
pub async fn get_within(addr: SocketAddr, target: &str, wait: Duration) -> Got {
    http_with(addr, "GET", target, &[], b"", wait)
        .await
        .expect("answered")
}

/// Reads one request from `r`: its head up to the blank line (as sent) and the body its
/// `Content-Length` names; `None` if the peer closed or failed first. What the fake engines
/// read before they answer (one request per connection).
pub async fn read_request<R: tokio::io::AsyncRead + Unpin>(r: &mut R) -> Option<(String, Vec<u8>)> {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        if let Some(e) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..e]).into_owned();
            let len = head
                .lines()
                .filter_map(|l| l.split_once(':'))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
                .and_then(|(_, v)| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if got.len() >= e + 4 + len {
                return Some((head, got[e + 4..e + 4 + len].to_vec()));
            }
        }
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
}
