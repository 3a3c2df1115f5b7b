//! Memory tiers and typed page ids.
//!
//! Why: a device page id and a host page id are both small integers, and passing one where
//! the other is expected silently corrupts KV. Each tier is a zero-sized marker type, and a
//! [`PageId<T>`] carries its tier in the type, so the compiler rejects the mix-up. Inside the
//! cache, pages are stored as raw `u32` next to a runtime [`TierKind`]; the typed ids exist at
//! every public boundary.

use std::fmt;
use std::hash::Hash;
use std::marker::PhantomData;

use serde::{Deserialize, Serialize};

/// Runtime name of a tier that holds pages in the cache.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    strum::Display,
    strum::EnumIter,
    strum::IntoStaticStr,
)]
#[strum(serialize_all = "snake_case")]
pub enum TierKind {
    /// GPU HBM pages.
    Device,
    /// Pinned DRAM pages.
    Host,
}

/// A tier marker type: [`Device`] or [`Host`].
pub trait Tier:
    Copy + Clone + fmt::Debug + PartialEq + Eq + Hash + Ord + Default + Send + Sync + 'static
{
    const KIND: TierKind;
}

/// Marker for GPU pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Device;
/// Marker for pinned host pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Host;

impl Tier for Device {
    const KIND: TierKind = TierKind::Device;
}
impl Tier for Host {
    const KIND: TierKind = TierKind::Host;
}

/// Index of one page in the pool of tier `T`.
#[derive(Serialize, Deserialize)]
#[serde(transparent)]
pub struct PageId<T: Tier>(u32, #[serde(skip)] PhantomData<T>);

/// A device page id.
pub type DevicePageId = PageId<Device>;
/// A host page id.
pub type HostPageId = PageId<Host>;

impl<T: Tier> PageId<T> {
    pub const fn new(index: u32) -> Self {
        PageId(index, PhantomData)
    }
    pub const fn index(self) -> u32 {
        self.0
    }
}

// Manual impls: derives would demand `T: Clone` etc. on the marker, which is noise.
impl<T: Tier> Clone for PageId<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: Tier> Copy for PageId<T> {}
impl<T: Tier> PartialEq for PageId<T> {
    fn eq(&self, o: &Self) -> bool {
        self.0 == o.0
    }
}
impl<T: Tier> Eq for PageId<T> {}
impl<T: Tier> PartialOrd for PageId<T> {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl<T: Tier> Ord for PageId<T> {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.cmp(&o.0)
    }
}
impl<T: Tier> Hash for PageId<T> {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.0.hash(h)
    }
}
impl<T: Tier> fmt::Debug for PageId<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", T::KIND, self.0)
    }
}
