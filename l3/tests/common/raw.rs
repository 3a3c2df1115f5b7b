//! Raw peers of a server for the denial-of-service tests: a `kvtier-l3` process with a
//! descriptor limit, its memory and descriptors as `/proc` says, raw tarpc frames, and
//! waiting for the server to close a socket.

use std::io::{BufRead, BufReader, ErrorKind, Read};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bincode::Options;
use kvtier_l3::rpc::service::L3RpcRequest;

/// The token of the servers these tests start.
pub const TOKEN: &str = "s3cret-token";

/// How long a test waits for what the server must do at once or within its deadlines.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// An in-process server over an embedded store of `segment_bytes`, asking for [`TOKEN`];
/// `opts` says the rest.
pub fn token_server(
    segment_bytes: u64,
    opts: kvtier_l3::rpc::server::ServerOptions,
) -> kvtier_l3::ServerHandle {
    let store = std::sync::Arc::new(
        kvtier_l3::EmbeddedStore::new(kvtier_l3::StoreConfig {
            local_segment_bytes: segment_bytes,
            ..Default::default()
        })
        .expect("store"),
    );
    let opts = kvtier_l3::rpc::server::ServerOptions {
        token: Some(TOKEN.into()),
        ..opts
    };
    kvtier_l3::spawn_server(store, opts).expect("server")
}

/// A `kvtier-l3` process (killed when dropped), its RPC and metrics addresses.
pub struct Server {
    pub child: Child,
    pub addr: SocketAddr,
    pub metrics: Option<SocketAddr>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `kvtier-l3` with `extra` flags, the token, and at most `nofile` descriptors.
    pub fn spawn(extra: &[&str], metrics: bool, nofile: Option<u64>) -> Server {
        let limits: Vec<(libc::__rlimit_resource_t, u64)> = nofile
            .map(|n| (libc::RLIMIT_NOFILE, n))
            .into_iter()
            .collect();
        Server::spawn_limited(extra, metrics, &limits)
    }

    /// Starts `kvtier-l3` with `extra` flags (a 16 MiB segment unless they name one) and the
    /// token, under the resource limits `limits` (soft and hard alike), e.g.
    /// `RLIMIT_NOFILE` or `RLIMIT_FSIZE`.
    pub fn spawn_limited(
        extra: &[&str],
        metrics: bool,
        limits: &[(libc::__rlimit_resource_t, u64)],
    ) -> Server {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvtier-l3"));
        cmd.args(["--listen", "127.0.0.1:0"]);
        if !extra.contains(&"--segment-bytes") {
            cmd.args(["--segment-bytes", "16777216"]);
        }
        cmd.args(extra)
            .env("KVTIER_L3_TOKEN", TOKEN)
            .env("KVTIER_L3_SHM", "off")
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if metrics {
            cmd.args(["--metrics", "127.0.0.1:0"]);
        }
        let limits = limits.to_vec();
        if !limits.is_empty() {
            // SAFETY: only setrlimit, async-signal-safe, between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    for &(resource, n) in &limits {
                        let lim = libc::rlimit {
                            rlim_cur: n,
                            rlim_max: n,
                        };
                        if libc::setrlimit(resource, &lim) != 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let addr = line
            .trim()
            .strip_prefix("LISTENING ")
            .unwrap_or_else(|| panic!("first line {line:?}"))
            .parse()
            .unwrap();
        let metrics = metrics.then(|| {
            line.clear();
            out.read_line(&mut line).unwrap();
            line.trim()
                .strip_prefix("METRICS ")
                .unwrap_or_else(|| panic!("second line {line:?}"))
                .parse()
                .unwrap()
        });
        Server {
            child,
            addr,
            metrics,
        }
    }

    /// A line of the process's `/proc/PID/status`, in KiB (`VmRSS`, `VmHWM`).
    pub fn status_kib(&self, field: &str) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no {field} in /proc status"))
    }

    /// Open file descriptors of the process.
    pub fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .unwrap()
            .count()
    }
}

/// One request frame as tarpc's client sends it (bincode varint, big-endian u32 length).
pub fn rpc_frame(id: u64, message: L3RpcRequest) -> Vec<u8> {
    rpc_frame_with_deadline(id, message, Duration::from_secs(30))
}

/// [`rpc_frame`] with the given relative deadline: `ClientMessage::Request(Request {
/// context: { deadline, trace_context }, id, message })`, field by field as tarpc's serde
/// derive writes it.
pub fn rpc_frame_with_deadline(id: u64, message: L3RpcRequest, deadline: Duration) -> Vec<u8> {
    #[derive(serde::Serialize)]
    struct Context {
        deadline: Duration,
        trace_context: tarpc::trace::Context,
    }
    #[derive(serde::Serialize)]
    struct Request {
        context: Context,
        id: u64,
        message: L3RpcRequest,
    }
    #[derive(serde::Serialize)]
    enum ClientMessage {
        Request(Request),
    }
    let msg = ClientMessage::Request(Request {
        context: Context {
            deadline,
            trace_context: tarpc::context::current().trace_context,
        },
        id,
        message,
    });
    let body = bincode::DefaultOptions::new().serialize(&msg).unwrap();
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&body);
    frame
}

/// Waits (at most [`PATIENCE`]) for the server to close `s`, reading whatever it sends
/// first; panics if it is still open.
pub fn assert_closed(s: &mut impl Read, what: &str) {
    let until = Instant::now() + PATIENCE;
    let mut buf = [0u8; 64 << 10];
    while Instant::now() < until {
        match s.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return, // reset: closed too
        }
    }
    panic!("{what}: still open after {PATIENCE:?}");
}
