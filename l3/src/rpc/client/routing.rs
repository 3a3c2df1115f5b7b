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
use crate::rpc::xfer::XferClient;
use crate::types::{PutHandle, PutOptions, QueryResult, ReplicaDescriptor, Tenant};

impl RemoteStore {
    /// Runs `f` on the data connection to the store node at `addr` (opened on first use).
    /// A transport failure drops the connection; `retry` (idempotent calls only) then runs
    /// `f` once more on a fresh one.
    fn with_node<T>(
        &self,
        addr: SocketAddr,
        retry: bool,
        mut f: impl FnMut(&mut XferClient) -> L3Result<T>,
    ) -> L3Result<T> {
        let slot = self.nodes.lock().entry(addr).or_default().clone();
        let mut guard = slot.lock();
        let attempts = if retry { 2 } else { 1 };
        let mut last = L3Error::RpcFail("store node unavailable".into());
        for _ in 0..attempts {
            if guard.is_none() {
                *guard = Some(XferClient::connect(
                    addr,
                    self.opts.token.clone(),
                    self.frame_cap(),
                )?);
            }
            let Some(conn) = guard.as_mut() else { continue };
            match f(conn) {
                Err(L3Error::RpcFail(m)) => {
                    *guard = None;
                    last = L3Error::RpcFail(m);
                }
                other => return other,
            }
        }
        Err(last)
    }

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

    /// Split deployment: reads each key from the node its first live replica names.
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
        let mut groups: HashMap<SocketAddr, Vec<(usize, ReplicaDescriptor)>> = HashMap::new();
        for (i, q) in qs.into_iter().enumerate() {
            out.push(Err(L3Error::ObjectNotFound));
            let q = match q {
                Ok(q) => q,
                Err(e) => {
                    out[i] = Err(e);
                    continue;
                }
            };
            let have = bufs[i].len() as u64;
            if have < q.size {
                out[i] = Err(L3Error::BufferOverflow {
                    needed: q.size,
                    have,
                });
                continue;
            }
            // Memory replicas come first in a descriptor list.
            match q.replicas.into_iter().find(|r| r.node().is_some()) {
                Some(r) => {
                    if let Some(n) = r.node() {
                        groups.entry(n.addr).or_default().push((i, r));
                    }
                }
                None => {
                    out[i] = Err(L3Error::Unavailable(
                        "no replica on a live store node".into(),
                    ))
                }
            }
        }
        let mut slots: Vec<Option<&mut [u8]>> = bufs.iter_mut().map(|b| Some(&mut **b)).collect();
        for (addr, items) in groups {
            let ks: Vec<String> = items.iter().map(|(i, _)| keys[*i].clone()).collect();
            let reps: Vec<ReplicaDescriptor> = items.iter().map(|(_, r)| r.clone()).collect();
            let mut sub: Vec<&mut [u8]> = items
                .iter()
                .map(|(i, _)| slots[*i].take().unwrap_or_default())
                .collect();
            match self.with_node(addr, true, |x| x.node_read(tenant, &ks, &reps, &mut sub)) {
                Ok(v) => {
                    for ((i, _), r) in items.iter().zip(v) {
                        out[*i] = r;
                    }
                }
                Err(e) => {
                    for (i, _) in &items {
                        out[*i] = Err(e.clone());
                    }
                }
            }
        }
        Ok(out)
    }

    /// Split deployment: writes (`data` one per handle, or empty) and/or ends (`end`) puts
    /// on the nodes their handles name.
    pub(super) fn cluster_put_on_nodes(
        &self,
        handles: &[PutHandle],
        data: &[&[u8]],
        end: Option<PutOptions>,
    ) -> Vec<L3Result<()>> {
        let mut out: Vec<L3Result<()>> = vec![Ok(()); handles.len()];
        let mut groups: HashMap<SocketAddr, Vec<usize>> = HashMap::new();
        for (i, h) in handles.iter().enumerate() {
            match h.replica.node() {
                Some(n) => groups.entry(n.addr).or_default().push(i),
                None => {
                    out[i] = Err(L3Error::Unavailable(
                        "the put was placed on no store node".into(),
                    ))
                }
            }
        }
        for (addr, idx) in groups {
            let ranges = self.chunks(idx.len(), |j| {
                data.get(idx[j]).map_or(0, |d| d.len()) + handles[idx[j]].key.len()
            });
            for r in ranges {
                let part = &idx[r];
                let hs: Vec<PutHandle> = part.iter().map(|&i| handles[i].clone()).collect();
                let ds: Vec<&[u8]> = if data.is_empty() {
                    Vec::new()
                } else {
                    part.iter().map(|&i| data[i]).collect()
                };
                match self.with_node(addr, false, |x| x.node_put(&hs, &ds, end)) {
                    Ok(v) => {
                        for (&i, res) in part.iter().zip(v) {
                            out[i] = res;
                        }
                    }
                    Err(e) => {
                        for &i in part {
                            out[i] = Err(e.clone());
                        }
                    }
                }
            }
        }
        out
    }

    /// Split deployment: whole puts (place at the master, write and end on the node).
    pub(super) fn cluster_put(
        &self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &[&[u8]],
        opts: PutOptions,
    ) -> BatchResult<()> {
        let sizes: Vec<u64> = bufs.iter().map(|b| b.len() as u64).collect();
        let started = self.batch_put_start(tenant, keys, &sizes)?;
        if started.len() != keys.len() {
            return Err(L3Error::RpcFail("reply length mismatch".into()));
        }
        let mut out: Vec<L3Result<()>> = Vec::with_capacity(keys.len());
        let mut handles = Vec::new();
        let mut data = Vec::new();
        let mut at = Vec::new();
        for (i, r) in started.into_iter().enumerate() {
            match r {
                Ok(h) => {
                    out.push(Ok(()));
                    handles.push(h);
                    data.push(bufs[i]);
                    at.push(i);
                }
                Err(e) => out.push(Err(e)),
            }
        }
        let res = self.cluster_put_on_nodes(&handles, &data, Some(opts));
        let mut failed = Vec::new();
        for ((i, h), r) in at.into_iter().zip(handles).zip(res) {
            if let Err(e) = r {
                if !matches!(e, L3Error::ObjectAlreadyExists) {
                    failed.push(h);
                }
                out[i] = Err(e);
            }
        }
        if !failed.is_empty() {
            // Best effort: free the placements at once instead of at the put timeout.
            let _ = self.batch_put_revoke(&failed);
        }
        Ok(out)
    }

    pub(super) fn cluster_flush(&self) -> L3Result<()> {
        let nodes = match self.cluster(ClusterRequest::Nodes)? {
            ClusterReply::Nodes(v) => v,
            _ => return Err(L3Error::RpcFail("unexpected reply".into())),
        };
        for n in nodes {
            self.with_node(n.addr, true, |x| x.node_flush())?;
        }
        Ok(())
    }
}
