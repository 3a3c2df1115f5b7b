//! Tenant quotas (`/kvtier/<cluster>/tenants`) and the digest of the shared-secret token
//! (`/kvtier/<cluster>/token`) kept in etcd, so every leader enforces the same caps and
//! refuses the same clients after a failover.
//!
//! Why: `--tenant-quota` is a flag of one master; a standby started without it (or with
//! other values) would take over and let a capped tenant take the whole cache. The key is
//! written by a leader that was given the flags (a txn fenced on its epoch, like the
//! settles: a deposed master cannot overwrite it) and read by a leader that was not.
//!
//! Format: one `NAME=BYTES` line per tenant, the flag's own syntax, so the key is readable
//! with `etcdctl get`. A value that does not parse is refused (typed error, the master steps
//! down and tries again), never half applied.
//!
//! The token is stored as its [`TokenDigest`] (hex), never in plaintext: etcd has no TLS or
//! auth here, so anyone who can reach it could read a plaintext token. A leader started
//! without `--token-file` / `KVTIER_L3_TOKEN` checks hellos against the stored digest; one
//! given a token writes its digest, fenced like the quotas.

use std::collections::BTreeMap;

use super::election::LeaderLease;
use super::etcd::{Compare, Op};
use crate::error::{L3Error, L3Result};
use crate::rpc::accept::TokenDigest;
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
    fenced_put(lease, key, encode(flags), "the tenant quotas")?;
    Ok(flags.clone())
}

/// The token digest this leader checks hellos against: its own token's when it was given
/// one (then written to etcd, fenced on its epoch), else the one a previous leader left.
pub fn settle_token(lease: &LeaderLease, given: Option<&str>) -> L3Result<Option<TokenDigest>> {
    let key = lease.keys().token.clone();
    let Some(t) = given else {
        return match lease.etcd().get(&key)? {
            Some(kv) => {
                let hex = std::str::from_utf8(&kv.value)
                    .map_err(|e| L3Error::Internal(format!("etcd token digest is corrupt: {e}")))?;
                TokenDigest::from_hex(hex).map(Some)
            }
            None => Ok(None),
        };
    };
    let d = TokenDigest::of(t);
    fenced_put(lease, key, d.to_hex().into_bytes(), "the token digest")?;
    Ok(Some(d))
}

/// Writes `key` if this leader's epoch still holds; a deposed leader loses its lease.
fn fenced_put(lease: &LeaderLease, key: Vec<u8>, value: Vec<u8>, what: &str) -> L3Result<()> {
    let (ok, _, _) = lease.etcd().txn(
        &[Compare::CreateRevision(
            lease.keys().leader.clone(),
            lease.epoch() as i64,
        )],
        &[Op::Put {
            key,
            value,
            lease: 0,
        }],
        None,
    )?;
    if !ok {
        lease.lose();
        return Err(L3Error::NotLeader(format!(
            "epoch {} is over before it could write {what}",
            lease.epoch()
        )));
    }
    Ok(())
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
    fn a_token_digest_round_trips_and_accepts_only_its_token() {
        let d = TokenDigest::of("s3cret");
        let back = TokenDigest::from_hex(&d.to_hex()).unwrap();
        assert_eq!(back, d);
        assert!(back.accepts(Some("s3cret")));
        assert!(!back.accepts(Some("s3cret ")));
        assert!(!back.accepts(None));
        assert!(!d.to_hex().contains("s3cret"));
        for bad in ["", "zz", &"g".repeat(64), &"é".repeat(32)] {
            assert!(TokenDigest::from_hex(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_malformed_value_is_a_typed_error() {
        for bad in [&b"a"[..], b"a=x", b"=5", b"\xff=1", b"a/b=1"] {
            assert!(matches!(decode(bad), Err(L3Error::Internal(_))), "{bad:?}");
        }
    }
}
