//! Client liveness and segments: mount/unmount, pings, and the sweeper that revokes timed-out
//! puts and declares silent clients dead.
//!
//! Why apart: liveness decides which memory replicas exist at all (a dead client's segments
//! are unmounted and their replicas dropped); it shares nothing with placement but the
//! segment table.

use super::*;

impl Master {
    // ---- clients and segments ------------------------------------------------------------

    /// Registers a client that is never declared dead (the embedded store itself).
    pub fn register_immortal_client(&mut self, c: ClientId, now: u64) {
        self.clients.insert(
            c,
            ClientInfo {
                last_ping_ms: now,
                immortal: true,
            },
        );
    }

    /// `MountSegment`: the client becomes known (alive) and its segment usable.
    pub fn mount_segment(
        &mut self,
        client: ClientId,
        seg: SegmentId,
        capacity: u64,
        now: u64,
    ) -> L3Result<()> {
        self.segments.mount(seg, client, capacity)?;
        self.clients
            .entry(client)
            .and_modify(|c| c.last_ping_ms = now)
            .or_insert(ClientInfo {
                last_ping_ms: now,
                immortal: false,
            });
        Ok(())
    }

    /// `UnmountSegment`: memory replicas in it are dropped; disk replicas stay.
    pub fn unmount_segment(&mut self, client: ClientId, seg: SegmentId) -> L3Result<u64> {
        match self.segments.get(seg) {
            None => return Err(L3Error::SegmentNotFound),
            Some(s) if s.owner != client => {
                return Err(L3Error::IllegalClient(
                    "segment owned by another client".into(),
                ));
            }
            Some(_) => {}
        }
        let gone = self.segments.unmount(seg)?;
        Ok(self.drop_allocs(&gone))
    }

    /// Drops every replica living in the given allocations (already gone from their
    /// segment); returns how many objects lost one. A complete object keeps its other
    /// replicas; a pending put that lost one can never end and is dropped with the rest of
    /// its replicas (and its SSD copy, if its first replica's node already registered one;
    /// a copy still being written is cancelled).
    pub(super) fn drop_allocs(&mut self, allocs: &[u64]) -> u64 {
        if allocs.is_empty() {
            return 0;
        }
        let set: std::collections::HashSet<u64> = allocs.iter().copied().collect();
        let mut n = 0;
        let mut orphans: Vec<u64> = Vec::new();
        let mut gone: Vec<(Tenant, String, settle::Gone, bool)> = Vec::new();
        for (t, m) in self.tenants.iter_mut() {
            m.retain(|k, o| {
                let before = o.mem.len();
                o.mem.retain(|r| !set.contains(&r.alloc));
                if o.mem.len() == before {
                    return true;
                }
                n += 1;
                if o.is_complete() && o.has_data() {
                    return true;
                }
                orphans.extend(o.allocs());
                gone.push((t.clone(), k.clone(), o.gone(), o.is_complete()));
                false
            });
        }
        self.tenants.retain(|_, m| !m.is_empty());
        for a in orphans {
            self.segments.free(a);
        }
        for (t, k, g, complete) in gone {
            if complete {
                self.lose(&t, &k);
            }
            self.settle_gone(&t, &k, g);
        }
        n
    }

    /// `Ping`: renews liveness. Unknown (or declared-dead) clients must remount.
    pub fn ping(&mut self, client: ClientId, now: u64) -> ClientStatus {
        match self.clients.get_mut(&client) {
            Some(c) => {
                c.last_ping_ms = now;
                ClientStatus::Ok
            }
            None => ClientStatus::NeedRemount,
        }
    }

    /// Revokes timed-out puts and declares silent clients dead (their memory replicas go,
    /// their SSD replicas stay). Returns (puts revoked, clients expired).
    pub fn sweep(&mut self, now: u64) -> (u64, u64) {
        let timeout = self.policy.put_timeout_ms;
        let mut stale = Vec::new();
        for (t, m) in &self.tenants {
            for (k, o) in m {
                if let ObjState::Pending { since_ms } = o.state
                    && now.saturating_sub(since_ms) >= timeout
                {
                    stale.push((t.clone(), k.clone()));
                }
            }
        }
        let revoked = stale.len() as u64;
        for (t, k) in stale {
            self.revoke_object(&t, &k);
        }
        let ttl = self.policy.client_ttl_ms;
        let dead: Vec<ClientId> = self
            .clients
            .iter()
            .filter(|(_, c)| !c.immortal && now.saturating_sub(c.last_ping_ms) >= ttl)
            .map(|(&id, _)| id)
            .collect();
        for c in &dead {
            self.clients.remove(c);
            if let Some(n) = self.nodes.get_mut(c) {
                // Its SSD replicas stay registered (readable again when it comes back).
                n.addr = None;
                n.segment = None;
            }
            for seg in self.segments.owned_by(*c) {
                if let Ok(gone) = self.segments.unmount(seg) {
                    self.drop_allocs(&gone);
                }
            }
            self.drop_node_memory_state(*c);
        }
        (revoked, dead.len() as u64)
    }
}
