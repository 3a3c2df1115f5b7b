//! The master's objects by tenant and key, with their census: how many are complete, how
//! many of those have a memory replica, how many an SSD one; and per tenant the DRAM bytes
//! its memory replicas hold (what a tenant quota caps).
//!
//! Why a census kept at every change: `stats()` (the store's gauges, `/metrics`, the vLLM
//! tier's gauges) used to walk every object under the master lock — 118 µs at a few
//! thousand objects, so tens of milliseconds at a million, with every put and get of every
//! client waiting meanwhile. Now it reads three counters. Likewise a put of a tenant with a
//! quota summed the tenant's objects twice, under the same lock.
//!
//! How it stays right: the map is private to this module, so every change goes through it:
//! [`ObjectTable::get_mut`] hands out a guard that takes the object's class out of the
//! census when it is made and puts the class it has then back when it is dropped;
//! [`ObjectTable::insert`], [`ObjectTable::remove`] and [`ObjectTable::retain`] do the same
//! around what they change. [`ObjectTable::census_by_scan`] counts from scratch, for the
//! invariant check the tests call.
//!
//! The same guard keeps each tenant's **eviction order**: its eviction candidates (complete
//! objects with a memory replica) ordered by (no SSD copy, last access), the order
//! [`crate::eviction`] ranks them in apart from pins and leases, which change with the clock
//! and are checked when the order is walked. An eviction used to collect and sort every
//! object of the store (or of a tenant at its quota) under the master lock: 29 ms a put for
//! a tenant of 100,000 objects at its quota (`benches/evict.rs`); it now walks the order
//! from its front and stops when enough bytes are chosen.

use std::collections::{BTreeSet, HashMap};
use std::ops::{Deref, DerefMut};

use super::Object;
use crate::types::Tenant;

/// Counts of complete objects (what `StoreStats` reports).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Census {
    pub objects: u64,
    pub mem_objects: u64,
    pub disk_objects: u64,
}

impl Census {
    /// What one object adds: nothing unless it is complete.
    fn of(o: &Object) -> Census {
        let complete = o.is_complete();
        Census {
            objects: u64::from(complete),
            mem_objects: u64::from(complete && !o.mem.is_empty()),
            disk_objects: u64::from(complete && o.disk.is_some()),
        }
    }

    fn add(&mut self, c: Census) {
        self.objects += c.objects;
        self.mem_objects += c.mem_objects;
        self.disk_objects += c.disk_objects;
    }

    /// Takes out what [`Census::of`] added for the same object (never below 0: a count
    /// that would go below is a bug the invariant check reports, not a panic).
    fn sub(&mut self, c: Census) {
        self.objects = self.objects.saturating_sub(c.objects);
        self.mem_objects = self.mem_objects.saturating_sub(c.mem_objects);
        self.disk_objects = self.disk_objects.saturating_sub(c.disk_objects);
    }
}

/// DRAM bytes an object's memory replicas hold (pending puts' included).
fn dram_bytes(o: &Object) -> u64 {
    o.size.saturating_mul(o.mem.len() as u64)
}

/// Where an eviction candidate stands in its tenant's eviction order: those with an SSD
/// copy first (evicting them loses nothing), then least recently used first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct EvictRank {
    pub unsaved: bool,
    pub last_access: u64,
}

impl EvictRank {
    /// `None` for an object no eviction may take: incomplete, or no memory replica.
    fn of(o: &Object) -> Option<EvictRank> {
        (!o.mem.is_empty() && o.is_complete()).then_some(EvictRank {
            unsaved: o.disk.is_none(),
            last_access: o.last_access,
        })
    }
}

/// One entry of a tenant's eviction order: a candidate's rank and key, ordered by rank,
/// then key (a total order).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Entry(EvictRank, String);

/// A tenant's eviction candidates in eviction order.
type Order = BTreeSet<Entry>;

/// Moves `key` in `order` from the rank it had to the rank it has (either may be none).
/// Every read moves its object: one key allocated for the lookup (a borrowed-key lookup
/// through `dyn` comparisons measured slower), the stored one reused.
fn reorder(order: &mut Order, key: &str, was: Option<EvictRank>, now: Option<EvictRank>) {
    if was == now {
        return;
    }
    let mut owned = None;
    if let Some(r) = was {
        owned = order.take(&Entry(r, key.to_string())).map(|e| e.1);
    }
    if let Some(r) = now {
        order.insert(Entry(r, owned.unwrap_or_else(|| key.to_string())));
    }
}

/// One tenant's objects, the DRAM bytes they hold and their eviction order.
#[derive(Debug, Default)]
struct TenantObjects {
    objects: HashMap<String, Object>,
    dram_bytes: u64,
    order: Order,
}

/// `tenant → key → object`, and the census of what it holds.
#[derive(Debug, Default)]
pub(super) struct ObjectTable {
    map: HashMap<Tenant, TenantObjects>,
    census: Census,
}

/// A mutable object; its census class, its tenant's DRAM bytes and its place in the
/// tenant's eviction order are updated when the guard is dropped.
pub(super) struct ObjMut<'a> {
    obj: &'a mut Object,
    key: &'a str,
    rank: Option<EvictRank>,
    census: &'a mut Census,
    dram: &'a mut u64,
    order: &'a mut Order,
}

impl<'a> ObjMut<'a> {
    fn new(
        obj: &'a mut Object,
        key: &'a str,
        census: &'a mut Census,
        dram: &'a mut u64,
        order: &'a mut Order,
    ) -> Self {
        census.sub(Census::of(obj));
        *dram = dram.saturating_sub(dram_bytes(obj));
        let rank = EvictRank::of(obj);
        ObjMut {
            obj,
            key,
            rank,
            census,
            dram,
            order,
        }
    }
}

impl Deref for ObjMut<'_> {
    type Target = Object;
    fn deref(&self) -> &Object {
        self.obj
    }
}

impl DerefMut for ObjMut<'_> {
    fn deref_mut(&mut self) -> &mut Object {
        self.obj
    }
}

impl Drop for ObjMut<'_> {
    fn drop(&mut self) {
        self.census.add(Census::of(self.obj));
        *self.dram += dram_bytes(self.obj);
        reorder(self.order, self.key, self.rank, EvictRank::of(self.obj));
    }
}

impl ObjectTable {
    pub fn get(&self, t: &Tenant, key: &str) -> Option<&Object> {
        self.map.get(t).and_then(|m| m.objects.get(key))
    }

    pub fn get_mut<'a>(&'a mut self, t: &Tenant, key: &'a str) -> Option<ObjMut<'a>> {
        let m = self.map.get_mut(t)?;
        let obj = m.objects.get_mut(key)?;
        Some(ObjMut::new(
            obj,
            key,
            &mut self.census,
            &mut m.dram_bytes,
            &mut m.order,
        ))
    }

    /// One tenant's objects (read only).
    pub fn tenant(&self, t: &Tenant) -> Option<&HashMap<String, Object>> {
        self.map.get(t).map(|m| &m.objects)
    }

    /// Every tenant's objects (read only).
    pub fn iter(&self) -> impl Iterator<Item = (&Tenant, &HashMap<String, Object>)> {
        self.map.iter().map(|(t, m)| (t, &m.objects))
    }

    /// DRAM bytes tenant `t`'s memory replicas hold, pending puts' included (O(1)).
    pub fn dram_bytes(&self, t: &Tenant) -> u64 {
        self.map.get(t).map_or(0, |m| m.dram_bytes)
    }

    /// Puts `obj` under `key`, returning the object it replaced.
    pub fn insert(&mut self, t: &Tenant, key: String, obj: Object) -> Option<Object> {
        self.census.add(Census::of(&obj));
        let m = self.map.entry(t.clone()).or_default();
        m.dram_bytes += dram_bytes(&obj);
        let rank = EvictRank::of(&obj);
        let old = m.objects.insert(key.clone(), obj);
        if let Some(o) = &old {
            self.census.sub(Census::of(o));
            m.dram_bytes = m.dram_bytes.saturating_sub(dram_bytes(o));
        }
        reorder(
            &mut m.order,
            &key,
            old.as_ref().and_then(EvictRank::of),
            rank,
        );
        old
    }

    /// Takes an object out (a tenant left with none goes too).
    pub fn remove(&mut self, t: &Tenant, key: &str) -> Option<Object> {
        let m = self.map.get_mut(t)?;
        let o = m.objects.remove(key);
        if let Some(o) = &o {
            self.census.sub(Census::of(o));
            m.dram_bytes = m.dram_bytes.saturating_sub(dram_bytes(o));
            reorder(&mut m.order, key, EvictRank::of(o), None);
        }
        if m.objects.is_empty() {
            self.map.remove(t);
        }
        o
    }

    /// Keeps the objects for which `keep(tenant, key, object)` is true (it may change them);
    /// tenants left with none go.
    pub fn retain(&mut self, mut keep: impl FnMut(&Tenant, &str, &mut Object) -> bool) {
        let census = &mut self.census;
        for (t, m) in self.map.iter_mut() {
            let dram = &mut m.dram_bytes;
            let order = &mut m.order;
            m.objects.retain(|k, o| {
                census.sub(Census::of(o));
                *dram = dram.saturating_sub(dram_bytes(o));
                let was = EvictRank::of(o);
                let kept = keep(t, k, o);
                if kept {
                    census.add(Census::of(o));
                    *dram += dram_bytes(o);
                }
                reorder(order, k, was, if kept { EvictRank::of(o) } else { None });
                kept
            });
        }
        self.map.retain(|_, m| !m.objects.is_empty());
    }

    /// The census kept at every change.
    pub fn census(&self) -> Census {
        self.census
    }

    /// The census counted from scratch (O(objects): the invariant check's reference).
    pub fn census_by_scan(&self) -> Census {
        let mut c = Census::default();
        for o in self.map.values().flat_map(|m| m.objects.values()) {
            c.add(Census::of(o));
        }
        c
    }

    /// Tenant `only`'s (or every tenant's) eviction candidates in eviction order: by rank,
    /// tenants merged (ties between tenants in tenant order), each with its key and object.
    pub fn eviction_order<'s>(
        &'s self,
        only: Option<&Tenant>,
    ) -> impl Iterator<Item = (&'s Tenant, &'s str, &'s Object)> + 's {
        let mut heads: Vec<_> = self
            .map
            .iter()
            .filter(|(t, _)| only.is_none_or(|o| o == *t))
            .map(|(t, m)| (t, m, m.order.iter().peekable()))
            .collect();
        heads.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
        std::iter::from_fn(move || {
            loop {
                // The tenant whose next candidate ranks first (few tenants: a scan of heads).
                let (i, _) = heads
                    .iter_mut()
                    .enumerate()
                    .filter_map(|(i, h)| h.2.peek().map(|e| (i, e.0)))
                    .min_by_key(|&(i, r)| (r, i))?;
                let (t, m, it) = &mut heads[i];
                let Entry(_, key) = it.next()?;
                // Every entry names an object (the invariant check's `order_mismatch`).
                if let Some(o) = m.objects.get(key) {
                    return Some((*t, key.as_str(), o));
                }
            }
        })
    }

    /// The first tenant whose kept eviction order differs from the one its objects give:
    /// (tenant, what differs); `None` when every tenant's agree.
    pub fn order_mismatch(&self) -> Option<(Tenant, String)> {
        self.map.iter().find_map(|(t, m)| {
            let scanned: Order = m
                .objects
                .iter()
                .filter_map(|(k, o)| EvictRank::of(o).map(|r| Entry(r, k.clone())))
                .collect();
            (scanned != m.order).then(|| {
                let extra = m.order.difference(&scanned).next().cloned();
                let missing = scanned.difference(&m.order).next().cloned();
                (
                    t.clone(),
                    format!("kept but not found {extra:?}, found but not kept {missing:?}"),
                )
            })
        })
    }

    /// The first tenant whose kept DRAM bytes differ from its objects' sum: (tenant, kept,
    /// summed); `None` when every tenant's agree.
    pub fn dram_mismatch(&self) -> Option<(Tenant, u64, u64)> {
        self.map.iter().find_map(|(t, m)| {
            let sum: u64 = m.objects.values().map(dram_bytes).sum();
            (sum != m.dram_bytes).then(|| (t.clone(), m.dram_bytes, sum))
        })
    }
}
