"""The L3 namespace of a model served by kvtier.torch, derived from what makes KV incompatible.

Why derive it: L3 keys are ``{namespace}:{page hash}:{rank}`` and the page hash covers only
tokens, so two models on one store with the same namespace read each other's pages as their
own KV: wrong tokens, no error. The namespace (docs/page-keys.md) must therefore change with
everything that changes the bytes of a page: the architecture and the weights (a name the
engine gives, by default the config's ``_name_or_path``, a hash of the whole config, and a
fingerprint of the weights themselves), the KV dtype, the layout (MHA/MLA, layers, heads,
head dims), the page size and the tensor-parallel shape. :func:`torch_namespace` puts them
into the scheduler's namespace fields; ``TorchEngine`` fills them in when the config leaves the
namespace empty.

Why the weights' fingerprint: a name is a promise the caller may not make. Models built in
code from one config (an empty ``_name_or_path``, no ``model_id``) with different weights
would otherwise share a namespace and read each other's KV. :func:`weights_fingerprint`
hashes every parameter's name, shape and dtype and a fixed sample of its values
(:data:`SAMPLES_PER_TENSOR` evenly strided elements), gathered on the tensor's own device
and copied to the host once: milliseconds for a model of hundreds of MB (docs/torch.md). A
model whose weights are on the meta device (not loaded) has nothing to fingerprint and gets
no derived namespace (:class:`NamespaceError`); name it yourself with the namespace's
``model`` field.

Same config, same ``model_id`` and same weights means same namespace: two engines serving one
model share L3 pages, which is the point of L3. The fingerprint is a sample, not a checksum:
two weight sets that differ only outside the sampled elements (an edit of a few rows) get one
namespace; give them different ``model_id``s.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any, Dict, List, Optional, Tuple

import torch

from .errors import NamespaceError
from .pools import KVLayout

__all__ = ["SAMPLES_PER_TENSOR", "config_hash", "sample_positions", "torch_namespace", "weights_fingerprint"]

SAMPLES_PER_TENSOR = 256
"""Elements of each parameter tensor :func:`weights_fingerprint` reads."""


def config_hash(config: Any) -> str:
    """16 hex digits of SHA-256 over the config's public fields (sorted JSON; private fields
    such as the attention implementation, the dtype and the transformers version left out)."""
    d = config.to_dict()
    skip = {"transformers_version", "dtype", "torch_dtype", "_name_or_path"}
    clean = {k: v for k, v in d.items() if not k.startswith("_") and k not in skip}
    text = json.dumps(clean, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sample_positions(numel: int) -> List[int]:
    """The flat (row-major) positions :func:`weights_fingerprint` reads in a tensor of
    ``numel`` elements: every one up to :data:`SAMPLES_PER_TENSOR`, else that many evenly
    strided from the first to the last."""
    k = SAMPLES_PER_TENSOR
    if numel <= k:
        return list(range(numel))
    return [i * (numel - 1) // (k - 1) for i in range(k)]


@functools.lru_cache(maxsize=256)
def _positions(numel: int, device: torch.device) -> torch.Tensor:
    """:func:`sample_positions` as an int64 tensor on ``device`` (made there: no host list)."""
    k = SAMPLES_PER_TENSOR
    if numel <= k:
        return torch.arange(numel, dtype=torch.int64, device=device)
    return torch.arange(k, dtype=torch.int64, device=device) * (numel - 1) // (k - 1)


def _sample(t: torch.Tensor) -> torch.Tensor:
    """The sampled elements of ``t`` as bytes (uint8, on ``t``'s device), gathered without
    copying ``t`` (a non-contiguous tensor is indexed by coordinates)."""
    if t.is_quantized:
        t = t.int_repr()
    if t.dim() == 0:
        s = t.reshape(1)
    else:
        idx = _positions(t.numel(), t.device)
        s = t.reshape(-1).index_select(0, idx) if t.is_contiguous() else t[torch.unravel_index(idx, t.shape)]
    return s.contiguous().view(torch.uint8).reshape(-1)


def weights_fingerprint(model: Any) -> str:
    """16 hex digits of SHA-256 over every parameter of ``model`` (``named_parameters()``,
    in order): its name, shape and dtype and the bytes of its :func:`sample_positions`.
    Independent of the device the weights are on and of their memory layout; equal for
    copies of one set of weights, different when a sampled element, a name, a shape or a
    dtype differs. Raises :class:`NamespaceError` for a model without parameters to read
    (weights on the meta device, or not a ``torch.nn.Module``)."""
    named = getattr(model, "named_parameters", None)
    if not callable(named):
        raise NamespaceError(f"{type(model).__name__} has no named_parameters(): no weights to fingerprint for an L3"
                             " namespace; set the namespace's model field yourself")
    params: List[Tuple[str, torch.Tensor]] = [(n, p.detach()) for n, p in named()]
    meta = [n for n, p in params if p.is_meta]
    if meta:
        raise NamespaceError(f"{len(meta)} parameters (first {meta[0]!r}) are on the meta device: no weights to"
                             " fingerprint for an L3 namespace; load the weights, or set the namespace's model"
                             " field yourself")
    # One gather per tensor on its own device, one copy to the host per device.
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    spans: List[Tuple[torch.device, int, int]] = []
    offsets: Dict[torch.device, int] = {}
    with torch.no_grad():
        for _, p in params:
            b = _sample(p) if p.numel() else torch.empty(0, dtype=torch.uint8, device=p.device)
            at = offsets.get(p.device, 0)
            by_device.setdefault(p.device, []).append(b)
            spans.append((p.device, at, at + b.numel()))
            offsets[p.device] = at + b.numel()
        host = {d: torch.cat(bs).cpu().numpy().tobytes() for d, bs in by_device.items()}
    h = hashlib.sha256()
    for (name, p), (dev, lo, hi) in zip(params, spans):
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|{hi - lo}\n".encode())
        h.update(host[dev][lo:hi])
    return h.hexdigest()[:16]


def torch_namespace(model: Any, layout: KVLayout, model_id: Optional[str] = None, tp_size: int = 1) -> Dict[str, str]:
    """The scheduler's ``namespace`` dict for ``model`` with KV in ``layout``: the ``model``
    field names the architecture, ``model_id`` (default the config's ``_name_or_path``), the
    config's hash and the weights' fingerprint (:func:`weights_fingerprint`; raises
    :class:`NamespaceError` for weights on the meta device)."""
    cfg = model.config
    weights = weights_fingerprint(model)
    arch = ",".join(getattr(cfg, "architectures", None) or [type(model).__name__])
    name = model_id if model_id is not None else str(getattr(cfg, "_name_or_path", "") or "")
    return {"model": f"{arch}|{name}|cfg:{config_hash(cfg)}|w:{weights}", **kv_fields(layout, tp_size),
            "tenant": "", "adapter": ""}


def kv_fields(layout: KVLayout, tp_size: int = 1) -> Dict[str, str]:
    """The namespace fields that name the KV's bytes: ``dtype`` and ``layout``."""
    shape = "x".join(str(d) for d in layout.chunk_shape[1:])
    return {
        "dtype": str(layout.dtype).replace("torch.", ""),
        "layout": f"{layout.attention.value}:{layout.num_layers}L:{shape}:page{layout.page_size}:tp{tp_size}",
    }
