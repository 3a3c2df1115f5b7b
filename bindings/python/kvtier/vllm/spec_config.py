"""What ``KvtierOffloadingSpec`` accepts: KV cache groups whose chunks form prefixes, and
tenants with host quotas.

Why a module: both are checked when vLLM builds the spec (a config kvtier cannot serve stops
the engine at startup with ``KvtierSpecConfigError``, never serves wrongly), and the
tenant of a request is read in two places (stores, prefetches).

How: groups with a window (vLLM 0.33's ``sliding_window_size_in_chunks``, computed the same
way on 0.32 by compat.py: sliding-window, chunked-local, Mamba) are refused; ``kvtier_tenant_quotas`` (``{tenant: host chunks}``, or a share of the
host slots in (0, 1]) become the host caps of kvtier's ``OffloadManager`` (a tenant within its
cap loses no chunk to another tenant's stores); a request names its tenant with
``kvtier_tenant`` in its ``kv_transfer_params``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from vllm.v1.kv_offload.base import ReqContext

from .. import KvtierError
from .compat import group_windows

__all__ = ["KvtierSpecConfigError", "quotas_of", "refuse_non_prefix_groups", "room_wait_of", "tenant_of"]

ROOM_WAIT_MS = 1000  # how long a request whose L3 prefetch finds no free host slot waits


class KvtierSpecConfigError(KvtierError, ValueError):
    """A ``KvtierOffloadingSpec`` kvtier cannot run with (raised when vLLM builds the spec, so
    the engine does not start): a KV cache group whose chunks do not form prefixes, or a
    malformed ``kvtier_tenant_quotas``."""


def refuse_non_prefix_groups(config: Any) -> None:
    """kvtier's host tier is a radix tree: a chunk is kept, found and evicted with its whole
    prefix. Sliding-window, chunked-local and Mamba groups keep only the last chunks of a
    prompt (vLLM's ``sliding_window_size_in_chunks``), so their chunks do not form prefixes;
    refused here rather than served wrongly. Their models run with vLLM's
    ``TieringOffloadingSpec`` and kvtier's tier and policy (docs/vllm.md)."""
    windows = group_windows(config)  # vLLM 0.32's config lacks the field (compat.py)
    for g in config.groups:
        window = windows.get(int(g.group_id))
        if window is not None:
            raise KvtierSpecConfigError(
                f"KvtierOffloadingSpec: KV cache group {g.group_id} keeps a window of {window} chunk(s) "
                f"(sliding-window, chunked-local or Mamba layers {list(g.layer_names)[:3]}...): its chunks do not "
                "form prefixes, which kvtier's radix tree needs; use TieringOffloadingSpec with kvtier's "
                "KvtierSecondaryTier and KvtierFreqDepthPolicy for this model")


def quotas_of(raw: Any, num_chunks: int) -> Dict[str, int]:
    """``kvtier_tenant_quotas``: ``{tenant: host chunks}`` (a fraction in (0, 1] is a share of
    the host slots)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise KvtierSpecConfigError(f"kvtier_tenant_quotas is {{tenant: chunks}}, got {raw!r}")
    out: Dict[str, int] = {}
    for name, v in raw.items():
        if isinstance(v, float) and 0 < v <= 1:
            v = max(1, int(v * num_chunks))
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise KvtierSpecConfigError(
                f"kvtier_tenant_quotas[{name!r}] must be a number of host chunks >= 0 or a share in (0, 1], got {v!r}")
        out[str(name)] = v
    return out


def room_wait_of(raw: Any) -> float:
    """``kvtier_room_wait_ms``: how long (ms, >= 0) a request whose L3 prefetch finds every
    host slot held by copies in flight waits for one (RETRY) before vLLM computes it; in
    seconds."""
    if raw is None:
        return ROOM_WAIT_MS / 1e3
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not raw >= 0:
        raise KvtierSpecConfigError(f"kvtier_room_wait_ms must be a number of milliseconds >= 0, got {raw!r}")
    return float(raw) / 1e3


def tenant_of(ctx: ReqContext) -> Optional[str]:
    """A request's kvtier tenant: ``kvtier_tenant`` in its ``kv_transfer_params`` (what a
    client sends in the request's ``extra_args``); None: shared."""
    t = (ctx.kv_transfer_params or {}).get("kvtier_tenant")
    return None if t is None else str(t)
