//! A client's global segment: Mooncake's model, where every client mounts
//! `global_segment_size` bytes of its own memory into the cluster.
//!
//! Why: in Mooncake the objects a cluster holds live in the segments its clients contribute;
//! when a client closes, its segment is unmounted and the objects placed in it are gone
//! (checked against a real master: after one of two clients closes, the keys that landed in
//! its segment read as missing). kvtier's embedded store models that with the master's own
//! segment table: each compatible client mounts a segment of `global_segment_size` bytes
//! under a client id of its own, pings it (a silent client is declared dead after the
//! store's `client_ttl`, as in Mooncake), and unmounts it on `close`. Placement is the
//! master's (the segment with the most free space), so, as in Mooncake, an object may land
//! in any contributing client's segment.
//!
//! The segment's bytes live in the store's process (the embedded store), not in the client's
//! own mapping: same lifetime and capacity semantics, no cross-process memory.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{RecvTimeoutError, SyncSender, sync_channel};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use kvtier_l3::{ClientId, L3Error, L3Result, L3Store, SegmentId};

/// How often a contributing client pings (well inside the default 10 s client TTL).
const PING_EVERY: Duration = Duration::from_millis(500);

/// Segment id → the name of the client that mounted it (its `get_hostname()`), for replica
/// descriptors and `batch_replica_clear(keys, segment_name)`.
fn names() -> &'static Mutex<HashMap<u64, String>> {
    static N: OnceLock<Mutex<HashMap<u64, String>>> = OnceLock::new();
    N.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The name of a segment: its client's hostname if a client of this process mounted it,
/// `"embedded"` for an embedded store's own segment, else `"segment-<id>"`.
pub(crate) fn segment_name(seg: SegmentId) -> String {
    if let Some(n) = names().lock().get(&seg.0) {
        return n.clone();
    }
    if seg == kvtier_l3::store::LOCAL_SEGMENT {
        "embedded".to_string()
    } else {
        format!("segment-{}", seg.0)
    }
}

/// The segment a Mooncake segment name stands for: a client's `get_hostname()` (a segment
/// mounted by this process), `"embedded"`, or `"segment-<id>"` as [`segment_name`] reports
/// them. None for any other name (Mooncake's -600 for an unknown segment).
pub(crate) fn segment_by_name(name: &str) -> Option<SegmentId> {
    if let Some((&id, _)) = names().lock().iter().find(|(_, n)| n.as_str() == name) {
        return Some(SegmentId(id));
    }
    if name == "embedded" {
        return Some(kvtier_l3::store::LOCAL_SEGMENT);
    }
    let id = name.strip_prefix("segment-")?;
    // Only the canonical spelling (no sign, no leading zeros) names a segment.
    id.parse::<u64>()
        .ok()
        .filter(|v| v.to_string() == id)
        .map(SegmentId)
}

/// Client and segment ids unique in this process (0 is the embedded store's own).
fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    (u64::from(std::process::id()) << 32) | NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A mounted segment, unmounted (its objects dropped) when this is dropped.
pub(crate) struct Contribution {
    store: Arc<dyn L3Store>,
    client: ClientId,
    segment: SegmentId,
    stop: Option<SyncSender<()>>,
    pinger: Option<JoinHandle<()>>,
}

impl Contribution {
    /// Mounts `bytes` bytes named `name` into `store` and starts pinging for it.
    pub(crate) fn mount(store: Arc<dyn L3Store>, bytes: u64, name: &str) -> L3Result<Self> {
        let id = next_id();
        let (client, segment) = (ClientId(id), SegmentId(id));
        store.mount_segment(client, segment, bytes)?;
        names().lock().insert(id, name.to_string());
        let (tx, rx) = sync_channel::<()>(1);
        let s = store.clone();
        let pinger = std::thread::Builder::new()
            .name("kvtier-mc-ping".into())
            .spawn(move || {
                while let Err(RecvTimeoutError::Timeout) = rx.recv_timeout(PING_EVERY) {
                    // A failed ping changes nothing here: the segment is remounted by no one,
                    // exactly as a Mooncake client that lost its master.
                    let _ = s.ping(client);
                }
            })
            .map_err(|e| L3Error::Internal(format!("spawn pinger: {e}")));
        let mut c = Contribution {
            store,
            client,
            segment,
            stop: Some(tx),
            pinger: None,
        };
        c.pinger = Some(pinger?);
        Ok(c)
    }
}

impl Drop for Contribution {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(h) = self.pinger.take() {
            kvtier_l3::error::join_logged("segment pinger", h);
        }
        // Already gone if the store declared this client dead: nothing left to unmount.
        kvtier_l3::error::best_effort(
            "unmount a compat client's segment",
            self.store.unmount_segment(self.client, self.segment),
        );
        names().lock().remove(&self.segment.0);
    }
}
