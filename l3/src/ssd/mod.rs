//! SSD tier: bucket files ([`bucket`]), their manager ([`tier`]; `writer` is its writer
//! thread, `unconfirmed` the records whose registration a store node could not confirm,
//! [`files`] the bounded cache of open bucket files).
//!
//! Why a tier below DRAM: KV-cache reuse distance often exceeds DRAM; SSD keeps evicted
//! prefixes reusable at a fraction of recompute cost (seed 002).

pub mod bucket;
pub mod files;
pub mod tier;
mod unconfirmed;
mod writer;

pub use tier::{OffloadJob, SsdTier, TierHooks, TierStats};
pub use unconfirmed::{Registration, Unconfirmed};
