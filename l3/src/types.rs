//! Plain data types shared by the master, the SSD tier, the embedded store and the wire.
//!
//! Why: the embedded store and the tarpc service must speak exactly the same vocabulary
//! (replica descriptors, query results with lease deadlines, exist options), so they live
//! here once, serde-serialisable, with validation of everything a caller can send.
//!
//! Invariant kept here: a [`Tenant`] is valid by construction ([`Tenant::parse`] is its only
//! constructor, serde included), and an object key is checked at every entry point by
//! [`check_key`]; the rest of the crate may assume both are well formed. Both limits fit
//! the SSD record header (`ssd::bucket`), which refuses anything longer on its own.

use serde::{Deserialize, Serialize};

use crate::error::{L3Error, L3Result};

/// Longest key accepted (bytes). It fits the 16-bit key length of an SSD record header.
pub const MAX_KEY_LEN: usize = 4096;
/// Longest tenant name accepted (bytes). It fits the 16-bit tenant length of an SSD record
/// header.
pub const MAX_TENANT_LEN: usize = 256;
/// The bytes a tenant name may hold besides ASCII letters and digits.
pub const TENANT_PUNCTUATION: &str = "-_.:@+";

/// Which kind of name a [`NameError`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NameKind {
    /// A tenant name ([`Tenant`]).
    Tenant,
    /// An object key ([`validate_key`]).
    Key,
}

impl std::fmt::Display for NameKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NameKind::Tenant => "tenant name",
            NameKind::Key => "key",
        })
    }
}

/// Why a tenant name or a key was refused: the one typed error of name validation, on every
/// path (library, TCP, shared memory, node links, Python, Mooncake compat). As an
/// [`L3Error`] it is -600 (`InvalidParams`) for a tenant and -400 (`InvalidKey`) for a key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// Empty.
    #[error("{kind} is empty")]
    Empty {
        /// Tenant or key.
        kind: NameKind,
    },
    /// Longer than its limit ([`MAX_TENANT_LEN`], [`MAX_KEY_LEN`]).
    #[error("{kind} of {len} bytes is longer than the {max}-byte limit")]
    TooLong {
        /// Tenant or key.
        kind: NameKind,
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Holds a character it may not (tenant: anything but ASCII letters, digits and
    /// [`TENANT_PUNCTUATION`]; key: NUL).
    #[error("{kind} has {ch:?} at byte {at} ({allowed})")]
    BadChar {
        /// Tenant or key.
        kind: NameKind,
        /// The first character refused.
        ch: char,
        /// Its byte offset.
        at: usize,
        /// What is allowed.
        allowed: &'static str,
    },
}

impl From<NameError> for L3Error {
    fn from(e: NameError) -> Self {
        let kind = match &e {
            NameError::Empty { kind }
            | NameError::TooLong { kind, .. }
            | NameError::BadChar { kind, .. } => *kind,
        };
        match kind {
            NameKind::Tenant => L3Error::InvalidParams(e.to_string()),
            NameKind::Key => L3Error::InvalidKey(e.to_string()),
        }
    }
}

/// Checks that a name is 1..=`max` bytes.
fn check_len(kind: NameKind, name: &str, max: usize) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty { kind });
    }
    if name.len() > max {
        return Err(NameError::TooLong {
            kind,
            len: name.len(),
            max,
        });
    }
    Ok(())
}

/// A tenant namespace. Keys of different tenants never meet: every map in the master is
/// indexed by tenant first, so no operation can name another tenant's key.
///
/// [`Tenant::parse`] is the only way to make one, deserialisation included (serde goes
/// through it: a frame naming a bad tenant is malformed on every wire), so every `Tenant`
/// is 1..=[`MAX_TENANT_LEN`] bytes of ASCII letters, digits and [`TENANT_PUNCTUATION`]:
/// it fits an SSD record header, a path component, an etcd `NAME=BYTES` line and a log line.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String")]
pub struct Tenant(String);

impl Tenant {
    /// Validates and wraps a tenant name (the typed [`NameError`] says why not).
    pub fn parse(name: impl Into<String>) -> Result<Self, NameError> {
        let name = name.into();
        let kind = NameKind::Tenant;
        check_len(kind, &name, MAX_TENANT_LEN)?;
        if let Some((at, ch)) = name
            .char_indices()
            .find(|(_, c)| !(c.is_ascii_alphanumeric() || TENANT_PUNCTUATION.contains(*c)))
        {
            return Err(NameError::BadChar {
                kind,
                ch,
                at,
                allowed: "ASCII letters, digits and -_.:@+",
            });
        }
        Ok(Tenant(name))
    }

    /// [`Tenant::parse`] with its error as an [`L3Error`] (-600).
    pub fn new(name: impl Into<String>) -> L3Result<Self> {
        Ok(Self::parse(name)?)
    }

    /// The tenant's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Tenant {
    type Error = NameError;

    fn try_from(name: String) -> Result<Self, NameError> {
        Tenant::parse(name)
    }
}

/// Checks an object key: non-empty, ≤ [`MAX_KEY_LEN`] bytes, no NUL (the typed
/// [`NameError`] says why not).
pub fn check_key(key: &str) -> Result<(), NameError> {
    let kind = NameKind::Key;
    check_len(kind, key, MAX_KEY_LEN)?;
    if let Some(at) = key.find('\0') {
        return Err(NameError::BadChar {
            kind,
            ch: '\0',
            at,
            allowed: "anything but NUL",
        });
    }
    Ok(())
}

/// [`check_key`] with its error as an [`L3Error`] (-400).
pub fn validate_key(key: &str) -> L3Result<()> {
    Ok(check_key(key)?)
}

/// Identifier of a client (a process that mounts segments and pings the master).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ClientId(pub u64);

/// Identifier of a mounted memory segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SegmentId(pub u64);

/// A store node of a split deployment (`kvtier-l3 --role node`): who it is and where its
/// data channel listens. Replica descriptors handed out by a master carry it, so a client
/// reads (and writes) the bytes on the node directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NodeRef {
    /// The node's client id (it mounts its segment and pings under this id).
    pub id: ClientId,
    /// The node's data-channel address.
    pub addr: std::net::SocketAddr,
}

/// Where one copy of an object lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReplicaDescriptor {
    /// A DRAM copy in a memory segment; `alloc` names the allocation inside the segment.
    Memory {
        /// Segment holding the bytes.
        segment: SegmentId,
        /// Allocation id inside the segment (unique for the store's lifetime).
        alloc: u64,
        /// Object size in bytes.
        size: u64,
        /// The node holding the segment (None: the serving process itself holds it).
        node: Option<NodeRef>,
    },
    /// An SSD copy in a bucket file of a store node.
    Disk {
        /// Bucket id (file name) on the node.
        bucket: u64,
        /// Byte offset of the payload inside the bucket file.
        offset: u64,
        /// Object size in bytes.
        size: u64,
        /// CRC32C of the payload.
        crc: u32,
        /// The node holding the bucket file (None: the serving process itself).
        node: Option<NodeRef>,
    },
}

impl ReplicaDescriptor {
    /// The node holding this replica (None when the serving process holds it).
    pub fn node(&self) -> Option<NodeRef> {
        match self {
            ReplicaDescriptor::Memory { node, .. } | ReplicaDescriptor::Disk { node, .. } => *node,
        }
    }
}

/// Result of `GetReplicaList` / `BatchQuery`: replica descriptors plus the lease they hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueryResult {
    /// The key queried.
    pub key: String,
    /// Object size in bytes.
    pub size: u64,
    /// Replicas, memory ones first.
    pub replicas: Vec<ReplicaDescriptor>,
    /// Lease deadline in milliseconds on the store's monotonic clock ([`crate::clock`]).
    /// The descriptors may be used without another metadata lookup until then.
    pub lease_deadline_ms: u64,
}

/// Options of `ExistKey` / `BatchExistKey`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExistOptions {
    /// Promote SSD-only keys to DRAM asynchronously (seed 000).
    pub prefetch_to_memory: bool,
}

/// Options of a put.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutOptions {
    /// Soft-pin the object: evicted last, until the pin's TTL passes.
    pub soft_pin: bool,
    /// Wait until the SSD copy is durable before returning (only with an SSD tier in
    /// write-through mode). Returning `Ok` then means "acknowledged as persisted".
    pub wait_persisted: bool,
}

/// Most replicas one put may ask for (more is -600: a placement never has more failure
/// domains than nodes, and this bounds what one request can make the master do).
pub const MAX_REPLICA_NUM: u32 = 64;

/// Where a put's bytes go: the placement half of Mooncake's `ReplicateConfig` (its
/// `with_soft_pin` is [`PutOptions::soft_pin`], given when the put ends).
///
/// `replica_num` memory replicas are placed on distinct segments of distinct store nodes
/// (split deployment), best effort like Mooncake: with fewer live nodes (or fewer with room)
/// than asked, the put gets as many replicas as there are, at least one (-200 if none). The
/// embedded store and `--role both` place them the same way over the segments they hold (their
/// own and those clients mounted, one replica per segment owner): with their own segment alone
/// that is one replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicateConfig {
    /// Memory replicas wanted, 1 ..= [`MAX_REPLICA_NUM`] (Mooncake's default is 1).
    pub replica_num: u32,
}

impl Default for ReplicateConfig {
    fn default() -> Self {
        ReplicateConfig { replica_num: 1 }
    }
}

impl ReplicateConfig {
    /// A config asking for `n` replicas.
    pub fn replicas(n: u32) -> Self {
        ReplicateConfig { replica_num: n }
    }

    /// Checks `replica_num` (-600 when 0 or above [`MAX_REPLICA_NUM`]).
    pub fn validate(&self) -> L3Result<()> {
        if self.replica_num == 0 || self.replica_num > MAX_REPLICA_NUM {
            return Err(L3Error::InvalidParams(format!(
                "replica_num must be 1..={MAX_REPLICA_NUM}, got {}",
                self.replica_num
            )));
        }
        Ok(())
    }
}

/// What `PutStart` hands back: the writer's token and where to write.
///
/// On the wire a handle names one replica (`replica`): that is all a store node needs to
/// write and end its own copy, and it keeps the encoding of single-replica puts unchanged.
/// The other replicas of a replicated put (`extra_replicas`) travel beside the handle in the
/// reply of `batch_put_start_replicated` and are filled in by the client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutHandle {
    /// Tenant of the key.
    pub tenant: Tenant,
    /// The key.
    pub key: String,
    /// Object size in bytes.
    pub size: u64,
    /// Put token: `PutEnd`/`PutRevoke` must present it (a revoked writer cannot end a newer put).
    pub token: u64,
    /// The (first) memory replica to write.
    pub replica: ReplicaDescriptor,
    /// Epoch of the master that placed it (0 without etcd HA): another epoch's master
    /// refuses to end or revoke it (`EpochFenced`).
    pub epoch: u64,
    /// The other memory replicas of a replicated put, each on another node (not serialised:
    /// see the type's documentation).
    #[serde(skip)]
    pub extra_replicas: Vec<ReplicaDescriptor>,
}

impl PutHandle {
    /// Every memory replica to write, the first one first.
    pub fn replicas(&self) -> impl Iterator<Item = &ReplicaDescriptor> {
        std::iter::once(&self.replica).chain(&self.extra_replicas)
    }

    /// The handle a store node gets for one replica: that replica alone.
    pub fn for_replica(&self, r: &ReplicaDescriptor) -> PutHandle {
        PutHandle {
            tenant: self.tenant.clone(),
            key: self.key.clone(),
            size: self.size,
            token: self.token,
            replica: r.clone(),
            epoch: self.epoch,
            extra_replicas: Vec::new(),
        }
    }
}

/// What `Ping` answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClientStatus {
    /// Alive and known.
    Ok,
    /// Unknown or declared dead: the client must remount its segments.
    NeedRemount,
}

/// Which tier served a read (for metrics and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Tier {
    /// DRAM segment.
    Memory,
    /// SSD bucket.
    Disk,
}

/// Summary numbers of a store (for metrics, tests and benches).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreStats {
    /// Objects (complete) known to the master.
    pub objects: u64,
    /// Objects with a memory replica.
    pub mem_objects: u64,
    /// Bytes charged in memory segments (including pending puts): each replica's value, key
    /// and metadata ([`crate::charge`]), what the capacity bounds.
    pub mem_used_bytes: u64,
    /// Total capacity of mounted segments.
    pub mem_capacity_bytes: u64,
    /// Objects with a disk replica.
    pub disk_objects: u64,
    /// Bytes in live SSD bucket files where this process holds the SSD tier (embedded, a
    /// standalone server); a split deployment's master, whose nodes hold it, reports the bytes
    /// of the objects on their SSDs.
    pub disk_used_bytes: u64,
}

/// Object bytes on the wire: serialised as one byte string (`serde_bytes` style), sent from
/// a shared DRAM replica without copying it first, received as an owned vector.
#[derive(Debug, Clone)]
pub enum Blob {
    /// A DRAM replica's bytes (server side: no copy before serialisation).
    Shared(std::sync::Arc<[u8]>),
    /// Owned bytes (SSD reads, anything deserialised).
    Owned(Vec<u8>),
}

impl Blob {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Blob::Shared(a) => a,
            Blob::Owned(v) => v,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl PartialEq for Blob {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Serialize for Blob {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self.as_slice())
    }
}

impl<'de> Deserialize<'de> for Blob {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let b = serde_bytes::ByteBuf::deserialize(d)?;
        Ok(Blob::Owned(b.into_vec()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_names_follow_the_rules_and_say_why_not() {
        for ok in [
            "a",
            "model-x_tenant.7",
            "base.salt-0f",
            "u@host:1+2",
            &"t".repeat(256),
        ] {
            assert_eq!(Tenant::parse(ok).unwrap().as_str(), ok);
        }
        let kind = NameKind::Tenant;
        assert_eq!(Tenant::parse(""), Err(NameError::Empty { kind }));
        assert_eq!(
            Tenant::parse("x".repeat(70_000)),
            Err(NameError::TooLong {
                kind,
                len: 70_000,
                max: MAX_TENANT_LEN
            })
        );
        for (bad, ch, at) in [
            ("a/b", '/', 1),
            ("nul\0", '\0', 3),
            ("line\nq=1", '\n', 4),
            ("a b", ' ', 1),
            ("a=b", '=', 1),
            ("..\\x", '\\', 2),
            ("caf\u{e9}", '\u{e9}', 3),
        ] {
            match Tenant::parse(bad) {
                Err(NameError::BadChar {
                    kind: NameKind::Tenant,
                    ch: c,
                    at: a,
                    ..
                }) => assert_eq!((c, a), (ch, at), "{bad:?}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        // As an L3Error: -600, naming the rule.
        let e = Tenant::new("a/b").unwrap_err();
        assert_eq!(e.code(), crate::error::ErrorCode::InvalidParams);
        assert!(e.to_string().contains("tenant name"), "{e}");
    }

    #[test]
    fn keys_follow_the_rules_and_say_why_not() {
        assert!(check_key("any key/with \u{e9} and = signs").is_ok());
        assert!(check_key(&"k".repeat(MAX_KEY_LEN)).is_ok());
        let kind = NameKind::Key;
        assert_eq!(check_key(""), Err(NameError::Empty { kind }));
        assert!(matches!(
            check_key(&"k".repeat(MAX_KEY_LEN + 1)),
            Err(NameError::TooLong { .. })
        ));
        assert!(matches!(
            check_key("a\0"),
            Err(NameError::BadChar {
                ch: '\0',
                at: 1,
                ..
            })
        ));
        let e = validate_key("").unwrap_err();
        assert_eq!(e.code(), crate::error::ErrorCode::InvalidKey);
    }

    /// Deserialising goes through [`Tenant::parse`]: no wire can carry a bad tenant in.
    #[test]
    fn a_bad_tenant_does_not_deserialize() {
        for bad in ["", "a/b", "a\nb"] {
            let wire = bincode::serialize(bad).unwrap();
            let e = bincode::deserialize::<Tenant>(&wire).unwrap_err();
            assert!(e.to_string().contains("tenant name"), "{bad:?}: {e}");
        }
        let wire = bincode::serialize(&Tenant::parse("ok").unwrap()).unwrap();
        assert_eq!(wire, bincode::serialize("ok").unwrap());
        assert_eq!(
            bincode::deserialize::<Tenant>(&wire).unwrap().as_str(),
            "ok"
        );
    }
}
