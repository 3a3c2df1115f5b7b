"""How the SGLang storage backend sees a host pool: a pool of equal byte chunks, a page a
fixed set of them (module doc of ``storage.py``), and the namespace fields that depend on
the pool and the deployment (the KV dtype, the model's identity).

Why apart from the backend class: which pools can be stored whole, and how their bytes map
to L3 objects, is where wrong KV comes from (an MLA model's MHA draft pool, an MXFP8 pool's
scales beside its buffer); it is checked once, at registration, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

import numpy as np
import torch
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from ..model_identity import engine_identity, namespace_model
from .storage_options import UnsupportedPoolError

# Layouts whose page is a fixed set of chunks of the one kv_buffer (see the module doc).
_PAGE_MAJOR = ("page_first", "page_first_direct", "page_head")
_LAYOUTS = _PAGE_MAJOR + ("layer_first",)


def _object_key(namespace: str, page: str, rank: int, part: str) -> str:
    """The L3 object key of one part of one page (module docs)."""
    return f"{namespace}:{page}:{rank}/{part}"


# SGLang's page hashes are SHA-256 hex digests; a namespace is 16 hex digits (namespace.py)
_SAMPLE_PAGE = "0" * 64
_SAMPLE_NAMESPACE = "0" * 16


@dataclass(frozen=True)
class _Grid:
    """A host pool as a pool of chunks: ``parts`` chunks of ``chunk_bytes`` per page."""

    pool: Any
    flat: np.ndarray  # the kv_buffer's bytes (shares memory with the torch tensor)
    page_size: int
    pages: int
    parts: Tuple[str, ...]
    chunk_bytes: int
    layout: str
    dtype: str
    # the pool's own kind (an MHA draft pool of an MLA model is MHA), and whether its KV is the
    # same on every rank (an MLA pool of an MLA deployment: one writer, every rank reads it)
    mla: bool = False
    replicated: bool = False

    @property
    def page_bytes(self) -> int:
        return self.chunk_bytes * len(self.parts)

    def chunk_ids(self, page_ids: np.ndarray) -> np.ndarray:
        """Chunk numbers of the pages, page-major (all parts of page 0, then page 1, ...)."""
        parts = np.arange(len(self.parts), dtype=np.int64) * self.pages
        return (page_ids[:, None].astype(np.int64) + parts[None, :]).reshape(-1)


def _pool_is_mla(pool: Any, mla_model: bool) -> bool:
    """Whether ``pool`` holds MLA latent rows (one component) or MHA K and V, by its own class:
    SGLang builds a draft model's host pool from the draft's device pool, so an MLA model's
    EAGLE draft pool is an ``MHATokenToKVPoolHost``. Other classes: the model's kind."""
    if isinstance(pool, MLATokenToKVPoolHost):
        return True
    if isinstance(pool, MHATokenToKVPoolHost):
        return False
    return mla_model


def _state_outside_kv_buffer(pool: Any) -> List[str]:
    """Attributes of ``pool`` holding per-page state beside its ``kv_buffer`` (SGLang's MXFP8
    pool keeps each page's scales in ``k_scale_host`` / ``v_scale_host``): a page stored
    from ``kv_buffer`` alone would come back with the scales its host slot held before."""
    out = []
    for name, v in vars(pool).items():
        if "scale" not in name:
            continue
        vals = v if isinstance(v, (list, tuple)) else [v]
        if any(isinstance(t, torch.Tensor) and t.numel() for t in vals):
            out.append(name)
    return sorted(out)


def _grid(pool: Any, mla_model: bool) -> _Grid:
    layout = getattr(pool, "layout", None)
    buf = getattr(pool, "kv_buffer", None)
    if layout not in _LAYOUTS or not isinstance(buf, torch.Tensor):
        raise UnsupportedPoolError(f"host pool layout {layout!r} (supported: {', '.join(_LAYOUTS)})")
    beside = _state_outside_kv_buffer(pool)
    if beside:
        raise UnsupportedPoolError(
            f"{type(pool).__name__} keeps per-page state outside its kv_buffer ({', '.join(beside)}: "
            "a quantized KV cache's scales); its pages cannot be stored whole (SGLang's own flat-page "
            "calls refuse it too)")
    mla = _pool_is_mla(pool, mla_model)
    if buf.device.type != "cpu" or not buf.is_contiguous():
        raise UnsupportedPoolError("the host pool's kv_buffer must be a contiguous CPU tensor")
    if getattr(pool, "dcp_size", 1) != 1:
        raise UnsupportedPoolError("decode context parallelism (dcp_size > 1) is not supported")
    ps, size = int(pool.page_size), int(pool.size)
    layers = int(pool.layer_num)
    comps = ("kv",) if mla else ("k", "v")
    if not mla and buf.shape[0] != 2:
        raise UnsupportedPoolError(f"an MHA pool's kv_buffer starts with K/V (2), got {tuple(buf.shape)}")
    if layout == "layer_first":
        parts = tuple(f"{c}{layer}" for c in comps for layer in range(layers))
    else:
        parts = comps
    pages = size // ps
    nbytes = buf.numel() * buf.element_size()
    chunk = nbytes // (len(parts) * pages) if pages else 0
    if size % ps or chunk == 0 or chunk * len(parts) * pages != nbytes:
        raise UnsupportedPoolError(f"kv_buffer {tuple(buf.shape)} is not {len(parts)} parts x {pages} pages")
    flat = buf.view(-1).view(torch.uint8).numpy()
    return _Grid(pool, flat, ps, pages, parts, chunk, layout, _kv_dtype(buf.dtype), mla, mla and mla_model)


def _server_args() -> Any:
    """SGLang's published ``ServerArgs`` (None outside an engine)."""
    try:
        from sglang.srt.runtime_context import get_context

        return get_context().server_args
    except (ImportError, AttributeError, RuntimeError, ValueError):
        return None


def sglang_model(name: str, server_args: Any = None, version: str = "") -> str:
    """The namespace's model field of an SGLang deployment (docs/page-keys.md): ``name`` and
    what its pages depend on beyond it (``kvtier.model_identity``): the checkpoint at
    ``--model-path`` (its content fingerprint), ``--json-model-override-args``,
    ``--quantization``, ``--revision``, ``--dtype`` (fp8 KV computed in bfloat16 and in
    float32 fills equal host pools with other bytes) and the operator's ``model_version``. A
    name alone let a new fine-tune at the same path read the old one's pages (wrong KV).
    ``server_args``: SGLang's (None: the published ones, if any)."""
    sa = server_args if server_args is not None else _server_args()
    path = str(getattr(sa, "model_path", None) or name)
    ident = engine_identity(path, engine_config=sa is not None, revision=getattr(sa, "revision", None),
                            overrides=getattr(sa, "json_model_override_args", None),
                            quantization=getattr(sa, "quantization", None), version=version,
                            settings=f"dtype={getattr(sa, 'dtype', 'auto')}")
    return namespace_model(name, ident)


def _kv_dtype(stored: torch.dtype) -> str:
    """The KV dtype for the namespace: the host pool's, and SGLang's ``--kv-cache-dtype``
    when it is not ``auto`` (every fp8 variant is stored as uint8: an fp8_e4m3 and an
    fp8_e5m2 deployment must not read each other's bytes)."""
    name = str(stored).replace("torch.", "")
    # no server args published (a backend built outside an engine): the pool's dtype alone
    logical = str(getattr(_server_args(), "kv_cache_dtype", "auto") or "auto")
    return name if logical == "auto" else f"{name}.{logical}"
