//! Cluster routing for [`RemoteStore`]: against the master of a split deployment, metadata
//! goes to the master and bytes go to the store nodes its descriptors name.
//!
//! Why apart from the tarpc client: routing decides *which node* serves each key and keeps
//! one data connection per node; the parent module only speaks to one server.

use std::collections::HashMap;
use std::net::SocketAddr;

use super::RemoteStore;
use crate::api::{BatchResult, L3Store};
use crate::error::{L3Error, L3Result};
use crate::rpc::service::{ClusterReply, ClusterRequest};
use crate::types::{
    PutHandle, PutOptions, QueryResult, ReplicaDescriptor, ReplicateConfig, Tenant,
};

/// Whether a data-channel call may run again on a fresh connection after a transport
/// failure (only idempotent calls may).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Retry {
    /// Reads, flushes.
    Once,
    /// Writes and ends.
    Never,
}

impl RemoteStore {
    /// Split deployment: reads through the master's descriptors from the nodes.
    pub(super) fn cluster_get(
        &self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &mut [&mut [u8]],
        queries: Option<&[QueryResult]>,
    ) -> BatchResult<u64> {
        self.check_bufs(keys.len(), bufs.len())?;
        let qs: Vec<L3Result<QueryResult>> = match queries {
            None => self.batch_query(tenant, keys)?,
            Some(q) => {
                let req = ClusterRequest::CheckQueries {
                    tenant: tenant.clone(),
                    queries: q.to_vec(),
                };
                match self.cluster(req)? {
                    ClusterReply::Checked(v) if v.len() == q.len() => q
                        .iter()
                        .zip(v)
                        .map(|(q, c)| c.map(|()| q.clone()))
                        .collect(),
                    _ => return Err(L3Error::RpcFail("unexpected reply".into())),
                }
            }
        };
        self.cluster_read(tenant, keys, bufs, qs)
    }

    /// Split deployment: reads each key from the first of its replicas whose node answers
    /// (memory replicas come first in a descriptor list). A node that fails (unreachable,
    /// killed, transport error) or no longer holds the bytes sends its keys to their next
    /// replica; a key fails only when every replica did (with the last error).
    pub(super) fn cluster_read(
        &self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &mut [&mut [u8]],
        qs: Vec<L3Result<QueryResult>>,
    ) -> BatchResult<u64> {
        if qs.len() != keys.len() || bufs.len() != keys.len() {
            return Err(L3Error::RpcFail("reply length mismatch".into()));
        }
        let mut out: Vec<L3Result<u64>> = Vec::with_capacity(keys.len());
        let mut cands: Vec<Vec<ReplicaDescriptor>> = Vec::with_capacity(keys.len());
        let mut pending: Vec<usize> = Vec::new();
        for (i, q) in qs.into_iter().enumerate() {
            let on_nodes = match q {
                Err(e) => {
                    out.push(Err(e));
                    Vec::new()
                }
                Ok(q) if (bufs[i].len() as u64) < q.size => {
                    out.push(Err(L3Error::BufferOverflow {
                        needed: q.size,
                        have: bufs[i].len() as u64,
                    }));
                    Vec::new()
                }
                Ok(q) => {
                    let v: Vec<ReplicaDescriptor> = q
                        .replicas
                        .into_iter()
                        .filter(|r| r.node().is_some())
                        .collect();
                    out.push(Err(L3Error::Unavailable(
                        "no replica on a live store node".into(),
                    )));
                    if !v.is_empty() {
                        pending.push(i);
                    }
                    v
                }
            };
            cands.push(on_nodes);
        }
        let mut next = vec![0usize; keys.len()];
        while !pending.is_empty() {
            let mut groups: HashMap<SocketAddr, Vec<usize>> = HashMap::new();
            pending.sort_unstable();
            for &i in &pending {
                if let Some(n) = cands[i].get(next[i]).and_then(ReplicaDescriptor::node) {
                    groups.entry(n.addr).or_default().push(i);
                }
            }
            pending.clear();
            for (addr, items) in groups {
                let ks: Vec<String> = items.iter().map(|&i| keys[i].clone()).collect();
                let reps: Vec<ReplicaDescriptor> =
                    items.iter().map(|&i| cands[i][next[i]].clone()).collect();
                let mut mask = vec![false; keys.len()];
                for &i in &items {
                    mask[i] = true;
                }
                let mut sub: Vec<&mut [u8]> = bufs
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, _)| mask[*i])
                    .map(|(_, b)| &mut **b)
                    .collect();
                let res = self.node_read_at(addr, tenant, &ks, &reps, &mut sub);
                let per_key: Vec<L3Result<u64>> = match res {
                    Ok(v) if v.len() == items.len() => v,
                    Ok(_) => {
                        vec![Err(L3Error::RpcFail("reply length mismatch".into())); items.len()]
                    }
                    Err(e) => vec![Err(e); items.len()],
                };
                for (&i, r) in items.iter().zip(per_key) {
                    let try_next = matches!(
                        r,
                        Err(L3Error::RpcFail(_)
                            | L3Error::Unavailable(_)
                            | L3Error::ObjectNotFound)
                    );
                    out[i] = r;
                    if try_next {
                        next[i] += 1;
                        if next[i] < cands[i].len() {
                            pending.push(i);
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// Split deployment: writes (`data` one per handle, or empty) and/or ends (`end`) puts
    /// on the nodes their handles name — every replica of each, the nodes in parallel. A
    /// put succeeds only when every one of its replicas did (per key: the first error).
    pub(super) fn cluster_put_on_nodes(
        &self,
        handles: &[PutHandle],
        data: &[&[u8]],
        end: Option<PutOptions>,
    ) -> Vec<L3Result<()>> {
        self.cluster_put_replicas(handles, data, end)
            .into_iter()
            .map(|rs| rs.into_iter().find(Result::is_err).unwrap_or(Ok(())))
            .collect()
    }

    /// [`Self::cluster_put_on_nodes`], per key the result of each replica (in the order of
    /// [`PutHandle::replicas`]: the primary first).
    fn cluster_put_replicas(
        &self,
        handles: &[PutHandle],
        data: &[&[u8]],
        end: Option<PutOptions>,
    ) -> Vec<Vec<L3Result<()>>> {
        let mut out: Vec<Vec<L3Result<()>>> = handles
            .iter()
            .map(|h| vec![Ok(()); h.replicas().count()])
            .collect();
        // Per node: (key, replica, that replica's handle).
        type Items = Vec<(usize, usize, PutHandle)>;
        let mut groups: HashMap<SocketAddr, Items> = HashMap::new();
        for (i, h) in handles.iter().enumerate() {
            for (j, r) in h.replicas().enumerate() {
                match r.node() {
                    Some(n) => groups
                        .entry(n.addr)
                        .or_default()
                        .push((i, j, h.for_replica(r))),
                    None => {
                        out[i][j] = Err(L3Error::Unavailable(
                            "the put was placed on no store node".into(),
                        ))
                    }
                }
            }
        }
        type Done = Vec<((usize, usize), L3Result<()>)>;
        let one_node = |addr: SocketAddr, items: Items| -> Done {
            let hs: Vec<PutHandle> = items.iter().map(|(_, _, h)| h.clone()).collect();
            let ds: Vec<&[u8]> = if data.is_empty() {
                Vec::new()
            } else {
                items.iter().map(|(i, _, _)| data[*i]).collect()
            };
            let at = items.iter().map(|(i, j, _)| (*i, *j));
            match self.node_put_at(addr, &hs, &ds, end) {
                Ok(v) if v.len() == items.len() => at.zip(v).collect(),
                Ok(_) => at
                    .map(|i| (i, Err(L3Error::RpcFail("reply length mismatch".into()))))
                    .collect(),
                Err(e) => at.map(|i| (i, Err(e.clone()))).collect(),
            }
        };
        let mut groups: Vec<(SocketAddr, Items)> = groups.into_iter().collect();
        let results: Vec<Done> = match groups.pop() {
            None => Vec::new(),
            Some(last) if groups.is_empty() => vec![one_node(last.0, last.1)],
            // Replicas on several nodes: one thread per extra node, so a replicated put costs
            // about one node's write time, not one per replica.
            Some(last) => std::thread::scope(|sc| {
                let f = &one_node;
                let spawned: Vec<_> = groups
                    .into_iter()
                    .map(|(a, items)| {
                        let idx: Vec<(usize, usize)> =
                            items.iter().map(|(i, j, _)| (*i, *j)).collect();
                        (idx, sc.spawn(move || f(a, items)))
                    })
                    .collect();
                let mut all = vec![f(last.0, last.1)];
                for (idx, h) in spawned {
                    all.push(h.join().unwrap_or_else(|_| {
                        let e = L3Error::Internal("store node writer thread failed".into());
                        idx.into_iter().map(|i| (i, Err(e.clone()))).collect()
                    }));
                }
                all
            }),
        };
        for ((i, j), r) in results.into_iter().flatten() {
            if let Some(slot) = out.get_mut(i).and_then(|v| v.get_mut(j)) {
                *slot = r;
            }
        }
        out
    }

    /// Split deployment: whole puts (place at the master, write and end every replica on
    /// its node; revoke what failed). A replica answered -705 counts as done: the placement
    /// was this put's (another writer's object is refused at `PutStart`), so a -705 for its
    /// handle says this put's own object is complete — the master's `end_replica` when the
    /// token matches a complete object, e.g. one a restarted master adopted from the other
    /// replicas' nodes while this replica's node was paused ([`whole_put_result`]).
    pub(super) fn cluster_put(
        &self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &[&[u8]],
        opts: PutOptions,
        cfg: ReplicateConfig,
    ) -> BatchResult<()> {
        self.put_placed(tenant, keys, bufs, cfg, |hs, ds| {
            Ok(self
                .cluster_put_replicas(hs, ds, Some(opts))
                .into_iter()
                .map(|rs| whole_put_result(rs, opts))
                .collect())
        })
    }

    pub(super) fn cluster_flush(&self) -> L3Result<()> {
        let nodes = match self.cluster(ClusterRequest::Nodes)? {
            ClusterReply::Nodes(v) => v,
            _ => return Err(L3Error::RpcFail("unexpected reply".into())),
        };
        for n in nodes {
            self.with_node(n.addr, Retry::Once, |x| x.node_flush())?;
        }
        Ok(())
    }
}

/// One whole put's result from its replicas' (the primary first): the first error, where a
/// replica's -705 (this put's own object complete: see [`RemoteStore::cluster_put`]) is
/// success — except on the primary of a put that waits for its SSD copy: the primary's node
/// writes that copy once its end is accepted, and this end was not, so the copy is not
/// confirmed (not -705 either: the put's version is stored).
fn whole_put_result(replicas: Vec<L3Result<()>>, opts: PutOptions) -> L3Result<()> {
    for (j, r) in replicas.into_iter().enumerate() {
        match r {
            Ok(()) => {}
            Err(L3Error::ObjectAlreadyExists) if j == 0 && opts.wait_persisted => {
                return Err(L3Error::Unavailable(
                    "the put's object is stored (completed by its other replicas) but its SSD \
                     copy is not confirmed: the primary replica's end was not accepted"
                        .into(),
                ));
            }
            Err(L3Error::ObjectAlreadyExists) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn result() -> impl Strategy<Value = L3Result<()>> {
        prop_oneof![
            3 => Just(Ok(())),
            2 => Just(Err(L3Error::ObjectAlreadyExists)),
            1 => Just(Err(L3Error::RpcFail("x".into()))),
            1 => Just(Err(L3Error::IllegalClient("x".into()))),
            1 => Just(Err(L3Error::ReplicaIsNotReady)),
        ]
    }

    proptest! {
        /// A whole put is never answered -705 from its replicas' results (only `PutStart`
        /// answers another writer's object); it is Ok exactly when every replica is Ok or
        /// -705, unless the primary's -705 leaves a waited-for SSD copy unconfirmed; any
        /// other error is the first one's.
        #[test]
        fn a_whole_put_from_its_replicas(
            rs in prop::collection::vec(result(), 1..4),
            wait_persisted in any::<bool>(),
        ) {
            let opts = PutOptions { soft_pin: false, wait_persisted };
            let got = whole_put_result(rs.clone(), opts);
            prop_assert!(!matches!(got, Err(L3Error::ObjectAlreadyExists)));
            let unconfirmed = wait_persisted && rs[0] == Err(L3Error::ObjectAlreadyExists);
            let first_other = rs
                .iter()
                .enumerate()
                .find(|(j, r)| match r {
                    Ok(()) => false,
                    Err(L3Error::ObjectAlreadyExists) => *j == 0 && unconfirmed,
                    Err(_) => true,
                })
                .map(|(_, r)| r.clone());
            match first_other {
                None => prop_assert_eq!(got, Ok(())),
                Some(Err(L3Error::ObjectAlreadyExists)) => {
                    prop_assert!(matches!(got, Err(L3Error::Unavailable(_))));
                }
                Some(e) => prop_assert_eq!(got, e),
            }
        }
    }
}
