//! The kvtier-router service's tests, one test binary (each binary links tokio, axum, hyper
//! and ZMQ, and CI builds them in release):
//!
//! - [`events`]: real kvtier publishers on loopback: gaps, snapshots, dead and garbage
//!   publishers, the page cap, `POST /route`;
//! - [`proxy`]: the OpenAI proxy against recorded vLLM responses, and vLLM's recorded events;
//! - [`stream_props`]: proptest invariants of a stream's recovery and of the cap;
//! - [`bookings`]: `POST /route` clients reporting their requests' first token and end;
//! - [`docs`]: docs/router.md's command line and requests;
//! - [`upstream_errors`]: instances that answer errors, or cannot be sent to;
//! - [`forwarding`]: what of a client's request reaches the instance;
//! - [`faults`]: instances that hang, cannot be reached or close idle connections;
//! - [`apis`]: `/v1/embeddings`, `/v1/responses` and SGLang's `/generate` through the proxy;
//! - [`admin`]: admin calls fanned out to every instance (LoRA adapters, cache resets);
//! - [`abuse`]: clients that go away, every request shape, odd HTTP, clients that stall;
//! - [`endpoints`]: `/v1/models`, `/tokenize`, `/readiness`, `/metrics`;
//! - [`learnt`]: error events, batches of prompts and float token ids, as booked and learnt;
//! - [`release_props`]: proptest: in-flight counts and bookings return to zero whatever
//!   clients and instances do.

mod abuse;
mod admin;
mod apis;
mod bookings;
mod common;
mod docs;
mod endpoints;
mod events;
mod faults;
mod forwarding;
mod learnt;
mod proxy;
mod release_props;
mod stream_props;
mod upstream_errors;
