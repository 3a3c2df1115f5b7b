"""L3 keys of vLLM's offloaded chunks.

Why: vLLM names a chunk by its ``OffloadKey`` (the block hash of the chunk's last block plus
the KV group index). Those hashes already separate prompts, LoRA adapters and
``cache_salt``s, but not what the bytes *are*: two models (or dtypes, chunkings, KV layouts,
tensor-parallel shapes) hash the same tokens to the same key while their chunks hold
different bytes. kvtier prefixes every key with a namespace over all of that, so engines
that would read each other's bytes wrongly never share a key, and engines serving the same
model with the same layout share everything.

How: the namespace is kvtier's (docs/page-keys.md, ``kvtier.sglang.l3_namespace``) over the
model (its name and :func:`model_identity`: what its checkpoint is, see below), the KV dtype,
a layout string and the tenant. The layout string carries the
tokens per hash and per block, the blocks per chunk, the chunk's byte size, vLLM's KV cache
layout, the parallel shape — ``agnostic`` when vLLM says the bytes are the same under any
topology (``is_parallelism_agnostic``), ``canonical`` for its canonical host layout,
``replicated`` for a replicated (MLA) layout, else TP/PP/PCP/DCP and world size — and each
offloaded group's id, block size and layer names. The key is ``{namespace}:{OffloadKey hex}``.

Why the model's identity and not its name: a new fine-tune at the same path or hub id, or a
``--hf-overrides`` that changes RoPE, keeps the name and changes every page; an engine on a
shared store then served another checkpoint's KV (wrong tokens, an adversarial tester's
case). :func:`model_identity` adds the checkpoint's content fingerprint
(``kvtier.model_identity``), the engine's ``hf_overrides``, quantization and revision (from
the ``VllmConfig`` the connector is built with), the dtype the model computes in and
LongRoPE's factors (:func:`engine_settings`), and an operator's ``model_version``.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any, Optional

from ..model_identity import engine_identity, namespace_model
from ..namespace import l3_namespace

__all__ = ["engine_settings", "engine_vllm_config", "layout_of", "model_identity", "namespace_of", "l3_key"]


def engine_vllm_config() -> Optional[Any]:
    """The ``VllmConfig`` the connector is being built with: vLLM hands an offloading spec
    only its normalized ``OffloadingConfig`` (the name, not the overrides), so the caller
    frames' ``vllm_config`` is read (``OffloadingConnector.__init__`` holds it). None outside
    an engine (a spec built by hand)."""
    f = inspect.currentframe()
    try:
        depth = 0
        while f is not None and depth < 64:
            v = f.f_locals.get("vllm_config")
            if getattr(v, "model_config", None) is not None and type(v).__name__ == "VllmConfig":
                return v
            f, depth = f.f_back, depth + 1
        return None
    finally:
        del f


def _engine_model_config() -> Optional[Any]:
    """The ``ModelConfig`` of :func:`engine_vllm_config`."""
    return getattr(engine_vllm_config(), "model_config", None)


def _overrides(mc: Any) -> Any:
    o = getattr(mc, "hf_overrides", None)
    if callable(o):  # a function: named by where it lives (its repr holds an address)
        return f"{getattr(o, '__module__', '')}.{getattr(o, '__qualname__', repr(type(o)))}"
    return o


def _longrope(mc: Any) -> str:
    """Which LongRoPE factors vLLM rotates with (``Phi3LongRoPEScaledRotaryEmbedding``: the
    long ones when ``max_model_len`` passes ``original_max_position_embeddings``, so that a
    sequence's keys never change mid-way); ``""`` for any other RoPE, whose keys do not depend
    on ``max_model_len``."""
    t = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    params = getattr(t, "rope_parameters", None) or getattr(t, "rope_scaling", None)
    # one dict, or one per layer type (Gemma 3's full and sliding attention)
    every = [params, *params.values()] if isinstance(params, dict) else []
    for p in every:
        if isinstance(p, dict) and (p.get("rope_type") or p.get("type")) in ("longrope", "su"):
            orig = p.get("original_max_position_embeddings") or getattr(t, "original_max_position_embeddings", None)
            if orig is None:
                return "longrope"  # unknown which: kept apart from both
            try:
                long_ = int(getattr(mc, "max_model_len")) > int(orig)
            except (TypeError, ValueError):
                return "longrope"  # unknown which: kept apart from both
            return "longrope.long" if long_ else "longrope.short"
    return ""


def engine_settings(mc: Any) -> str:
    """The engine's settings that change every page beyond the checkpoint and its overrides:
    the dtype the model computes in (vLLM's offloading config names only the *cache* dtype,
    ``fp8`` for a bfloat16 and a float32 engine alike: their fp8 pages differ, and shared a
    namespace until 2026-12-06) and LongRoPE's factors (:func:`_longrope`)."""
    parts = [f"dtype={str(getattr(mc, 'dtype', '')).replace('torch.', '')}"]
    rope = _longrope(mc)
    if rope:
        parts.append(rope)
    return ";".join(parts)


def model_identity(cfg: Any, version: str = "", model_config: Any = None) -> str:
    """What the model's pages depend on beyond its name (module doc): the checkpoint's
    content fingerprint, the engine's ``hf_overrides``, quantization, revision and
    :func:`engine_settings` (``model_config``, else the ``VllmConfig`` being built, when there
    is one), and the operator's ``version``. ``""`` when none of these is known."""
    mc = model_config if model_config is not None else _engine_model_config()
    if mc is None:
        return engine_identity(str(cfg.model.name), engine_config=False, version=version)
    return engine_identity(str(cfg.model.name), engine_config=True, revision=getattr(mc, "revision", None),
                           overrides=_overrides(mc), quantization=getattr(mc, "quantization", None),
                           version=version, settings=engine_settings(mc))


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


def namespace_of(cfg: Any, chunk_bytes: int, tenant: str, identity: str = "") -> str:
    """The L3 key namespace of an engine's chunks (16 hex digits); ``identity`` is
    :func:`model_identity` (``""``: the name alone)."""
    return l3_namespace(namespace_model(str(cfg.model.name), identity), str(cfg.model.dtype), layout_of(cfg, chunk_bytes), tenant)


def l3_key(namespace: str, offload_key: bytes) -> str:
    """The L3 object key of one vLLM chunk."""
    return f"{namespace}:{bytes(offload_key).hex()}"
