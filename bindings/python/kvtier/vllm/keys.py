"""L3 keys of vLLM's offloaded chunks.

Why: vLLM names a chunk by its ``OffloadKey`` (the block hash of the chunk's last block plus
the KV group index). Those hashes already separate prompts, LoRA adapters and
``cache_salt``s, but not what the bytes *are*: two models (or dtypes, chunkings, KV layouts,
tensor-parallel shapes) hash the same tokens to the same key while their chunks hold
different bytes. kvtier prefixes every key with a namespace over all of that, so engines
that would read each other's bytes wrongly never share a key, and engines serving the same
model with the same layout share everything.

How: the namespace is kvtier's (docs/page-keys.md, ``kvtier.sglang.l3_namespace``) over the
model name, the KV dtype, a layout string and the tenant. The layout string carries the
tokens per hash and per block, the blocks per chunk, the chunk's byte size, vLLM's KV cache
layout, the parallel shape — ``agnostic`` when vLLM says the bytes are the same under any
topology (``is_parallelism_agnostic``), ``canonical`` for its canonical host layout,
``replicated`` for a replicated (MLA) layout, else TP/PP/PCP/DCP and world size — and each
offloaded group's id, block size and layer names. The key is ``{namespace}:{OffloadKey hex}``.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ..namespace import l3_namespace

__all__ = ["layout_of", "namespace_of", "l3_key"]


def _parallel(cfg: Any) -> str:
    p = cfg.parallel
    if p.is_parallelism_agnostic:
        return "agnostic"
    if getattr(cfg, "canonical_layout", False):
        return "canonical"
    if getattr(cfg, "replicated_layout", False):
        return f"replicated.pp{p.pp_size}"
    return f"tp{p.tp_size}.pp{p.pp_size}.pcp{p.pcp_size}.dcp{p.dcp_size}.ws{p.world_size}"


def layout_of(cfg: Any, chunk_bytes: int) -> str:
    """The layout field of the namespace of an ``OffloadingConfig`` whose host chunk slots
    are ``chunk_bytes`` long."""
    groups = []
    for g in cfg.groups:
        names = hashlib.sha256("\0".join(g.layer_names).encode()).hexdigest()[:16]
        # vLLM 0.32 has no window field: its groups read as full attention (None), as 0.33's do.
        window = getattr(g, "sliding_window_size_in_chunks", None)
        groups.append(f"g{g.group_id}.t{g.tokens_per_block}.w{window}.{names}")
    return ".".join([
        "vllm",
        f"tph{cfg.cache.tokens_per_hash}",
        f"bpc{cfg.cache.blocks_per_chunk}",
        f"cb{chunk_bytes}",
        f"wb{cfg.worker_kv_bytes_per_block}",
        str(cfg.kv_cache_layout or "default"),
        _parallel(cfg),
        *groups,
    ])


def namespace_of(cfg: Any, chunk_bytes: int, tenant: str) -> str:
    """The L3 key namespace of an engine's chunks (16 hex digits)."""
    return l3_namespace(str(cfg.model.name), str(cfg.model.dtype), layout_of(cfg, chunk_bytes), tenant)


def l3_key(namespace: str, offload_key: bytes) -> str:
    """The L3 object key of one vLLM chunk."""
    return f"{namespace}:{bytes(offload_key).hex()}"
