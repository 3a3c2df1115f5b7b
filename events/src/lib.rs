//! kvtier's KV cache events for KV-aware routers, in vLLM's wire format.
//!
//! Why: a router sends each request to the instance that can serve its prefix fastest, and
//! every router in use learns where prefixes are from the engines' cache events in vLLM's
//! format (ZMQ PUB, msgpack `KVEventBatch`). kvtier knows more than an engine does: which
//! pages are on the device (`GPU`), in pinned host memory (`CPU`), and in the shared L3
//! (`STORAGE`). This crate puts that on the wire in the format routers already decode:
//!
//! - [`wire`]: the msgpack encoding of vLLM's `KVEventBatch`, `BlockStored`, `BlockRemoved`,
//!   `AllBlocksCleared`, and kvtier's events mapped onto them;
//! - [`publisher`]: a PUB socket with vLLM's framing and replay socket, plus a snapshot
//!   request for subscribers that start late or restart;
//! - [`mirror`]: the resident-block index the publisher answers snapshots from.

mod answers;
mod bind;
pub mod mirror;
pub mod publisher;
pub mod wire;
mod worker;

pub use mirror::Mirror;
pub use publisher::{
    DEFAULT_BUFFER_BYTES, END_SEQ, PublishError, Publisher, PublisherConfig, SNAPSHOT_REQUEST,
};
pub use wire::{EncodeError, HashFormat, Locality, Medium, WireEvent, encode_batch};
