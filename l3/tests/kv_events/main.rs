//! The store's KV events for routers (`kvtier-l3 --kv-events`, `StoreConfig::kv_events`), in
//! one test binary: `live` (real processes, a real subscriber and router), `failover` (an etcd
//! HA pair: the router follows the new leader's stream), `props` (the embedded store's
//! snapshot equals its listing after random operations).

#[path = "../common/mod.rs"]
mod common;

mod failover;
mod live;
mod props;
