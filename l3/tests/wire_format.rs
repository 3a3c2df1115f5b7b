//! The wire format of everything kvtier-l3 peers exchange is recorded in
//! `tests/wire_format.json`, under the protocol version that speaks it: a change to any
//! type crossing the wire (a field added to a query result, a variant to a cluster message,
//! a tarpc upgrade) fails here until `PROTOCOL_VERSION` is bumped and the record regenerated.
//! Peers of two versions then refuse each other at `hello` (-300) instead of misreading
//! bytes (tests/protocol_version.rs).
//!
//! How: serde-reflection traces the serde format of each type (every field, variant and
//! variant order, recursively) into a registry; the record is that registry as JSON.
//! Regenerate it with `KVTIER_BLESS=1 cargo test --release -p kvtier-l3 --test wire_format`.
//!
//! Covered: `L3Rpc`'s calls and tarpc's response frame (`L3RpcRequest`,
//! `Response<L3RpcResponse>`: every call's arguments and reply, with `ClusterRequest`,
//! `ClusterReply`, `QueryResult`, replica descriptors, `L3Error`, ...), the limits `hello`
//! carries as bytes (`ServerLimits`), and the transfer and shared-memory channels' messages
//! (`XferRequest`/`XferReply`, `ShmRequest`/`ShmReply`). Not covered: bytes serde does not
//! describe: tarpc's request envelope around the call (two structs of one name, which
//! serde-reflection cannot record: pinned by `the_tarpc_envelope_is_unchanged`
//! instead), the length-delimited framing (tarpc's), the bincode options (varint integers:
//! pinned by `hello_is_frozen` below) and the SSD record layout (on disk, not on the wire).
//!
//! `hello` itself is frozen across versions (its request and reply must stay readable by
//! every version, or a peer could not even be told its version is wrong): `hello_is_frozen`
//! pins its bytes and no bless changes that.

use std::collections::BTreeMap;
use std::path::PathBuf;

use bincode::Options;
use kvtier_l3::master::{NodeSync, ReplicaEnded, Settle};
use kvtier_l3::rpc::service::{
    ClusterRequest, Hello, L3RpcRequest, L3RpcResponse, PROTOCOL_VERSION, ServerLimits,
};
use kvtier_l3::rpc::shm::{ShmOffer, ShmRequest};
use kvtier_l3::rpc::xfer::XferRequest;
use kvtier_l3::types::{
    ClientStatus, NodeRef, PutHandle, QueryResult, ReplicaDescriptor, StoreStats,
};
use kvtier_l3::{L3Error, LossCursor, Losses};
use serde::{Deserialize, Serialize};
use serde_reflection::{ContainerFormat, Tracer, TracerConfig};

#[derive(Serialize, Deserialize, PartialEq, Debug)]
struct Record {
    protocol_version: u32,
    formats: BTreeMap<String, ContainerFormat>,
    signatures: BTreeMap<String, String>,
}

fn golden_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/wire_format.json")
}

fn trace() -> BTreeMap<String, ContainerFormat> {
    // Strings trace as "t": a valid tenant (tenants are checked as they are read).
    let config = TracerConfig::default()
        .default_string_value("t".into())
        .default_borrowed_str_value("t");
    let mut t = Tracer::new(config);
    macro_rules! types {
        ($($ty:ty),* $(,)?) => {$(
            t.trace_simple_type::<$ty>()
                .unwrap_or_else(|e| panic!("tracing {}: {e}", stringify!($ty)));
        )*};
    }
    // Requests, and what replies carry. Not the reply enums themselves (`L3RpcResponse`,
    // `ClusterReply`, `XferReply`, `ShmReply`): each holds `Result`s of several payload
    // types, and serde names every `Result` alike, which one registry cannot hold apart;
    // their variants are pinned by `signatures` instead. Nor tarpc's request envelope: it
    // holds two structs named `Context` (pinned by `the_tarpc_envelope_is_unchanged`).
    types!(
        L3RpcRequest,
        ClusterRequest,
        XferRequest,
        ShmRequest,
        tarpc::trace::Context,
        tarpc::ServerError,
        Hello,
        ServerLimits,
        L3Error,
        PutHandle,
        QueryResult,
        ClientStatus,
        StoreStats,
        NodeSync,
        ReplicaEnded,
        NodeRef,
        Losses,
        LossCursor,
        ShmOffer,
        ReplicaDescriptor,
        std::net::SocketAddr,
        tarpc::trace::SamplingDecision,
        Settle,
    );
    t.registry()
        .unwrap_or_else(|e| panic!("incomplete wire trace: {e}"))
        .into_iter()
        .collect()
}

/// The source of the types serde-reflection cannot trace (see `trace`): the reply enums and
/// the service's calls, comments and layout left out.
fn signatures() -> BTreeMap<String, String> {
    let src = |rel: &str| {
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel))
            .unwrap_or_else(|e| panic!("{rel}: {e}"))
    };
    let service = src("src/rpc/service.rs");
    let xfer = src("src/rpc/xfer/mod.rs");
    let shm = src("src/rpc/shm/mod.rs");
    [
        ("L3Rpc", &service, "pub trait L3Rpc {"),
        ("ClusterReply", &service, "pub enum ClusterReply {"),
        ("WireBatch", &service, "pub type WireBatch<T>"),
        ("XferReply", &xfer, "pub enum XferReply {"),
        ("ShmReply", &shm, "pub enum ShmReply {"),
    ]
    .into_iter()
    .map(|(name, text, start)| (name.to_string(), item(text, start)))
    .collect()
}

/// The item starting at `start` in `text` (to its closing brace, or `;`), without comments,
/// its whitespace collapsed.
fn item(text: &str, start: &str) -> String {
    let at = text
        .find(start)
        .unwrap_or_else(|| panic!("`{start}` not found: update tests/wire_format.rs"));
    let mut depth = 0i32;
    let mut out = String::new();
    for line in text[at..].lines() {
        let code = line.split("//").next().unwrap_or("").trim();
        if code.is_empty() {
            continue;
        }
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(&code.split_whitespace().collect::<Vec<_>>().join(" "));
        depth += code.matches('{').count() as i32 - code.matches('}').count() as i32;
        if depth <= 0 && (code.ends_with('}') || code.ends_with(';')) {
            break;
        }
    }
    out
}

#[test]
fn the_wire_format_changes_only_with_a_protocol_version_bump() {
    let now = Record {
        protocol_version: PROTOCOL_VERSION,
        formats: trace(),
        signatures: signatures(),
    };
    let path = golden_path();
    if std::env::var_os("KVTIER_BLESS").is_some_and(|v| v == "1") {
        let text = serde_json::to_string_pretty(&now).unwrap();
        std::fs::write(&path, text + "\n").unwrap();
        return;
    }
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (generate it with KVTIER_BLESS=1)", path.display()));
    let was: Record = serde_json::from_str(&text).unwrap();
    if was == now {
        return;
    }
    let mut changed: std::collections::BTreeSet<&String> = now
        .formats
        .keys()
        .chain(was.formats.keys())
        .filter(|k| now.formats.get(*k) != was.formats.get(*k))
        .collect();
    changed.extend(
        now.signatures
            .keys()
            .chain(was.signatures.keys())
            .filter(|k| now.signatures.get(*k) != was.signatures.get(*k)),
    );
    if was.protocol_version == now.protocol_version {
        panic!(
            "the kvtier-l3 wire format changed ({changed:?}) but PROTOCOL_VERSION is still {}: \
             peers of the old and new format would misread each other's bytes. Bump \
             PROTOCOL_VERSION in l3/src/rpc/service.rs, then regenerate {} with \
             `KVTIER_BLESS=1 cargo test --release -p kvtier-l3 --test wire_format` and commit \
             both",
            now.protocol_version,
            path.display()
        );
    }
    panic!(
        "PROTOCOL_VERSION is {} and {} records version {} (changed: {changed:?}): regenerate \
         it with `KVTIER_BLESS=1 cargo test --release -p kvtier-l3 --test wire_format`",
        now.protocol_version,
        path.display(),
        was.protocol_version
    );
}

/// `hello`'s request and reply, byte for byte as every version writes them (bincode with
/// varint integers): never bless these, a peer must be able to read any version's hello.
#[test]
fn hello_is_frozen() {
    let b = |v: &dyn erased::Ser| v.bytes();
    // Request: variant 0 (the first call), then the token, then the version.
    let req = L3RpcRequest::Hello {
        token: Some("tk".into()),
        version: 7,
    };
    assert_eq!(b(&req), [0, 1, 2, b't', b'k', 7]);
    let req = L3RpcRequest::Hello {
        token: None,
        version: 300,
    };
    assert_eq!(b(&req), [0, 0, 251, 44, 1]);
    // Reply: variant 0, Ok, the server's version, the limits as a byte string.
    let ok = L3RpcResponse::Hello(Ok(Hello {
        version: 7,
        limits: vec![9, 8],
    }));
    assert_eq!(b(&ok), [0, 0, 7, 2, 9, 8]);
    // The refusals hello answers: their variant numbers in L3Error never change.
    let err = |e: L3Error| b(&L3RpcResponse::Hello(Err(e)));
    assert_eq!(
        err(L3Error::ProtocolMismatch {
            client: 1,
            server: 2
        }),
        [0, 1, 25, 1, 2]
    );
    assert_eq!(err(L3Error::IllegalClient("x".into())), [0, 1, 8, 1, b'x']);
    assert_eq!(err(L3Error::Unavailable("x".into())), [0, 1, 19, 1, b'x']);
    assert_eq!(err(L3Error::NotLeader("x".into())), [0, 1, 23, 1, b'x']);
    // The limits inside: decoded only by a client of the same version.
    let limits = ServerLimits {
        max_frame_bytes: 1,
        max_batch_keys: 2,
        max_object_bytes: 3,
        xfer_port: 4,
        cluster: true,
        epoch: 5,
    };
    let h = Hello::new(PROTOCOL_VERSION, &limits).unwrap();
    assert_eq!(h.limits_for(PROTOCOL_VERSION).unwrap(), limits);
    assert_eq!(
        h.limits_for(PROTOCOL_VERSION + 1).unwrap_err(),
        L3Error::ProtocolMismatch {
            client: PROTOCOL_VERSION + 1,
            server: PROTOCOL_VERSION
        }
    );
}

mod erased {
    use bincode::Options;

    pub trait Ser {
        fn bytes(&self) -> Vec<u8>;
    }

    impl<T: serde::Serialize> Ser for T {
        fn bytes(&self) -> Vec<u8> {
            bincode::DefaultOptions::new().serialize(self).unwrap()
        }
    }
}

/// An old-format `hello` (before versions: the token alone) is malformed for this version:
/// the frame ends before the version (a strict prefix), so bincode refuses it.
#[test]
fn a_hello_without_a_version_does_not_decode() {
    #[derive(Serialize)]
    enum OldRequest {
        Hello { token: Option<String> },
    }
    for token in [None, Some(String::new()), Some("s3cret".into())] {
        let old = bincode::DefaultOptions::new()
            .serialize(&OldRequest::Hello { token })
            .unwrap();
        let r: Result<L3RpcRequest, _> = bincode::DefaultOptions::new().deserialize(&old);
        assert!(r.is_err(), "an old hello decoded: {r:?}");
    }
}

/// tarpc's envelopes, field by field as this version writes them, still read as tarpc's:
/// the request (`ClientMessage::Request(Request { context: { deadline, trace_context }, id,
/// message })` and `Cancel`) and the response (`Response { request_id, message: Result<_,
/// ServerError> }`). A tarpc upgrade that changes them fails here: bump PROTOCOL_VERSION
/// then, and update these mirrors.
#[test]
fn the_tarpc_envelope_is_unchanged() {
    use tarpc::trace::Context as Trace;
    #[derive(Serialize)]
    struct Context {
        deadline: std::time::Duration,
        trace_context: Trace,
    }
    #[derive(Serialize)]
    struct Request {
        context: Context,
        id: u64,
        message: L3RpcRequest,
    }
    #[derive(Serialize)]
    enum ClientMessage {
        // Boxed: serde writes a box as its content.
        Request(Box<Request>),
        Cancel {
            trace_context: Trace,
            request_id: u64,
        },
    }
    #[derive(Serialize)]
    struct Response {
        request_id: u64,
        message: Result<L3RpcResponse, tarpc::ServerError>,
    }
    let o = bincode::DefaultOptions::new();
    let req = ClientMessage::Request(Box::new(Request {
        context: Context {
            deadline: std::time::Duration::from_secs(5),
            trace_context: Trace::default(),
        },
        id: 9,
        message: L3RpcRequest::Stats {},
    }));
    let got: tarpc::ClientMessage<L3RpcRequest> =
        o.deserialize(&o.serialize(&req).unwrap()).unwrap();
    match got {
        tarpc::ClientMessage::Request(r) => {
            assert_eq!(r.id, 9);
            assert!(matches!(r.message, L3RpcRequest::Stats {}));
        }
        other => panic!("not a request: {other:?}"),
    }
    let cancel = ClientMessage::Cancel {
        trace_context: Trace::default(),
        request_id: 11,
    };
    let got: tarpc::ClientMessage<L3RpcRequest> =
        o.deserialize(&o.serialize(&cancel).unwrap()).unwrap();
    assert!(
        matches!(got, tarpc::ClientMessage::Cancel { request_id: 11, .. }),
        "{got:?}"
    );
    let resp = Response {
        request_id: 5,
        message: Ok(L3RpcResponse::Flush(Ok(()))),
    };
    let got: tarpc::Response<L3RpcResponse> = o.deserialize(&o.serialize(&resp).unwrap()).unwrap();
    assert_eq!(got.request_id, 5);
    assert!(matches!(got.message, Ok(L3RpcResponse::Flush(Ok(())))));
}
