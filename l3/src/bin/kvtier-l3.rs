//! `kvtier-l3`: the L3 store as a server process.
//!
//! Why a binary: when one engine process is not enough (several engines sharing one L3),
//! the embedded store moves behind tarpc. This process holds the master metadata, a memory
//! segment and the SSD tier ("both" roles in one process), listens on 127.0.0.1 unless told
//! otherwise, prints `LISTENING <addr>` (and `METRICS <addr>`) on stdout once bound, and on
//! SIGTERM/SIGINT stops accepting, flushes queued SSD writes and exits 0 — nothing
//! acknowledged as persisted is lost, and a restart rescans the buckets.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use kvtier_l3::rpc::server::{DEFAULT_MAX_FRAME, ServerOptions, start};
use kvtier_l3::{EmbeddedStore, L3Store, OffloadMode, SsdConfig, StoreConfig};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Role {
    /// Master metadata, memory segment and SSD tier in this one process.
    Both,
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
    about = "kvtier L3 store server (Mooncake-compatible)"
)]
struct Args {
    /// Roles served by this process.
    #[arg(long, value_enum, default_value = "both")]
    role: Role,
    /// RPC listen address.
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: SocketAddr,
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
    /// SSD capacity in bytes.
    #[arg(long, default_value_t = 64 << 30)]
    ssd_capacity: u64,
    /// SSD offload mode.
    #[arg(long, value_enum, default_value = "write-through")]
    offload: Mode,
    /// Read lease in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    lease_ms: u64,
    /// Client liveness TTL in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    client_ttl_ms: u64,
    /// Largest frame in bytes.
    #[arg(long, default_value_t = DEFAULT_MAX_FRAME)]
    max_frame: usize,
    /// Most keys per batch.
    #[arg(long, default_value_t = 65_536)]
    max_batch_keys: usize,
    /// Largest object in bytes.
    #[arg(long, default_value_t = 32 << 20)]
    max_object_bytes: u64,
    /// Do not serve the transfer channel (bulk reads and probes then go through tarpc).
    #[arg(long)]
    no_transfer_channel: bool,
}

fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvtier-l3: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    let Role::Both = args.role;
    let token = match &args.token_file {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .map_err(|e| format!("token file {}: {e}", p.display()))?
                .trim()
                .to_string(),
        ),
        None => std::env::var("KVTIER_L3_TOKEN").ok(),
    };
    let ssd = args.ssd_dir.as_ref().map(|d| {
        let mut s = SsdConfig::new(d);
        s.capacity_bytes = args.ssd_capacity;
        s.mode = match args.offload {
            Mode::WriteThrough => OffloadMode::WriteThrough,
            Mode::OnEvict => OffloadMode::OnEvict,
        };
        s
    });
    let cfg = StoreConfig {
        local_segment_bytes: args.segment_bytes,
        lease_ttl: Duration::from_millis(args.lease_ms),
        client_ttl: Duration::from_millis(args.client_ttl_ms),
        max_batch_keys: args.max_batch_keys,
        max_object_bytes: args.max_object_bytes,
        ssd,
        ..Default::default()
    };
    let store = Arc::new(EmbeddedStore::new(cfg).map_err(|e| e.to_string())?);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let opts = ServerOptions {
        addr: args.listen,
        token,
        max_frame_bytes: args.max_frame,
        metrics_addr: args.metrics,
        transfer_channel: !args.no_transfer_channel,
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    rt.block_on(async {
        let (addr, maddr) = start(store.clone(), opts, stop_rx)
            .await
            .map_err(|e| e.to_string())?;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "LISTENING {addr}");
        if let Some(m) = maddr {
            let _ = writeln!(out, "METRICS {m}");
        }
        let _ = out.flush();
        drop(out);
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(|e| e.to_string())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        let _ = stop_tx.send(true);
        Ok::<(), String>(())
    })?;
    rt.shutdown_timeout(Duration::from_secs(2));
    // Every queued write-through lands on disk before exit.
    store.flush().map_err(|e| e.to_string())?;
    store.shutdown();
    eprintln!("kvtier-l3: shut down cleanly");
    Ok(())
}
