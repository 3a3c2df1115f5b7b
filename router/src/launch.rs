//! The router's configuration (the CLI's flags) and start-up: subscribers, then the HTTP
//! server. The binary and the tests start the router the same way ([`start`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::cluster::{Cluster, Keys, Target};
use crate::cost::CostModel;
use crate::index::{Budget, ClusterIndex};
use crate::service::{self, AppState};
use crate::subscriber::{self, StreamSpec, SubscribeOptions};

/// One `--instance` or `--storage` value: `key=value` pairs separated by commas, keys
/// `events` (the PUB endpoint), `replay` (the replay endpoint) and, for instances, `url` (the
/// HTTP server the proxy sends to). Every key is optional (an instance without events is
/// routed by load; one without a URL is routed to by `/route` only).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointSpec {
    pub events: Option<String>,
    pub replay: Option<String>,
    pub url: Option<String>,
    /// The topic the stream's batches must name (`topic=`): batches of another are refused
    /// (`foreign_topic` in `/stats`), so a store's stream of another model's namespace is
    /// never folded in. `None`: any topic.
    pub topic: Option<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpecError {
    #[error("{0:?}: expected key=value (keys: events, replay, url, topic)")]
    NotKeyValue(String),
    #[error("{0:?}: unknown key (keys: events, replay, url, topic)")]
    UnknownKey(String),
    #[error("{0:?}: given twice")]
    Repeated(String),
    #[error("{0:?}: a ZMQ endpoint is tcp://host:port or ipc://path")]
    BadEndpoint(String),
    #[error("{0:?}: a URL is http://host[:port][/path] (a valid URI, no user or query)")]
    BadUrl(String),
    #[error("{0}= without events=: it goes with the stream events= names")]
    WithoutEvents(&'static str),
    #[error("--storage: no events= (the shared store's stream)")]
    StorageWithoutEvents,
    #[error("--storage: url= is an instance's (the proxy sends requests there), not the store's")]
    StorageUrl,
}

impl EndpointSpec {
    /// Refuses keys that would be ignored: `replay=` or `topic=` without `events=` (nothing
    /// to replay or filter), and for the shared store (`storage`) a `url=` or no `events=`.
    pub fn check(&self, storage: bool) -> Result<(), SpecError> {
        if storage && self.url.is_some() {
            return Err(SpecError::StorageUrl);
        }
        if self.events.is_none() {
            if storage {
                return Err(SpecError::StorageWithoutEvents);
            }
            if self.replay.is_some() {
                return Err(SpecError::WithoutEvents("replay"));
            }
            if self.topic.is_some() {
                return Err(SpecError::WithoutEvents("topic"));
            }
        }
        Ok(())
    }
}

/// Whether `url` is what an instance's `url=` must be: an `http://` URI with a host and
/// optionally a numeric port and a path (the proxy appends `/v1/...` to it), no user or
/// query, that stays a URI with the proxy's paths appended; [`SpecError::BadUrl`] if not.
pub fn check_url(url: &str) -> Result<(), SpecError> {
    use axum::http::Uri;
    let bad = || SpecError::BadUrl(url.into());
    let uri: Uri = url.parse().map_err(|_| bad())?;
    let (Some(auth), Some(host)) = (uri.authority(), uri.host()) else {
        return Err(bad());
    };
    // what follows the host: nothing or a port (the URI parser takes any port text)
    let port_ok = match auth.as_str().strip_prefix(host) {
        Some("") => true,
        Some(p) => p
            .strip_prefix(':')
            .is_some_and(|p| p.parse::<u16>().is_ok()),
        None => false, // a user before the host
    };
    let with_path = format!("{}/v1/chat/completions", url.trim_end_matches('/'));
    let ok = uri.scheme_str() == Some("http")
        && url
            .get(..7)
            .is_some_and(|p| p.eq_ignore_ascii_case("http://"))
        && !host.is_empty()
        && port_ok
        && uri.query().is_none()
        && with_path.parse::<Uri>().is_ok();
    if ok { Ok(()) } else { Err(bad()) }
}

impl std::str::FromStr for EndpointSpec {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        let mut out = EndpointSpec::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| SpecError::NotKeyValue(part.into()))?;
            let slot = match k {
                "events" => &mut out.events,
                "replay" => &mut out.replay,
                "url" => &mut out.url,
                "topic" => &mut out.topic,
                _ => return Err(SpecError::UnknownKey(k.into())),
            };
            if slot.is_some() {
                return Err(SpecError::Repeated(k.into()));
            }
            let ok = if k == "url" {
                check_url(v).is_ok()
            } else if k == "topic" {
                true // any bytes, the empty topic too (`topic=`: vLLM's default)
            } else {
                (v.starts_with("tcp://") || v.starts_with("ipc://")) && v.len() > 6
            };
            if !ok {
                return Err(if k == "url" {
                    SpecError::BadUrl(v.into())
                } else {
                    SpecError::BadEndpoint(v.into())
                });
            }
            *slot = Some(v.into());
        }
        Ok(out)
    }
}

/// A byte count as a flag gives it: `268435456`, `256MiB`, `1GB` (suffixes `B`, `k`/`KB`,
/// `M`/`MB`, `G`/`GB`, `T`/`TB` in powers of 1000, `KiB`, `MiB`, `GiB`, `TiB` in powers of
/// 1024, any case, a space allowed before them); never 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteSize(pub usize);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ByteSizeError {
    #[error(
        "{0:?}: expected a whole number of bytes with an optional unit (4096, 64KiB, 256MiB, 1GB)"
    )]
    Invalid(String),
    #[error("a byte budget must be positive")]
    Zero,
    #[error("more bytes than this machine can address")]
    TooLarge,
}

impl std::str::FromStr for ByteSize {
    type Err = ByteSizeError;
    fn from_str(s: &str) -> Result<Self, ByteSizeError> {
        let t = s.trim();
        let digits = t.bytes().take_while(u8::is_ascii_digit).count();
        let invalid = || ByteSizeError::Invalid(s.into());
        let n: u64 = t[..digits].parse().map_err(|_| invalid())?;
        let unit: u64 = match t[digits..].trim_start().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" => 1_000,
            "m" | "mb" => 1_000_000,
            "g" | "gb" => 1_000_000_000,
            "t" | "tb" => 1_000_000_000_000,
            "kib" => 1 << 10,
            "mib" => 1 << 20,
            "gib" => 1 << 30,
            "tib" => 1 << 40,
            _ => return Err(invalid()),
        };
        let bytes = n.checked_mul(unit).ok_or(ByteSizeError::TooLarge)?;
        if bytes == 0 {
            return Err(ByteSizeError::Zero);
        }
        usize::try_from(bytes)
            .map(ByteSize)
            .map_err(|_| ByteSizeError::TooLarge)
    }
}

/// Everything the router needs.
#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    pub instances: Vec<EndpointSpec>,
    /// The shared store's stream.
    pub storage: Option<EndpointSpec>,
    pub model: CostModel,
    /// The weight of a request's work in its routing cost ([`crate::DELAY_WEIGHT`]).
    pub delay_weight: f64,
    /// The instances' device memory and decode step, for the memory term of the proxy's
    /// closed-loop queue (`None`: not counted).
    pub occupancy: Option<crate::Occupancy>,
    /// The index's bound in entries, all tiers and instances (`usize::MAX`: none).
    pub max_pages: usize,
    /// The index's bound in bytes, the streams' key tables included (`usize::MAX`: none); at
    /// least [`ClusterIndex::min_bytes`] of the instances.
    pub max_index_bytes: usize,
    pub keys: Keys,
    pub subscribe: SubscribeOptions,
    /// How long a `POST /route` booking lasts without its end reported
    /// ([`crate::cluster::BOOKING_TTL_S`] by default).
    pub booking_ttl_s: f64,
    /// How long the proxy waits for the head of a streamed answer before it takes the
    /// instance as not having taken the request and tries the next best
    /// ([`crate::proxy::HEAD_TIMEOUT_S`] by default; 0: for ever).
    pub head_timeout_s: f64,
    /// How long a client's connection may take to send a request's head, counted from the
    /// connection's start or its previous answer (so also how long a kept connection may
    /// stay idle) before the router closes it ([`crate::service::HEADER_TIMEOUT_S`] by
    /// default); a request whose head came is never cut short. Its body's bytes must come
    /// within this time of the head and of each other (else a 408).
    pub header_timeout_s: f64,
}

impl Config {
    /// A router on `listen` for `instances` with the `kvtier-router` binary's defaults: no
    /// shared store, [`CostModel::h100_llama8b`], [`crate::DELAY_WEIGHT`], no occupancy term,
    /// kvtier's own page hashes ([`Keys::Engine`]), a 256 MiB index, replay answers awaited
    /// 500 ms, a resync after 5 quiet seconds, bookings kept
    /// [`crate::cluster::BOOKING_TTL_S`], streamed answers' heads awaited
    /// [`crate::proxy::HEAD_TIMEOUT_S`]. Change fields with struct update syntax, so a field
    /// added later does not break the caller:
    ///
    /// ```
    /// use kvtier_router::launch::{Config, EndpointSpec};
    /// let cfg = Config {
    ///     max_pages: 1 << 20,
    ///     ..Config::new("127.0.0.1:0".parse().unwrap(), vec![EndpointSpec::default()])
    /// };
    /// assert_eq!(cfg.instances.len(), 1);
    /// ```
    pub fn new(listen: SocketAddr, instances: Vec<EndpointSpec>) -> Config {
        Config {
            listen,
            instances,
            storage: None,
            model: CostModel::h100_llama8b(),
            delay_weight: crate::DELAY_WEIGHT,
            occupancy: None,
            max_pages: usize::MAX,
            max_index_bytes: 256 << 20,
            keys: Keys::Engine,
            subscribe: subscribe_options(500, 5.0),
            booking_ttl_s: crate::cluster::BOOKING_TTL_S,
            head_timeout_s: crate::proxy::HEAD_TIMEOUT_S,
            header_timeout_s: crate::service::HEADER_TIMEOUT_S,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("no instances: give --instance once per engine")]
    NoInstances,
    #[error("either every instance has a url= (proxy) or none does")]
    MixedUrls,
    #[error("--instance: {0}")]
    Spec(#[from] SpecError),
    #[error("an index budget of {0} bytes is below the {1} bytes of an empty index")]
    BudgetTooSmall(usize, usize),
    #[error("--delay-weight: {0}")]
    DelayWeight(crate::RouteError),
    #[error("--device-tokens / --decode-step-ms: {0}")]
    Occupancy(crate::RouteError),
    #[error("{0}")]
    Model(crate::RouteError),
    #[error("--booking-ttl-s: {0}")]
    BookingTtl(crate::RouteError),
    #[error("--head-timeout-s must be a number of seconds, at least 0, not {0}")]
    HeadTimeout(f64),
    #[error("header_timeout_s must be a positive number of seconds, not {0}")]
    HeaderTimeout(f64),
    #[error("bind {0}: {1}")]
    Bind(SocketAddr, std::io::Error),
    #[error(transparent)]
    Subscribe(#[from] subscriber::SubscribeError),
    #[error("the tokio runtime: {0}")]
    Runtime(std::io::Error),
}

/// A started router.
pub struct Running {
    /// The HTTP address (the port filled in).
    pub addr: SocketAddr,
    pub cluster: Arc<Mutex<Cluster>>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

/// Starts the subscribers and the HTTP server (on the current tokio runtime).
pub async fn start(cfg: Config) -> Result<Running, StartError> {
    if cfg.instances.is_empty() {
        return Err(StartError::NoInstances);
    }
    let urls: Vec<String> = cfg.instances.iter().filter_map(|i| i.url.clone()).collect();
    if !urls.is_empty() && urls.len() != cfg.instances.len() {
        return Err(StartError::MixedUrls);
    }
    for u in &urls {
        check_url(u)?; // a spec built without parsing it
    }
    for spec in &cfg.instances {
        spec.check(false)?;
    }
    if let Some(st) = &cfg.storage {
        st.check(true)?;
    }
    let head_timeout = crate::proxy::head_timeout(cfg.head_timeout_s)
        .ok_or(StartError::HeadTimeout(cfg.head_timeout_s))?;
    let header_timeout = Duration::try_from_secs_f64(cfg.header_timeout_s)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or(StartError::HeaderTimeout(cfg.header_timeout_s))?;
    let min = ClusterIndex::min_bytes(cfg.instances.len());
    if cfg.max_index_bytes < min {
        return Err(StartError::BudgetTooSmall(cfg.max_index_bytes, min));
    }
    let budget = Budget {
        max_bytes: cfg.max_index_bytes,
        max_pages: cfg.max_pages,
    };
    let mut cluster = Cluster::with_budget(cfg.instances.len(), cfg.model, budget, cfg.keys)
        .map_err(StartError::Model)?;
    cluster
        .set_delay_weight(cfg.delay_weight)
        .map_err(StartError::DelayWeight)?;
    cluster
        .set_occupancy(cfg.occupancy)
        .map_err(StartError::Occupancy)?;
    cluster
        .set_booking_ttl_s(cfg.booking_ttl_s)
        .map_err(StartError::BookingTtl)?;
    let mut subs = Vec::new();
    for (i, spec) in cfg.instances.iter().enumerate() {
        if let Some(ev) = &spec.events {
            let n = cluster.add_stream(&format!("instance {i}"), ev, Target::Instance(i));
            subs.push((n, ev.clone(), spec.replay.clone(), spec.topic.clone()));
        }
    }
    if let Some(st) = &cfg.storage
        && let Some(ev) = &st.events
    {
        let n = cluster.add_stream("storage", ev, Target::Storage);
        subs.push((n, ev.clone(), st.replay.clone(), st.topic.clone()));
    }
    let cluster = Arc::new(Mutex::new(cluster));
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for (n, endpoint, replay, topic) in subs {
        let spec = StreamSpec {
            endpoint,
            replay,
            topic,
        };
        match subscriber::spawn(
            spec,
            n,
            Arc::clone(&cluster),
            Arc::clone(&stop),
            cfg.subscribe,
        ) {
            Ok(t) => threads.push(t),
            Err(e) => {
                stop.store(true, Ordering::Relaxed);
                for t in threads {
                    let _ = t.join();
                }
                return Err(e.into());
            }
        }
    }
    let (listener, addr) = match service::bind(cfg.listen).await {
        Ok(x) => x,
        Err(e) => {
            stop.store(true, Ordering::Relaxed);
            return Err(StartError::Bind(cfg.listen, e));
        }
    };
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let mut st = AppState::new(Arc::clone(&cluster), urls);
    st.upstream.set_head_timeout(head_timeout);
    st.header_timeout = header_timeout;
    let server = tokio::spawn(service::serve(listener, st, async {
        let _ = rx.await;
    }));
    Ok(Running {
        addr,
        cluster,
        stop,
        threads,
        shutdown: Some(tx),
        server: Some(server),
    })
}

impl Running {
    /// Stops the HTTP server and the subscribers and waits for them.
    pub async fn stop(mut self) {
        self.halt();
        if let Some(s) = self.server.take() {
            let _ = s.await;
        }
        let threads = std::mem::take(&mut self.threads);
        let _ = tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
        })
        .await;
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // threads see the flag within their poll interval and exit on their own
        self.halt();
    }
}

/// The shortest resync period: a stream asks for a missed tail at most this often, so a
/// quiet publisher is not polled in a loop.
pub const MIN_RESYNC_S: f64 = 0.01;

/// `--resync-s` as the streams take it: at least [`MIN_RESYNC_S`] and a time a `Duration`
/// holds (before, a shorter period was taken as 10 ms and a longer one as the default 5 s,
/// silently).
pub fn resync_period(resync_s: f64) -> Result<Duration, String> {
    match Duration::try_from_secs_f64(resync_s) {
        Ok(d) if resync_s >= MIN_RESYNC_S => Ok(d),
        _ => Err(format!(
            "--resync-s must be a number of seconds from {MIN_RESYNC_S} to {:e}, not {resync_s}",
            Duration::MAX.as_secs_f64()
        )),
    }
}

/// The default replay wait and resync period, as flags give them (a resync period
/// [`resync_period`] refuses is taken as 10 ms below it, 5 s above: the binary refuses both).
pub fn subscribe_options(replay_timeout_ms: u64, resync_s: f64) -> SubscribeOptions {
    SubscribeOptions {
        replay_timeout: Duration::from_millis(replay_timeout_ms.max(1)),
        resync: Duration::try_from_secs_f64(resync_s.max(0.01)).unwrap_or(Duration::from_secs(5)),
        ..SubscribeOptions::default()
    }
}

/// Raises this process's soft limit of open files to its hard limit (as vLLM does): each
/// proxied request holds two sockets (the client's and the instance's), and the common soft
/// limit of 1,024 runs out at ~500 concurrent streams. Returns the limits (soft, hard) before
/// and the soft limit after.
pub fn raise_open_files_limit() -> std::io::Result<((u64, u64), u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a valid pointer to a local
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let before = (lim.rlim_cur, lim.rlim_max);
    if lim.rlim_cur >= lim.rlim_max {
        return Ok((before, before.0));
    }
    let raised = libc::rlimit {
        rlim_cur: lim.rlim_max,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: setrlimit reads one rlimit through a valid pointer to a local
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((before, raised.rlim_cur))
}
