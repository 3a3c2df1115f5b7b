//! A small blocking etcd v3 client over etcd's own HTTP/JSON gateway (`/v3/kv/*`,
//! `/v3/lease/*`), the documented JSON mapping of its gRPC API.
//!
//! Why not the `etcd-client` crate: it is async (tonic, prost, hyper, h2; `protoc` at build
//! time) while every caller here is synchronous — the settle log commits from a lock
//! guard's `Drop`, clients resolve the leader from a plain thread — and the few calls the
//! HA layer makes (grant, keep-alive, range, txn, compact) are one request and one reply
//! each. So: one short-lived HTTP/1.0 connection per call (no chunked replies, no pooling to
//! go stale), a deadline on connect, write and read, and the endpoints tried in turn
//! starting with the one that answered last. A member that is paused or cut off costs one
//! deadline, then the next member answers (Mooncake's master hung there: issue #2253).
//!
//! Every request is linearizable (the gateway's default), so a read never returns a leader
//! key older than one another process has already seen.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use serde_json::{Value, json};

use crate::error::{L3Error, L3Result};

/// A key and its revisions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    /// The key.
    pub key: Vec<u8>,
    /// The value.
    pub value: Vec<u8>,
    /// Revision that created the key (the leader key's is the epoch).
    pub create_revision: i64,
    /// Revision of its last change.
    pub mod_revision: i64,
}

/// A comparison of a txn.
#[derive(Debug, Clone)]
pub enum Compare {
    /// The key's create revision equals this (0: the key does not exist).
    CreateRevision(Vec<u8>, i64),
}

/// An operation of a txn.
#[derive(Debug, Clone)]
pub enum Op {
    /// Put a value, optionally under a lease.
    Put {
        /// Key.
        key: Vec<u8>,
        /// Value.
        value: Vec<u8>,
        /// Lease id (0: none).
        lease: i64,
    },
    /// Delete the keys in `[from, to)`.
    DeleteRange {
        /// First key.
        from: Vec<u8>,
        /// End (exclusive).
        to: Vec<u8>,
    },
}

/// The etcd cluster's client endpoints.
#[derive(Debug)]
pub struct Etcd {
    endpoints: Vec<String>,
    timeout: Duration,
    /// Index of the endpoint that answered last (tried first).
    preferred: AtomicUsize,
}

fn unavailable(what: String) -> L3Error {
    L3Error::Unavailable(format!("etcd: {what}"))
}

fn b64(b: &[u8]) -> String {
    B64.encode(b)
}

fn unb64(v: &Value) -> L3Result<Vec<u8>> {
    match v.as_str() {
        None => Ok(Vec::new()),
        Some(s) => B64
            .decode(s)
            .map_err(|e| unavailable(format!("bad base64 in a reply: {e}"))),
    }
}

/// An int64 field (the gateway writes them as strings; absent means 0).
fn int(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

/// The first key after every key starting with `prefix` (etcd's `range_end` for a prefix).
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn parse_kvs(v: &Value) -> L3Result<Vec<Kv>> {
    let Some(kvs) = v.get("kvs").and_then(Value::as_array) else {
        return Ok(Vec::new());
    };
    kvs.iter()
        .map(|kv| {
            Ok(Kv {
                key: unb64(&kv["key"])?,
                value: unb64(&kv["value"])?,
                create_revision: int(&kv["create_revision"]),
                mod_revision: int(&kv["mod_revision"]),
            })
        })
        .collect()
}

impl Etcd {
    /// Parses endpoints: `etcd://h:p;h:p` (Mooncake's locator), or `h:p,h:p` / `http://h:p`
    /// lists (etcd's own `--endpoints` form). `timeout` bounds each request on one member.
    pub fn parse(spec: &str, timeout: Duration) -> L3Result<Self> {
        let body = spec.strip_prefix("etcd://").unwrap_or(spec);
        let mut endpoints = Vec::new();
        for part in body.split([';', ',']) {
            let p = part.trim();
            if p.is_empty() {
                continue;
            }
            let hp = p
                .strip_prefix("http://")
                .unwrap_or(p)
                .trim_end_matches('/')
                .to_string();
            if hp.starts_with("https://") || hp.contains('/') || !hp.contains(':') {
                return Err(L3Error::InvalidParams(format!(
                    "etcd endpoint {p:?}: expected host:port or http://host:port"
                )));
            }
            endpoints.push(hp);
        }
        if endpoints.is_empty() {
            return Err(L3Error::InvalidParams(format!(
                "no etcd endpoint in {spec:?}"
            )));
        }
        if timeout.is_zero() {
            return Err(L3Error::InvalidParams("etcd timeout must be > 0".into()));
        }
        Ok(Etcd {
            endpoints,
            timeout,
            preferred: AtomicUsize::new(0),
        })
    }

    /// The endpoints, as given.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Tries every member in turn from the preferred one; the first reply wins.
    pub(crate) fn call(&self, path: &str, body: &Value) -> L3Result<Value> {
        self.post(path, body)
    }

    fn post(&self, path: &str, body: &Value) -> L3Result<Value> {
        let n = self.endpoints.len();
        let first = self.preferred.load(Ordering::Relaxed) % n;
        let mut last = String::new();
        for i in 0..n {
            let at = (first + i) % n;
            match self.post_one(&self.endpoints[at], path, body) {
                Ok(v) => {
                    self.preferred.store(at, Ordering::Relaxed);
                    return Ok(v);
                }
                Err(e) => last = format!("{}: {e}", self.endpoints[at]),
            }
        }
        Err(unavailable(format!("no member answered {path}: {last}")))
    }

    fn post_one(&self, hostport: &str, path: &str, body: &Value) -> Result<Value, String> {
        let addr: SocketAddr = hostport
            .to_socket_addrs()
            .map_err(|e| e.to_string())?
            .next()
            .ok_or("no address")?;
        let mut s = TcpStream::connect_timeout(&addr, self.timeout).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(self.timeout))
            .and_then(|_| s.set_write_timeout(Some(self.timeout)))
            .map_err(|e| e.to_string())?;
        let _ = s.set_nodelay(true);
        let payload = body.to_string();
        let req = format!(
            "POST {path} HTTP/1.0\r\nHost: {hostport}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{payload}",
            payload.len()
        );
        s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        s.take(64 << 20)
            .read_to_end(&mut out)
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out);
        let (head, body) = text.split_once("\r\n\r\n").ok_or("truncated reply")?;
        let status = head.split_whitespace().nth(1).unwrap_or("");
        let v: Value = serde_json::from_str(body.trim()).map_err(|e| format!("{e}: {body}"))?;
        if status != "200" {
            let msg = v
                .get("error")
                .or_else(|| v.get("message"))
                .and_then(Value::as_str)
                .unwrap_or("");
            return Err(format!("HTTP {status}: {msg}"));
        }
        // A streamed call (keep-alive) wraps its one reply in `result`.
        Ok(v.get("result").cloned().unwrap_or(v))
    }

    /// Grants a lease of `ttl_s` seconds; returns its id.
    pub fn grant(&self, ttl_s: u64) -> L3Result<i64> {
        let v = self.post("/v3/lease/grant", &json!({ "TTL": ttl_s.to_string() }))?;
        match int(&v["ID"]) {
            0 => Err(unavailable(format!("lease grant refused: {v}"))),
            id => Ok(id),
        }
    }

    /// Renews a lease; returns its remaining TTL in seconds (0: the lease is gone).
    pub fn keep_alive(&self, lease: i64) -> L3Result<i64> {
        let v = self.post("/v3/lease/keepalive", &json!({ "ID": lease.to_string() }))?;
        Ok(int(&v["TTL"]))
    }

    /// Revokes a lease (its keys go with it).
    pub fn revoke(&self, lease: i64) -> L3Result<()> {
        self.post("/v3/lease/revoke", &json!({ "ID": lease.to_string() }))
            .map(|_| ())
    }

    /// The key, if it exists.
    pub fn get(&self, key: &[u8]) -> L3Result<Option<Kv>> {
        let v = self.post("/v3/kv/range", &json!({ "key": b64(key) }))?;
        Ok(parse_kvs(&v)?.into_iter().next())
    }

    /// Every key starting with `prefix`, in key order, and the store's revision.
    pub fn get_prefix(&self, prefix: &[u8]) -> L3Result<(Vec<Kv>, i64)> {
        let v = self.post(
            "/v3/kv/range",
            &json!({ "key": b64(prefix), "range_end": b64(&prefix_end(prefix)) }),
        )?;
        Ok((parse_kvs(&v)?, int(&v["header"]["revision"])))
    }

    /// Puts a value (no lease), unconditionally.
    pub fn put(&self, key: &[u8], value: &[u8]) -> L3Result<()> {
        self.post(
            "/v3/kv/put",
            &json!({ "key": b64(key), "value": b64(value) }),
        )
        .map(|_| ())
    }

    /// A transaction: `ops` if every comparison holds. Returns whether it did, the
    /// revision after it, and on failure the current value of `read_on_failure` (if any).
    pub fn txn(
        &self,
        compare: &[Compare],
        ops: &[Op],
        read_on_failure: Option<&[u8]>,
    ) -> L3Result<(bool, i64, Option<Kv>)> {
        let cmp: Vec<Value> = compare
            .iter()
            .map(|c| match c {
                Compare::CreateRevision(k, r) => json!({
                    "target": "CREATE", "key": b64(k), "create_revision": r.to_string()
                }),
            })
            .collect();
        let success: Vec<Value> = ops
            .iter()
            .map(|o| match o {
                Op::Put { key, value, lease } => json!({ "request_put": {
                    "key": b64(key), "value": b64(value), "lease": lease.to_string()
                }}),
                Op::DeleteRange { from, to } => json!({ "request_delete_range": {
                    "key": b64(from), "range_end": b64(to)
                }}),
            })
            .collect();
        let failure: Vec<Value> = read_on_failure
            .map(|k| vec![json!({ "request_range": { "key": b64(k) } })])
            .unwrap_or_default();
        let v = self.post(
            "/v3/kv/txn",
            &json!({ "compare": cmp, "success": success, "failure": failure }),
        )?;
        let ok = v["succeeded"].as_bool().unwrap_or(false);
        let rev = int(&v["header"]["revision"]);
        let mut current = None;
        if !ok && let Some(r) = v["responses"].as_array().and_then(|a| a.first()) {
            current = parse_kvs(&r["response_range"])?.into_iter().next();
        }
        Ok((ok, rev, current))
    }

    /// Drops the history before `revision` (keeps etcd's database bounded).
    pub fn compact(&self, revision: i64) -> L3Result<()> {
        self.post(
            "/v3/kv/compaction",
            &json!({ "revision": revision.to_string() }),
        )
        .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_in_both_forms_and_bad_ones_are_refused() {
        let t = Duration::from_secs(1);
        let e = Etcd::parse("etcd://127.0.0.1:1;127.0.0.1:2", t).unwrap();
        assert_eq!(e.endpoints(), ["127.0.0.1:1", "127.0.0.1:2"]);
        let e = Etcd::parse("http://a:1/,b:2", t).unwrap();
        assert_eq!(e.endpoints(), ["a:1", "b:2"]);
        for bad in ["", "etcd://", "https://a:1", "a", "a:1/x"] {
            assert!(
                matches!(Etcd::parse(bad, t), Err(L3Error::InvalidParams(_))),
                "{bad}"
            );
        }
        assert!(Etcd::parse("a:1", Duration::ZERO).is_err());
    }

    #[test]
    fn prefix_end_is_the_next_key() {
        assert_eq!(prefix_end(b"/a/"), b"/a0");
        assert_eq!(prefix_end(&[1, 0xff]), [2]);
        assert_eq!(prefix_end(&[0xff]), [0]);
    }
}
