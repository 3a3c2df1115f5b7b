//! The `kvtier-l3` command line (also `kvtier l3 …`): the L3 store as a server process.
//!
//! Why a binary: when one engine process is not enough (several engines sharing one L3),
//! the embedded store moves behind tarpc. Three roles:
//! - `both` (default): master metadata, a memory segment and the SSD tier in one process;
//! - `master`: metadata only (placement, leases, pins, eviction, node liveness);
//! - `node --master ADDR`: mounts a memory segment (and an SSD tier) with the master, pings
//!   it, and serves the bytes on its data channel.
//!
//! Each listens on 127.0.0.1 unless told otherwise, prints `LISTENING <addr>` (and
//! `METRICS <addr>`) on stdout once ready (a node: once mounted, with its data address), and
//! on SIGTERM/SIGINT stops accepting, flushes queued SSD writes and exits 0 — nothing
//! acknowledged as persisted is lost, and a restart rescans the buckets.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use crate::rpc::server::{
    Backend, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_FRAME, DEFAULT_MAX_REQUESTS_PER_CONNECTION,
    DEFAULT_RPC_STALL_TIMEOUT, ServerOptions, start,
};
use crate::rpc::shm::ShmMode;
use crate::{
    ClientId, ClusterMaster, EmbeddedStore, L3Store, NodeOptions, OffloadMode, PromotionConfig,
    SsdConfig, StoreConfig, StoreNode,
};
use clap::{CommandFactory, FromArgMatches, Parser, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Role {
    /// Master metadata, memory segment and SSD tier in this one process.
    Both,
    /// Metadata only: store nodes mount segments and hold the bytes.
    Master,
    /// A store node: mounts a segment (and --ssd-dir) with --master, serves its bytes.
    Node,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Mode {
    /// Every put is written to SSD after PutEnd.
    WriteThrough,
    /// Objects go to SSD when DRAM eviction drops them.
    OnEvict,
}

#[derive(Debug, Parser)]
#[command(
    name = "kvtier-l3",
    about = "kvtier L3 store server (Mooncake-compatible)",
    after_help = "Roles:\n  \
        --role both                one process: metadata, DRAM segment and SSD tier (default)\n  \
        --role master              metadata only; clients connect here\n  \
        --role node --master ADDR  a store node: DRAM segment (+ --ssd-dir), serves its bytes\n\n\
        A node that stops pinging for --client-ttl-ms (set on the master) is declared dead: its\n\
        memory replicas are dropped; its SSD replicas stay registered and are readable again\n\
        once it restarts with the same --node-id and --ssd-dir."
)]
struct Args {
    /// Roles served by this process.
    #[arg(long, value_enum, default_value = "both")]
    role: Role,
    /// Listen address: RPC for both/master (default 127.0.0.1:50051), data channel for a
    /// node (default 127.0.0.1:50052).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Node role: the master's RPC address, or `etcd://h:p;h:p[/CLUSTER]` to follow the
    /// leader of an etcd HA cluster.
    #[arg(long)]
    master: Option<String>,
    /// Master role: etcd endpoints (`h:p,h:p`, `http://h:p` or `etcd://h:p;h:p`; a host is
    /// an IPv4 address, `[IPv6]` or a DNS name, a port 1 to 65535: anything else is refused
    /// at startup, naming it). Several masters campaign; the leader serves, the others wait
    /// to take over (see docs/l3/ha.md). Replaces --state-dir: the settle
    /// state lives in etcd.
    #[arg(long, conflicts_with_all = ["state_dir", "no_state_dir"])]
    etcd: Option<String>,
    /// Master role with --etcd: the cluster name (its keys are under /kvtier/NAME/).
    #[arg(long, default_value = "default")]
    cluster: String,
    /// Master role with --etcd: the leader lease TTL in seconds, 1 to 3600. A dead leader
    /// is replaced after about this long (one that resigns on SIGTERM, at once). How soon an
    /// elected master serves does not depend on it: candidates and standbys look at the
    /// leader key every TTL/10, at most every 0.5 s.
    #[arg(
        long,
        default_value_t = 5,
        value_parser = clap::value_parser!(u64).range(
            *crate::ha::election::LEADER_TTL_S.start()..=*crate::ha::election::LEADER_TTL_S.end()
        )
    )]
    leader_ttl_s: u64,
    /// Node role: deadline of one call on the master, in milliseconds (with an etcd
    /// locator, a paused leader costs this before the node looks for the next one).
    /// Positive (0 was taken as 1 ms: every call timed out).
    #[arg(long, default_value_t = 10_000, value_parser = positive_ms)]
    master_timeout_ms: u64,
    /// Node role: node id (> 0; keep it across restarts so its SSD replicas are recognised).
    #[arg(long, default_value_t = 1)]
    node_id: u64,
    /// Node role: ping period in milliseconds (keep it well under the master's TTL).
    #[arg(long, default_value_t = 1_000)]
    ping_ms: u64,
    /// Prometheus metrics address (loopback only); omit to disable.
    #[arg(long)]
    metrics: Option<SocketAddr>,
    /// File holding the shared-secret token (the env var KVTIER_L3_TOKEN also works).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// DRAM segment size in bytes.
    #[arg(long, default_value_t = 1 << 30)]
    segment_bytes: u64,
    /// SSD tier directory (omit for DRAM only).
    #[arg(long)]
    ssd_dir: Option<PathBuf>,
    /// SSD capacity in bytes (positive); never more than the filesystem holds (the tier's use
    /// plus the free space).
    #[arg(long, default_value_t = 64 << 30, value_parser = clap::value_parser!(u64).range(1..))]
    ssd_capacity: u64,
    /// SSD offload mode.
    #[arg(long, value_enum, default_value = "write-through")]
    offload: Mode,
    /// Promote an SSD-only object to DRAM when reads hit it (Mooncake's master flag
    /// `--promotion_on_hit`), evicting cold DRAM copies of objects already on SSD to make
    /// room (never an object's only copy).
    #[arg(long)]
    promotion_on_hit: bool,
    /// With --promotion-on-hit: reads of an SSD-only object before it is promoted
    /// (Mooncake's `--promotion_admission_threshold`; clamped to 1..=255).
    #[arg(long, default_value_t = 2)]
    promotion_admission_threshold: u32,
    /// Read lease in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    lease_ms: u64,
    /// A put started but not ended within this many milliseconds is revoked (master,
    /// both), and its bytes dropped (node): Mooncake's `put_start_discard_timeout`.
    /// Positive (0 was taken as 1 ms: puts were revoked mid-flight, not left unbounded).
    #[arg(long, default_value_t = 30_000, value_parser = positive_ms)]
    put_timeout_ms: u64,
    /// Client (node) liveness TTL in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    client_ttl_ms: u64,
    /// Largest frame in bytes (at least 64 KiB: a smaller one refuses every request).
    #[arg(long, default_value_t = DEFAULT_MAX_FRAME, value_parser = frame_bytes)]
    max_frame: usize,
    /// Most RPC connections at once (positive; at most half the open-file limit, which
    /// the server raises to its hard limit). Past it, a new connection closes the oldest
    /// one that has not authenticated (at most 256 of those), or is closed at once.
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS, value_parser = positive)]
    max_connections: usize,
    /// Most requests of one RPC connection held at once; at the cap the server reads no more
    /// of that connection until it has written a reply (positive).
    #[arg(long, default_value_t = DEFAULT_MAX_REQUESTS_PER_CONNECTION, value_parser = positive)]
    max_requests_per_connection: usize,
    /// An RPC connection whose replies make no progress (its peer does not read them), or
    /// that leaves a frame half-sent, for this many milliseconds is dropped (positive).
    #[arg(long, default_value_t = DEFAULT_RPC_STALL_TIMEOUT.as_millis() as u64, value_parser = positive_ms)]
    rpc_stall_timeout_ms: u64,
    /// Most keys per batch.
    #[arg(long, default_value_t = 65_536)]
    max_batch_keys: usize,
    /// Keys the loss journal keeps for engines reading what the store evicted or removed
    /// (`L3Store::losses_since`); 0 turns it off.
    #[arg(long, default_value_t = 65_536)]
    loss_journal_keys: usize,
    /// Largest object in bytes.
    #[arg(long, default_value_t = 32 << 20)]
    max_object_bytes: u64,
    /// Do not serve the transfer channel (bulk reads and probes then go through tarpc).
    #[arg(long)]
    no_transfer_channel: bool,
    /// Do not serve the shared-memory path to clients on this host (they then use TCP;
    /// `KVTIER_L3_SHM=off` does the same).
    #[arg(long)]
    no_shm: bool,
    /// Directory of the shared-memory socket (default: the system's temporary directory).
    #[arg(long)]
    shm_dir: Option<PathBuf>,
    /// Master role: directory of its durable state (the settle log: tombstones and write
    /// cancels its nodes have not acknowledged). Required, so that a restarted master never
    /// brings back a removed key, unless --no-state-dir.
    #[arg(long, conflicts_with = "no_state_dir")]
    state_dir: Option<PathBuf>,
    /// Master role: keep settles in memory only. A master restart may then bring back keys
    /// removed shortly before it (their SSD records on nodes that had not heard yet).
    #[arg(long)]
    no_state_dir: bool,
    /// Recycled object buffers kept once the store is idle, in bytes; the rest are freed
    /// and free heap pages returned to the system (both/node roles).
    #[arg(long, default_value_t = 64 << 20)]
    recycle_idle_bytes: u64,
    /// The store is idle after this many milliseconds without an operation.
    #[arg(long, default_value_t = 5_000)]
    idle_trim_ms: u64,
    /// Master role with --state-dir: after a restart, clients are answered -1010 until every
    /// store node it knew has mounted again and reported its SSD records, or this many
    /// milliseconds have passed (the late nodes are then fenced: their old records are
    /// dropped when they come back).
    #[arg(long, default_value_t = 30_000)]
    rebuild_timeout_ms: u64,
    /// Cap a tenant's DRAM bytes: NAME=BYTES (repeatable). A put past the cap evicts that
    /// tenant's own objects first, and fails with -200 when it cannot make room.
    #[arg(long = "tenant-quota", value_parser = parse_quota)]
    tenant_quota: Vec<(String, u64)>,
    /// The role-bound flags given on the command line (`cli_roles`).
    #[arg(skip)]
    flags_given: Vec<&'static str>,
    /// Most capacity, in all, that clients may mount as segments this server holds the bytes
    /// of (a Mooncake client's `global_segment_size`); a mount past it answers -200.
    /// Default: the host's physical memory (`MemTotal`).
    #[arg(long)]
    client_segments_max_bytes: Option<u64>,
    /// Publish the store's residency as KV cache events for KV-aware routers (vLLM's wire
    /// format, medium STORAGE): the ZMQ PUB endpoint to bind, `tcp://HOST:PORT` or
    /// `ipc://PATH` (see docs/l3/kv-events.md). Roles both and master; with
    /// --etcd only the leader binds it.
    #[arg(long, value_parser = parse_endpoint)]
    kv_events: Option<String>,
    /// With --kv-events: the replay endpoint (gap recovery and snapshots for subscribers).
    #[arg(long, value_parser = parse_endpoint, requires = "kv_events")]
    kv_events_replay: Option<String>,
    /// With --kv-events: publish only keys of this namespace (repeatable; default: every
    /// namespace). Keys are `{namespace}:{page hash hex}:{rank}`.
    #[arg(long, requires = "kv_events")]
    kv_events_namespace: Vec<String>,
    /// One more event stream, of one namespace's pages: `NAMESPACE=PUB[,REPLAY][,parts=N]`
    /// (ZMQ endpoints as for --kv-events; `parts=N` overrides --kv-events-parts-per-page for
    /// this stream; repeatable). Each stream has its own sequence numbers, replay socket and
    /// topic (the namespace), so the routers of several models sharing this store each
    /// follow their own (`kvtier-router --storage …,topic=NAMESPACE`).
    #[arg(long = "kv-events-stream", value_parser = parse_stream)]
    kv_events_stream: Vec<StreamArg>,
    /// With --kv-events or --kv-events-stream: the `block_size` (tokens per page) stated in
    /// `BlockStored`.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    kv_events_block_size: u32,
    /// With --kv-events or --kv-events-stream: publish a page once this many of its parts
    /// (the engines' tensor-parallel ranks × KV groups) are readable under one tenant and
    /// namespace, and remove it when none keeps that many (default 1: while any part is
    /// readable).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    kv_events_parts_per_page: u32,
}

fn parse_endpoint(s: &str) -> Result<String, String> {
    crate::kv_events::check_endpoint(s)
        .map(|()| s.to_string())
        .map_err(|e| e.to_string())
}

/// A `--kv-events-stream` value: the stream, and its own part count if it names one.
#[derive(Clone, Debug)]
struct StreamArg {
    cfg: crate::kv_events::KvEventsConfig,
    parts: Option<u32>,
}

fn parse_stream(s: &str) -> Result<StreamArg, String> {
    let usage = || format!("expected NAMESPACE=PUB[,REPLAY][,parts=N], got {s:?}");
    let (ns, rest) = s.split_once('=').ok_or_else(usage)?;
    let mut items = rest.split(',');
    let events = parse_endpoint(items.next().unwrap_or_default())?;
    let mut cfg = crate::kv_events::KvEventsConfig::for_namespace(ns, events);
    let mut parts = None;
    for item in items {
        if let Some(n) = item.strip_prefix("parts=") {
            let n = n
                .parse::<u32>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("parts={n:?} in {s:?}: a positive integer"))?;
            parts = parts.map_or(Ok(Some(n)), |_| Err(usage()))?;
        } else if cfg.replay_endpoint.is_none() {
            cfg.replay_endpoint = Some(parse_endpoint(item)?);
        } else {
            return Err(usage());
        }
    }
    cfg.validate().map_err(|e| e.to_string())?;
    Ok(StreamArg { cfg, parts })
}

fn parse_quota(s: &str) -> Result<(String, u64), String> {
    let (name, bytes) = s
        .split_once('=')
        .ok_or_else(|| format!("expected NAME=BYTES, got {s:?}"))?;
    crate::types::Tenant::new(name).map_err(|e| e.to_string())?;
    let bytes = bytes
        .parse::<u64>()
        .map_err(|e| format!("bad byte count in {s:?}: {e}"))?;
    Ok((name.to_string(), bytes))
}

/// The address a starting `kvtier-l3` prints on the first line of its stdout
/// (`LISTENING <addr>`), for whoever launched it (benchmarks, the chaos tool, tests).
pub fn read_listening(stdout: impl std::io::Read) -> Result<SocketAddr, String> {
    use std::io::BufRead;
    let mut line = String::new();
    std::io::BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    line.trim()
        .strip_prefix("LISTENING ")
        .ok_or_else(|| format!("unexpected first line {line:?}"))?
        .parse()
        .map_err(|e| format!("bad address in {line:?}: {e}"))
}

/// Parses `args` (the first item is the program name) and runs the server role they name
/// until SIGTERM/SIGINT. Used by the `kvtier-l3` binary and by `kvtier l3`.
pub fn main_with_args<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let parsed = Args::command().try_get_matches_from(args).and_then(|m| {
        let mut a = Args::from_arg_matches(&m)?;
        a.flags_given = crate::cli_roles::flags_given(&m);
        Ok(a)
    });
    let args = match parsed {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let token = match read_token(&args) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("kvtier-l3: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = ShmMode::try_from_env() {
        eprintln!("kvtier-l3: {e}");
        return ExitCode::from(2);
    }
    raise_descriptor_limit();
    ignore_file_size_signal();
    match run(args, token) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvtier-l3: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Raises the soft open-file limit to the hard one (best effort), as the connection caps
/// assume: RPC connections may take half of it (`ServerOptions::max_connections`).
fn raise_descriptor_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write only the struct given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                tracing::debug!("could not raise the open-file limit");
            }
        }
    }
}

/// Ignores SIGXFSZ, so that a write past the file size limit (`RLIMIT_FSIZE`, `ulimit -f`)
/// fails with EFBIG — a failed SSD write (-1103, nothing registered, the DRAM copy served) —
/// instead of killing the process (the signal's default action).
fn ignore_file_size_signal() {
    // SAFETY: setting a signal's disposition to SIG_IGN installs no handler code.
    if unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) } == libc::SIG_ERR {
        tracing::warn!("could not ignore SIGXFSZ: a write past RLIMIT_FSIZE kills the server");
    }
}

fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{s:?}: {e}")),
    }
}

fn positive_ms(s: &str) -> Result<u64, String> {
    positive(s).map(|n| n as u64)
}

/// The smallest `--max-frame`: a frame must hold a request's keys and its answer's header.
const MIN_MAX_FRAME: usize = 64 << 10;

fn frame_bytes(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    if n < MIN_MAX_FRAME {
        return Err(format!(
            "{n} bytes: a frame under {MIN_MAX_FRAME} refuses every request"
        ));
    }
    Ok(n)
}

/// The shared secret, from `--token-file` or `$KVTIER_L3_TOKEN`; an empty one is refused
/// (a client sending the empty token would be admitted).
fn read_token(args: &Args) -> Result<Option<String>, String> {
    let token = match &args.token_file {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .map_err(|e| format!("token file {}: {e}", p.display()))?
                .trim()
                .to_string(),
        ),
        None => std::env::var("KVTIER_L3_TOKEN").ok(),
    };
    if token.as_deref().is_some_and(|t| t.trim().is_empty()) {
        return Err("the token (--token-file or KVTIER_L3_TOKEN) is empty".into());
    }
    Ok(token)
}

fn run(args: Args, token: Option<String>) -> Result<(), String> {
    let ssd = args.ssd_dir.as_ref().map(|d| {
        let mut s = SsdConfig::new(d);
        s.capacity_bytes = args.ssd_capacity;
        s.mode = match args.offload {
            Mode::WriteThrough => OffloadMode::WriteThrough,
            Mode::OnEvict => OffloadMode::OnEvict,
        };
        s
    });
    if args.role != Role::Node && args.master.is_some() {
        return Err("--master is for --role node".into());
    }
    let listen = args.listen.unwrap_or(match args.role {
        Role::Node => SocketAddr::from(([127, 0, 0, 1], 50052)),
        _ => SocketAddr::from(([127, 0, 0, 1], 50051)),
    });
    crate::cli_roles::check_quotas(&args.tenant_quota)?;
    if args.role == Role::Node {
        crate::cli_roles::check_node_flags(&args.flags_given)?;
    } else {
        crate::cli_roles::check_server_flags(&args.flags_given)?;
    }
    let master = args.role == Role::Master;
    crate::cli_roles::check_ssd_flags(&args.flags_given, master, args.ssd_dir.is_some())?;
    if args.role == Role::Node {
        for (given, flag) in [
            (args.kv_events.is_some(), "--kv-events"),
            (!args.kv_events_stream.is_empty(), "--kv-events-stream"),
        ] {
            if given {
                return Err(format!(
                    "{flag} is published by the master (--role master or both)"
                ));
            }
        }
        return run_node(&args, listen, token, ssd);
    }
    // --kv-events (if given) first, then each --kv-events-stream; the shared flags on all
    let main = args.kv_events.as_ref().map(|ep| StreamArg {
        cfg: crate::kv_events::KvEventsConfig {
            replay_endpoint: args.kv_events_replay.clone(),
            namespaces: args.kv_events_namespace.clone(),
            ..crate::kv_events::KvEventsConfig::new(ep.clone())
        },
        parts: None,
    });
    let kv_events: Vec<crate::kv_events::KvEventsConfig> = main
        .iter()
        .chain(&args.kv_events_stream)
        .map(|s| crate::kv_events::KvEventsConfig {
            block_size: args.kv_events_block_size,
            parts_per_page: s.parts.unwrap_or(args.kv_events_parts_per_page),
            ..s.cfg.clone()
        })
        .collect();
    crate::kv_events::validate_streams(&kv_events).map_err(|e| e.to_string())?;
    if args.role == Role::Master && ssd.is_some() {
        return Err("a master holds no SSD tier: give --ssd-dir to the nodes".into());
    }
    if args.role != Role::Master && (args.state_dir.is_some() || args.no_state_dir) {
        return Err("--state-dir / --no-state-dir are for --role master".into());
    }
    if args.role != Role::Master && args.etcd.is_some() {
        return Err("--etcd is for --role master (nodes take --master etcd://...)".into());
    }
    if args.role == Role::Master
        && args.state_dir.is_none()
        && !args.no_state_dir
        && args.etcd.is_none()
    {
        return Err(
            "--role master needs --state-dir DIR (its settle log, so a restart never \
                    brings back a removed key), --etcd URLS (several masters, the state in \
                    etcd), or --no-state-dir to keep it in memory only"
                .into(),
        );
    }
    let cfg = StoreConfig {
        local_segment_bytes: args.segment_bytes,
        lease_ttl: Duration::from_millis(args.lease_ms),
        put_timeout: Duration::from_millis(args.put_timeout_ms),
        client_ttl: Duration::from_millis(args.client_ttl_ms),
        max_batch_keys: args.max_batch_keys,
        max_object_bytes: args.max_object_bytes,
        loss_journal_keys: args.loss_journal_keys,
        recycle_idle_bytes: args.recycle_idle_bytes,
        idle_trim_after: Duration::from_millis(args.idle_trim_ms),
        rebuild_timeout: Duration::from_millis(args.rebuild_timeout_ms),
        tenant_quota_bytes: args.tenant_quota.iter().cloned().collect(),
        client_segments_max_bytes: args
            .client_segments_max_bytes
            .or_else(crate::config::host_memory_bytes),
        promotion: PromotionConfig {
            on_hit: args.promotion_on_hit,
            admission_threshold: args.promotion_admission_threshold,
            ..PromotionConfig::default()
        },
        ssd,
        kv_events,
        ..Default::default()
    };
    let opts = ServerOptions {
        addr: listen,
        token,
        token_digest: None,
        max_frame_bytes: args.max_frame,
        metrics_addr: args.metrics,
        transfer_channel: !args.no_transfer_channel,
        shm: if args.no_shm {
            ShmMode::Off
        } else {
            ShmMode::from_env()
        },
        shm_dir: args.shm_dir.clone(),
        max_connections: args.max_connections,
        max_requests_per_connection: args.max_requests_per_connection,
        rpc_stall_timeout: Duration::from_millis(args.rpc_stall_timeout_ms),
        ..ServerOptions::default()
    };
    if args.role == Role::Master
        && let Some(spec) = &args.etcd
    {
        return crate::ha::serve::run_master(
            spec,
            &args.cluster,
            crate::ha::election::leader_ttl(args.leader_ttl_s).map_err(|e| e.to_string())?,
            cfg,
            opts,
        );
    }
    if args.role == Role::Master {
        let master =
            ClusterMaster::open(cfg, args.state_dir.as_deref()).map_err(|e| e.to_string())?;
        announce_kv_events(master.kv_events());
        serve(master.clone(), opts)?;
        master.shutdown();
        eprintln!("kvtier-l3: master shut down cleanly");
        return Ok(());
    }
    let store = Arc::new(EmbeddedStore::new(cfg).map_err(|e| e.to_string())?);
    announce_kv_events(store.kv_events());
    serve(store.clone(), opts)?;
    // Every queued write-through lands on disk before exit.
    store.flush().map_err(|e| e.to_string())?;
    store.shutdown();
    eprintln!("kvtier-l3: shut down cleanly");
    Ok(())
}

/// Says on stderr where KV events are published (a `*` port filled in), a line per stream.
pub(crate) fn announce_kv_events(streams: Vec<crate::kv_events::KvEventsHandle>) {
    for ev in streams {
        let state = if ev.bound() {
            "publishing"
        } else {
            "will publish (address busy)"
        };
        let topic = ev.topic();
        let topic = if topic.is_empty() {
            String::new()
        } else {
            format!(", topic {topic:?}")
        };
        eprintln!(
            "kvtier-l3: {state} KV events on {} (replay {}{topic})",
            ev.endpoint(),
            ev.replay_endpoint().as_deref().unwrap_or("none")
        );
    }
}

/// A store node: mount with the master, serve until SIGTERM/SIGINT, flush, leave; or, once
/// its master refuses its protocol version (-300), flush and exit with that error.
fn run_node(
    args: &Args,
    listen: SocketAddr,
    token: Option<String>,
    ssd: Option<SsdConfig>,
) -> Result<(), String> {
    let master = args
        .master
        .as_deref()
        .ok_or("--role node needs --master <addr> (the master's RPC address)")?;
    let locator = crate::ha::Locator::parse(master).map_err(|e| e.to_string())?;
    if args.metrics.is_some() {
        return Err("--metrics is served by the master (and by --role both)".into());
    }
    let fixed = match &locator {
        crate::ha::Locator::Fixed(a) => *a,
        crate::ha::Locator::Etcd { .. } => SocketAddr::from(([127, 0, 0, 1], 0)),
    };
    let mut opts = NodeOptions::new(ClientId(args.node_id), fixed);
    opts.locator = Some(locator);
    opts.master_timeout = Duration::from_millis(args.master_timeout_ms);
    opts.listen = listen;
    opts.token = token;
    opts.segment_bytes = args.segment_bytes;
    opts.ssd = ssd;
    opts.max_frame_bytes = args.max_frame;
    opts.max_batch_keys = args.max_batch_keys;
    opts.max_object_bytes = args.max_object_bytes;
    opts.ping_interval = Duration::from_millis(args.ping_ms);
    opts.put_timeout = Duration::from_millis(args.put_timeout_ms);
    if args.no_shm {
        opts.shm = ShmMode::Off;
    }
    opts.shm_dir = args.shm_dir.clone();
    opts.recycle_idle_bytes = args.recycle_idle_bytes;
    opts.idle_trim_after = Duration::from_millis(args.idle_trim_ms);
    let node = StoreNode::start(opts).map_err(|e| e.to_string())?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let refused = rt.block_on(async {
        // The handler before the readiness line: a SIGTERM sent the moment a supervisor reads
        // `LISTENING` must reach the shutdown path, not the default disposition.
        let (mut term, mut int) = stop_signals()?;
        {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "LISTENING {}", node.data_addr());
            let _ = out.flush();
        }
        // A master refusing this node's protocol version refuses every call: exit with it.
        let mut check = tokio::time::interval(Duration::from_millis(100));
        let refused = loop {
            tokio::select! {
                _ = term.recv() => break None,
                _ = int.recv() => break None,
                _ = check.tick() => {
                    if let Some(e) = node.refused() {
                        break Some(e);
                    }
                }
            }
        };
        Ok::<_, String>(refused)
    })?;
    node.shutdown();
    if let Some(e) = refused {
        return Err(format!(
            "this store node was refused by its master: {e}; start the node in its master's \
             release"
        ));
    }
    eprintln!("kvtier-l3: node shut down cleanly");
    Ok(())
}

/// SIGTERM and SIGINT handlers (inside a runtime), installed before a server reports ready.
fn stop_signals() -> Result<(tokio::signal::unix::Signal, tokio::signal::unix::Signal), String> {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
    let int = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
    Ok((term, int))
}

/// Serves `backend` over tarpc until SIGTERM/SIGINT.
fn serve<B: Backend>(backend: Arc<B>, opts: ServerOptions) -> Result<(), String> {
    serve_then(backend, opts, |_| Ok(()))
}

/// [`serve`], calling `listening` with the bound address before the readiness line (an
/// etcd HA leader publishes itself there).
pub(crate) fn serve_then<B: Backend>(
    backend: Arc<B>,
    opts: ServerOptions,
    listening: impl FnOnce(SocketAddr) -> Result<(), String>,
) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    rt.block_on(async {
        // The handler before the readiness line (see `run_node`).
        let (mut term, mut int) = stop_signals()?;
        let (addr, maddr) = start(backend, opts, stop_rx)
            .await
            .map_err(|e| e.to_string())?;
        listening(addr)?;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "LISTENING {addr}");
        if let Some(m) = maddr {
            let _ = writeln!(out, "METRICS {m}");
        }
        let _ = out.flush();
        drop(out);
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        let _ = stop_tx.send(true);
        Ok::<(), String>(())
    })?;
    rt.shutdown_timeout(Duration::from_secs(2));
    Ok(())
}
