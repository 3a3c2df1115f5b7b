//! The tarpc service: wire types, server and client. See [`service`].

pub mod client;
pub mod codec;
pub mod server;
pub mod service;
pub mod xfer;
