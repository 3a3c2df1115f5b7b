//! The tarpc service: wire types, server and client. See [`service`].

pub mod accept;
pub mod client;
pub mod codec;
pub mod server;
pub mod service;
pub mod shm;
pub mod xfer;
