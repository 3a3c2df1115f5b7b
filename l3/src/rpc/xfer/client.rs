//! The client side of the transfer channel: one connection, one call at a time, replies read
//! straight into the caller's buffers.
//!
//! Why: `RemoteStore` holds one of these for its server's bulk reads and probes (and one per
//! store node for a split deployment's data); the server's errors come back typed, a broken
//! connection or an unexpected reply as `RpcFail` (-900), on which the caller reconnects.

use std::io::{self, Read};
use std::net::{SocketAddr, TcpStream};

use serde_bytes::ByteBuf;

use crate::error::{L3Error, L3Result};
use crate::types::{ExistOptions, PutHandle, PutOptions, QueryResult, ReplicaDescriptor, Tenant};

use super::frame::{FrameError, pack_keys, read_frame, write_frame};
use super::{XferReply, XferRequest};

/// One client connection on the transfer channel.
pub struct XferClient {
    sock: TcpStream,
    max_frame: usize,
}

fn io_err(e: io::Error) -> L3Error {
    L3Error::RpcFail(format!("transfer channel: {e}"))
}

fn frame_err(e: FrameError) -> L3Error {
    match e {
        FrameError::Closed => L3Error::RpcFail("transfer channel closed".into()),
        FrameError::Io(e) => io_err(e),
        FrameError::TooLarge(n) => {
            L3Error::RpcFail(format!("reply frame of {n} bytes over the limit"))
        }
        FrameError::Malformed(m) => L3Error::RpcFail(format!("malformed reply: {m}")),
    }
}

impl XferClient {
    /// Connects and says hello.
    ///
    /// `timeout` bounds the connect and every read and write on the socket (the client's
    /// `rpc_timeout`): a store node that is paused or partitioned fails the call with
    /// -900 instead of blocking its caller until it comes back.
    pub fn connect(
        addr: SocketAddr,
        token: Option<String>,
        max_frame: usize,
        timeout: std::time::Duration,
    ) -> L3Result<Self> {
        let sock = TcpStream::connect_timeout(&addr, timeout).map_err(io_err)?;
        sock.set_read_timeout(Some(timeout)).map_err(io_err)?;
        sock.set_write_timeout(Some(timeout)).map_err(io_err)?;
        let _ = sock.set_nodelay(true);
        let mut c = XferClient { sock, max_frame };
        write_frame(&mut c.sock, &XferRequest::Hello { token }).map_err(io_err)?;
        match read_frame(&mut c.sock, c.max_frame).map_err(frame_err)? {
            XferReply::Hello(r) => r?,
            XferReply::Get(Err(e)) | XferReply::Exist(Err(e)) => return Err(e),
            _ => return Err(L3Error::RpcFail("unexpected reply".into())),
        }
        Ok(c)
    }

    fn check_request(&self, approx: usize) -> L3Result<()> {
        if approx > self.max_frame {
            return Err(L3Error::InvalidParams(format!(
                "request of about {approx} bytes exceeds the {}-byte frame limit",
                self.max_frame
            )));
        }
        Ok(())
    }

    /// Batched existence probe.
    pub fn exist(
        &mut self,
        tenant: &Tenant,
        keys: &[String],
        opts: ExistOptions,
    ) -> L3Result<Vec<L3Result<bool>>> {
        let packed = pack_keys(keys)?;
        self.check_request(packed.len() + 512)?;
        let req = XferRequest::Exist {
            tenant: tenant.clone(),
            opts,
            keys: ByteBuf::from(packed),
        };
        write_frame(&mut self.sock, &req).map_err(io_err)?;
        match read_frame(&mut self.sock, self.max_frame).map_err(frame_err)? {
            XferReply::Exist(r) => {
                let flags = r?;
                if flags.len() != keys.len() {
                    return Err(L3Error::RpcFail("reply length mismatch".into()));
                }
                Ok(flags
                    .iter()
                    .map(|f| match f {
                        0 => Ok(false),
                        1 => Ok(true),
                        _ => Err(L3Error::InvalidKey("invalid key".into())),
                    })
                    .collect())
            }
            XferReply::Get(Err(e)) => Err(e),
            _ => Err(L3Error::RpcFail("unexpected reply".into())),
        }
    }

    /// Batched read straight into the caller's buffers.
    pub fn get(
        &mut self,
        tenant: &Tenant,
        keys: &[String],
        queries: Option<&[QueryResult]>,
        bufs: &mut [&mut [u8]],
    ) -> L3Result<Vec<L3Result<u64>>> {
        let caps: Vec<u64> = bufs.iter().map(|b| b.len() as u64).collect();
        let req = match queries {
            Some(q) => XferRequest::GetWithQuery {
                tenant: tenant.clone(),
                queries: q.to_vec(),
                caps,
            },
            None => XferRequest::Get {
                tenant: tenant.clone(),
                keys: ByteBuf::from(pack_keys(keys)?),
                caps,
            },
        };
        let approx = keys.iter().map(|k| k.len() + 96).sum::<usize>() + 512;
        self.check_request(approx)?;
        write_frame(&mut self.sock, &req).map_err(io_err)?;
        self.read_blobs(bufs)
    }

    /// Store node: reads the replicas named by `replicas` into `bufs`.
    pub fn node_read(
        &mut self,
        tenant: &Tenant,
        keys: &[String],
        replicas: &[ReplicaDescriptor],
        bufs: &mut [&mut [u8]],
    ) -> L3Result<Vec<L3Result<u64>>> {
        let approx = keys.iter().map(|k| k.len() + 160).sum::<usize>() + 512;
        self.check_request(approx)?;
        let req = XferRequest::NodeRead {
            tenant: tenant.clone(),
            keys: keys.to_vec(),
            replicas: replicas.to_vec(),
            caps: bufs.iter().map(|b| b.len() as u64).collect(),
        };
        write_frame(&mut self.sock, &req).map_err(io_err)?;
        self.read_blobs(bufs)
    }

    /// Store node: writes and/or ends puts (see [`XferRequest::NodePut`]).
    pub fn node_put(
        &mut self,
        handles: &[PutHandle],
        data: &[&[u8]],
        end: Option<PutOptions>,
    ) -> L3Result<Vec<L3Result<()>>> {
        let approx = handles.iter().map(|h| h.key.len() + 256).sum::<usize>()
            + data.iter().map(|d| d.len() + 8).sum::<usize>()
            + 512;
        self.check_request(approx)?;
        let req = XferRequest::NodePut {
            handles: handles.to_vec(),
            data: data.iter().map(|d| ByteBuf::from(d.to_vec())).collect(),
            end,
        };
        write_frame(&mut self.sock, &req).map_err(io_err)?;
        match read_frame(&mut self.sock, self.max_frame).map_err(frame_err)? {
            XferReply::Batch(r) => {
                let v = r?;
                if v.len() != handles.len() {
                    return Err(L3Error::RpcFail("reply length mismatch".into()));
                }
                Ok(v)
            }
            XferReply::Get(Err(e)) | XferReply::Exist(Err(e)) => Err(e),
            _ => Err(L3Error::RpcFail("unexpected reply".into())),
        }
    }

    /// Store node: its shared-memory offer (None: none, or a node or server that does not
    /// know the request).
    pub fn shm_offer(&mut self) -> L3Result<Option<crate::rpc::shm::ShmOffer>> {
        write_frame(&mut self.sock, &XferRequest::ShmOffer).map_err(io_err)?;
        match read_frame(&mut self.sock, self.max_frame).map_err(frame_err)? {
            XferReply::ShmOffer(o) => Ok(o),
            XferReply::Get(Err(_)) => Ok(None),
            _ => Err(L3Error::RpcFail("unexpected reply".into())),
        }
    }

    /// Store node: waits for its queued SSD writes.
    pub fn node_flush(&mut self) -> L3Result<()> {
        write_frame(&mut self.sock, &XferRequest::NodeFlush).map_err(io_err)?;
        match read_frame(&mut self.sock, self.max_frame).map_err(frame_err)? {
            XferReply::Batch(r) => r.map(|_| ()),
            XferReply::Get(Err(e)) | XferReply::Exist(Err(e)) => Err(e),
            _ => Err(L3Error::RpcFail("unexpected reply".into())),
        }
    }

    fn read_blobs(&mut self, bufs: &mut [&mut [u8]]) -> L3Result<Vec<L3Result<u64>>> {
        let sizes = match read_frame(&mut self.sock, self.max_frame).map_err(frame_err)? {
            XferReply::Get(r) => r?,
            _ => return Err(L3Error::RpcFail("unexpected reply".into())),
        };
        if sizes.len() != bufs.len() {
            return Err(L3Error::RpcFail("reply length mismatch".into()));
        }
        for (s, buf) in sizes.iter().zip(bufs.iter_mut()) {
            if let Ok(n) = s {
                let n = *n as usize;
                if n > buf.len() {
                    return Err(L3Error::RpcFail(
                        "server sent more than the buffer holds".into(),
                    ));
                }
                self.sock.read_exact(&mut buf[..n]).map_err(io_err)?;
            }
        }
        Ok(sizes)
    }
}
