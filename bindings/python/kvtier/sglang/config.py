"""The radix-cache backend's configuration (``$KVTIER_SGLANG_CONFIG``) and its typed errors,
all raised at startup, before SGLang serves a request (docs/sglang.md)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional

from ..mooncake_compat._setup import parse_size
from .storage import ENV_ADDR, SGLangBackendError

ENV_CONFIG = "KVTIER_SGLANG_CONFIG"
BACKEND_NAME = "kvtier"
MAX_PAGES = 2 ** 32 - 1  # kvtier's OffloadManager numbers host pages with u32
MAX_BYTES = 2 ** 64 - 1


class RadixConfigError(SGLangBackendError):
    """A bad kvtier radix-backend config (raised at startup, before anything is built)."""


class UnsupportedModelError(RadixConfigError):
    """A model or mode this backend does not serve (SWA, Mamba, DSA, speculative bigram keys)."""


class UnsupportedPageSizeError(RadixConfigError):
    """A page size SGLang allows but kvtier cannot serve: one page's bytes over the L3
    store's largest object (kvtier stores a page as one object), or no host page fits."""


@dataclass(frozen=True)
class RadixBackendConfig:
    """The backend's options (JSON in ``$KVTIER_SGLANG_CONFIG``; docs/sglang.md).

    - ``host_bytes`` (text sizes as Mooncake's, default "4GB") or ``host_pages``: the host pool;
    - ``policy``: kvtier's host eviction policy ("lru", "freq-depth", "adaptive");
    - ``l3``: "off", "embedded" or "server" (default: "server" when ``server`` or
      ``$KVTIER_L3_ADDR`` is set, else "off"); ``server``, ``token``, ``rpc_timeout_ms``;
      ``segment_bytes`` and ``name`` for an embedded store;
    - ``tenant`` (default "default"), ``tenant_caps`` (``{tenant: host pages}``);
    - ``io_threads``: 1 (default) runs L3 I/O on a worker thread; 0 in the scheduler thread
      (backups in the per-step hook; a prefetch inside its request's match when
      ``prefetch_wait_ms`` > 0, read whole, else in the hook);
    - ``write_policy``: "write_through" (default: a request's pages go to host when SGLang
      inserts them) or "write_back" (only when SGLang evicts them from the device);
    - ``probe_l3``: probe the store for pages other engines stored (default on);
    - ``mover``: how pages move between device and host: "auto" (default: index copies on
      CPU, kvtier.torch's ``kernel`` mover on a CUDA device where it runs), "torch", "dma",
      "kernel" (``copies.py``; a mover named that cannot run here is refused at startup);
    - ``model_version``: a name for the weights, added to the L3 namespace (for a checkpoint
      kvtier cannot read at ``--model-path``, when its weights change under that path);
    - ``prefetch_wait_ms``: how long, in all, one request's matches may wait for its own
      prefetch (default 20; 0: never, its prefetched pages serve later requests); SGLang
      matches a step's requests in turn, so a step may wait this long per such request.
    """

    host_bytes: Optional[str] = None
    host_pages: Optional[int] = None
    policy: str = "lru"
    l3: Optional[str] = None
    server: Optional[str] = None
    token: Optional[str] = None
    rpc_timeout_ms: int = 120_000
    segment_bytes: str = "1GB"
    name: str = ""
    tenant: str = "default"
    tenant_caps: Dict[str, int] = field(default_factory=dict)
    io_threads: int = 1
    probe_l3: bool = True
    prefetch_wait_ms: int = 20
    write_policy: str = "write_through"
    mover: str = "auto"
    model_version: str = ""

    @classmethod
    def from_dict(cls, d: Any) -> "RadixBackendConfig":
        if not isinstance(d, dict):
            raise RadixConfigError(f"the kvtier config is a JSON object, not {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise RadixConfigError(f"unknown kvtier config keys {unknown} (known: {sorted(known)})")
        try:
            cfg = cls(**d)
        except TypeError as e:
            raise RadixConfigError(str(e)) from None
        cfg.validate()
        return cfg

    @classmethod
    def from_env(cls) -> "RadixBackendConfig":
        raw = os.environ.get(ENV_CONFIG, "")
        if not raw.strip():
            return cls.from_dict({})
        try:
            return cls.from_dict(json.loads(raw))
        except json.JSONDecodeError as e:
            raise RadixConfigError(f"${ENV_CONFIG} is not JSON: {e}") from None

    def validate(self) -> None:
        def is_int(v: object) -> bool:  # bool is an int subclass: True is no page count
            return isinstance(v, int) and not isinstance(v, bool)

        if self.host_pages is not None and (not is_int(self.host_pages) or not 0 < self.host_pages <= MAX_PAGES):
            raise RadixConfigError(f"host_pages must be an int in [1, {MAX_PAGES}] (kvtier numbers host pages "
                                   f"with u32), got {self.host_pages!r}")
        if not isinstance(self.probe_l3, bool):
            raise RadixConfigError(f"probe_l3 is true or false, got {self.probe_l3!r}")
        if not is_int(self.rpc_timeout_ms) or not 0 < self.rpc_timeout_ms < 1 << 32:
            raise RadixConfigError(f"rpc_timeout_ms must be a positive int (ms), got {self.rpc_timeout_ms!r}")
        for key in ("server", "token"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), str):
                raise RadixConfigError(f"{key} must be a str, got {getattr(self, key)!r}")
        for key in ("name", "model_version"):
            if not isinstance(getattr(self, key), str):
                raise RadixConfigError(f"{key} must be a str, got {getattr(self, key)!r}")
        # sizes past u64: an OverflowError from the store, a torch error deep in the cache's
        # constructor for host_bytes (this machine's memory is checked there, before anything
        # is allocated: a config is also read where it does not run)
        for key in ("segment_bytes", "host_bytes"):
            v = getattr(self, key)
            if v is not None and not 0 < (parse_size(v) or 0) <= MAX_BYTES:
                raise RadixConfigError(f"bad {key} {v!r} (a size in bytes up to 2**64 - 1, or text as \"64GB\")")
        if self.l3 not in (None, "off", "embedded", "server"):
            raise RadixConfigError(f"l3 is 'off', 'embedded' or 'server', got {self.l3!r}")
        if not is_int(self.prefetch_wait_ms) or self.prefetch_wait_ms < 0:
            raise RadixConfigError(f"prefetch_wait_ms must be a non-negative int, got {self.prefetch_wait_ms!r}")
        if self.write_policy not in ("write_through", "write_back"):
            raise RadixConfigError(f"write_policy is 'write_through' or 'write_back', got {self.write_policy!r}")
        if self.mover not in ("auto", "torch", "dma", "kernel"):
            raise RadixConfigError(f"mover is 'auto', 'torch', 'dma' or 'kernel', got {self.mover!r}")
        if not is_int(self.io_threads) or self.io_threads not in (0, 1):
            raise RadixConfigError(f"io_threads is 0 or 1, got {self.io_threads!r}")
        if not isinstance(self.tenant, str) or not self.tenant:
            raise RadixConfigError("tenant must be a non-empty str")
        if not isinstance(self.tenant_caps, dict) or not all(
            isinstance(k, str) and is_int(v) and 0 < v <= MAX_PAGES for k, v in self.tenant_caps.items()
        ):
            raise RadixConfigError(f"tenant_caps maps tenant names to page counts in [1, {MAX_PAGES}], "
                                   f"got {self.tenant_caps!r}")
        # a salted request's host tenant is "salt-<cache_salt>"; unsalted requests have none:
        # a cap keyed otherwise ({"alice": 2}) was accepted and capped nothing
        nameless = sorted(k for k in self.tenant_caps if not k.startswith("salt-") or k == "salt-")
        if nameless:
            raise RadixConfigError(f"tenant_caps keys {nameless} name no tenant: a salted request's tenant is "
                                   "'salt-<cache_salt>' (unsalted requests are not capped)")
        if self.policy not in ("lru", "freq-depth", "adaptive"):
            raise RadixConfigError(f"policy is 'lru', 'freq-depth' or 'adaptive', got {self.policy!r}")
        if self.l3 == "server" and not (self.server or os.environ.get(ENV_ADDR)):
            raise RadixConfigError(f"l3 'server' needs server or ${ENV_ADDR}")

    def l3_mode(self) -> str:
        if self.l3 is not None:
            return self.l3
        return "server" if (self.server or os.environ.get(ENV_ADDR)) else "off"
