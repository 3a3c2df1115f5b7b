//! `kvtier-router`: subscribes to engine instances' KV events (and the shared store's) and
//! routes requests to the instance with the least expected time to first token, over HTTP
//! (`POST /route`) or as an OpenAI-compatible proxy. docs/router.md, "Running the router".

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use kvtier_router::cluster::Keys;
use kvtier_router::launch::{self, ByteSize, Config, EndpointSpec};
use kvtier_router::subscriber::SubscribeOptions;
use kvtier_router::{ClusterIndex, CostModel, DELAY_WEIGHT, Occupancy};

#[derive(Parser, Debug)]
#[command(name = "kvtier-router", version, about)]
struct Args {
    /// HTTP address to serve on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// One engine instance: `events=tcp://H:P,replay=tcp://H:P,url=http://H:P` (each key
    /// optional; url= on every instance turns the OpenAI proxy on). Repeat per instance.
    #[arg(long = "instance", required = true)]
    instances: Vec<EndpointSpec>,
    /// The shared store's event stream: `events=tcp://H:P,replay=tcp://H:P[,topic=NS]` (with
    /// `topic=`, batches naming another topic are refused: `kvtier-l3 --kv-events-stream`).
    #[arg(long)]
    storage: Option<EndpointSpec>,
    /// How pages are keyed: `engine` (kvtier's hashes as published) or `tokens` (the router's
    /// hash of each event's tokens: vLLM, SGLang).
    #[arg(long, value_enum, default_value = "engine")]
    keys: Keys,
    /// The index's memory, in bytes: its tables and, with `--keys tokens`, every stream's
    /// engine-hash table (`268435456`, `256MiB`, `1GB`). Stores past it are dropped (counted).
    #[arg(long, default_value = "256MiB")]
    max_index_bytes: ByteSize,
    /// The index's entries, all tiers and instances, if they should be bounded too.
    #[arg(long)]
    max_pages: Option<usize>,
    /// Tokens per page (the engines' block size).
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    /// Bytes of one page's KV, all layers.
    #[arg(long, default_value_t = 2 << 20)]
    page_bytes: u64,
    /// Prefill throughput of one instance, tokens per second.
    #[arg(long, default_value_t = 20_000.0)]
    prefill_tokens_per_s: f64,
    /// Host-to-device bandwidth, GB/s.
    #[arg(long, default_value_t = 50.0)]
    host_gbps: f64,
    /// Shared-store-to-device bandwidth, GB/s.
    #[arg(long, default_value_t = 10.0)]
    l3_gbps: f64,
    /// Weight of a request's work in its routing cost (its TTFT + weight x its work: the delay
    /// it imposes on the requests behind it); 0 routes by the request's own TTFT alone.
    #[arg(long, default_value_t = DELAY_WEIGHT)]
    delay_weight: f64,
    /// Tokens of KV one instance's device holds for running requests (its KV blocks × block
    /// size): with --decode-step-ms, the proxy's queue counts what running requests hold.
    #[arg(long)]
    device_tokens: Option<f64>,
    /// Milliseconds of one decode step of an instance (with --device-tokens).
    #[arg(long)]
    decode_step_ms: Option<f64>,
    /// Wait for each message of a replay or snapshot answer, milliseconds (positive).
    #[arg(long, default_value_t = 500)]
    replay_timeout_ms: u64,
    /// Quiet seconds after which a stream asks for a tail it may have missed.
    #[arg(long, default_value_t = 5.0)]
    resync_s: f64,
    /// Seconds a `POST /route` booking (`"track": true`) lasts without its end reported:
    /// a client that dies keeps no request counted past it.
    #[arg(long, default_value_t = kvtier_router::cluster::BOOKING_TTL_S)]
    booking_ttl_s: f64,
    /// Seconds the proxy waits for the head of a streamed answer (`"stream": true`; vLLM and
    /// SGLang send it before generating) before it takes the instance as not having taken
    /// the request, counts its error and tries the next best; 0: wait for ever.
    #[arg(long, default_value_t = kvtier_router::proxy::HEAD_TIMEOUT_S)]
    head_timeout_s: f64,
    /// Seconds a client connection may take to send a request's head (from its start or its
    /// previous answer; also the most a request's body may pause, else 408) before it is
    /// closed: idle and half-sent connections hold a file descriptor that long (positive).
    #[arg(long, default_value_t = kvtier_router::service::HEADER_TIMEOUT_S)]
    header_timeout_s: f64,
    /// Exit after this many seconds (scripts and tests); default: run until Ctrl-C.
    #[arg(long)]
    exit_after_s: Option<f64>,
}

fn positive(name: &str, v: f64) -> Result<f64, String> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("--{name} must be a positive number, not {v}"))
    }
}

fn config(a: &Args) -> Result<Config, String> {
    if a.page_size == 0 || a.page_bytes == 0 || a.max_pages == Some(0) {
        return Err("--page-size, --page-bytes and --max-pages must be positive".into());
    }
    if a.replay_timeout_ms == 0 {
        // it was taken as 1 ms: a replay or snapshot answer slower than that was given up on
        return Err("--replay-timeout-ms must be positive".into());
    }
    let min = ClusterIndex::min_bytes(a.instances.len());
    if a.max_index_bytes.0 < min {
        return Err(format!(
            "--max-index-bytes {} is below the {min} bytes an empty index of {} instances holds",
            a.max_index_bytes.0,
            a.instances.len()
        ));
    }
    Ok(Config {
        listen: a.listen,
        instances: a.instances.clone(),
        storage: a.storage.clone(),
        model: CostModel {
            page_size: a.page_size,
            page_bytes: a.page_bytes,
            prefill_tokens_per_s: positive("prefill-tokens-per-s", a.prefill_tokens_per_s)?,
            host_bytes_per_s: positive("host-gbps", a.host_gbps)? * 1e9,
            l3_bytes_per_s: positive("l3-gbps", a.l3_gbps)? * 1e9,
        },
        delay_weight: if a.delay_weight.is_finite() && a.delay_weight >= 0.0 {
            a.delay_weight
        } else {
            return Err(format!(
                "--delay-weight must be a number at least 0, not {}",
                a.delay_weight
            ));
        },
        occupancy: match (a.device_tokens, a.decode_step_ms) {
            (None, None) => None,
            (Some(t), Some(ms)) => Some(Occupancy {
                device_tokens: positive("device-tokens", t)?,
                decode_step_s: positive("decode-step-ms", ms)? / 1e3,
            }),
            _ => return Err("--device-tokens and --decode-step-ms go together".into()),
        },
        max_pages: a.max_pages.unwrap_or(usize::MAX),
        max_index_bytes: a.max_index_bytes.0,
        keys: a.keys,
        booking_ttl_s: positive("booking-ttl-s", a.booking_ttl_s)?,
        head_timeout_s: match kvtier_router::proxy::head_timeout(a.head_timeout_s) {
            Some(_) => a.head_timeout_s,
            None => {
                return Err(format!(
                    "--head-timeout-s must be a number of seconds, at least 0, not {}",
                    a.head_timeout_s
                ));
            }
        },
        header_timeout_s: positive("header-timeout-s", a.header_timeout_s)?,
        subscribe: SubscribeOptions {
            resync: launch::resync_period(a.resync_s)?,
            ..launch::subscribe_options(a.replay_timeout_ms, a.resync_s)
        },
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    let cfg = match config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvtier-router: {e}");
            return ExitCode::from(2);
        }
    };
    let exit_after = match args
        .exit_after_s
        .map(|s| positive("exit-after-s", s))
        .transpose()
    {
        Ok(s) => s.and_then(|s| Duration::try_from_secs_f64(s).ok()),
        Err(e) => {
            eprintln!("kvtier-router: {e}");
            return ExitCode::from(2);
        }
    };
    // each proxied request holds two sockets: the soft limit (often 1,024) goes up to the hard
    match launch::raise_open_files_limit() {
        Ok(((soft, hard), now)) => {
            eprintln!("kvtier-router: open files: {now} (soft limit was {soft}, hard {hard})")
        }
        Err(e) => eprintln!("kvtier-router: open files limit not raised: {e}"),
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvtier-router: tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async move {
        let running = match launch::start(cfg).await {
            Ok(r) => r,
            Err(e) => {
                eprintln!("kvtier-router: {e}");
                return ExitCode::FAILURE;
            }
        };
        println!("kvtier-router listening on http://{}", running.addr);
        match exit_after {
            Some(d) => tokio::time::sleep(d).await,
            None => {
                if let Err(e) = tokio::signal::ctrl_c().await {
                    eprintln!("kvtier-router: waiting for Ctrl-C: {e}");
                }
            }
        }
        // open streams get 10 s to finish
        if tokio::time::timeout(Duration::from_secs(10), running.stop())
            .await
            .is_err()
        {
            eprintln!("kvtier-router: connections still open after 10 s; exiting");
        }
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Config::new` is what the binary runs with no flags but the required ones: a library
    /// user starting from it gets the router the docs describe.
    #[test]
    fn the_binarys_defaults_are_config_new() {
        let a = Args::try_parse_from(["kvtier-router", "--instance", "events=tcp://127.0.0.1:1"])
            .expect("parse");
        let from_flags = config(&a).expect("config");
        let new = Config::new(a.listen, a.instances.clone());
        assert_eq!(format!("{from_flags:?}"), format!("{new:?}"));
    }
}
