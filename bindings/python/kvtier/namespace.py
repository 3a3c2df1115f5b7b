"""kvtier's L3 key namespace, for engine integrations written in Python.

Why: every integration (``kvtier.sglang``, ``kvtier.vllm``) prefixes its L3 keys with the
namespace the native scheduler computes (docs/page-keys.md), so keys of different models,
dtypes, layouts or tenants never meet; one definition here keeps them equal.
"""

from __future__ import annotations

import hashlib
from typing import Optional

__all__ = ["l3_namespace"]


def l3_namespace(model: str, dtype: str, layout: str, tenant: str, adapter: str = "",
                 page_size: Optional[int] = None) -> str:
    """kvtier's L3 key namespace (docs/page-keys.md): the first 8 bytes, as hex, of
    SHA-256("kvtier-ns-v1" ‖ for each field: LE64(len) ‖ field).

    With ``page_size`` (tokens per page), the namespace a native ``Scheduler`` of that
    page size keys its pages under: SHA-256("kvtier-ns-v2" ‖ the fields ‖ LE64(len) ‖ the
    page size in decimal). Without it, ``layout`` must name the page geometry itself (as
    the vLLM and SGLang integrations' layouts do): a first page of P + 8 tokens can have the
    digest of a later page of P tokens."""
    fields = [model, dtype, layout, tenant, adapter]
    if page_size is None:
        h = hashlib.sha256(b"kvtier-ns-v1")
    else:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, not {page_size!r}")
        h = hashlib.sha256(b"kvtier-ns-v2")
        fields.append(str(page_size))
    for f in fields:
        b = f.encode("utf-8")
        h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()[:16]
