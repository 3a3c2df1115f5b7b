"""The L3 namespace of a model served by kvtier.torch, derived from what makes KV incompatible.

Why derive it: L3 keys are ``{namespace}:{page hash}:{rank}`` and the page hash covers only
tokens, so two models on one store with the same namespace read each other's pages as their
own KV: wrong tokens, no error. The namespace (docs/page-keys.md) must therefore change with
everything that changes the bytes of a page: the architecture and the weights (a name the
engine gives, by default the config's ``_name_or_path``, plus a hash of the whole config),
the KV dtype, the layout (MHA/MLA, layers, heads, head dims), the page size and the
tensor-parallel shape. :func:`torch_namespace` puts them into the scheduler's namespace
fields; ``TorchEngine`` fills them in when the config leaves the namespace empty.

Same config and same ``model_id`` means same namespace: two engines serving one model share
L3 pages, which is the point of L3. Two checkpoints of one architecture loaded from
different paths differ by name; random-weight models built from one config in memory do
not, so give them a ``model_id`` if their weights differ.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Optional

from .pools import KVLayout

__all__ = ["config_hash", "torch_namespace"]


def config_hash(config: Any) -> str:
    """16 hex digits of SHA-256 over the config's public fields (sorted JSON; private fields
    such as the attention implementation, the dtype and the transformers version left out)."""
    d = config.to_dict()
    skip = {"transformers_version", "dtype", "torch_dtype", "_name_or_path"}
    clean = {k: v for k, v in d.items() if not k.startswith("_") and k not in skip}
    text = json.dumps(clean, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def torch_namespace(model: Any, layout: KVLayout, model_id: Optional[str] = None, tp_size: int = 1) -> Dict[str, str]:
    """The scheduler's ``namespace`` dict for ``model`` with KV in ``layout``."""
    cfg = model.config
    arch = ",".join(getattr(cfg, "architectures", None) or [type(model).__name__])
    name = model_id if model_id is not None else str(getattr(cfg, "_name_or_path", "") or "")
    shape = "x".join(str(d) for d in layout.chunk_shape[1:])
    return {
        "model": f"{arch}|{name}|cfg:{config_hash(cfg)}",
        "dtype": str(layout.dtype).replace("torch.", ""),
        "layout": f"{layout.attention.value}:{layout.num_layers}L:{shape}:page{layout.page_size}:tp{tp_size}",
        "tenant": "",
        "adapter": "",
    }
