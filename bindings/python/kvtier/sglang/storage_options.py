"""The SGLang storage backend's options (SGLang's ``--hicache-storage-backend-extra-config``)
and its typed errors, all checked before anything is built.

Why apart from the backend class: the extra config is shared with SGLang, and what it may
hold, what is refused and what is only logged is a policy of its own (a misspelt key was
ignored and the engine ran without what it asked for); the radix backend's configuration
(``config.py``) builds on the same errors and keys.
"""

from __future__ import annotations

import difflib
import enum
import hashlib
import logging
from typing import Any, Dict, List, Optional

from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

import kvtier

from ..mooncake_compat._setup import parse_size

logger = logging.getLogger("kvtier.sglang.storage")

ENV_ADDR = "KVTIER_L3_ADDR"
ENV_TOKEN = "KVTIER_L3_TOKEN"
# The extra config's keys: this backend's, and SGLang's own (0.5.23: its dynamic factory's
# three, its controller's interface switch, its host allocator, the file backend's path it
# adds, and those its parser pops before a backend sees them, in case a path does not).
# A key like one of the backend's (a misspelling) is refused: it was ignored, and the engine
# ran without what it asked for; a key unlike any is logged and ignored (the extra config is
# shared with SGLang, and a later SGLang's own key must not stop the engine).
BACKEND_KEYS = ("server", "token", "rpc_timeout_ms", "segment_bytes", "ssd_dir", "ssd_capacity_bytes", "name",
                "tenant", "max_batch_pages", "prefetch_ssd", "model_version")
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "allocator", "file_storage_path",
               "tp_lcm_size", "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
               "hicache_storage_pass_prefix_keys")
_MAX_BYTES = 2 ** 64 - 1  # the store's sizes are u64


class SGLangBackendError(kvtier.KvtierError, ValueError):
    """Bad input to the SGLang backend; raised before anything was read or written."""


class HostIndicesError(SGLangBackendError):
    """``host_indices`` are not whole, in-range pages of the registered host pool (wrong
    dtype or shape, a count that is not ``len(keys) * page_size``, misaligned or
    non-consecutive pages, indices outside the pool, one page twice in a read)."""


class BatchTooLargeError(SGLangBackendError):
    """More pages in one call than ``max_batch_pages`` (extra config)."""


class UnsupportedPoolError(SGLangBackendError):
    """A host pool whose buffer layout this backend does not know."""


class PoolNotRegisteredError(SGLangBackendError):
    """A page call before ``register_mem_pool_host`` (keys need the pool's dtype and layout)."""


class Interface(enum.Enum):
    """Which calls SGLang's controller makes: ``interface_v1`` in the extra config picks the
    zero-copy ``batch_get_v1``/``batch_set_v1``; otherwise it uses ``batch_get``/``batch_set``.
    Both store the same objects, so this only names what the backend expects."""

    ZERO_COPY = "v1"
    VALUES = "values"


def salt_tenant(base: str, cache_salt: Optional[str]) -> str:
    """The kvtier tenant of a request: the deployment's, or one of its own per cache salt."""
    if cache_salt is None:
        return base
    if not isinstance(cache_salt, str):
        raise SGLangBackendError(f"cache_salt must be a str, not {type(cache_salt).__name__}")
    return f"{base}.salt-{hashlib.sha256(cache_salt.encode('utf-8')).hexdigest()[:32]}"


def misspelling_of(key: str) -> List[str]:
    """The backend key ``key`` misspells, if any (case aside, at least 75 % alike by
    ``difflib``'s ratio): ``segmnt_bytes``, ``Server``, ``ssd_capacity``, ``tenant_id``."""
    return difflib.get_close_matches(key.lower(), BACKEND_KEYS, n=1, cutoff=0.75)


def _options(extra: Dict[str, Any]) -> Dict[str, Any]:
    """The backend's options from SGLang's extra config, every one checked before anything is
    built (``SGLangBackendError`` naming the key): a misspelt key, a string for a bool
    (``prefetch_ssd: "false"`` was truthy), a size or timeout past what the store takes
    (an OverflowError from the extension), a value that was coerced (``tenant: 5``)."""
    unknown = sorted((str(k) for k in extra if k not in BACKEND_KEYS and k not in SGLANG_KEYS))
    misspelt = {k: m[0] for k in unknown for m in [misspelling_of(k)] if m}
    if misspelt:
        raise SGLangBackendError(f"kvtier: unknown extra config key(s) {sorted(misspelt)} (did you mean "
                                 f"{misspelt}?); this backend's keys are {list(BACKEND_KEYS)} (and SGLang's "
                                 f"own: {list(SGLANG_KEYS)})")
    others = [k for k in unknown if k not in misspelt]
    if others:
        # the extra config is shared with SGLang: a later version's own key must not stop the
        # engine, so a key unlike any of ours is said, not refused
        logger.warning("kvtier: extra config key(s) %s are neither this backend's %s nor SGLang 0.5.23's; "
                       "ignored", others, list(BACKEND_KEYS))

    def text(key: str, default: Optional[str], empty: bool = True) -> Optional[str]:
        v = extra.get(key, default)
        if v is not None and (not isinstance(v, str) or (not empty and not v)):
            raise SGLangBackendError(f"kvtier: {key} must be a {'' if empty else 'non-empty '}str, got {v!r}")
        return v

    def count(key: str, default: int, most: int) -> int:
        v = extra.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= most:
            raise SGLangBackendError(f"kvtier: {key} must be an int in [1, {most}], got {v!r}")
        return v

    def size(key: str, default: Any) -> Optional[int]:
        v = extra.get(key, default)
        if v is None:
            return None
        n = parse_size(v)
        if n is None or n > _MAX_BYTES:
            # unreadable was no cap at all (ssd_capacity_bytes), past u64 an OverflowError
            raise SGLangBackendError(f"kvtier: bad {key} {v!r} (a size in bytes up to 2**64 - 1, or text as \"64MB\")")
        return n

    opts = dict(
        server=text("server", None, empty=False), token=text("token", None),
        rpc_timeout_ms=count("rpc_timeout_ms", 120_000, 2 ** 32 - 1),
        segment_bytes=size("segment_bytes", "4GB"), ssd_dir=text("ssd_dir", None, empty=False),
        ssd_capacity_bytes=size("ssd_capacity_bytes", None), name=text("name", ""),
        tenant=text("tenant", "default", empty=False), max_batch_pages=count("max_batch_pages", 1024, 2 ** 63 - 1),
        model_version=text("model_version", ""),
    )
    if opts["max_batch_pages"] < STORAGE_BATCH_SIZE:
        # SGLang's HiCache reads and writes STORAGE_BATCH_SIZE pages a call: a smaller bound
        # refused every one of them, and a backup stopped at its first batch (no L3 past it)
        raise SGLangBackendError(
            f"kvtier: max_batch_pages must be at least {STORAGE_BATCH_SIZE} (SGLang's HiCache reads and writes "
            f"{STORAGE_BATCH_SIZE} pages a call), got {opts['max_batch_pages']}")
    if not opts["segment_bytes"]:
        raise SGLangBackendError(f"kvtier: bad segment_bytes {extra.get('segment_bytes')!r}")
    prefetch = extra.get("prefetch_ssd", opts["ssd_dir"] is not None)
    if not isinstance(prefetch, bool):
        raise SGLangBackendError(f"kvtier: prefetch_ssd is true or false, got {prefetch!r}")
    opts["prefetch_ssd"] = prefetch
    return opts
