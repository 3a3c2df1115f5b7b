//! [`RemoteStore`]: the [`L3Store`](crate::L3Store) trait over tarpc, for callers in another process.
//!
//! Why synchronous: the same trait as the embedded store, so the scheduler can switch
//! between them with one line. The client owns a small tokio runtime and blocks on it; do
//! not call it from inside another tokio runtime's worker thread.
//!
//! How big transfers stay fast and within limits: a batch is split into chunks whose bytes
//! stay well below the server's frame limit (learnt from `hello`), and all chunks are sent
//! at once on the one connection (tarpc multiplexes), so the server works on one chunk
//! while the previous reply is on the wire. The RPC deadline is raised from tarpc's 10 s
//! default (big transfers over slow links take longer). Requests that would exceed a limit
//! fail here with a typed error (-600) instead of being cut off by the transport.
//!
//! Against the master of a split deployment (`hello` says `cluster`), metadata calls go to
//! the master as usual and bytes go to the store nodes: a put asks the master to place it
//! (`PutStart`), then writes and ends it on the node named by the handle's descriptor; a get
//! asks the master for descriptors (`BatchQuery`, which takes the lease) and reads each key
//! from the node its first live replica names. One transfer connection per node, opened on
//! first use and reopened after a failure, and a shared-memory connection to each node on
//! this host (`nodes`).
//!
//! This file holds the connection (options, limits, chunking, the transfer channel's
//! reconnect loop); `routing` the split deployment's node routing; `nodes` the per-node
//! data connections (shared memory or TCP); `api` the [`L3Store`](crate::L3Store) calls
//! themselves.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::join_all;
use tarpc::client::{self, RpcError};
use tarpc::context;
use tarpc::tokio_serde::formats::Bincode;

use super::server::DEFAULT_MAX_FRAME;
use super::service::{
    ClusterReply, ClusterRequest, L3RpcClient, ServerLimits, announced_protocol_version,
};
use super::shm::{SharedRegion, ShmClient, ShmMode, ShmOffer, ShmOutcome};
use super::xfer::XferClient;
use crate::api::BatchResult;
use crate::error::{L3Error, L3Result};
use crate::ha::standby::redirect_of;
use crate::ha::{EpochFence, Locator};
use crate::types::{QueryResult, Tenant};

mod api;
mod nodes;
mod routing;
pub use nodes::DataPath;
use nodes::NodeConn;
use routing::Retry;

/// Client settings.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Shared-secret token.
    pub token: Option<String>,
    /// Per-call deadline (tarpc's default is 10 s).
    pub rpc_timeout: Duration,
    /// Largest frame this client accepts.
    pub max_frame_bytes: usize,
    /// Target bytes per chunk of a batched transfer.
    pub chunk_bytes: usize,
    /// Use the server's transfer channel for bulk reads and batched probes when it has one.
    pub use_transfer_channel: bool,
    /// Following an etcd HA leader ([`RemoteStore::connect_to`]): how long idempotent calls
    /// (queries, gets, exists, removes) keep retrying across a failover before failing.
    pub failover_timeout: Duration,
    /// Following an etcd HA leader: the deadline of one call on the master (metadata only;
    /// bytes go to the nodes), so a paused leader costs this, not `rpc_timeout`.
    pub leader_call_timeout: Duration,
    /// Use the server's shared-memory path when it runs on this host (see
    /// [`crate::rpc::shm`]); defaults to `KVTIER_L3_SHM` (on unless it says `off`; a value
    /// it does not know fails the connect).
    pub shm: ShmMode,
    /// Size of the shared-memory staging segment: the most bytes of caller buffers (outside
    /// shared regions) one shared-memory request carries.
    pub shm_staging_bytes: usize,
    /// The protocol version this client announces and requires of its server: always
    /// [`PROTOCOL_VERSION`](super::service::PROTOCOL_VERSION) but in tests playing a client
    /// of another version (default: [`announced_protocol_version`]).
    #[doc(hidden)]
    pub protocol_version: u32,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            token: None,
            rpc_timeout: Duration::from_secs(120),
            max_frame_bytes: DEFAULT_MAX_FRAME,
            chunk_bytes: 16 << 20,
            use_transfer_channel: true,
            failover_timeout: Duration::from_secs(30),
            leader_call_timeout: Duration::from_secs(3),
            shm: ShmMode::from_env(),
            shm_staging_bytes: 64 << 20,
            protocol_version: announced_protocol_version(),
        }
    }
}

/// Opens the RPC connection (not yet authenticated: `hello` follows), giving up after
/// `limit` (a server whose listen queue is full leaves a connect waiting for minutes).
fn dial(
    rt: &tokio::runtime::Runtime,
    addr: SocketAddr,
    max_frame: usize,
    limit: Duration,
) -> L3Result<L3RpcClient> {
    rt.block_on(async {
        let mut conn = tarpc::serde_transport::tcp::connect(addr, Bincode::default);
        conn.config_mut().max_frame_length(max_frame);
        let transport = tokio::time::timeout(limit, conn)
            .await
            .map_err(|_| L3Error::RpcFail(format!("connect {addr}: no answer within {limit:?}")))?
            .map_err(|e| L3Error::RpcFail(format!("connect {addr}: {e}")))?;
        // Latency only: a socket without TCP_NODELAY still works.
        let _ = transport.get_ref().set_nodelay(true);
        Ok(L3RpcClient::new(client::Config::default(), transport).spawn())
    })
}

/// Largest accepted [`ClientOptions::rpc_timeout`] (one day): tarpc's timer wheel panics on
/// deadlines past ~2^36 ms, and no store call should wait that long.
pub const MAX_RPC_TIMEOUT: Duration = Duration::from_secs(86_400);

/// How long past its deadline a call is waited for before it is given up as one that
/// exceeded it (tarpc expires it at the deadline itself once it is written).
const CALL_GRACE: Duration = Duration::from_millis(500);

/// `call`, given up after `limit` as a call that exceeded its deadline. tarpc checks a
/// request's deadline only once the request is written: one queued behind a request the
/// socket cannot take (a paused server's full receive buffer) was waited for for ever, and
/// threads sharing a client stayed blocked until the server resumed (tests/paused_server.rs).
/// Dropping the call withdraws it (tarpc drops a request whose caller is gone unsent).
pub(super) async fn within<T>(
    limit: Duration,
    call: impl Future<Output = Result<T, RpcError>>,
) -> Result<T, RpcError> {
    tokio::time::timeout(limit, call)
        .await
        .unwrap_or(Err(RpcError::DeadlineExceeded))
}

/// Per-key overhead allowance when sizing frames (key, tenant, enum tags, lengths).
const PER_KEY_OVERHEAD: usize = 64;

/// The transfer channel: its address (the server's port may change when it restarts) and
/// the live connection (None after a failure; the next call reconnects, because a failed
/// read leaves the stream out of step).
struct XferSlot {
    addr: SocketAddr,
    conn: Option<XferClient>,
}

/// A connection to a `kvtier-l3` server.
///
/// The RPC connection is dialled again when it broke (the server restarted, or the link
/// dropped): the call that found it broken fails with -900 (it may or may not have been
/// applied, so it is not repeated), and the next call dials, authenticates and goes on.
pub struct RemoteStore {
    /// The master's (server's) address; moves when an etcd HA leader changes.
    addr: parking_lot::Mutex<SocketAddr>,
    /// Where the master is found again after a failure.
    locator: Locator,
    /// The highest leader epoch seen (an older master is refused).
    fence: EpochFence,
    /// Transfer channel, when the server has one.
    xfer: Option<parking_lot::Mutex<XferSlot>>,
    /// Shared-memory path, when the server is on this host.
    shm: Option<parking_lot::Mutex<ShmClient>>,
    /// Split deployment: data connections to store nodes, by data address.
    nodes: parking_lot::Mutex<HashMap<SocketAddr, NodeConn>>,
    /// Split deployment: regions handed out by [`RemoteStore::shared_region`], shared with
    /// every store node reached through shared memory (also ones connected later).
    node_regions: parking_lot::Mutex<Vec<std::sync::Weak<SharedRegion>>>,
    rt: tokio::runtime::Runtime,
    client: parking_lot::Mutex<L3RpcClient>,
    /// The RPC connection failed in transport: dial again before the next call.
    broken: AtomicBool,
    /// A standby master redirected this client (given a plain address) to the leader: it
    /// is in an etcd HA cluster, so it retries and re-finds the leader as an `etcd://`
    /// client does (through the address it was given).
    redirected: AtomicBool,
    /// The last redial's refusal of the server's protocol version (a server replaced by
    /// one of another version at the same address): what a call on the broken connection
    /// fails with, rather than a bare -900, until a redial succeeds.
    refused: parking_lot::Mutex<Option<L3Error>>,
    limits: ServerLimits,
    opts: ClientOptions,
    /// The process that connected: a child forked after that shares this client's sockets
    /// and shared-memory rings with its parent, and each would read the other's replies
    /// (another key's bytes, answered as its own). Every call from another process is
    /// refused ([`RemoteStore::same_process`]); the child connects its own client.
    pid: u32,
}

/// The error for a one-key call whose reply holds no result.
fn empty_reply() -> L3Error {
    L3Error::RpcFail("empty reply".into())
}

fn rpc_err(e: RpcError) -> L3Error {
    L3Error::RpcFail(e.to_string())
}

impl RemoteStore {
    /// Connects and authenticates.
    pub fn connect(addr: SocketAddr, opts: ClientOptions) -> L3Result<Self> {
        Self::connect_to(Locator::Fixed(addr), opts)
    }

    /// Connects to the master `locator` names (`etcd://…`: the current leader, followed
    /// across failovers: idempotent calls retry for `failover_timeout`, a put whose two
    /// phases straddle a failover fails with `EpochFenced`).
    pub fn connect_to(locator: Locator, opts: ClientOptions) -> L3Result<Self> {
        ShmMode::try_from_env()?;
        let (addr, epoch) = locator.resolve(opts.failover_timeout)?;
        // Current-thread runtime: the caller's thread drives the connection while it waits,
        // so a call costs no cross-thread wake-ups (this halves small-call latency).
        if opts.rpc_timeout < Duration::from_millis(1) || opts.rpc_timeout > MAX_RPC_TIMEOUT {
            return Err(L3Error::InvalidParams(format!(
                "rpc_timeout must be within 1 ms ..= {} s, got {:?}",
                MAX_RPC_TIMEOUT.as_secs(),
                opts.rpc_timeout
            )));
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| L3Error::Internal(format!("runtime: {e}")))?;
        let max_frame = opts.max_frame_bytes;
        let mut me = RemoteStore {
            addr: parking_lot::Mutex::new(addr),
            locator,
            fence: EpochFence::default(),
            xfer: None,
            shm: None,
            nodes: parking_lot::Mutex::new(HashMap::new()),
            node_regions: parking_lot::Mutex::new(Vec::new()),
            client: parking_lot::Mutex::new(dial(
                &rt,
                addr,
                max_frame,
                opts.rpc_timeout + CALL_GRACE,
            )?),
            broken: AtomicBool::new(false),
            redirected: AtomicBool::new(false),
            refused: parking_lot::Mutex::new(None),
            pid: std::process::id(),
            rt,
            limits: ServerLimits {
                max_frame_bytes: max_frame as u64,
                max_batch_keys: 0,
                max_object_bytes: 0,
                xfer_port: 0,
                cluster: false,
                epoch: 0,
            },
            opts,
        };
        let first = me.client.lock().clone();
        let (addr, first, limits) = me.hello_following(addr, first)?;
        me.fence.admit(epoch.max(limits.epoch))?;
        me.limits = limits;
        *me.addr.lock() = addr;
        *me.client.lock() = first;
        if me.opts.use_transfer_channel && limits.xfer_port != 0 {
            let xa = SocketAddr::new(addr.ip(), limits.xfer_port);
            let frame = me.frame_cap();
            match XferClient::connect(xa, me.opts.token.clone(), frame, me.opts.rpc_timeout) {
                Ok(conn) => {
                    me.xfer = Some(parking_lot::Mutex::new(XferSlot {
                        addr: xa,
                        conn: Some(conn),
                    }))
                }
                // A refused token is the caller's error; anything else (the channel is
                // saturated or unreachable) leaves this client on the RPC path, which serves
                // every call the channel does.
                Err(e @ L3Error::IllegalClient(_)) => return Err(e),
                Err(e) => {
                    tracing::warn!(error = %e, "transfer channel unavailable; using RPC only");
                }
            }
        }
        me.shm = me.open_shm().map(parking_lot::Mutex::new);
        Ok(me)
    }

    /// The shared-memory path, when enabled, offered (an older server offers none) and on
    /// this host; connected now so that a client reports at once which path it uses.
    fn open_shm(&self) -> Option<ShmClient> {
        if self.opts.shm == ShmMode::Off {
            return None;
        }
        if self.limits.cluster {
            // Bytes go to the nodes: open a path to each now (shared memory where it can).
            self.open_nodes();
            return None;
        }
        let offer = self.run(self.rpc().shm_offer(self.ctx())).ok()??;
        let mut c = ShmClient::new(
            offer,
            self.opts.token.clone(),
            self.frame_cap(),
            self.limits.max_batch_keys as usize,
            self.opts.shm_staging_bytes,
            self.opts.rpc_timeout,
        )?
        .with_mode(self.opts.shm);
        if let Err(e) = c.connect() {
            tracing::info!(error = %e, "shared-memory path unavailable; using TCP");
        }
        Some(c)
    }

    /// Whether the server copies plain caller buffers in place (one copy; see
    /// `rpc::shm::inplace`) rather than through the staging segment.
    pub fn shm_in_place(&self) -> bool {
        self.shm.as_ref().is_some_and(|s| s.lock().in_place())
    }

    /// What the server offers for the shared-memory path (None: nothing, e.g. `--no-shm`).
    pub fn shm_offer(&self) -> L3Result<Option<ShmOffer>> {
        self.run(self.rpc().shm_offer(self.ctx()))
    }

    /// Whether calls move bytes through shared memory (the server is on this host and its
    /// socket answered; against a split deployment's master: with at least one store node).
    pub fn uses_shm(&self) -> bool {
        if self.limits.cluster {
            return self
                .node_paths()
                .iter()
                .any(|(_, p)| *p == DataPath::SharedMemory);
        }
        self.shm.as_ref().is_some_and(|s| s.lock().is_live())
    }

    /// `len` bytes of memory shared with the server: puts from and gets into buffers inside
    /// it move with no copy in this client (Mooncake's dummy-client pool). Against a split
    /// deployment, shared with every store node on this host (nodes elsewhere get its bytes
    /// over TCP, as any buffer's). -1010 when this client has no shared-memory path.
    pub fn shared_region(&self, len: usize) -> L3Result<Arc<SharedRegion>> {
        if self.limits.cluster && self.opts.shm != ShmMode::Off {
            return self.node_region(len);
        }
        match &self.shm {
            Some(s) => s.lock().alloc(len),
            None => Err(L3Error::Unavailable(
                "no shared-memory path to this server".into(),
            )),
        }
    }

    /// The server's limits.
    pub fn limits(&self) -> ServerLimits {
        self.limits
    }

    /// The highest master epoch this client has seen (0 without etcd HA).
    pub fn epoch(&self) -> u64 {
        self.fence.seen()
    }

    /// The current master's address.
    pub fn master_addr(&self) -> SocketAddr {
        *self.addr.lock()
    }

    /// Whether this client follows an etcd HA leader.
    pub fn follows_leader(&self) -> bool {
        self.locator.follows_leader() || self.redirected.load(Ordering::Acquire)
    }

    /// Runs an idempotent call, again after a failover-shaped failure (transport, not the
    /// leader, rebuilding, an older epoch) until `failover_timeout` — only when following an
    /// etcd leader; against a fixed address the first result is returned.
    pub(crate) fn idempotent<T>(&self, mut f: impl FnMut() -> L3Result<T>) -> L3Result<T> {
        let deadline = Instant::now() + self.opts.failover_timeout;
        let mut pause = Duration::from_millis(20);
        loop {
            let r = f();
            let retry = self.follows_leader()
                && matches!(
                    r,
                    Err(L3Error::RpcFail(_)
                        | L3Error::NotLeader(_)
                        | L3Error::EpochFenced(_)
                        | L3Error::Unavailable(_))
                )
                && Instant::now() + pause < deadline;
            if !retry {
                return r;
            }
            if matches!(r, Err(L3Error::RpcFail(_) | L3Error::NotLeader(_))) {
                self.broken.store(true, Ordering::Release);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(200));
        }
    }

    /// Ok in the process that connected; -1011 in a child forked after (see `pid`).
    pub(crate) fn same_process(&self) -> L3Result<()> {
        let me = std::process::id();
        if me == self.pid {
            return Ok(());
        }
        Err(L3Error::UnavailableInMode(format!(
            "this client was connected by process {} and this is process {me} (forked \
             after): its connections are the parent's; connect a client in this process",
            self.pid
        )))
    }

    /// Whether the server is the master of a split deployment (bytes live on store nodes).
    pub fn is_cluster(&self) -> bool {
        self.limits.cluster
    }

    /// The `cluster` call (store node ↔ master, cluster queries); -1010 unless the server
    /// is a master.
    pub fn cluster(&self, req: ClusterRequest) -> L3Result<ClusterReply> {
        self.same_process()?;
        self.run(self.rpc().cluster(self.ctx(), req))
    }

    /// `hello` on connection `c`: authenticates, returns the server's limits; -300 when the
    /// server speaks another protocol version (whether it refused this client or this client
    /// refuses its answer).
    fn hello_on(&self, c: &L3RpcClient) -> L3Result<ServerLimits> {
        let token = self.opts.token.clone();
        let ours = self.opts.protocol_version;
        let ctx = self.ctx();
        let hello = self
            .rt
            .block_on(within(self.call_limit(), c.hello(ctx, token, ours)))
            .map_err(|e| match self.transport_err(e) {
                // A server released before protocol versions cannot read this hello: it
                // closes the connection.
                L3Error::RpcFail(m) => L3Error::RpcFail(format!(
                    "hello (protocol {ours}): {m}; a server of a kvtier-l3 release older than \
                     protocol versions closes the connection here"
                )),
                other => other,
            })??;
        hello.limits_for(ours)
    }

    /// The RPC client, dialled again first if the connection broke. A failed dial keeps
    /// the broken one, so the call fails at once with -900 and the next one tries again.
    fn rpc(&self) -> L3RpcClient {
        if self.broken.load(Ordering::Acquire) {
            let r = self.redial();
            if let Err(e) = &r {
                tracing::debug!(error = %e, addr = %self.master_addr(), "reconnect failed");
            }
            *self.refused.lock() = r
                .err()
                .filter(|e| matches!(e, L3Error::ProtocolMismatch { .. }));
        }
        self.client.lock().clone()
    }

    /// Dials the server again and authenticates; its transfer channel may have moved.
    fn redial(&self) -> L3Result<()> {
        let (addr, epoch) = self.locator.resolve(self.leader_wait())?;
        let fresh = dial(&self.rt, addr, self.opts.max_frame_bytes, self.call_limit())?;
        // Authenticated before any other call can use it.
        let (addr, fresh, limits) = self.hello_following(addr, fresh)?;
        self.fence.admit(epoch.max(limits.epoch))?;
        *self.addr.lock() = addr;
        *self.client.lock() = fresh;
        self.broken.store(false, Ordering::Release);
        if let Some(slot) = &self.xfer
            && limits.xfer_port != 0
        {
            let xa = SocketAddr::new(addr.ip(), limits.xfer_port);
            let mut s = slot.lock();
            if s.addr != xa {
                s.addr = xa;
                s.conn = None;
            }
        }
        if let Some(shm) = &self.shm
            && let Ok(Ok(Some(offer))) = self.rt.block_on(within(
                self.call_limit(),
                self.client.lock().clone().shm_offer(self.ctx()),
            ))
        {
            shm.lock().reoffer(offer);
        }
        tracing::info!(%addr, epoch = limits.epoch, "reconnected");
        Ok(())
    }

    /// `hello` on `c` (dialled to `addr`), following a standby master's redirect to the
    /// leader (a few hops at most: a redirect names the leader etcd published, which may
    /// have just been replaced). Returns where the client ends up.
    fn hello_following(
        &self,
        mut addr: SocketAddr,
        mut c: L3RpcClient,
    ) -> L3Result<(SocketAddr, L3RpcClient, ServerLimits)> {
        // A standby that knows no serving leader yet (an election under way) is asked
        // again, as an `etcd://` client waits for a published leader.
        let deadline = Instant::now() + self.leader_wait();
        let mut hops = 0;
        loop {
            let e = match self.hello_on(&c) {
                Ok(limits) => return Ok((addr, c, limits)),
                Err(e) => e,
            };
            match redirect_of(&e) {
                Some(leader) if leader != addr && hops < 4 => {
                    tracing::info!(standby = %addr, %leader, "redirected to the leader");
                    self.redirected.store(true, Ordering::Release);
                    hops += 1;
                    addr = leader;
                    c = dial(&self.rt, addr, self.opts.max_frame_bytes, self.call_limit())?;
                }
                _ if matches!(e, L3Error::NotLeader(_)) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                _ => return Err(e),
            }
        }
    }

    /// How long a redial waits for an etcd cluster to publish a leader (one call's worth).
    fn leader_wait(&self) -> Duration {
        self.opts.leader_call_timeout
    }

    /// A transport error: -900, and a broken connection is dialled again by the next call.
    fn transport_err(&self, e: RpcError) -> L3Error {
        // Following a leader, a call past its deadline means a paused or cut-off master:
        // find the leader again rather than wait on it.
        if matches!(
            e,
            RpcError::Shutdown | RpcError::Send(_) | RpcError::Channel(_)
        ) || (self.follows_leader() && matches!(e, RpcError::DeadlineExceeded))
        {
            self.broken.store(true, Ordering::Release);
        }
        let refused = self.refused.lock().clone();
        refused.unwrap_or_else(|| rpc_err(e))
    }

    /// How long one call may take: the RPC timeout, or less while following a leader.
    fn call_timeout(&self) -> Duration {
        if self.follows_leader() {
            self.opts.rpc_timeout.min(self.opts.leader_call_timeout)
        } else {
            self.opts.rpc_timeout
        }
    }

    /// How long a call made now is waited for at most ([`within`]).
    pub(super) fn call_limit(&self) -> Duration {
        self.call_timeout() + CALL_GRACE
    }

    fn ctx(&self) -> context::Context {
        let mut c = context::current();
        c.deadline = Instant::now() + self.call_timeout();
        c
    }

    fn frame_cap(&self) -> usize {
        (self.limits.max_frame_bytes as usize).min(self.opts.max_frame_bytes)
    }

    fn check_keys(&self, n: usize) -> L3Result<()> {
        if n as u64 > self.limits.max_batch_keys {
            return Err(L3Error::InvalidParams(format!(
                "{n} keys in one batch; server limit is {}",
                self.limits.max_batch_keys
            )));
        }
        Ok(())
    }

    /// One buffer per key, and no more keys than the server takes.
    fn check_bufs(&self, keys: usize, bufs: usize) -> L3Result<()> {
        if keys != bufs {
            return Err(L3Error::InvalidParams(
                "keys and buffers differ in length".into(),
            ));
        }
        self.check_keys(keys)
    }

    /// The largest object one frame carries with the longest key and tenant.
    pub(super) fn frame_object_bytes(&self) -> u64 {
        let headroom = crate::types::MAX_KEY_LEN + crate::types::MAX_TENANT_LEN + PER_KEY_OVERHEAD;
        self.frame_cap().saturating_sub(headroom) as u64
    }

    fn check_request(&self, bytes: usize) -> L3Result<()> {
        if bytes > self.frame_cap() {
            return Err(L3Error::InvalidParams(format!(
                "request of {bytes} bytes exceeds the {}-byte frame limit",
                self.frame_cap()
            )));
        }
        Ok(())
    }

    fn run<T>(&self, f: impl Future<Output = Result<L3Result<T>, RpcError>>) -> L3Result<T> {
        let r = self
            .rt
            .block_on(within(self.call_limit(), f))
            .map_err(|e| self.transport_err(e))?;
        if let Err(L3Error::NotLeader(_)) = &r {
            // The master stepped down: find the leader again before the next call.
            self.broken.store(true, Ordering::Release);
        }
        r
    }

    /// Splits `0..n` into consecutive ranges whose `size(i)` sum stays within a chunk.
    fn chunks(&self, n: usize, size: impl Fn(usize) -> usize) -> Vec<std::ops::Range<usize>> {
        let cap = self.opts.chunk_bytes.min(self.frame_cap() / 2).max(1);
        let mut out = Vec::new();
        let mut start = 0;
        let mut acc = 0;
        for i in 0..n {
            let s = size(i) + PER_KEY_OVERHEAD;
            if i > start && acc + s > cap {
                out.push(start..i);
                start = i;
                acc = 0;
            }
            acc += s;
        }
        if start < n {
            out.push(start..n);
        }
        out
    }

    /// Runs an idempotent call on the transfer channel, reconnecting (once) when the
    /// connection is gone or broke during the previous call.
    fn with_xfer<T>(&self, f: impl FnMut(&mut XferClient) -> L3Result<T>) -> L3Result<T> {
        let Some(slot) = &self.xfer else {
            return Err(L3Error::Unavailable("no transfer channel".into()));
        };
        if self.broken.load(Ordering::Acquire) {
            // The server restarted: its transfer channel may listen elsewhere now.
            drop(self.rpc());
        }
        let mut s = slot.lock();
        let addr = s.addr;
        let r = self.on_conn(addr, &mut s.conn, Retry::Once, &mut |_| {}, f);
        if matches!(r, Err(L3Error::RpcFail(_))) {
            // Twice in a row: the server is gone or moved; the next call redials.
            self.broken.store(true, Ordering::Release);
        }
        r
    }

    /// Runs `f` on the data connection in `conn` to `addr`, opening it first if needed. A
    /// transport failure drops the connection; with `Retry::Once` (idempotent calls only) `f`
    /// runs once more on a fresh one. The one reconnect loop of the transfer channel and of
    /// the store nodes; `opened` sees each fresh connection first (a node's is asked for its
    /// shared-memory offer).
    fn on_conn<T>(
        &self,
        addr: SocketAddr,
        conn: &mut Option<XferClient>,
        retry: Retry,
        opened: &mut dyn FnMut(&mut XferClient),
        mut f: impl FnMut(&mut XferClient) -> L3Result<T>,
    ) -> L3Result<T> {
        let attempts = match retry {
            Retry::Once => 2,
            Retry::Never => 1,
        };
        let mut last = L3Error::RpcFail("data connection unavailable".into());
        for _ in 0..attempts {
            let tried = Instant::now();
            let c = match conn {
                Some(c) => c,
                None => {
                    let c = conn.insert(XferClient::connect(
                        addr,
                        self.opts.token.clone(),
                        self.frame_cap(),
                        self.opts.rpc_timeout,
                    )?);
                    opened(c);
                    c
                }
            };
            match f(c) {
                Err(L3Error::RpcFail(m)) => {
                    *conn = None;
                    if !self.may_retry(tried) {
                        return Err(L3Error::RpcFail(m));
                    }
                    last = L3Error::RpcFail(m);
                }
                other => return other,
            }
        }
        Err(last)
    }

    /// Whether a try that failed may be made again: a retry is for a connection found
    /// stale (a restarted peer), which fails at once. A try that took half the
    /// `rpc_timeout` or more met a peer that does not answer (paused, partitioned), and
    /// another would wait as long again: a get from a paused node took 2-3 × the timeout,
    /// 4-6 minutes with the Python client's default of 120 s.
    pub(super) fn may_retry(&self, tried: Instant) -> bool {
        tried.elapsed() < self.opts.rpc_timeout / 2
    }

    fn get_chunks(
        &self,
        tenant: &Tenant,
        keys: &[String],
        bufs: &mut [&mut [u8]],
        queries: Option<&[QueryResult]>,
    ) -> BatchResult<u64> {
        self.check_bufs(keys.len(), bufs.len())?;
        if let Some(shm) = &self.shm
            && let ShmOutcome::Done(r) = shm.lock().get(tenant, keys, queries, bufs)
        {
            return r;
        }
        if self.xfer.is_some() {
            return self.with_xfer(|x| x.get(tenant, keys, queries, bufs));
        }
        let ranges = self.chunks(keys.len(), |i| bufs[i].len());
        let client = self.rpc();
        let limit = self.call_limit();
        let calls = ranges.iter().map(|r| {
            let ctx = self.ctx();
            let c = client.clone();
            let t = tenant.clone();
            match queries {
                Some(q) => {
                    let qs = q[r.clone()].to_vec();
                    async move { within(limit, c.batch_get_with_query(ctx, t, qs)).await }.boxed()
                }
                None => {
                    let ks = keys[r.clone()].to_vec();
                    async move { within(limit, c.batch_get(ctx, t, ks)).await }.boxed()
                }
            }
        });
        let replies = self.rt.block_on(join_all(calls));
        let mut out = Vec::with_capacity(keys.len());
        for (r, reply) in ranges.iter().zip(replies) {
            let per_key = reply.map_err(|e| self.transport_err(e))??;
            if per_key.len() != r.len() {
                return Err(L3Error::RpcFail("reply length mismatch".into()));
            }
            for (i, res) in r.clone().zip(per_key) {
                out.push(res.and_then(|blob| {
                    let b = blob.as_slice();
                    let have = bufs[i].len() as u64;
                    if (b.len() as u64) > have {
                        return Err(L3Error::BufferOverflow {
                            needed: b.len() as u64,
                            have,
                        });
                    }
                    bufs[i][..b.len()].copy_from_slice(b);
                    Ok(b.len() as u64)
                }));
            }
        }
        Ok(out)
    }
}
