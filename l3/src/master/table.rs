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
//! The same guard places each object in its tenant's **eviction order** (`order.rs`), which
//! an eviction walks from the front ([`ObjectTable::walk`]) instead of sorting every object.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};

use super::Object;
use super::order::{Entry, Order};
use crate::eviction::Candidate;
use crate::types::Tenant;

/// Counts of complete objects (what `StoreStats` reports).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Census {
    pub objects: u64,
    pub mem_objects: u64,
    pub disk_objects: u64,
    /// Bytes of the complete objects with a disk replica (a split master's nodes hold its
    /// SSD tier, so this is all it knows of the tier's use).
    pub disk_bytes: u64,
}

impl Census {
    /// What one object adds: nothing unless it is complete.
    fn of(o: &Object) -> Census {
        let complete = o.is_complete();
        Census {
            objects: u64::from(complete),
            mem_objects: u64::from(complete && !o.mem.is_empty()),
            disk_objects: u64::from(complete && o.disk.is_some()),
            disk_bytes: if complete && o.disk.is_some() {
                o.fp.bytes()
            } else {
                0
            },
        }
    }

    fn add(&mut self, c: Census) {
        self.objects += c.objects;
        self.mem_objects += c.mem_objects;
        self.disk_objects += c.disk_objects;
        self.disk_bytes += c.disk_bytes;
    }

    /// Takes out what [`Census::of`] added for the same object (never below 0: a count
    /// that would go below is a bug the invariant check reports, not a panic).
    fn sub(&mut self, c: Census) {
        self.objects = self.objects.saturating_sub(c.objects);
        self.mem_objects = self.mem_objects.saturating_sub(c.mem_objects);
        self.disk_objects = self.disk_objects.saturating_sub(c.disk_objects);
        self.disk_bytes = self.disk_bytes.saturating_sub(c.disk_bytes);
    }
}

/// DRAM bytes an object's memory replicas are charged (pending puts' included).
fn dram_bytes(o: &Object) -> u64 {
    o.fp.charge().saturating_mul(o.mem.len() as u64)
}

/// One tenant's objects by key. Boxed: a churned hash table can sit at a fifth of its
/// capacity (hashbrown doubles when tombstones fill it), and every empty slot then costs a
/// key and a pointer rather than a whole object record (the charge of a memory replica,
/// `segment.rs`, counts the table at that worst load).
pub(super) type Objects = HashMap<String, Box<Object>>;

/// One tenant's objects, the DRAM bytes they hold and their eviction order.
#[derive(Debug, Default)]
struct TenantObjects {
    objects: Objects,
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
        ObjMut {
            obj,
            key,
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
        self.order.place(self.key, self.obj);
    }
}

impl ObjectTable {
    pub fn get(&self, t: &Tenant, key: &str) -> Option<&Object> {
        self.map
            .get(t)
            .and_then(|m| m.objects.get(key))
            .map(|o| &**o)
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
    pub fn tenant(&self, t: &Tenant) -> Option<&Objects> {
        self.map.get(t).map(|m| &m.objects)
    }

    /// Every tenant's objects (read only).
    pub fn iter(&self) -> impl Iterator<Item = (&Tenant, &Objects)> {
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
        let old = m.objects.remove(&key).map(|o| *o);
        if let Some(o) = &old {
            self.census.sub(Census::of(o));
            m.dram_bytes = m.dram_bytes.saturating_sub(dram_bytes(o));
            m.order.unplace(&key, o);
        }
        let mut obj = obj;
        obj.ordered_as = None; // placed afresh: what it says of another table means nothing
        m.order.place(&key, &mut obj);
        m.objects.insert(key, Box::new(obj));
        old
    }

    /// Takes an object out (a tenant left with none goes too).
    pub fn remove(&mut self, t: &Tenant, key: &str) -> Option<Object> {
        let m = self.map.get_mut(t)?;
        let o = m.objects.remove(key).map(|o| *o);
        if let Some(o) = &o {
            self.census.sub(Census::of(o));
            m.dram_bytes = m.dram_bytes.saturating_sub(dram_bytes(o));
            m.order.unplace(key, o);
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
                let kept = keep(t, k, o);
                if kept {
                    census.add(Census::of(o));
                    *dram += dram_bytes(o);
                    order.place(k, o);
                } else {
                    order.unplace(k, o);
                }
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

    /// Walks tenant `only`'s (or every tenant's) eviction candidates in eviction order,
    /// tenants merged by rank (ties in tenant order), handing `visit` each one's tenant, key
    /// and `candidate(object)` until it returns `false`. Stale entries passed on the way are
    /// moved to where their objects stand (order.rs), so the walk needs `&mut`.
    pub fn walk(
        &mut self,
        only: Option<&Tenant>,
        candidate: impl Fn(&Object) -> Candidate,
        visit: &mut dyn FnMut((&Tenant, &str), Candidate) -> bool,
    ) {
        let mut tenants: Vec<Tenant> = self
            .map
            .keys()
            .filter(|t| only.is_none_or(|o| o == *t))
            .cloned()
            .collect();
        tenants.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        // per tenant: the entry last visited, and its next fresh entry (None: not looked up)
        let mut cursor: Vec<Option<Entry>> = vec![None; tenants.len()];
        let mut next: Vec<Option<Option<Entry>>> = vec![None; tenants.len()];
        loop {
            for (i, t) in tenants.iter().enumerate() {
                if next[i].is_none()
                    && let Some(m) = self.map.get_mut(t)
                {
                    next[i] = Some(m.order.next_fresh(cursor[i].as_ref(), &mut m.objects));
                }
            }
            let Some(i) = (0..tenants.len())
                .filter_map(|i| next[i].as_ref()?.as_ref().map(|e| (e.0, i)))
                .min()
                .map(|(_, i)| i)
            else {
                return;
            };
            let Some(e) = next[i].take().flatten() else {
                return;
            };
            let Some(o) = self.map.get(&tenants[i]).and_then(|m| m.objects.get(&e.1)) else {
                return;
            };
            if !visit((&tenants[i], &e.1), candidate(o)) {
                return;
            }
            cursor[i] = Some(e);
        }
    }

    /// The first tenant whose eviction order breaks its invariant (order.rs): (tenant, what);
    /// `None` when every tenant's holds.
    pub fn order_mismatch(&self) -> Option<(Tenant, String)> {
        self.map
            .iter()
            .find_map(|(t, m)| m.order.mismatch(&m.objects).map(|w| (t.clone(), w)))
    }

    /// The first tenant whose kept DRAM bytes differ from its objects' sum: (tenant, kept,
    /// summed); `None` when every tenant's agree.
    pub fn dram_mismatch(&self) -> Option<(Tenant, u64, u64)> {
        self.map.iter().find_map(|(t, m)| {
            let sum: u64 = m.objects.values().map(|o| dram_bytes(o)).sum();
            (sum != m.dram_bytes).then(|| (t.clone(), m.dram_bytes, sum))
        })
    }
}
