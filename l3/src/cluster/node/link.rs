//! The node's connection to the master.
//!
//! Why: every exchange with the master is a call the node makes (mount, ping, put end,
//! registrations), so one lazily (re)connected client is all the node needs; a failed call
//! drops it and the next call connects again.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::{L3Error, L3Result};
use crate::rpc::client::{ClientOptions, RemoteStore};
use crate::rpc::service::{ClusterReply, ClusterRequest};

/// The node's connection to the master; reconnects on the next call after a failure.
pub(super) struct MasterLink {
    pub(super) addr: SocketAddr,
    pub(super) token: Option<String>,
    pub(super) conn: Mutex<Option<Arc<RemoteStore>>>,
}

impl MasterLink {
    pub(super) fn call(&self, req: ClusterRequest) -> L3Result<ClusterReply> {
        let c = {
            let mut g = self.conn.lock();
            match &*g {
                Some(c) => c.clone(),
                None => {
                    let c = Arc::new(RemoteStore::connect(
                        self.addr,
                        ClientOptions {
                            token: self.token.clone(),
                            rpc_timeout: Duration::from_secs(10),
                            use_transfer_channel: false,
                            ..Default::default()
                        },
                    )?);
                    if !c.limits().cluster {
                        return Err(L3Error::InvalidParams(format!(
                            "{} is not a master (start one with `kvtier-l3 --role master`)",
                            self.addr
                        )));
                    }
                    *g = Some(c.clone());
                    c
                }
            }
        };
        let r = c.cluster(req);
        if let Err(L3Error::RpcFail(_)) = &r {
            *self.conn.lock() = None;
        }
        r
    }
}
