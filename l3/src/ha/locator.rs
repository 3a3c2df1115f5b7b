//! How a client or a store node finds the master: a fixed address, or the leader of an etcd
//! HA cluster (`etcd://host:port;host:port[/CLUSTER]`, Mooncake's locator form), and the
//! epoch fence that refuses an older leader once a newer one was seen.
//!
//! Why the client reads etcd itself instead of only following redirects: a dead or paused
//! leader redirects nobody, and etcd knows the new leader the moment it is elected. Reads
//! are linearizable, and a leader's key is empty until it listens, so a resolved address is
//! always a master that was serving its epoch.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::election::{ClusterKeys, read_leader};
use super::etcd::Etcd;
use crate::error::{L3Error, L3Result};

/// The cluster name used when a locator names none.
pub const DEFAULT_CLUSTER: &str = "default";

/// Where the master is.
#[derive(Debug, Clone)]
pub enum Locator {
    /// One master at a fixed address.
    Fixed(SocketAddr),
    /// The leader of an etcd HA cluster.
    Etcd {
        /// The etcd members.
        etcd: Arc<Etcd>,
        /// The cluster's keys.
        keys: ClusterKeys,
    },
}

impl Locator {
    /// Parses `host:port` (a fixed master) or `etcd://h:p;h:p[/CLUSTER]`.
    pub fn parse(spec: &str) -> L3Result<Self> {
        let Some(rest) = spec.trim().strip_prefix("etcd://") else {
            return spec.trim().parse().map(Locator::Fixed).map_err(|e| {
                L3Error::InvalidParams(format!(
                    "master address {spec:?}: expected host:port or etcd://h:p;h:p[/CLUSTER] ({e})"
                ))
            });
        };
        let (members, cluster) = match rest.split_once('/') {
            Some((m, c)) => (m, c),
            None => (rest, DEFAULT_CLUSTER),
        };
        Ok(Locator::Etcd {
            etcd: Arc::new(Etcd::parse(members, Duration::from_millis(500))?),
            keys: ClusterKeys::new(cluster)?,
        })
    }

    /// The master's address and epoch (0 for a fixed address), waiting up to `wait` for an
    /// etcd cluster to have a published leader.
    pub fn resolve(&self, wait: Duration) -> L3Result<(SocketAddr, u64)> {
        let (etcd, keys) = match self {
            Locator::Fixed(a) => return Ok((*a, 0)),
            Locator::Etcd { etcd, keys } => (etcd, keys),
        };
        let deadline = Instant::now() + wait;
        loop {
            let why = match read_leader(etcd, keys) {
                Ok(Some(v)) => match v.addr {
                    Some(a) => return Ok((a, v.epoch)),
                    None => format!("the leader of epoch {} is not listening yet", v.epoch),
                },
                Ok(None) => "no master holds the leader key".to_string(),
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                return Err(L3Error::NotLeader(format!("no leader to follow: {why}")));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether the master moves (an etcd cluster): callers then re-resolve and retry.
    pub fn follows_leader(&self) -> bool {
        matches!(self, Locator::Etcd { .. })
    }
}

/// The highest master epoch seen: an older one is refused (its orders come from a master
/// that has been replaced).
#[derive(Debug, Default)]
pub struct EpochFence(AtomicU64);

impl EpochFence {
    /// Admits a master of `epoch` (raising the fence), or refuses an older one.
    pub fn admit(&self, epoch: u64) -> L3Result<()> {
        let seen = self.0.fetch_max(epoch, Ordering::AcqRel);
        if epoch < seen {
            return Err(L3Error::EpochFenced(format!(
                "a master of epoch {epoch} answered, but epoch {seen} was seen already"
            )));
        }
        Ok(())
    }

    /// The highest epoch seen.
    pub fn seen(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn locators_parse() {
        assert!(matches!(
            Locator::parse("127.0.0.1:5").unwrap(),
            Locator::Fixed(_)
        ));
        let Locator::Etcd { etcd, keys } = Locator::parse("etcd://a:1;b:2/c1").unwrap() else {
            panic!("not etcd")
        };
        assert_eq!(etcd.endpoints(), ["a:1", "b:2"]);
        assert_eq!(keys.leader, b"/kvtier/c1/leader");
        for bad in ["nope", "etcd://", "etcd://a:1/", "etcd://a:1/x y"] {
            assert!(Locator::parse(bad).is_err(), "{bad}");
        }
    }

    proptest! {
        /// Whatever order epochs arrive in, an epoch is admitted iff no larger one was
        /// admitted before it, and the fence ends at the maximum.
        #[test]
        fn the_fence_admits_exactly_the_non_decreasing_epochs(
            epochs in proptest::collection::vec(0u64..20, 0..50)
        ) {
            let f = EpochFence::default();
            let mut max = 0;
            for e in epochs {
                prop_assert_eq!(f.admit(e).is_ok(), e >= max);
                max = max.max(e);
            }
            prop_assert_eq!(f.seen(), max);
        }
    }
}
