//! `kvtier-l3 --role master --etcd …`: campaign, then serve as the leader until the lease is
//! lost (then restart as a candidate) or SIGTERM (then resign, so a standby takes over at
//! once instead of after the TTL).
//!
//! Why restart by re-executing the process: a deposed leader's whole state (objects, pending
//! puts, connections) belongs to an epoch that is over. Starting clean as a candidate is the
//! one way to be sure none of it is used again; everything that must survive is in etcd or
//! on the nodes. The process id stays the same, so a supervisor (or a test) keeps its handle.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::election::{ClusterKeys, campaign};
use super::etcd::Etcd;
use super::standby::StandbyServer;
use crate::cluster::ClusterMaster;
use crate::config::StoreConfig;
use crate::rpc::server::ServerOptions;

/// This process's executable, opened at start: a step-down re-executes *this* file. Its
/// path (`/proc/self/exe`) no longer resolves once the binary on disk was replaced (an
/// upgrade, `cp` + `mv`, a rebuild give a new inode), and the re-exec failed with ENOENT
/// and the master aborted, leaving the cluster for good.
static SELF_EXE: OnceLock<Option<std::fs::File>> = OnceLock::new();

fn open_self_exe() {
    SELF_EXE.get_or_init(|| match std::fs::File::open("/proc/self/exe") {
        Ok(f) => Some(f),
        Err(e) => {
            eprintln!("kvtier-l3 master: cannot open my executable ({e}): a step-down re-executes its path");
            None
        }
    });
}

/// Replaces this process by a fresh run of itself (the executable it started from, see
/// [`SELF_EXE`]) with the same arguments.
fn restart_self(why: &str) {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    eprintln!("kvtier-l3 master: restarting as a candidate ({why})");
    let exe = match SELF_EXE.get() {
        // exec through the descriptor (what fexecve does): the file this process runs
        Some(Some(f)) => PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd())),
        _ => match std::env::current_exe() {
            Ok(p) => p,
            Err(e) => {
                eprintln!("kvtier-l3 master: cannot find my executable: {e}");
                return;
            }
        },
    };
    let mut args = std::env::args_os();
    let mut cmd = std::process::Command::new(exe);
    if let Some(arg0) = args.next() {
        cmd.arg0(arg0);
    }
    let e = cmd.args(args).exec();
    eprintln!("kvtier-l3 master: re-exec failed: {e}");
}

/// Campaigns on `etcd_spec` for cluster `cluster`, then serves as its leader.
pub(crate) fn run_master(
    etcd_spec: &str,
    cluster: &str,
    ttl: Duration,
    cfg: StoreConfig,
    opts: ServerOptions,
) -> Result<(), String> {
    // A paused etcd member must cost well under the TTL, so the lease is renewed in time
    // through another member.
    let per_member = (ttl / 5).max(Duration::from_millis(150));
    let etcd = Arc::new(Etcd::parse(etcd_spec, per_member).map_err(|e| e.to_string())?);
    let keys = ClusterKeys::new(cluster).map_err(|e| e.to_string())?;
    open_self_exe();
    super::on_step_down(restart_self);
    eprintln!("kvtier-l3 master: standby in cluster {cluster:?}, campaigning on etcd");
    // Meanwhile, clients given this address are told where the leader is.
    let poll = super::election::poll_interval(ttl);
    let standby = StandbyServer::start(etcd.clone(), keys.clone(), poll, &opts)?;
    let never = AtomicBool::new(false);
    let lease = campaign(etcd, keys, ttl, &never)
        .map_err(|e| e.to_string())?
        .ok_or("campaign stopped")?;
    eprintln!(
        "kvtier-l3 master: elected leader of epoch {}",
        lease.epoch()
    );
    let _keeper = lease
        .spawn_keeper(|| super::step_down(&"the etcd lease could not be renewed in time"))
        .map_err(|e| e.to_string())?;
    // The tenant quotas every leader of the cluster enforces (from etcd when this master
    // was given none).
    let mut cfg = cfg;
    cfg.tenant_quota_bytes = match super::tenants::settle_quotas(&lease, &cfg.tenant_quota_bytes) {
        Ok(q) => q,
        Err(e) => super::step_down(&e),
    };
    // The token every leader checks hellos against (its digest from etcd when this master
    // was given none).
    let mut opts = opts;
    opts.token_digest = match super::tenants::settle_token(&lease, opts.token.as_deref()) {
        Ok(d) => d,
        Err(e) => super::step_down(&e),
    };
    let master = match ClusterMaster::open_ha(cfg, lease.clone()) {
        Ok(m) => m,
        // etcd failed us while replaying: try again from the start.
        Err(e) => super::step_down(&e),
    };
    crate::cli::announce_kv_events(master.kv_events());
    let l2 = lease.clone();
    let publish = move |addr: SocketAddr| match l2.publish(addr) {
        Ok(()) => Ok(()),
        Err(e) => super::step_down(&e),
    };
    // Frees the port at once (the poller is joined when `_poller` drops, after serving).
    let _poller = standby.map(StandbyServer::stop);
    crate::cli::serve_then(master.clone(), opts, publish)?;
    lease.resign();
    master.shutdown();
    eprintln!("kvtier-l3: master shut down cleanly (leadership given up)");
    Ok(())
}
