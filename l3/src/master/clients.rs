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
        let immortal = |c: ClientId| self.clients.get(&c).is_some_and(|i| i.immortal);
        if let Some(cap) = self.policy.client_segments_max_bytes
            && !immortal(client)
        {
            let held = self.segments.held_capacity(|owner| !immortal(owner));
            if held.saturating_add(capacity) > cap {
                return Err(L3Error::NoAvailableHandle { needed: capacity });
            }
        }
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
        let holder = self.nodes.contains_key(&client).then_some(client);
        Ok(self.drop_allocs(&gone, holder))
    }

    /// Drops every replica living in the given allocations (already gone from their
    /// segment); returns how many objects lost one. A complete object keeps its other
    /// replicas; a pending put that lost one can never end and is dropped with the rest of
    /// its replicas (and its SSD copy, if its first replica's node already registered one;
    /// a copy still being written is cancelled).
    ///
    /// `holder`: the store node whose memory held them, if it may still hold the bytes
    /// (its death was declared here, not seen): each object remembers it (`frees`), so
    /// the version's death reaches it.
    pub(super) fn drop_allocs(&mut self, allocs: &[u64], holder: Option<ClientId>) -> u64 {
        if allocs.is_empty() {
            return 0;
        }
        let set: std::collections::HashSet<u64> = allocs.iter().copied().collect();
        let mut n = 0;
        let mut orphans: Vec<u64> = Vec::new();
        let mut gone: Vec<(Tenant, String, settle::Gone, bool)> = Vec::new();
        self.objects.retain(|t, k, o| {
            let before = o.mem.len();
            o.mem.retain(|r| {
                let drop = set.contains(&r.alloc);
                if drop && let Some(h) = holder {
                    o.freed_on.push((h, r.alloc));
                }
                !drop
            });
            if o.mem.len() == before {
                return true;
            }
            n += 1;
            if o.is_complete() && o.has_data() {
                return true;
            }
            orphans.extend(o.allocs());
            gone.push((t.clone(), k.to_string(), o.gone(), o.is_complete()));
            false
        });
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
        for (t, m) in self.objects.iter() {
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
            self.orphan_node_memory(*c);
            if let Some(n) = self.nodes.get_mut(c) {
                // Its SSD replicas stay registered (readable again when it comes back).
                n.addr = None;
                n.segment = None;
            }
            for seg in self.segments.owned_by(*c) {
                if let Ok(gone) = self.segments.unmount(seg) {
                    self.drop_allocs(&gone, Some(*c));
                }
            }
            self.drop_node_memory_state(*c);
        }
        (revoked, dead.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StoreConfig;
    use crate::master::MasterPolicy;
    use proptest::prelude::*;

    const CAP: u64 = 100;
    const TTL: u64 = 1_000;

    #[derive(Debug, Clone)]
    enum Op {
        Mount {
            client: u64,
            seg: u64,
            bytes: u64,
        },
        Unmount {
            client: u64,
            seg: u64,
        },
        /// Time passes by this many ms; clients 1 and 2 ping first, the others do not.
        Tick(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u64..5, 1u64..12, 0u64..70).prop_map(|(client, seg, bytes)| Op::Mount { client, seg, bytes }),
            2 => (0u64..5, 1u64..12).prop_map(|(client, seg)| Op::Unmount { client, seg }),
            1 => (0u64..1_500).prop_map(Op::Tick),
        ]
    }

    fn mortal_bytes(m: &Master) -> u64 {
        m.segments.held_capacity(|o| o != ClientId(0))
    }

    proptest! {
        /// What mortal clients mount never passes `client_segments_max_bytes`; a refused
        /// mount is -200 and changes nothing; a mount that fits (and whose id is free) is
        /// accepted; the store's own (immortal) segment is never counted nor refused; a dead
        /// client's segments give their room back.
        #[test]
        fn client_mounts_stay_under_the_cap(ops in proptest::collection::vec(op(), 1..60)) {
            let cfg = StoreConfig { client_segments_max_bytes: Some(CAP), client_ttl: std::time::Duration::from_millis(TTL), ..StoreConfig::default() };
            let mut m = Master::new(MasterPolicy::from_config(&cfg));
            let mut now = 0u64;
            m.register_immortal_client(ClientId(0), now);
            for o in ops {
                match o {
                    Op::Mount { client, seg, bytes } => {
                        let before = (mortal_bytes(&m), m.segments.capacity());
                        let taken = m.segments.get(SegmentId(seg)).is_some();
                        let fits = client == 0 || before.0 + bytes <= CAP;
                        let r = m.mount_segment(ClientId(client), SegmentId(seg), bytes, now);
                        match &r {
                            Ok(()) => prop_assert!(fits && !taken && bytes > 0),
                            Err(L3Error::NoAvailableHandle { needed }) => {
                                prop_assert!(!fits && client != 0);
                                prop_assert_eq!(*needed, bytes);
                            }
                            Err(_) => prop_assert!(taken || bytes == 0, "{:?}", r),
                        }
                        if fits && !taken && bytes > 0 {
                            prop_assert!(r.is_ok(), "a mount that fits was refused: {:?}", r);
                        }
                        if r.is_err() {
                            prop_assert_eq!((mortal_bytes(&m), m.segments.capacity()), before);
                        }
                    }
                    Op::Unmount { client, seg } => {
                        let owned = m.segments.get(SegmentId(seg)).is_some_and(|s| s.owner == ClientId(client));
                        prop_assert_eq!(m.unmount_segment(ClientId(client), SegmentId(seg)).is_ok(), owned);
                    }
                    Op::Tick(ms) => {
                        now += ms;
                        for c in [0, 1, 2] {
                            if m.clients.contains_key(&ClientId(c)) {
                                m.ping(ClientId(c), now);
                            }
                        }
                        m.sweep(now);
                        // Clients 3 and 4 never ping: once dead, they own nothing.
                        for c in [3, 4] {
                            if !m.clients.contains_key(&ClientId(c)) {
                                prop_assert!(m.segments.owned_by(ClientId(c)).is_empty());
                            }
                        }
                    }
                }
                prop_assert!(mortal_bytes(&m) <= CAP, "{} > {}", mortal_bytes(&m), CAP);
            }
        }
    }
}
