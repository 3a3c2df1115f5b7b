//! The tarpc server: a [`Backend`] behind the [`L3Rpc`] service, plus the loopback
//! Prometheus endpoint. The backend is an [`EmbeddedStore`] (`--role both`: metadata and
//! bytes in this process) or a [`crate::cluster::ClusterMaster`] (`--role master`: metadata
//! only, bytes on store nodes).
//!
//! Why these choices:
//! - Loopback by default: the store has no per-tenant authentication beyond the optional
//!   shared-secret token, so exposure beyond the host is an explicit operator decision.
//! - Frame limit raised to 64 MiB by default (tokio-util's default is 8 MiB, too small for a
//!   batch of 1 MiB objects); clients split batches below it and learn it from `hello`.
//! - A malformed or oversized frame only closes *that* connection (tarpc/tokio-util reject
//!   it); the listener and other connections keep serving.
//! - Peers without the token hold little (`limits`): a connection must authenticate within
//!   [`ServerOptions::hello_timeout`] and sends frames of at most 64 KiB until it has; the
//!   connections are capped, unauthenticated ones more tightly, the oldest of those making
//!   room for a new one; a failed accept (out of descriptors) pauses the accept loop.
//! - Every connection holds at most [`ServerOptions::max_requests_per_connection`] requests
//!   at once: at the cap the server stops reading it until a reply is written (`flow`), and
//!   one whose replies are not read, or that leaves a frame half-sent, for
//!   [`ServerOptions::rpc_stall_timeout`] is dropped (`limits::FrameGuard`).
//! - Shutdown stops accepting, then flushes the SSD queue, so every put acknowledged as
//!   persisted (and every queued write-through) is on disk before the process exits.
//!
//! The per-connection service (authentication, blocking pool vs inline) is in `conn`.

mod conn;
mod flow;
pub mod limits;
mod refusals;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::prelude::*;
use tarpc::server::{self, Channel};
use tarpc::tokio_util::codec::LengthDelimitedCodec;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use super::accept::TokenDigest;
use super::codec::ClampedBincode;
use super::service::{
    ClusterReply, ClusterRequest, L3Rpc, ServerLimits, announced_protocol_version,
};
use super::shm::{ShmMode, ShmServer};
use super::xfer::{XferHandler, XferServer};
use crate::api::{BatchResult, L3Store};
use crate::cluster::ClusterMaster;
use crate::error::{L3Error, L3Result};
use crate::store::EmbeddedStore;
use crate::types::{Blob, QueryResult, Tenant};

use conn::Conn;
use limits::{ConnGuard, FrameGuard, Registry, accept_loop};

/// Default frame limit (above tarpc's 8 MiB default).
pub const DEFAULT_MAX_FRAME: usize = 64 << 20;
/// Default of [`ServerOptions::hello_timeout`].
pub const DEFAULT_HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Default of [`ServerOptions::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// Default of [`ServerOptions::max_unauthenticated`].
pub const DEFAULT_MAX_UNAUTHENTICATED: usize = 256;
/// Default of [`ServerOptions::xfer_write_timeout`].
pub const DEFAULT_XFER_WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default of [`ServerOptions::max_requests_per_connection`].
pub const DEFAULT_MAX_REQUESTS_PER_CONNECTION: usize = 16;
/// Default of [`ServerOptions::rpc_stall_timeout`].
pub const DEFAULT_RPC_STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// How to serve.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// RPC listen address (default 127.0.0.1:0, an ephemeral port).
    pub addr: SocketAddr,
    /// Shared-secret token clients must present in `hello` (None = no token).
    pub token: Option<String>,
    /// The token's digest, for a server not given the token itself (an HA leader loads it
    /// from etcd); used only when `token` is None.
    pub token_digest: Option<TokenDigest>,
    /// Largest frame accepted or sent.
    pub max_frame_bytes: usize,
    /// Prometheus endpoint (None = off). Must be a loopback address.
    pub metrics_addr: Option<SocketAddr>,
    /// Also serve the transfer channel (bulk reads, batched probes) on an ephemeral port
    /// of the same address; advertised to clients by `hello`.
    pub transfer_channel: bool,
    /// Serve the shared-memory path to clients on this host (see [`crate::rpc::shm`]);
    /// defaults to `KVTIER_L3_SHM` (on unless it says `off`).
    pub shm: ShmMode,
    /// Directory of the shared-memory socket (None: the system's temporary directory).
    pub shm_dir: Option<std::path::PathBuf>,
    /// An RPC connection that has not said a valid hello this long after it was accepted
    /// is closed.
    pub hello_timeout: Duration,
    /// Most RPC connections at once; never more than half the process's descriptor limit
    /// (`RLIMIT_NOFILE`). Past it, a new connection closes the oldest unauthenticated one,
    /// or is closed at once when all are authenticated.
    pub max_connections: usize,
    /// Most RPC connections that have not authenticated yet (within `max_connections`);
    /// past it, a new connection closes the oldest of them.
    pub max_unauthenticated: usize,
    /// A write on an authenticated transfer-channel connection that makes no progress for
    /// this long (the peer does not read its reply) drops the connection, and with it the
    /// reply's hold on the objects it was sending.
    pub xfer_write_timeout: Duration,
    /// Most requests of one RPC connection the server holds at once (read, not yet
    /// answered on the wire). At the cap the server stops reading the connection until a
    /// reply is written: a client that does not read its replies holds at most this many.
    pub max_requests_per_connection: usize,
    /// An RPC connection whose replies make no progress for this long (the peer does not
    /// read them), or that leaves a frame half-sent this long, is dropped.
    pub rpc_stall_timeout: Duration,
    /// The protocol version this server announces and requires of its clients: always
    /// [`PROTOCOL_VERSION`](crate::rpc::service::PROTOCOL_VERSION) but in tests playing a
    /// server of another version (default: [`announced_protocol_version`]).
    #[doc(hidden)]
    pub protocol_version: u32,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            token: None,
            token_digest: None,
            max_frame_bytes: DEFAULT_MAX_FRAME,
            metrics_addr: None,
            transfer_channel: true,
            shm: ShmMode::from_env(),
            shm_dir: None,
            hello_timeout: DEFAULT_HELLO_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_unauthenticated: DEFAULT_MAX_UNAUTHENTICATED,
            xfer_write_timeout: DEFAULT_XFER_WRITE_TIMEOUT,
            max_requests_per_connection: DEFAULT_MAX_REQUESTS_PER_CONNECTION,
            rpc_stall_timeout: DEFAULT_RPC_STALL_TIMEOUT,
            protocol_version: announced_protocol_version(),
        }
    }
}

/// What the tarpc server serves: the [`L3Store`] operations plus the server-side extras.
pub trait Backend: L3Store + 'static {
    /// Most keys per batch.
    fn max_batch_keys(&self) -> usize;
    /// Whether this is the master of a split deployment (bytes live on store nodes).
    fn is_cluster_master(&self) -> bool {
        false
    }
    /// Reads objects as wire blobs (DRAM replicas without a copy).
    fn get_blobs(&self, tenant: &Tenant, keys: &[String]) -> BatchResult<Blob>;
    /// Reads objects reusing query results, as wire blobs.
    fn get_with_query_blobs(&self, tenant: &Tenant, queries: &[QueryResult]) -> BatchResult<Blob>;
    /// Prometheus text.
    fn render_metrics(&self) -> String;
    /// What the transfer channel serves (None: no transfer channel).
    fn xfer_handler(self: Arc<Self>) -> Option<Arc<dyn XferHandler>>;
    /// The store the shared-memory path serves (None: no shared-memory path).
    fn shm_store(self: Arc<Self>) -> Option<Arc<EmbeddedStore>> {
        None
    }
    /// The `cluster` call (node ↔ master); -1010 unless this is a master.
    /// Leader epoch advertised by `hello` (etcd HA masters; 0 otherwise).
    fn epoch(&self) -> u64 {
        0
    }
    /// Ok while this server may answer calls (an etcd HA master: while it surely holds its
    /// leader lease); checked before and after every call.
    fn gate(&self) -> L3Result<()> {
        Ok(())
    }
    fn cluster(&self, _req: ClusterRequest) -> L3Result<ClusterReply> {
        Err(L3Error::Unavailable(
            "not a master (start one with `kvtier-l3 --role master`)".into(),
        ))
    }
}

impl Backend for EmbeddedStore {
    fn max_batch_keys(&self) -> usize {
        self.config().max_batch_keys
    }
    fn get_blobs(&self, tenant: &Tenant, keys: &[String]) -> BatchResult<Blob> {
        self.batch_get_blobs(tenant, keys)
    }
    fn get_with_query_blobs(&self, tenant: &Tenant, queries: &[QueryResult]) -> BatchResult<Blob> {
        self.batch_get_with_query_blobs(tenant, queries)
    }
    fn render_metrics(&self) -> String {
        EmbeddedStore::render_metrics(self)
    }
    fn xfer_handler(self: Arc<Self>) -> Option<Arc<dyn XferHandler>> {
        Some(self)
    }
    fn shm_store(self: Arc<Self>) -> Option<Arc<EmbeddedStore>> {
        Some(self)
    }
}

/// A running server. Dropping it (or [`ServerHandle::shutdown`]) stops accepting and flushes
/// the store's SSD queue.
pub struct ServerHandle {
    /// Bound RPC address.
    pub addr: SocketAddr,
    /// Bound metrics address.
    pub metrics_addr: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    store: Arc<EmbeddedStore>,
    rt: Option<tokio::runtime::Runtime>,
}

impl ServerHandle {
    /// Stops accepting connections, then flushes queued SSD writes.
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        let _ = self.stop.send(true);
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(std::time::Duration::from_secs(2));
        }
        if let Err(e) = self.store.flush() {
            tracing::warn!(error = %e, "flush at shutdown: queued SSD writes may be lost");
        }
    }

    /// The served store.
    pub fn store(&self) -> &Arc<EmbeddedStore> {
        &self.store
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// Starts a server on its own runtime (2 worker threads) and returns once it listens.
pub fn spawn_server(store: Arc<EmbeddedStore>, opts: ServerOptions) -> L3Result<ServerHandle> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvtier-l3-server")
        .enable_all()
        .build()
        .map_err(|e| L3Error::Internal(format!("runtime: {e}")))?;
    let (stop, stop_rx) = watch::channel(false);
    let (addr, metrics_addr) = rt.block_on(start(store.clone(), opts, stop_rx))?;
    Ok(ServerHandle {
        addr,
        metrics_addr,
        stop,
        store,
        rt: Some(rt),
    })
}

/// A metadata-only master of a split deployment served on its own runtime, in this
/// process (tests and benchmarks; the `kvtier-l3 --role master` binary does the same).
/// Dropping it stops serving and the master's sweeper.
pub struct ClusterMasterHandle {
    /// Bound RPC address (what nodes and clients connect to).
    pub addr: SocketAddr,
    stop: watch::Sender<bool>,
    master: Arc<ClusterMaster>,
    rt: Option<tokio::runtime::Runtime>,
}

impl ClusterMasterHandle {
    /// The served master.
    pub fn master(&self) -> &Arc<ClusterMaster> {
        &self.master
    }
}

impl Drop for ClusterMasterHandle {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(std::time::Duration::from_secs(2));
        }
        self.master.shutdown();
    }
}

/// Starts a [`ClusterMaster`] server on its own runtime (2 worker threads) and returns once
/// it listens.
pub fn spawn_cluster_master(
    master: Arc<ClusterMaster>,
    opts: ServerOptions,
) -> L3Result<ClusterMasterHandle> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvtier-l3-master")
        .enable_all()
        .build()
        .map_err(|e| L3Error::Internal(format!("runtime: {e}")))?;
    let (stop, stop_rx) = watch::channel(false);
    let (addr, _) = rt.block_on(start(master.clone(), opts, stop_rx))?;
    Ok(ClusterMasterHandle {
        addr,
        stop,
        master,
        rt: Some(rt),
    })
}

/// Binds and spawns the RPC listener (and metrics endpoint) on the current runtime; both
/// stop when `stop` turns true. Returns the bound addresses.
pub async fn start<B: Backend>(
    store: Arc<B>,
    opts: ServerOptions,
    stop: watch::Receiver<bool>,
) -> L3Result<(SocketAddr, Option<SocketAddr>)> {
    ShmMode::try_from_env()?;
    if opts.hello_timeout.is_zero()
        || opts.xfer_write_timeout.is_zero()
        || opts.rpc_stall_timeout.is_zero()
        || opts.max_requests_per_connection == 0
    {
        return Err(L3Error::InvalidParams(
            "hello_timeout, xfer_write_timeout, rpc_stall_timeout and \
             max_requests_per_connection must be positive"
                .into(),
        ));
    }
    let listener = tokio::net::TcpListener::bind(opts.addr)
        .await
        .map_err(|e| L3Error::Unavailable(format!("bind {}: {e}", opts.addr)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| L3Error::Internal(e.to_string()))?;
    let token: Option<TokenDigest> = opts
        .token
        .as_deref()
        .map(TokenDigest::of)
        .or(opts.token_digest);
    let handler = if opts.transfer_channel {
        store.clone().xfer_handler()
    } else {
        None
    };
    let xfer = match handler {
        Some(h) => Some(XferServer::start(
            h,
            SocketAddr::new(addr.ip(), 0),
            token,
            opts.max_frame_bytes,
            opts.xfer_write_timeout,
        )?),
        None => None,
    };
    let limits = ServerLimits {
        max_frame_bytes: opts.max_frame_bytes as u64,
        max_batch_keys: store.max_batch_keys() as u64,
        max_object_bytes: store.max_object_bytes(),
        xfer_port: xfer.as_ref().map(|x| x.addr.port()).unwrap_or(0),
        cluster: store.is_cluster_master(),
        epoch: store.epoch(),
    };
    let shm = start_shm(&store, &opts, token);
    let offer = Arc::new(shm.as_ref().map(|s| s.offer.clone()));
    if xfer.is_some() || shm.is_some() {
        let mut stop_x = stop.clone();
        tokio::spawn(async move {
            let _ = stop_x.wait_for(|s| *s).await;
            let _ = tokio::task::spawn_blocking(move || drop((xfer, shm))).await;
        });
    }
    let max_live = opts.max_connections.min(descriptor_share());
    if max_live < opts.max_connections {
        tracing::info!(
            max_connections = max_live,
            asked = opts.max_connections,
            "RPC connections capped at half the descriptor limit (RLIMIT_NOFILE)"
        );
    }
    let registry = Registry::new(max_live, opts.max_unauthenticated);
    let rpc_registry = registry.clone();
    let flow = Flow {
        max_frame: opts.max_frame_bytes,
        hello_timeout: opts.hello_timeout,
        max_requests: opts.max_requests_per_connection,
        stall: opts.rpc_stall_timeout,
    };
    let st = store.clone();
    let version = opts.protocol_version;
    tokio::spawn(accept_loop(
        "RPC",
        listener,
        stop.clone(),
        move |sock: tokio::net::TcpStream| {
            // Refused (every connection authenticated, at the cap): closed here.
            let Some(guard) = registry.admit(flow.max_frame) else {
                return;
            };
            let conn = Conn {
                store: st.clone(),
                token,
                state: guard.state().clone(),
                limits,
                version,
                shm: offer.clone(),
            };
            serve_rpc(sock, guard, conn, flow);
        },
    ));
    let metrics_addr = match opts.metrics_addr {
        None => None,
        Some(m) => Some(start_metrics(store, rpc_registry, m, stop).await?),
    };
    Ok((addr, metrics_addr))
}

/// Half the process's descriptor limit: the most RPC connections it may hold (the other
/// half for the SSD tier, the other listeners, etcd).
fn descriptor_share() -> usize {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return usize::MAX;
    }
    usize::try_from(r.rlim_cur / 2).unwrap_or(usize::MAX)
}

/// The limits of one RPC connection.
#[derive(Debug, Clone, Copy)]
struct Flow {
    max_frame: usize,
    hello_timeout: Duration,
    max_requests: usize,
    stall: Duration,
}

/// Serves one RPC connection on its own task: closed when it has not authenticated within
/// `hello_timeout`, or earlier to make room for a newer one while it has not; when its
/// replies or a frame it sends stall for `stall`. At most `max_requests` of its requests
/// are held at once.
fn serve_rpc<B: Backend>(sock: tokio::net::TcpStream, guard: ConnGuard, conn: Conn<B>, flow: Flow) {
    if let Err(e) = sock.set_nodelay(true) {
        tracing::debug!(error = %e, "TCP_NODELAY");
    }
    let state = guard.state().clone();
    let hello_timeout = flow.hello_timeout;
    let framed = LengthDelimitedCodec::builder()
        .max_frame_length(flow.max_frame)
        .new_framed(FrameGuard::new(sock, state.clone(), flow.stall));
    let transport = tarpc::serde_transport::new(framed, ClampedBincode::default());
    let (transport, gate) = flow::Gated::new(transport);
    let channel = flow::Bounded::new(
        server::BaseChannel::with_defaults(transport),
        gate,
        flow.max_requests,
        state.clone(),
    );
    tokio::spawn(async move {
        // Gives the connection's place back when the connection ends, however it ends.
        let _guard = guard;
        let serve = channel.execute(conn.serve()).for_each(|fut| async move {
            tokio::spawn(fut);
        });
        tokio::pin!(serve);
        tokio::select! {
            _ = &mut serve => return,
            _ = state.evicted() => return,
            _ = tokio::time::sleep(hello_timeout) => {}
        }
        // Dropping `serve` closes the connection.
        if state.is_authed() {
            serve.await;
        }
    });
}

/// The shared-memory listener, when enabled and the backend has one; a failure to start it
/// only leaves clients on TCP.
fn start_shm<B: Backend>(
    store: &Arc<B>,
    opts: &ServerOptions,
    token: Option<TokenDigest>,
) -> Option<ShmServer> {
    if opts.shm == ShmMode::Off {
        return None;
    }
    let s = store.clone().shm_store()?;
    let dir = opts.shm_dir.clone().unwrap_or_else(std::env::temp_dir);
    match ShmServer::start(s, &dir, token, opts.max_frame_bytes) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "shared-memory path unavailable; TCP only");
            None
        }
    }
}

/// The RPC port's gauges: connections, and requests read but not yet answered on the wire.
fn render_rpc_metrics(rpc: &Registry) -> String {
    let (authed, pending) = rpc.counts();
    format!(
        "# HELP kvtier_l3_rpc_connections Open RPC connections.\n\
         # TYPE kvtier_l3_rpc_connections gauge\n\
         kvtier_l3_rpc_connections {}\n\
         # HELP kvtier_l3_rpc_requests_in_flight RPC requests read and not yet answered on the wire.\n\
         # TYPE kvtier_l3_rpc_requests_in_flight gauge\n\
         kvtier_l3_rpc_requests_in_flight {}\n",
        authed + pending,
        rpc.in_flight()
    )
}

/// Most connections the metrics endpoint holds; past it, a new one closes the oldest.
pub const METRICS_MAX_CONNECTIONS: usize = 64;
/// How long a metrics connection may take, from accept to the last byte of the answer.
pub const METRICS_DEADLINE: Duration = Duration::from_secs(10);

async fn start_metrics<B: Backend>(
    store: Arc<B>,
    rpc: Arc<Registry>,
    addr: SocketAddr,
    stop: watch::Receiver<bool>,
) -> L3Result<SocketAddr> {
    if !addr.ip().is_loopback() {
        return Err(L3Error::InvalidParams(
            "metrics endpoint must be on loopback".into(),
        ));
    }
    let l = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| L3Error::Unavailable(format!("bind metrics {addr}: {e}")))?;
    let bound = l
        .local_addr()
        .map_err(|e| L3Error::Internal(e.to_string()))?;
    // Scrapers never authenticate: every connection counts as pending, the oldest closed
    // to make room for a new one.
    let registry = Registry::new(METRICS_MAX_CONNECTIONS, METRICS_MAX_CONNECTIONS);
    tokio::spawn(accept_loop(
        "metrics",
        l,
        stop,
        move |mut sock: tokio::net::TcpStream| {
            let Some(guard) = registry.admit(0) else {
                return;
            };
            let store = store.clone();
            let rpc = rpc.clone();
            tokio::spawn(async move {
                let answer = async {
                    let mut buf = [0u8; 4096];
                    let _ = sock.read(&mut buf).await;
                    let body = store.render_metrics() + &render_rpc_metrics(&rpc);
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = sock.write_all(resp.as_bytes()).await;
                    let _ = sock.shutdown().await;
                };
                tokio::select! {
                    _ = answer => {}
                    _ = tokio::time::sleep(METRICS_DEADLINE) => {}
                    _ = guard.state().evicted() => {}
                }
            });
        },
    ));
    Ok(bound)
}
