//! Tenant quotas kept in etcd (`/kvtier/<cluster>/tenants`), so every leader enforces the
//! same caps after a failover.
//!
//! Why: `--tenant-quota` is a flag of one master; a standby started without it (or with
//! other values) would take over and let a capped tenant take the whole cache. The key is
//! written by a leader that was given the flags (a txn fenced on its epoch, like the
//! settles: a deposed master cannot overwrite it) and read by a leader that was not.
//!
//! Format: one `NAME=BYTES` line per tenant, the flag's own syntax, so the key is readable
//! with `etcdctl get`. A value that does not parse is refused (typed error, the master steps
//! down and tries again), never half applied.

use std::collections::BTreeMap;

use super::election::LeaderLease;
use super::etcd::{Compare, Op};
use crate::error::{L3Error, L3Result};
use crate::types::Tenant;

/// Encodes quotas as `NAME=BYTES` lines.
pub fn encode(q: &BTreeMap<String, u64>) -> Vec<u8> {
    q.iter()
        .map(|(n, b)| format!("{n}={b}\n"))
        .collect::<String>()
        .into_bytes()
}

/// Decodes `NAME=BYTES` lines (tenant names checked as `Tenant::new` does).
pub fn decode(v: &[u8]) -> L3Result<BTreeMap<String, u64>> {
    let bad = |why: String| L3Error::Internal(format!("etcd tenant quotas are corrupt: {why}"));
    let text = std::str::from_utf8(v).map_err(|e| bad(e.to_string()))?;
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        let (n, b) = line
            .rsplit_once('=')
            .ok_or_else(|| bad(format!("{line:?}")))?;
        Tenant::new(n).map_err(|e| bad(e.to_string()))?;
        let b = b
            .parse::<u64>()
            .map_err(|e| bad(format!("{line:?}: {e}")))?;
        out.insert(n.to_string(), b);
    }
    Ok(out)
}

/// The quotas this leader enforces: its own flags when it was given any (then written to
/// etcd, fenced on its epoch), else the ones a previous leader left in etcd.
pub fn settle_quotas(
    lease: &LeaderLease,
    flags: &BTreeMap<String, u64>,
) -> L3Result<BTreeMap<String, u64>> {
    let key = lease.keys().tenants.clone();
    if flags.is_empty() {
        return match lease.etcd().get(&key)? {
            Some(kv) => decode(&kv.value),
            None => Ok(BTreeMap::new()),
        };
    }
    let (ok, _, _) = lease.etcd().txn(
        &[Compare::CreateRevision(
            lease.keys().leader.clone(),
            lease.epoch() as i64,
        )],
        &[Op::Put {
            key,
            value: encode(flags),
            lease: 0,
        }],
        None,
    )?;
    if !ok {
        lease.lose();
        return Err(L3Error::NotLeader(format!(
            "epoch {} is over before it could write the tenant quotas",
            lease.epoch()
        )));
    }
    Ok(flags.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn quotas_round_trip(q in proptest::collection::btree_map("[a-z][a-z0-9_-]{0,15}", any::<u64>(), 0..8)) {
            prop_assert_eq!(decode(&encode(&q)).unwrap(), q);
        }

        #[test]
        fn any_bytes_decode_or_are_refused_without_panic(v in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode(&v);
        }
    }

    #[test]
    fn a_malformed_value_is_a_typed_error() {
        for bad in [&b"a"[..], b"a=x", b"=5", b"\xff=1", b"a/b=1"] {
            assert!(matches!(decode(bad), Err(L3Error::Internal(_))), "{bad:?}");
        }
    }
}
