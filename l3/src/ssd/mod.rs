//! SSD tier: bucket files ([`bucket`]) and their manager ([`tier`]).
//!
//! Why a tier below DRAM: KV-cache reuse distance often exceeds DRAM; SSD keeps evicted
//! prefixes reusable at a fraction of recompute cost (seed 002).

pub mod bucket;
pub mod tier;
mod writer;

pub use tier::{OffloadJob, SsdTier, TierHooks, TierStats};
