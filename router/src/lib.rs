//! Routes each request to the engine instance where its time to first token is least.
//!
//! Why not overlap counts: a router that scores instances by how many of a prompt's blocks
//! they cache (Dynamo, llm-d) treats a block in host memory or a shared store as a fixed
//! fraction of a GPU hit, and does not see the shared store at all (Dynamo drops REMOTE
//! events). With kvtier every instance publishes where each page is (GPU, CPU) and the shared
//! L3 holds pages any instance can load, so the router can price each instance in seconds:
//! the work queued there, the tokens it must compute, and the pages it must load from host
//! and from L3 at each tier's bandwidth ([`cost::CostModel`]), and take the least.
//!
//! - [`index`]: which pages each instance holds on which tier, and the shared store's pages,
//!   folded from vLLM-format events (`kvtier-events`' wire, or any vLLM publisher's), within
//!   a byte budget (`table.rs`: the bytes a hash table holds, as the allocator counts them);
//! - [`cost`]: the TTFT model;
//! - [`feedback`]: closed-loop queues from each request's first token and end;
//! - [`occupancy`]: the device memory a request holds while it decodes, which its queue
//!   also counts;
//! - [`route`]: the decision, with each instance's queue kept by the router itself so one
//!   hot prefix spreads once its instance is busier than recomputing elsewhere.
//!
//! The `kvtier-router` service on top (docs/router.md, "Running the router"):
//!
//! - [`stream`]: one event stream's sequence numbers, gaps, replays and snapshots (sans I/O);
//! - [`subscriber`]: the ZMQ SUB and replay sockets, one thread per stream;
//! - [`keys`]: page keys from the events' tokens, for engines whose hashes the router cannot
//!   compute (vLLM, SGLang);
//! - [`resolve`]: keys for blocks named by hash alone (a shared store's pages, vLLM's
//!   offloading placeholders) through the instances' tables;
//! - [`cluster`]: the shared state: index, queues, streams, requests sent;
//! - [`service`]: `POST /route`, `GET /stats`, `GET /health`;
//! - [`proxy`]: the OpenAI-compatible proxy;
//! - [`readiness`]: `GET /readiness`, whether any instance serves now;
//! - [`metrics`]: `GET /metrics`, `/stats` in Prometheus' text format;
//! - [`errors`]: instances that answer errors, counted and passed over for a while;
//! - [`launch`]: the CLI's configuration and start-up, used by the binary and the tests.

mod background;
pub mod cluster;
pub mod cost;
pub mod errors;
pub mod feedback;
mod holders;
pub mod http_bookings;
pub mod index;
pub mod keys;
pub mod launch;
pub mod lora;
pub mod metrics;
pub mod occupancy;
pub mod proxy;
pub mod readiness;
mod request_fields;
pub mod resolve;
pub mod route;
pub mod service;
pub mod stream;
pub mod subscriber;
mod table;

pub use cost::{CostModel, Estimate};
pub use feedback::FirstToken;
pub use index::{Budget, ClusterIndex, DecodeError, IndexEvent, decode_batch};
pub use occupancy::Occupancy;
pub use route::{DELAY_WEIGHT, MAX_OUTPUT_TOKENS, RouteError, Router, Tracked};
