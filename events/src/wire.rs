//! vLLM's KV event wire format: one msgpack `KVEventBatch` per ZMQ message.
//!
//! Why vLLM's format rather than our own: every KV-aware router that exists (vLLM's own
//! subscribers, NVIDIA Dynamo's indexer, llm-d's) already decodes it, so kvtier's events reach
//! them without an adapter. The layout is msgspec's encoding of the classes in vLLM's
//! `vllm/distributed/kv_events.py`:
//!
//! - the batch is an array `[ts, events, data_parallel_rank]` (`array_like=True`);
//! - each event is a map tagged by its class name under `"type"` (`tag=True`), holding every
//!   field without a default and, as `omit_defaults=True` does, only those optional fields
//!   that are set: `BlockStored {block_hashes, parent_block_hash, token_ids, block_size,
//!   lora_id, medium, lora_name[, locality]}`, `BlockRemoved {block_hashes, medium[,
//!   locality]}`, `AllBlocksCleared {}`;
//! - a block hash (`ExternalBlockHash = bytes | int`) is, as vLLM sends it by default
//!   (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`), the hash's last 8 bytes as a big-endian
//!   unsigned integer ([`HashFormat::Int64`]; Dynamo's decoder accepts nothing else), or the
//!   whole 32-byte page hash as bytes ([`HashFormat::Bytes`]);
//! - `medium` is `"GPU"`, `"CPU"` or `"STORAGE"`.
//!
//! The tests decode these bytes with vLLM's own msgspec classes
//! (`bindings/tests/vllm_suite/test_vllm_kv_events.py`).

use kvtier_radix::{KvEvent, PageHash, TierKind};
use rmp::encode::{self, ValueWriteError};

/// Where a block's copy lives, as vLLM names it (`MEDIUM_GPU`, `MEDIUM_CPU`, `MEDIUM_STORAGE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Medium {
    Gpu,
    Cpu,
    Storage,
}

impl Medium {
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Storage => "STORAGE",
        }
    }

    /// The device tier is GPU memory, the host tier pinned DRAM.
    pub fn of_tier(t: TierKind) -> Self {
        match t {
            TierKind::Device => Medium::Gpu,
            TierKind::Host => Medium::Cpu,
        }
    }
}

/// How block hashes go on the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HashFormat {
    /// vLLM's default: the low 64 bits of the hash read big-endian (its last 8 bytes).
    #[default]
    Int64,
    /// The whole 32-byte hash as msgpack bytes.
    Bytes,
}

impl HashFormat {
    /// The integer vLLM publishes for a hash under [`HashFormat::Int64`].
    pub fn int64(h: &PageHash) -> u64 {
        let mut low = [0u8; 8];
        low.copy_from_slice(&h.0[24..]);
        u64::from_be_bytes(low)
    }
}

/// vLLM's `locality`: relative to the publisher (`None`: unspecified, and not encoded).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Locality {
    Local,
    Remote,
}

impl Locality {
    pub fn as_str(self) -> &'static str {
        match self {
            Locality::Local => "LOCAL",
            Locality::Remote => "REMOTE",
        }
    }
}

/// One event as it goes on the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireEvent {
    BlockStored {
        block_hashes: Vec<PageHash>,
        parent_block_hash: Option<PageHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        medium: Medium,
        lora_name: Option<String>,
        locality: Option<Locality>,
    },
    BlockRemoved {
        block_hashes: Vec<PageHash>,
        medium: Medium,
        locality: Option<Locality>,
    },
    AllBlocksCleared,
}

impl WireEvent {
    /// A kvtier cache event in vLLM's terms (`block_size`: the cache's page size in tokens).
    pub fn from_kv(e: &KvEvent, block_size: u32) -> Self {
        match e {
            KvEvent::Stored {
                tier,
                parent,
                hashes,
                tokens,
                label,
            } => WireEvent::BlockStored {
                block_hashes: hashes.clone(),
                parent_block_hash: *parent,
                token_ids: tokens.clone(),
                block_size,
                medium: Medium::of_tier(*tier),
                lora_name: label.as_ref().and_then(|l| l.adapter.clone()),
                locality: Some(Locality::Local),
            },
            KvEvent::Removed { tier, hashes, .. } => WireEvent::BlockRemoved {
                block_hashes: hashes.clone(),
                medium: Medium::of_tier(*tier),
                locality: Some(Locality::Local),
            },
            KvEvent::Cleared => WireEvent::AllBlocksCleared,
        }
    }
}

/// Why a batch could not be encoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EncodeError {
    /// msgpack counts in u32: more events, blocks or tokens than that in one batch.
    #[error("{what}: {len} items, msgpack holds at most 4,294,967,295")]
    TooLong { what: &'static str, len: usize },
    #[error("msgpack writer: {0}")]
    Write(String),
}

impl From<ValueWriteError> for EncodeError {
    fn from(e: ValueWriteError) -> Self {
        EncodeError::Write(e.to_string())
    }
}

/// Encodes `KVEventBatch(ts, events, data_parallel_rank)`.
pub fn encode_batch(
    ts: f64,
    events: &[WireEvent],
    data_parallel_rank: i64,
    hashes: HashFormat,
) -> Result<Vec<u8>, EncodeError> {
    let mut buf = Vec::with_capacity(64 + events.len() * 96);
    write_batch(&mut buf, ts, events, data_parallel_rank, hashes)?;
    Ok(buf)
}

fn write_batch(
    w: &mut Vec<u8>,
    ts: f64,
    events: &[WireEvent],
    dp: i64,
    f: HashFormat,
) -> Result<(), EncodeError> {
    encode::write_array_len(w, 3)?;
    encode::write_f64(w, ts)?;
    encode::write_array_len(w, len32("events", events.len())?)?;
    for e in events {
        write_event(w, e, f)?;
    }
    encode::write_sint(w, dp)?;
    Ok(())
}

fn write_event(w: &mut Vec<u8>, e: &WireEvent, f: HashFormat) -> Result<(), EncodeError> {
    match e {
        WireEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium,
            lora_name,
            locality,
        } => {
            encode::write_map_len(w, 8 + u32::from(locality.is_some()))?;
            kv_str(w, "type", "BlockStored")?;
            encode::write_str(w, "block_hashes")?;
            write_hashes(w, block_hashes, f)?;
            encode::write_str(w, "parent_block_hash")?;
            match parent_block_hash {
                Some(h) => write_hash(w, h, f)?,
                None => nil(w)?,
            }
            encode::write_str(w, "token_ids")?;
            encode::write_array_len(w, len32("token_ids", token_ids.len())?)?;
            for &t in token_ids {
                encode::write_uint(w, u64::from(t))?;
            }
            encode::write_str(w, "block_size")?;
            encode::write_uint(w, u64::from(*block_size))?;
            encode::write_str(w, "lora_id")?;
            nil(w)?;
            kv_str(w, "medium", medium.as_str())?;
            encode::write_str(w, "lora_name")?;
            match lora_name {
                Some(n) => encode::write_str(w, n)?,
                None => nil(w)?,
            }
            if let Some(l) = locality {
                kv_str(w, "locality", l.as_str())?;
            }
        }
        WireEvent::BlockRemoved {
            block_hashes,
            medium,
            locality,
        } => {
            encode::write_map_len(w, 3 + u32::from(locality.is_some()))?;
            kv_str(w, "type", "BlockRemoved")?;
            encode::write_str(w, "block_hashes")?;
            write_hashes(w, block_hashes, f)?;
            kv_str(w, "medium", medium.as_str())?;
            if let Some(l) = locality {
                kv_str(w, "locality", l.as_str())?;
            }
        }
        WireEvent::AllBlocksCleared => {
            encode::write_map_len(w, 1)?;
            kv_str(w, "type", "AllBlocksCleared")?;
        }
    }
    Ok(())
}

fn kv_str(w: &mut Vec<u8>, k: &str, v: &str) -> Result<(), EncodeError> {
    encode::write_str(w, k)?;
    Ok(encode::write_str(w, v)?)
}

fn nil(w: &mut Vec<u8>) -> Result<(), EncodeError> {
    encode::write_nil(w).map_err(|e| EncodeError::Write(e.to_string()))
}

fn write_hashes(w: &mut Vec<u8>, hs: &[PageHash], f: HashFormat) -> Result<(), EncodeError> {
    encode::write_array_len(w, len32("block_hashes", hs.len())?)?;
    for h in hs {
        write_hash(w, h, f)?;
    }
    Ok(())
}

fn write_hash(w: &mut Vec<u8>, h: &PageHash, f: HashFormat) -> Result<(), EncodeError> {
    match f {
        HashFormat::Int64 => encode::write_uint(w, HashFormat::int64(h)).map(|_| ())?,
        HashFormat::Bytes => encode::write_bin(w, &h.0)?,
    }
    Ok(())
}

fn len32(what: &'static str, len: usize) -> Result<u32, EncodeError> {
    u32::try_from(len).map_err(|_| EncodeError::TooLong { what, len })
}
