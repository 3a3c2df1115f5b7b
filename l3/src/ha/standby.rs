//! A standby master listens too, and answers every call with a typed `NotLeader` naming the
//! current leader's address (read from etcd), so a client given any master's plain address
//! (no `etcd://`) reaches the leader: it follows the redirect ([`redirect_of`]).
//!
//! Why: deployments that cannot hand etcd endpoints to every client (or tools written for a
//! single master) still get failover — list the masters' addresses, any one will do. Why a
//! backend that refuses everything rather than a second service: the server already checks
//! [`Backend::gate`] before every call (and in `hello`), so a standby is the plain server
//! with a gate that is never open; nothing a standby could answer can be stale.
//!
//! The leader's address is polled from etcd on a thread of its own (every
//! [`poll_interval`](super::election::poll_interval), at most 0.5 s whatever the TTL), not
//! read in the call, so a standby's answers never wait on etcd. When this master wins,
//! [`StandbyServer::stop`] frees the port at once: it wakes the poller rather than waiting
//! out its sleep, and does not wait for an etcd read in flight either (the poller is joined
//! later, when the `Poller` it returns drops), so how soon an elected master serves depends
//! neither on the TTL (it took TTL/10: 30 s at TTL 300) nor on etcd.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::mpsc::{RecvTimeoutError, Sender};
use std::time::Duration;

use parking_lot::Mutex;

use super::election::{ClusterKeys, LeaderView, read_leader};
use super::etcd::Etcd;
use crate::api::{BatchResult, L3Store};
use crate::error::{L3Error, L3Result};
use crate::master::{LossCursor, Losses};
use crate::rpc::server::{Backend, ServerOptions};
use crate::rpc::xfer::XferHandler;
use crate::types::{
    Blob, ClientId, ClientStatus, ExistOptions, PutHandle, PutOptions, QueryResult,
    ReplicateConfig, SegmentId, StoreStats, Tenant,
};

/// What a `NotLeader` redirect says before the leader's address.
const LEADER_AT: &str = "the leader is at ";

/// The leader's address a standby's `NotLeader` names (None: not a redirect).
pub fn redirect_of(e: &L3Error) -> Option<SocketAddr> {
    let L3Error::NotLeader(m) = e else {
        return None;
    };
    let rest = &m[m.find(LEADER_AT)? + LEADER_AT.len()..];
    rest.split_whitespace().next()?.parse().ok()
}

/// The backend of a standby master: every call refused with `NotLeader` (a redirect when a
/// leader is published).
pub(crate) struct Standby {
    leader: Mutex<Option<LeaderView>>,
}

impl Standby {
    fn refusal(&self) -> L3Error {
        match &*self.leader.lock() {
            Some(LeaderView {
                addr: Some(a),
                epoch,
            }) => L3Error::NotLeader(format!("a standby master; {LEADER_AT}{a} (epoch {epoch})")),
            _ => L3Error::NotLeader("a standby master; no leader is serving yet".into()),
        }
    }
}

/// A running standby listener; [`StandbyServer::stop`] frees its port (for the leader's
/// server, when this process wins).
pub(crate) struct StandbyServer {
    stop: tokio::sync::watch::Sender<bool>,
    /// Dropped to wake the poller and end it.
    wake: Sender<()>,
    poller: std::thread::JoinHandle<()>,
    server: std::thread::JoinHandle<()>,
}

/// The poll thread of a stopped standby, joined when this is dropped (by then it has long
/// ended: it was woken by [`StandbyServer::stop`]; only an etcd read in flight delays it).
pub(crate) struct Poller(Option<std::thread::JoinHandle<()>>);

impl Drop for Poller {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            crate::error::join_logged("standby master's leader poll", t);
        }
    }
}

impl StandbyServer {
    /// Listens on `opts.addr` (RPC only: no transfer channel, no metrics) and polls the
    /// leader key every `poll`. An ephemeral port (`:0`) names nobody a client could be
    /// given, so then nothing listens (Ok(None)).
    pub(crate) fn start(
        etcd: Arc<Etcd>,
        keys: ClusterKeys,
        poll: Duration,
        opts: &ServerOptions,
    ) -> Result<Option<Self>, String> {
        if opts.addr.port() == 0 {
            return Ok(None);
        }
        let me = Arc::new(Standby {
            leader: Mutex::new(None),
        });
        let (wake, woken) = std::sync::mpsc::channel::<()>();
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let sopts = ServerOptions {
            metrics_addr: None,
            transfer_channel: false,
            ..opts.clone()
        };
        let m = me.clone();
        let poller = std::thread::Builder::new()
            .name("kvtier-l3-standby-poll".into())
            .spawn(move || {
                loop {
                    if let Ok(v) = read_leader(&etcd, &keys) {
                        *m.leader.lock() = v;
                    }
                    // Sleeps `poll`, or less: `stop` drops the sender.
                    match woken.recv_timeout(poll) {
                        Err(RecvTimeoutError::Timeout) => {}
                        Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let server = std::thread::Builder::new()
            .name("kvtier-l3-standby".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let mut wait = stop_rx.clone();
                rt.block_on(async move {
                    let r = crate::rpc::server::start(me, sopts, stop_rx).await;
                    let _ = ready_tx.send(r.map(|_| ()).map_err(|e| e.to_string()));
                    let _ = wait.wait_for(|s| *s).await;
                });
                // Dropping the runtime drops the listener and every connection: the port
                // is free when this thread ends.
            })
            .map_err(|e| e.to_string())?;
        let me = StandbyServer {
            stop,
            wake,
            poller,
            server,
        };
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Some(me)),
            Ok(Err(e)) => Err(format!("standby listener: {e}")),
            Err(_) => Err("standby listener thread failed".into()),
        }
    }

    /// Stops listening and polling; returns once the port is free, without waiting for the
    /// poller (join it by dropping the [`Poller`], once serving).
    pub(crate) fn stop(self) -> Poller {
        let StandbyServer {
            stop,
            wake,
            poller,
            server,
        } = self;
        drop(wake);
        // The server thread may have ended already (its runtime failed): nothing to stop.
        crate::error::best_effort("stop the standby listener", stop.send(true));
        crate::error::join_logged("standby master", server);
        Poller(Some(poller))
    }
}

/// Every store call: refused (never reached: [`Backend::gate`] refuses first).
macro_rules! refuse {
    ($($name:ident($($arg:ty),*) -> $ret:ty;)*) => {
        $(fn $name(&self, $(_: $arg),*) -> $ret { Err(self.refusal()) })*
    };
}

impl L3Store for Standby {
    refuse! {
        put_start(&Tenant, &str, u64) -> L3Result<PutHandle>;
        put_write(&PutHandle, &[u8]) -> L3Result<()>;
        put_end(&PutHandle, PutOptions) -> L3Result<()>;
        put_revoke(&PutHandle) -> L3Result<()>;
        batch_put_start_with(&Tenant, &[String], &[u64], ReplicateConfig) -> BatchResult<PutHandle>;
        batch_put_end(&[PutHandle], PutOptions) -> BatchResult<()>;
        batch_put_revoke(&[PutHandle]) -> BatchResult<()>;
        get_replica_list(&Tenant, &str) -> L3Result<QueryResult>;
        batch_exist_key(&Tenant, &[String], ExistOptions) -> BatchResult<bool>;
        batch_query(&Tenant, &[String]) -> BatchResult<QueryResult>;
        batch_get_with_query(&Tenant, &[QueryResult], &mut [&mut [u8]]) -> BatchResult<u64>;
        remove(&Tenant, &str, bool) -> L3Result<()>;
        remove_all(&Tenant, bool) -> L3Result<u64>;
        remove_by_regex(&Tenant, &str, bool) -> L3Result<u64>;
        copy_replica(&Tenant, &str, SegmentId) -> L3Result<bool>;
        move_replica(&Tenant, &str, SegmentId, SegmentId) -> L3Result<()>;
        mount_segment(ClientId, SegmentId, u64) -> L3Result<()>;
        unmount_segment(ClientId, SegmentId) -> L3Result<()>;
        ping(ClientId) -> L3Result<ClientStatus>;
        put(&Tenant, &str, &[u8], PutOptions) -> L3Result<()>;
        get(&Tenant, &str) -> L3Result<Vec<u8>>;
        batch_put_from_with(&Tenant, &[String], &[&[u8]], PutOptions, ReplicateConfig) -> BatchResult<()>;
        batch_get_into(&Tenant, &[String], &mut [&mut [u8]]) -> BatchResult<u64>;
        get_size(&Tenant, &str) -> L3Result<u64>;
        flush() -> L3Result<()>;
        stats() -> L3Result<StoreStats>;
        losses_since(&Tenant, Option<LossCursor>) -> L3Result<Losses>;
    }

    fn max_object_bytes(&self) -> u64 {
        0
    }

    fn batch_keys_limit(&self) -> usize {
        0
    }
}

impl Backend for Standby {
    fn max_batch_keys(&self) -> usize {
        0
    }
    fn get_blobs(&self, _: &Tenant, _: &[String]) -> BatchResult<Blob> {
        Err(self.refusal())
    }
    fn get_with_query_blobs(&self, _: &Tenant, _: &[QueryResult]) -> BatchResult<Blob> {
        Err(self.refusal())
    }
    fn render_metrics(&self) -> String {
        String::new()
    }
    fn xfer_handler(self: Arc<Self>) -> Option<Arc<dyn XferHandler>> {
        None
    }
    fn gate(&self) -> L3Result<()> {
        Err(self.refusal())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_redirect_names_the_leader_and_nothing_else_is_one() {
        let s = Standby {
            leader: Mutex::new(Some(LeaderView {
                addr: Some("127.0.0.1:4242".parse().unwrap()),
                epoch: 9,
            })),
        };
        assert_eq!(
            redirect_of(&s.gate().unwrap_err()),
            Some("127.0.0.1:4242".parse().unwrap())
        );
        *s.leader.lock() = None;
        assert_eq!(redirect_of(&s.gate().unwrap_err()), None);
        assert_eq!(redirect_of(&L3Error::NotLeader(LEADER_AT.into())), None);
        assert_eq!(redirect_of(&L3Error::ObjectNotFound), None);
    }
}
