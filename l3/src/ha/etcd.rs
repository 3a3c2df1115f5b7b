//! A blocking etcd v3 client for the HA layer, built on the `etcd-client` crate (etcd's gRPC
//! API over tonic).
//!
//! Why a blocking wrapper: every caller is synchronous — the settle log commits from a lock
//! guard's `Drop`, clients resolve the leader from a plain thread — and some run on a worker
//! thread of the tarpc server's tokio runtime, where `Runtime::block_on` panics. So the
//! async calls run on one small runtime of this module's own (one worker thread, built on
//! first use, never dropped), and the caller waits for the reply on a std channel: that
//! works from any thread, inside another runtime or not.
//!
//! Why one `etcd_client::Client` per member rather than one for the whole cluster: its
//! balanced channel spreads requests over the members and knows nothing of a member that
//! accepts connections but never answers — a SIGSTOPped etcd keeps its sockets, and
//! Mooncake's master hung on exactly that (issue #2253). Here each attempt on a member is
//! bounded by one deadline (connect and request together), and the members are tried in
//! turn starting with the one that answered last: a paused or killed member costs at most
//! one deadline, then the next member answers. No `require_leader`: during etcd's own
//! leader election a request waits on its member (up to the deadline) rather than failing on
//! every member at once — the settle log steps the master down when a commit fails.
//!
//! Every read is linearizable (etcd's default), so a read never returns a leader key older
//! than one another process has already seen.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use etcd_client as ec;
use parking_lot::Mutex;
use tokio::runtime::Runtime;

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

/// One member's client, connected on first use and dropped after a failure (the next
/// attempt connects afresh).
type Slot = Arc<Mutex<Option<ec::Client>>>;

/// The etcd cluster's client endpoints.
pub struct Etcd {
    endpoints: Vec<String>,
    timeout: Duration,
    /// Index of the endpoint that answered last (tried first).
    preferred: AtomicUsize,
    members: Vec<Slot>,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd")
            .field("endpoints", &self.endpoints)
            .field("timeout", &self.timeout)
            .field("preferred", &self.preferred)
            .finish_non_exhaustive()
    }
}

fn unavailable(what: String) -> L3Error {
    L3Error::Unavailable(format!("etcd: {what}"))
}

/// The runtime every call runs on: one worker thread is plenty for a few small requests at
/// a time, and being static it is never dropped (dropping a runtime on a runtime's worker
/// thread panics).
fn runtime() -> L3Result<&'static Runtime> {
    static RT: OnceLock<Result<Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvtier-etcd")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| L3Error::Internal(format!("etcd client runtime: {e}")))
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

fn kv(k: &ec::KeyValue) -> Kv {
    Kv {
        key: k.key().to_vec(),
        value: k.value().to_vec(),
        create_revision: k.create_revision(),
        mod_revision: k.mod_revision(),
    }
}

fn revision(h: Option<&ec::ResponseHeader>) -> i64 {
    h.map_or(0, ec::ResponseHeader::revision)
}

/// What etcd-client reports when a keep-alive's reply has TTL 0 (the lease is gone).
fn lease_not_found(e: &ec::Error) -> bool {
    matches!(e, ec::Error::LeaseKeepAliveError(m) if m == "lease not found")
}

/// Why an etcd endpoint was refused: it names the endpoint as given (issue 33: before,
/// `host:notaport`, `127.0.0.1:99999` or `[::1` were taken, and a master campaigned on them
/// silently forever).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("etcd endpoint {endpoint:?}: {why}")]
pub struct EndpointError {
    /// The endpoint as given.
    pub endpoint: String,
    /// What is wrong with it.
    pub why: String,
}

impl From<EndpointError> for L3Error {
    fn from(e: EndpointError) -> Self {
        L3Error::InvalidParams(e.to_string())
    }
}

/// Whether `h` is a DNS host name: dot-separated labels of 1..=63 ASCII letters, digits and
/// '-' (not at either end), 253 bytes at most.
fn dns_name(h: &str) -> bool {
    h.len() <= 253
        && h.split('.').all(|l| {
            (1..=63).contains(&l.len())
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// One endpoint, `host:port` or `http://host:port[/]`, as the client dials it (`host:port`):
/// the host an IPv4 address, a bracketed IPv6 address or a DNS name, the port 1..=65535.
pub fn parse_endpoint(p: &str) -> Result<String, EndpointError> {
    let bad = |why: String| EndpointError {
        endpoint: p.to_string(),
        why,
    };
    let hp = p.strip_prefix("http://").unwrap_or(p);
    let hp = hp.strip_suffix('/').unwrap_or(hp);
    if let Some((scheme, _)) = hp.split_once("://") {
        return Err(bad(format!(
            "scheme {scheme:?}: only http:// (plain, no TLS) is spoken"
        )));
    }
    if hp.contains('/') {
        return Err(bad(
            "expected host:port or http://host:port, without a path".into(),
        ));
    }
    let (host, port) = if let Some(rest) = hp.strip_prefix('[') {
        let (h, after) = rest
            .split_once(']')
            .ok_or_else(|| bad("'[' of an IPv6 address is not closed".into()))?;
        if h.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(bad(format!("{h:?} is not an IPv6 address")));
        }
        let port = after
            .strip_prefix(':')
            .ok_or_else(|| bad("expected [IPv6]:port".into()))?;
        (h, port)
    } else {
        let (h, port) = hp
            .rsplit_once(':')
            .ok_or_else(|| bad("expected host:port (no port)".into()))?;
        if h.contains(':') {
            return Err(bad("an IPv6 address goes in brackets: [addr]:port".into()));
        }
        if h.parse::<std::net::Ipv4Addr>().is_err() && !dns_name(h) {
            return Err(bad(format!(
                "host {h:?} is neither an IP address nor a DNS name"
            )));
        }
        (h, port)
    };
    match port.parse::<u16>() {
        Ok(n) if n > 0 => {}
        _ => {
            return Err(bad(format!(
                "port {port:?} is not a number from 1 to 65535"
            )));
        }
    }
    debug_assert!(!host.is_empty());
    Ok(hp.to_string())
}

impl Etcd {
    /// Parses endpoints: `etcd://h:p;h:p` (Mooncake's locator), or `h:p,h:p` / `http://h:p`
    /// lists (etcd's own `--endpoints` form). Each is checked by [`parse_endpoint`] (a
    /// typed -600 naming the first bad one). `timeout` bounds each request on one member.
    pub fn parse(spec: &str, timeout: Duration) -> L3Result<Self> {
        let body = spec.strip_prefix("etcd://").unwrap_or(spec);
        let mut endpoints = Vec::new();
        for part in body.split([';', ',']) {
            let p = part.trim();
            if p.is_empty() {
                continue;
            }
            endpoints.push(parse_endpoint(p)?);
        }
        if endpoints.is_empty() {
            return Err(L3Error::InvalidParams(format!(
                "no etcd endpoint in {spec:?}"
            )));
        }
        if timeout.is_zero() {
            return Err(L3Error::InvalidParams("etcd timeout must be > 0".into()));
        }
        let members = endpoints.iter().map(|_| Slot::default()).collect();
        Ok(Etcd {
            endpoints,
            timeout,
            preferred: AtomicUsize::new(0),
            members,
        })
    }

    /// The endpoints, as given.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Runs `op` on every member in turn from the preferred one; the first reply wins.
    fn call<T, F, Fut>(&self, what: &str, op: F) -> L3Result<T>
    where
        T: Send + 'static,
        F: Fn(ec::Client) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<T, ec::Error>> + Send + 'static,
    {
        let rt = runtime()?;
        let n = self.endpoints.len();
        let first = self.preferred.load(Ordering::Relaxed) % n;
        let mut last = String::new();
        for i in 0..n {
            let at = (first + i) % n;
            match self.once(rt, at, op.clone()) {
                Ok(v) => {
                    self.preferred.store(at, Ordering::Relaxed);
                    return Ok(v);
                }
                Err(e) => {
                    *self.members[at].lock() = None;
                    last = format!("{}: {e}", self.endpoints[at]);
                }
            }
        }
        Err(unavailable(format!("no member answered {what}: {last}")))
    }

    /// One attempt on member `at`, connect included, bounded by the deadline.
    fn once<T, F, Fut>(&self, rt: &Runtime, at: usize, op: F) -> Result<T, String>
    where
        T: Send + 'static,
        F: FnOnce(ec::Client) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, ec::Error>> + Send + 'static,
    {
        let slot = self.members[at].clone();
        let url = format!("http://{}", self.endpoints[at]);
        let deadline = self.timeout;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        rt.spawn(async move {
            let attempt = async {
                let cached = slot.lock().clone();
                let client = match cached {
                    Some(c) => c,
                    None => {
                        let opts = ec::ConnectOptions::new()
                            .with_connect_timeout(deadline)
                            .with_timeout(deadline);
                        let c = ec::Client::connect([url], Some(opts)).await?;
                        *slot.lock() = Some(c.clone());
                        c
                    }
                };
                op(client).await
            };
            let r = match tokio::time::timeout(deadline, attempt).await {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(_) => Err(format!("no reply within {deadline:?}")),
            };
            let _ = tx.send(r);
        });
        // The task always replies within the deadline; the margin only guards against a
        // runtime that no longer runs (e.g. in a forked child).
        match rx.recv_timeout(deadline * 2 + Duration::from_millis(100)) {
            Ok(r) => r,
            Err(e) => Err(format!("etcd client runtime: {e}")),
        }
    }

    /// Grants a lease of `ttl_s` seconds; returns its id.
    pub fn grant(&self, ttl_s: u64) -> L3Result<i64> {
        let ttl = i64::try_from(ttl_s)
            .map_err(|_| L3Error::InvalidParams(format!("lease TTL {ttl_s}s is too long")))?;
        let id = self.call("lease grant", move |mut c| async move {
            Ok(c.lease_grant(ttl, None).await?.id())
        })?;
        match id {
            0 => Err(unavailable("lease grant refused".into())),
            id => Ok(id),
        }
    }

    /// Renews a lease; returns its remaining TTL in seconds (0: the lease is gone).
    ///
    /// etcd-client's keep-alive stream sends one renewal and reads its reply when it opens
    /// (refusing a TTL of 0 as "lease not found"); one more renewal on the stream, sent and
    /// read, gives the remaining TTL. Both happen within the one deadline.
    pub fn keep_alive(&self, lease: i64) -> L3Result<i64> {
        self.call("lease keep-alive", move |mut c| async move {
            let (mut keeper, mut replies) = match c.lease_keep_alive(lease).await {
                Ok(open) => open,
                Err(e) if lease_not_found(&e) => return Ok(0),
                Err(e) => return Err(e),
            };
            keeper.keep_alive().await?;
            match replies.message().await? {
                Some(r) => Ok(r.ttl()),
                None => Err(ec::Error::LeaseKeepAliveError(
                    "keep-alive stream closed".into(),
                )),
            }
        })
    }

    /// Revokes a lease (its keys go with it).
    pub fn revoke(&self, lease: i64) -> L3Result<()> {
        self.call("lease revoke", move |mut c| async move {
            c.lease_revoke(lease).await.map(|_| ())
        })
    }

    /// The key, if it exists.
    pub fn get(&self, key: &[u8]) -> L3Result<Option<Kv>> {
        let key = key.to_vec();
        self.call("range", move |mut c| {
            let key = key.clone();
            async move { Ok(c.get(key, None).await?.kvs().first().map(kv)) }
        })
    }

    /// Every key starting with `prefix`, in key order, and the store's revision.
    pub fn get_prefix(&self, prefix: &[u8]) -> L3Result<(Vec<Kv>, i64)> {
        let prefix = prefix.to_vec();
        self.call("range", move |mut c| {
            let opts = ec::GetOptions::new().with_range(prefix_end(&prefix));
            let prefix = prefix.clone();
            async move {
                let r = c.get(prefix, Some(opts)).await?;
                Ok((r.kvs().iter().map(kv).collect(), revision(r.header())))
            }
        })
    }

    /// Puts a value (no lease), unconditionally.
    pub fn put(&self, key: &[u8], value: &[u8]) -> L3Result<()> {
        let (key, value) = (key.to_vec(), value.to_vec());
        self.call("put", move |mut c| {
            let (key, value) = (key.clone(), value.clone());
            async move { c.put(key, value, None).await.map(|_| ()) }
        })
    }

    /// A transaction: `ops` if every comparison holds. Returns whether it did, the
    /// revision after it, and on failure the current value of `read_on_failure` (if any).
    pub fn txn(
        &self,
        compare: &[Compare],
        ops: &[Op],
        read_on_failure: Option<&[u8]>,
    ) -> L3Result<(bool, i64, Option<Kv>)> {
        let when: Vec<ec::Compare> = compare
            .iter()
            .map(|c| match c {
                Compare::CreateRevision(k, r) => {
                    ec::Compare::create_revision(k.clone(), ec::CompareOp::Equal, *r)
                }
            })
            .collect();
        let then: Vec<ec::TxnOp> = ops
            .iter()
            .map(|o| match o {
                Op::Put { key, value, lease } => ec::TxnOp::put(
                    key.clone(),
                    value.clone(),
                    Some(ec::PutOptions::new().with_lease(*lease)),
                ),
                Op::DeleteRange { from, to } => ec::TxnOp::delete(
                    from.clone(),
                    Some(ec::DeleteOptions::new().with_range(to.clone())),
                ),
            })
            .collect();
        let otherwise: Vec<ec::TxnOp> = read_on_failure
            .map(|k| vec![ec::TxnOp::get(k.to_vec(), None)])
            .unwrap_or_default();
        let txn = ec::Txn::new().when(when).and_then(then).or_else(otherwise);
        self.call("txn", move |mut c| {
            let txn = txn.clone();
            async move {
                let r = c.txn(txn).await?;
                let ok = r.succeeded();
                let mut current = None;
                if !ok && let Some(ec::TxnOpResponse::Get(g)) = r.op_responses().first() {
                    current = g.kvs().first().map(kv);
                }
                Ok((ok, revision(r.header()), current))
            }
        })
    }

    /// Drops the history before `revision` (keeps etcd's database bounded).
    pub fn compact(&self, revision: i64) -> L3Result<()> {
        self.call("compaction", move |mut c| async move {
            c.compact(revision, None).await.map(|_| ())
        })
    }

    /// This member's id and the raft leader's id (etcd's maintenance status).
    pub fn status(&self) -> L3Result<(u64, u64)> {
        self.call("status", |mut c| async move {
            let s = c.status().await?;
            Ok((s.header().map_or(0, |h| h.member_id()), s.leader()))
        })
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
        let e = Etcd::parse("[::1]:2379;http://etcd-0.example.com:2379/;10.0.0.1:1", t).unwrap();
        assert_eq!(
            e.endpoints(),
            ["[::1]:2379", "etcd-0.example.com:2379", "10.0.0.1:1"]
        );
    }

    /// Issue 33: each of these was accepted, and a master campaigned on it forever.
    #[test]
    fn an_endpoint_that_cannot_work_is_a_typed_error_naming_it() {
        for bad in [
            "host:notaport",
            "127.0.0.1:99999",
            "127.0.0.1:0",
            "127.0.0.1:",
            ":2379",
            "[::1",
            "[::1]",
            "[::1]:",
            "[nope]:1",
            "::1:2379",
            "bad_host!:1",
            "-a:1",
            "a..b:1",
            "ftp://a:1",
            "http://",
        ] {
            let e = parse_endpoint(bad).unwrap_err();
            assert_eq!(e.endpoint, bad);
            let l3: L3Error =
                Etcd::parse(&format!("127.0.0.1:1,{bad}"), Duration::from_secs(1)).unwrap_err();
            assert!(
                matches!(&l3, L3Error::InvalidParams(m) if m.contains(&format!("etcd endpoint {bad:?}"))),
                "{bad}: {l3}"
            );
        }
    }

    #[test]
    fn prefix_end_is_the_next_key() {
        assert_eq!(prefix_end(b"/a/"), b"/a0");
        assert_eq!(prefix_end(&[1, 0xff]), [2]);
        assert_eq!(prefix_end(&[0xff]), [0]);
    }
}
