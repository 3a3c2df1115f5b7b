//! # kvtier-scheduler — the request lifecycle across device, host and L3
//!
//! The engine's event loop calls [`Scheduler::next_execution_plan`] every step and reports
//! what happened with [`Scheduler::on_event`]. The scheduler decides which requests run,
//! which prefix pages they reuse from device, which they load back from host, which it probes
//! and prefetches from L3, and which finished pages it writes back to host and backs up to L3.
//!
//! - `config.rs`: [`SchedulerConfig`] and its policies, validated into [`ConfigError`]s;
//! - `types.rs`: requests, events, and the [`ExecutionPlan`];
//! - `scheduler.rs`: state, public API, the plan's skeleton;
//! - `submit.rs`: validating and recording submitted requests (hash scope, tenant, page hashes);
//! - `check.rs`: the full consistency check between requests, ops and the tree;
//! - `admission.rs`: decode rows, prefill chunks, admission (match, load-back, L3);
//! - `completion.rs`: validating and applying completions;
//! - `lifecycle.rs`: publish, finish, write-back, backup, retraction, release;
//!   `backup_retry.rs`: failed backups tried again once L3 answers (shared with the manager);
//! - `ops.rs`: the in-flight op table with the locks each op holds;
//! - `prefetch.rs`: the prefetch path (start, deadline, finish, pin until admission);
//! - `agreement.rs`: tensor-parallel agreement ([`RankAgreement`], [`ExecutionPlan::digest`]);
//!   `agreed_losses.rs`: the same for L3 losses (the union of every rank's, on every rank);
//! - `offload.rs`: [`OffloadManager`], the offloading-manager mode: the radix tree deciding an
//!   engine's host tier (lookup, store slots and evictions, loads) without owning its device;
//!   `offload_l3.rs`: L3 below it (write-through backups, what is known to be in L3);
//! - `stats.rs`: counters, also exported through the `metrics` facade;
//! - [`model`]: the reference engine model (page contents, page tables, the integrity oracle)
//!   shared by the scheduler's tests, the simulator and the end-to-end tests.

mod admission;
mod agreed_finds;
mod agreed_losses;
mod agreement;
mod backup_retry;
mod check;
mod completion;
mod config;
mod demotion;
mod error;
mod idhash;
mod lifecycle;
pub mod model;
mod offload;
mod offload_agreement;
mod offload_chain;
mod offload_hold;
mod offload_l3;
mod offload_landing;
mod offload_tenant;
mod ops;
mod prefetch;
mod release;
mod request;
mod scheduler;
mod stats;
mod submit;
mod types;
mod waiting;

pub use agreed_finds::FOUND_WORDS_TAG;
pub use agreed_losses::LOSS_WORDS_TAG;
pub use agreement::{AgreedLosses, AgreedOps, AgreementError, RankAgreement, SKIPPED};
pub use backup_retry::BackupRetry;
pub use config::{
    ConfigError, HostAdmission, L3Sharing, PrefetchStopPolicy, QueueProtection, RetractionPolicy,
    SchedulerConfig, TenantQuota, WritePolicy,
};
pub use error::SchedulerError;
pub use kvtier_fsm::{OpKind, RequestState};
pub use kvtier_radix::{
    DevicePageId, ExtraKey, HashScope, HostPageId, KeyNamespace, KvEvent, PageHash, ScopeLabel,
};
pub use offload::{JobKind, JobOutcome, LoadPlan, Lookup, OffloadError, OffloadManager, StorePlan};
pub use offload_l3::{BackupPlan, L3Backups};
pub use scheduler::Scheduler;
pub use stats::{OpStats, Stats};
pub use types::*;
