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

from .. import KvtierError, OffloadManager
from .compat import group_windows
from .tier import TIER_KEYS

__all__ = ["KvtierSpecConfigError", "refuse_mla_without_prefix_caching", "SPEC_KEYS", "check_spec_keys", "eviction_of", "host_chunks_of", "l3_of",
           "quotas_of",
           "refuse_non_prefix_groups", "room_wait_of", "tenant_of"]

ROOM_WAIT_MS = 1000  # how long a request whose L3 prefetch finds no free host slot waits
# The spec's keys in vLLM's kv_connector_extra_config (docs/vllm.md).
SPEC_KEYS = ("kvtier_eviction", "kvtier_l3", "kvtier_tenant_quotas", "kvtier_room_wait_ms")
MAX_HOST_CHUNKS = 2 ** 32 - 1  # kvtier's OffloadManager numbers its host slots with u32


class KvtierSpecConfigError(KvtierError, ValueError):
    """A ``KvtierOffloadingSpec`` kvtier cannot run with (raised when vLLM builds the spec, so
    the engine does not start): a KV cache group whose chunks do not form prefixes, a
    ``kvtier_`` key the spec does not have, a malformed ``kvtier_l3``, ``kvtier_tenant_quotas``
    or ``kvtier_room_wait_ms``, more host chunks than kvtier's host tier numbers."""


def check_spec_keys(extra: Any) -> None:
    """Every ``kvtier_``-prefixed key (in any case) of vLLM's extra config is one of
    ``SPEC_KEYS``: a misspelt one (``kvtier_l3_adress``) was ignored, and the engine ran
    without what it asked for. Keys without the prefix are vLLM's, not checked here."""
    unknown = sorted(str(k) for k in (extra or {}) if str(k).lower().startswith("kvtier_") and k not in SPEC_KEYS)
    if unknown:
        raise KvtierSpecConfigError(
            f"KvtierOffloadingSpec: unknown kvtier key(s) {unknown} in kv_connector_extra_config; "
            f"the spec's keys are {list(SPEC_KEYS)} (a request's tenant is kvtier_tenant in its "
            "kv_transfer_params, not here)")


def l3_of(raw: Any) -> Optional[Dict[str, Any]]:
    """``kvtier_l3``: an object of ``KvtierSecondaryTier``'s keys (``{}``: an embedded store of
    the default size), or None (null, absent): no L3. Anything else is refused: ``""`` gave
    a 4 GB embedded store, ``false`` a bare TypeError; the keys are checked here, not when
    vLLM first asks for the manager."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise KvtierSpecConfigError(
            'kvtier_l3 is an object of kvtier tier keys ({"server": "HOST:PORT"}; {"segment_bytes": "16GB"} '
            f"for an embedded store, {{}} for one of the default size) or null for no L3, got {raw!r}")
    unknown = sorted((k for k in raw if k not in TIER_KEYS), key=repr)
    if unknown:
        raise KvtierSpecConfigError(f"kvtier_l3: unknown tier key(s) {unknown}; known: {list(TIER_KEYS)}")
    return dict(raw)


def host_chunks_of(num_chunks: int, cpu_bytes: Any) -> int:
    """vLLM's host chunk count, within what kvtier's host tier numbers (u32 slot ids):
    ``cpu_bytes_to_use`` 2**70 was an OverflowError when vLLM asked for the manager."""
    if not 0 <= num_chunks <= MAX_HOST_CHUNKS:
        raise KvtierSpecConfigError(
            f"cpu_bytes_to_use {cpu_bytes!r} gives {num_chunks} host chunks; kvtier's host tier holds at "
            f"most {MAX_HOST_CHUNKS}")
    return num_chunks


def refuse_mla_without_prefix_caching(vllm_config: Any, on_cpu: bool) -> None:
    """An MLA model on vLLM's CPU build without prefix caching: vLLM's CPU platform turns
    prefix caching (and chunked prefill) off for MLA unless AMX MLA is there, because its CPU
    attention cannot prefill a suffix over cached KV; offloading there is kvtier's CPU copy
    path alone, and a reused prefix it loaded was prefilled over anyway: wrong tokens from the
    first one (an adversarial tester's DeepSeek-V2, every mode, the bytes moved exact).
    Refused at startup (``vllm_config``: None outside an engine, nothing to check)."""
    mc = getattr(vllm_config, "model_config", None)
    cc = getattr(vllm_config, "cache_config", None)
    if on_cpu and bool(getattr(mc, "use_mla", False)) and not bool(getattr(cc, "enable_prefix_caching", True)):
        raise KvtierSpecConfigError(
            "kvtier cannot offload an MLA model on vLLM's CPU build here: vLLM turned prefix caching off for MLA "
            "on CPU (its CPU MLA attention cannot prefill over cached KV), so a prefix kvtier loads back would be "
            "computed over wrongly; serve this model without kv_transfer_config on CPU, or on a GPU")


def _max_model_len(config: Any) -> Optional[int]:
    """The engine's ``max_model_len``: vLLM 0.34's offloading config carries it; on 0.32 and
    0.33 it is read from the ``VllmConfig`` the connector is built with (None outside an
    engine)."""
    n = getattr(getattr(config, "model", None), "max_model_len", None)
    if n is None:
        from .keys import engine_vllm_config

        n = getattr(getattr(engine_vllm_config(), "model_config", None), "max_model_len", None)
    return None if n is None else int(n)


def refuse_non_prefix_groups(config: Any) -> None:
    """kvtier's host tier is a radix tree: a chunk is kept, found and evicted with its whole
    prefix. Sliding-window, chunked-local and Mamba groups keep only the last chunks of a
    prompt (vLLM's ``sliding_window_size_in_chunks``), so their chunks do not form prefixes;
    refused here rather than served wrongly — unless the window covers every prompt the
    engine takes (``max_model_len``), where it never slides. Their models run with vLLM's
    ``TieringOffloadingSpec`` (on vLLM's CPU build, where vLLM's own spec refuses to start,
    ``KvtierTieringOffloadingSpec``, which the message names) and kvtier's tier and policy
    (docs/vllm/architectures.md)."""
    windows = group_windows(config)  # vLLM 0.32's config lacks the field (compat.py)
    max_len = _max_model_len(config)
    # Sliding or chunked-local layers beside full-attention ones: vLLM without its hybrid KV
    # cache manager gives them full-attention blocks (one group, every block kept), whose
    # chunks are prefixes (Gemma 2 served so, exact: vllm_engine/test_vllm_engine_archs.py).
    hint = ""
    if any(w is None for w in windows.values()):
        hint = ("; or, where these are sliding-window or chunked-local layers beside the model's full-attention "
                "ones (not Mamba), start vLLM with --disable-hybrid-kv-cache-manager "
                "(disable_hybrid_kv_cache_manager=True): they then keep every block in one full-attention group, "
                "whose chunks this spec serves")
    for g in config.groups:
        window = windows.get(int(g.group_id))
        tokens_per_chunk = int(g.tokens_per_block) * int(config.cache.blocks_per_chunk)
        if window is not None and max_len is not None and (window - 1) * tokens_per_chunk >= max_len:
            # A window past every prompt the engine takes (Mistral-7B-v0.1's 4096 tokens at a
            # max_model_len of 4096 or less) never slides: vLLM keeps and stores every chunk
            # of such a group, a prefix (served exact: vllm_engine/test_vllm_engine_archs.py).
            continue
        if window is not None:
            raise KvtierSpecConfigError(
                f"KvtierOffloadingSpec: KV cache group {g.group_id} keeps a window of {window} chunk(s) "
                f"(sliding-window, chunked-local or Mamba layers {list(g.layer_names)[:3]}...): its chunks do not "
                "form prefixes, which kvtier's radix tree needs; use vLLM's tiering for this model (spec_name "
                "TieringOffloadingSpec; on vLLM's CPU build KvtierTieringOffloadingSpec with spec_module_path "
                "kvtier.vllm) with kvtier's KvtierSecondaryTier and KvtierFreqDepthPolicy (docs/vllm/architectures.md)"
                + hint)


def quotas_of(raw: Any, num_chunks: int) -> Dict[str, int]:
    """``kvtier_tenant_quotas``: ``{tenant: host chunks}``, at least 1 (a tenant capped at 0
    can never store anything) and within kvtier's host slot numbers; a fraction in (0, 1] is
    a share of the host slots (at least one)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise KvtierSpecConfigError(f"kvtier_tenant_quotas is {{tenant: chunks}}, got {raw!r}")
    out: Dict[str, int] = {}
    for name, v in raw.items():
        if isinstance(v, float) and 0 < v <= 1:
            v = max(1, int(v * num_chunks))
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_HOST_CHUNKS:
            raise KvtierSpecConfigError(
                f"kvtier_tenant_quotas[{name!r}] must be a number of host chunks in [1, {MAX_HOST_CHUNKS}] "
                f"(0: the tenant could never store) or a share in (0, 1], got {v!r}")
        out[str(name)] = v
    return out


def eviction_of(raw: Any) -> str:
    """``kvtier_eviction``: a kvtier eviction policy (``lru`` by default, ``freq-depth``,
    ``adaptive``, ``freq-depth:C:M:D``), parsed here rather than when vLLM asks for the
    manager."""
    if raw is None:
        return "lru"
    if not isinstance(raw, str):
        raise KvtierSpecConfigError(f"kvtier_eviction is a policy name (str), got {raw!r}")
    try:
        OffloadManager(1, raw)
    except ValueError as e:  # kvtier.ConfigError
        raise KvtierSpecConfigError(f"kvtier_eviction: {e}") from None
    return raw


def room_wait_of(raw: Any) -> float:
    """``kvtier_room_wait_ms``: how long (ms, >= 0) a request whose L3 prefetch finds every
    host slot held by copies in flight waits for one (RETRY) before vLLM computes it; in
    seconds."""
    if raw is None:
        return ROOM_WAIT_MS / 1e3
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 <= raw < float("inf"):
        raise KvtierSpecConfigError(f"kvtier_room_wait_ms must be a finite number of milliseconds >= 0, got {raw!r}")
    return float(raw) / 1e3


def tenant_of(ctx: ReqContext) -> Optional[str]:
    """A request's kvtier tenant: ``kvtier_tenant`` in its ``kv_transfer_params`` (what a
    client sends in the request's ``extra_args``); None: shared."""
    t = (ctx.kv_transfer_params or {}).get("kvtier_tenant")
    return None if t is None else str(t)
