"""kvtier for SGLang, two ways (docs/sglang.md):

- ``storage``: kvtier's L3 as HiCache's *storage backend* (``KvtierHiCacheStorage``); SGLang's
  HiCache decides what its host tier and storage keep, kvtier stores the bytes;
- ``radix``: a *radix-cache backend* (``--radix-cache-backend kvtier``, registered by
  ``plugin.register`` through kvtier's ``sglang.srt.plugins`` entry point): SGLang keeps its
  device tree and kvtier's ``OffloadManager`` decides the host tier and L3.

The storage backend's names stay importable from ``kvtier.sglang`` (SGLang's dynamic backend
loads ``module_path: kvtier.sglang``); the radix backend's are loaded on first use, so the
storage backend does not import SGLang's scheduler modules.
"""

from __future__ import annotations

from typing import Any

from .storage import (  # noqa: F401  (the storage backend's public names)
    ENV_ADDR,
    ENV_TOKEN,
    BatchTooLargeError,
    HostIndicesError,
    Interface,
    KvtierHiCacheStorage,
    PoolNotRegisteredError,
    SGLangBackendError,
    UnsupportedPoolError,
    l3_namespace,
    salt_tenant,
)

_RADIX = ("KvtierRadixCache", "RadixBackendConfig", "RadixConfigError", "UnsupportedModelError",
          "UnsupportedPageSizeError", "kvtier_radix_cache_factory", "HitRecord")

__all__ = [
    "KvtierHiCacheStorage", "SGLangBackendError", "HostIndicesError", "BatchTooLargeError",
    "UnsupportedPoolError", "PoolNotRegisteredError", "l3_namespace", *_RADIX,
]


def __getattr__(name: str) -> Any:
    if name in _RADIX:
        from . import radix

        return getattr(radix, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
