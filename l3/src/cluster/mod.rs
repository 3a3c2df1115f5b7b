//! Split deployment: a metadata-only master ([`ClusterMaster`], `kvtier-l3 --role master`)
//! and store nodes holding the bytes ([`StoreNode`], `kvtier-l3 --role node`).
//!
//! Why: Mooncake's model. The master decides *what is where* (placement, leases, soft pins,
//! eviction, client liveness); nodes mount DRAM segments and an SSD tier, serve reads and
//! writes of their bytes on a data channel, and ping the master. A node that stops pinging
//! is declared dead: its memory replicas are dropped, its SSD replicas stay registered and
//! are readable again once it restarts, rescans its buckets and re-registers them.
//!
//! How the pieces talk: clients use the ordinary tarpc service on the master for metadata
//! ([`crate::rpc::service`]) and the transfer-channel framing ([`crate::rpc::xfer`]) on a
//! node for bytes, at the address the master's replica descriptors carry. Nodes talk to the
//! master through the service's `cluster` call ([`crate::rpc::service::ClusterRequest`]).

mod durable;
pub mod meta;
pub mod node;
pub mod state;
pub use durable::SettleBackend;

pub use meta::ClusterMaster;
pub use node::{NodeOptions, StoreNode};
