//! A storage event stream's configuration — where it publishes, which namespaces it carries,
//! how block hashes go on the wire — and the typed errors of a bad one (the module docs of
//! [`super`] say what the stream publishes).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How block hashes go on the wire.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BlockHashes {
    /// vLLM's default: the page hash's low 64 bits as an unsigned integer.
    #[default]
    Int64,
    /// The whole 32-byte page hash.
    Bytes,
}

/// The store's event stream (`kvtier-l3 --kv-events …`; [`crate::StoreConfig::kv_events`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEventsConfig {
    /// The PUB socket: `tcp://HOST:PORT` (`PORT` may be `*`: a free one) or `ipc://PATH`.
    pub endpoint: String,
    /// The replay socket (gap recovery, snapshots); `None`: none.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Publish only keys of these namespaces (empty: every namespace).
    #[serde(default)]
    pub namespaces: Vec<String>,
    /// The topic frame of every batch, live and replayed. `None` (the default): the namespace
    /// when the stream carries exactly one, else empty. A router told the topic it expects
    /// (`kvtier-router --storage …,topic=NS`) refuses batches of another, so one model's
    /// stream is never folded in as another's ([`KvEventsConfig::wire_topic`]).
    #[serde(default)]
    pub topic: Option<String>,
    /// The `block_size` field of `BlockStored` (tokens per page). The store does not know
    /// it; routers that key by block hash (kvtier's `--keys engine`) ignore it.
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// Parts a page needs under one tenant and namespace to be published as stored: 1 (the
    /// default) publishes a page while any of its objects is readable; the engines'
    /// tensor-parallel ranks × KV groups publishes only pages an engine can load whole.
    #[serde(default = "default_parts_per_page")]
    pub parts_per_page: u32,
    /// Batches the replay socket keeps.
    #[serde(default = "default_buffer_steps")]
    pub buffer_steps: usize,
    /// How often accumulated changes are published (one batch).
    #[serde(default = "default_flush_interval")]
    pub flush_interval: Duration,
    #[serde(default)]
    pub block_hashes: BlockHashes,
    /// How batches leave the store: sockets (the default) or taken by its owner.
    #[serde(default)]
    pub delivery: Delivery,
}

/// How the store's batches reach a router.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Delivery {
    /// A ZMQ PUB socket (and the replay socket, if configured), flushed by a thread every
    /// `flush_interval`: what a deployment's routers subscribe to.
    #[default]
    Sockets,
    /// No sockets and no thread: the store's owner takes each batch, in order, with
    /// [`KvEventsHandle::take_batch`] and hands it to a router in the same process. For an
    /// embedding on its own clock (the simulator), where a flushing thread would make the
    /// router's view depend on wall time.
    Pull,
}

fn default_block_size() -> u32 {
    16
}
fn default_parts_per_page() -> u32 {
    1
}
fn default_buffer_steps() -> usize {
    10_000
}
fn default_flush_interval() -> Duration {
    Duration::from_millis(10)
}

impl KvEventsConfig {
    /// Publishes on `endpoint`, with defaults for the rest (no replay socket).
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            namespaces: Vec::new(),
            topic: None,
            block_size: default_block_size(),
            parts_per_page: default_parts_per_page(),
            buffer_steps: default_buffer_steps(),
            flush_interval: default_flush_interval(),
            block_hashes: BlockHashes::default(),
            delivery: Delivery::Sockets,
        }
    }

    /// No sockets: the owner takes the batches ([`Delivery::Pull`]).
    pub fn pull() -> Self {
        Self {
            delivery: Delivery::Pull,
            ..Self::new(String::new())
        }
    }

    /// A stream of one namespace's pages, on `endpoint`, its topic the namespace (one of
    /// several streams of a store shared by several models: `kvtier-l3 --kv-events-stream`).
    pub fn for_namespace(namespace: impl Into<String>, endpoint: impl Into<String>) -> Self {
        Self {
            namespaces: vec![namespace.into()],
            ..Self::new(endpoint)
        }
    }

    /// The topic frame published: [`KvEventsConfig::topic`], or the stream's namespace when
    /// it carries exactly one, or empty.
    pub fn wire_topic(&self) -> String {
        match (&self.topic, self.namespaces.as_slice()) {
            (Some(t), _) => t.clone(),
            (None, [only]) => only.clone(),
            (None, _) => String::new(),
        }
    }

    /// Checks every field (what [`crate::StoreConfig::validate`] runs).
    pub fn validate(&self) -> Result<(), KvEventsError> {
        match self.delivery {
            Delivery::Sockets => {
                check_endpoint(&self.endpoint)?;
                if let Some(r) = &self.replay_endpoint {
                    check_endpoint(r)?;
                }
            }
            Delivery::Pull => {
                if !self.endpoint.is_empty() || self.replay_endpoint.is_some() {
                    return Err(KvEventsError::Config(
                        "delivery \"pull\" binds no socket: leave endpoint and replay_endpoint empty"
                            .into(),
                    ));
                }
            }
        }
        for n in &self.namespaces {
            if n.is_empty() || n.contains(':') {
                return Err(KvEventsError::BadNamespace(n.clone()));
            }
        }
        if self.block_size == 0
            || self.parts_per_page == 0
            || self.buffer_steps == 0
            || self.flush_interval.is_zero()
        {
            return Err(KvEventsError::Config(
                "block_size, parts_per_page, buffer_steps and flush_interval must be positive"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// Checks a store's streams: each one's fields, and no two binding the same address.
pub fn validate_streams(streams: &[KvEventsConfig]) -> Result<(), KvEventsError> {
    let mut seen: Vec<&str> = Vec::new();
    for s in streams {
        s.validate()?;
        let eps = std::iter::once(s.endpoint.as_str()).chain(s.replay_endpoint.as_deref());
        for ep in eps.filter(|e| !e.is_empty() && !e.ends_with(":*")) {
            if seen.contains(&ep) {
                return Err(KvEventsError::Config(format!(
                    "{ep:?} is given to two streams: each stream binds its own sockets"
                )));
            }
            seen.push(ep);
        }
    }
    Ok(())
}

/// Why the event stream cannot start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvEventsError {
    /// Not `tcp://HOST:PORT` or `ipc://PATH`.
    #[error("{0:?}: a ZMQ endpoint is tcp://HOST:PORT (PORT 1 to 65535, or *) or ipc://PATH")]
    BadEndpoint(String),
    /// Empty, or holds `:` (the key grammar's separator).
    #[error("{0:?}: a key namespace is non-empty and holds no ':'")]
    BadNamespace(String),
    #[error("kv events: {0}")]
    Config(String),
    /// The sockets could not be bound (address in use, not local, ...).
    #[error("kv events: cannot publish: {0}")]
    Bind(String),
    /// [`KvEventsHandle::take_batch`] on a stream published on sockets: its batches belong
    /// to the subscribers.
    #[error(
        "kv events: the stream is published on sockets; only delivery \"pull\" hands batches to its owner"
    )]
    NotPull,
}

impl From<KvEventsError> for crate::L3Error {
    fn from(e: KvEventsError) -> Self {
        match e {
            KvEventsError::Bind(_) => crate::L3Error::Unavailable(e.to_string()),
            _ => crate::L3Error::InvalidParams(e.to_string()),
        }
    }
}

/// Checks a ZMQ endpoint's form: `tcp://HOST:PORT` or `ipc://PATH`.
pub fn check_endpoint(ep: &str) -> Result<(), KvEventsError> {
    let bad = || KvEventsError::BadEndpoint(ep.to_string());
    if let Some(path) = ep.strip_prefix("ipc://") {
        return if path.is_empty() { Err(bad()) } else { Ok(()) };
    }
    let rest = ep.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    let port_ok = port == "*" || port.parse::<u16>().is_ok_and(|p| p > 0);
    if host.is_empty() || !port_ok || host.chars().any(char::is_whitespace) {
        return Err(bad());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_checked() {
        for ok in [
            "tcp://127.0.0.1:5557",
            "tcp://*:5557",
            "tcp://127.0.0.1:*",
            "ipc:///tmp/x",
        ] {
            assert_eq!(check_endpoint(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "127.0.0.1:5557",
            "tcp://",
            "tcp://127.0.0.1",
            "tcp://127.0.0.1:0",
            "tcp://127.0.0.1:70000",
            "tcp://:5557",
            "http://127.0.0.1:80",
            "ipc://",
            "tcp://a b:1",
        ] {
            assert_eq!(
                check_endpoint(bad),
                Err(KvEventsError::BadEndpoint(bad.into())),
                "{bad}"
            );
        }
    }

    #[test]
    fn namespaces_and_limits_are_checked() {
        let mut c = KvEventsConfig::new("tcp://127.0.0.1:*");
        c.namespaces = vec!["a:b".into()];
        assert_eq!(c.validate(), Err(KvEventsError::BadNamespace("a:b".into())));
        c.namespaces = vec![String::new()];
        assert!(matches!(c.validate(), Err(KvEventsError::BadNamespace(_))));
        c.namespaces.clear();
        c.block_size = 0;
        assert!(matches!(c.validate(), Err(KvEventsError::Config(_))));
    }
}
