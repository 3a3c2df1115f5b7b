"""kvtier's L3 key namespace, for engine integrations written in Python.

Why: every integration (``kvtier.sglang``, ``kvtier.vllm``) prefixes its L3 keys with the
namespace the native scheduler computes (docs/page-keys.md), so keys of different models,
dtypes, layouts or tenants never meet; one definition here keeps them equal.
"""

from __future__ import annotations

import hashlib

__all__ = ["l3_namespace"]


def l3_namespace(model: str, dtype: str, layout: str, tenant: str, adapter: str = "") -> str:
    """kvtier's L3 key namespace (docs/page-keys.md): the first 8 bytes, as hex, of
    SHA-256("kvtier-ns-v1" ‖ for each field: LE64(len) ‖ field)."""
    h = hashlib.sha256(b"kvtier-ns-v1")
    for f in (model, dtype, layout, tenant, adapter):
        b = f.encode("utf-8")
        h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()[:16]
