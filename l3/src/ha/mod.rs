//! High availability of the split deployment's master on etcd (`kvtier-l3 --role master
//! --etcd URL[,URL...]`): several masters, one leader, failover with nothing acknowledged
//! lost.
//!
//! Why etcd and not a home-made consensus: etcd is a proven coordination engine; all we
//! need from it is a lease, a create-if-absent txn, monotonic revisions and a few small
//! keys. Why not Mooncake's per-put operation log: object metadata is rebuilt from the
//! nodes' own reports when they mount on the new leader (each node reports what it holds
//! in DRAM and on SSD, with versions), so etcd holds only what cannot be rebuilt — the
//! settle state (`settles`) — and stays small and bounded.
//!
//! The pieces:
//! - `etcd`: a blocking wrapper of the `etcd-client` crate (gRPC; timeouts per member; a
//!   paused member costs one timeout, then the next answers);
//! - `election`: campaign for `/kvtier/<cluster>/leader` under a lease; the key's create
//!   revision is the **epoch**; a leader acts only while its lease is surely alive here;
//! - `settles`: the settle log as etcd keys, every write fenced on the epoch;
//! - `locator`: how clients and nodes find the leader (`etcd://a;b;c` or a fixed address),
//!   and the highest epoch they have seen (older epochs are refused: [`EpochFence`]);
//! - `standby`: a standby listens and answers `NotLeader` naming the leader, so a client
//!   given any master's plain address follows the redirect;
//! - `tenants`: the tenant quotas, written by a leader given `--tenant-quota`, read by one
//!   that was not.
//!
//! A master that loses its lease (keep-alive failing past its deadline, or a fenced write
//! refused) answers every call with `NotLeader` and restarts as a candidate
//! ([`step_down`]); a new leader replays the settles, listens, publishes its address, and
//! answers clients' key calls only once every member node has mounted again and reported
//! its records (the rebuild gate of [`crate::master`]).

pub mod election;
pub mod etcd;
pub mod local_etcd;
pub mod locator;
pub(crate) mod serve;
pub mod settles;
pub mod standby;
pub mod tenants;

use std::sync::OnceLock;

pub use election::{ClusterKeys, LeaderLease, LeaderView, campaign, read_leader};
pub use etcd::Etcd;
pub use locator::{EpochFence, Locator};

type StepDownHook = Box<dyn Fn(&str) + Send + Sync>;

static STEP_DOWN: OnceLock<StepDownHook> = OnceLock::new();

/// Sets what [`step_down`] does before the process aborts (the CLI: restart itself as a
/// candidate). Set once; later calls are ignored.
pub fn on_step_down(hook: impl Fn(&str) + Send + Sync + 'static) {
    let _ = STEP_DOWN.set(Box::new(hook));
}

/// Leaves leadership at once, without replying to anything in flight: runs the hook (which
/// normally never returns: it re-executes the process), else aborts.
pub fn step_down(why: &dyn std::fmt::Display) -> ! {
    let why = why.to_string();
    tracing::error!(reason = %why, "stepping down");
    eprintln!("kvtier-l3 master: stepping down: {why}");
    if let Some(h) = STEP_DOWN.get() {
        h(&why);
    }
    std::process::abort()
}
