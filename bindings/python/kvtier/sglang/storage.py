"""kvtier as SGLang's HiCache L3: a storage backend class over kvtier's L3 store.

Why: SGLang's hierarchical cache keeps the GPU and host tiers itself and asks a *storage
backend* for the third. Plugging kvtier's L3 in there gives SGLang deployments its leases
that probes never take, tenants, an SSD tier with verified reads and a ``kvtier-l3`` server
many engine instances share, without touching SGLang: it loads the class with
``--hicache-storage-backend dynamic --hicache-storage-backend-extra-config
'{"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name":
"KvtierHiCacheStorage", "interface_v1": 1}'`` (``interface_v1`` selects the zero-copy
calls; see docs/sglang.md).

How: a page of SGLang's host pool is, in every layout this backend takes, a fixed set of
*chunks* — byte ranges of the pool's one ``kv_buffer`` that hold the page's tokens of one
component (page-major layouts: K and V; ``layer_first``: K and V of each layer; MLA: the
latent rows, per layer in ``layer_first``). Viewed as a flat byte array, the buffer is a
pool of equal chunks, and chunk ``(part, page)`` is chunk number ``part * pages + page``.
Each chunk is one L3 object under ``{namespace}:{page hash}:{rank}/{part}``, written and
read with ``L3Store.batch_put_pages`` / ``batch_get_pages`` straight between the host pool
and the store: no staging copy in Python, every page id checked against the pool by the
extension. SGLang's flat page (``get_data_page(flat=True)``) is exactly the chunks in part
order, so the value-based calls (``get``/``set``/``batch_*``) store the same objects.

Keys: the namespace is kvtier's (docs/page-keys.md: model, dtype, layout, tenant, adapter
hashed); the layout field carries SGLang's layout and the parallel shape (tp size, pp and
attention-cp rank), the rank field the tensor-parallel rank — for MLA models, whose KV is
replicated over ranks, the one writer's rank (``HiCacheStorageConfig.is_storage_writer``):
only it writes, every rank reads its objects. The tenant is the deployment's (extra config
``tenant``) or, per call, the request's ``cache_salt`` (``extra_info.extra_info["cache_salt"]``)
made into its own kvtier tenant: the store keeps tenants in separate maps, so a salted
request can neither read nor probe another salt's pages.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

import kvtier

from ..l3_limits import object_refusal
from ..namespace import l3_namespace
from .storage_options import (  # noqa: F401  (the backend's options and errors, re-exported)
    ENV_ADDR,
    ENV_TOKEN,
    BatchTooLargeError,
    HostIndicesError,
    Interface,
    PoolNotRegisteredError,
    SGLangBackendError,
    UnsupportedPoolError,
    _options,
    salt_tenant,
)
from .storage_pools import _SAMPLE_NAMESPACE, _SAMPLE_PAGE, _Grid, _grid, _object_key, sglang_model

logger = logging.getLogger(__name__)

# Store handles kept for the most recently used salted tenants (one a cache salt); the rest are
# made again when needed (a handle is a few shared pointers).
VIEW_CACHE = 64

__all__ = [
    "KvtierHiCacheStorage",
    "SGLangBackendError",
    "HostIndicesError",
    "BatchTooLargeError",
    "UnsupportedPoolError",
    "PoolNotRegisteredError",
    "l3_namespace",
]

_EXISTS = int(kvtier._native.ERROR_CODES["OBJECT_ALREADY_EXISTS"])


def _answers_for(keys: Any) -> int:
    """How many answers a refused batch of ``keys`` gets: one per key for any sized sequence
    (a numpy array, too), none for what is not one (a str is one bad key, not its letters)."""
    if isinstance(keys, (str, bytes)) or not hasattr(keys, "__len__"):
        return 0
    try:
        return len(keys)
    except TypeError:  # a 0-d array
        return 0


@dataclass
class _Counters:
    pages_written: int = 0
    pages_read: int = 0
    read_misses: int = 0
    rejected_batches: int = 0
    store_errors: int = 0
    probes: int = 0
    ssd_prefetches: int = 0
    skipped_non_writer: int = 0


class KvtierHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over kvtier's L3 store (module doc: why and how).

    Built as SGLang's ``dynamic`` backend builds it: ``KvtierHiCacheStorage(storage_config,
    kwargs)``; options come from ``storage_config.extra_config``:

    - ``server``: ``"HOST:PORT"`` of a ``kvtier-l3`` server shared by many instances (else
      ``$KVTIER_L3_ADDR``; neither: an embedded store in this process), ``token`` (else
      ``$KVTIER_L3_TOKEN``), ``rpc_timeout_ms``;
    - embedded: ``segment_bytes`` (DRAM, default "4GB"; text sizes as Mooncake's), ``ssd_dir``,
      ``ssd_capacity_bytes``, ``name`` (instances of one process naming the same store share it);
    - ``tenant`` (default "default"), ``max_batch_pages`` (default 1024), ``prefetch_ssd``
      (promote SSD-only pages to DRAM on ``batch_exists``; default: on when ``ssd_dir`` is set),
      ``interface_v1`` (SGLang's switch to the zero-copy calls).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        extra = dict(storage_config.extra_config or {})
        opts = _options(extra)  # every key checked before anything is built
        self.storage_config = storage_config
        # SGLang's switch, read as SGLang's controller reads it
        self.interface = Interface.ZERO_COPY if extra.get("interface_v1") else Interface.VALUES
        self.tenant = opts["tenant"]
        self.max_batch_pages = opts["max_batch_pages"]
        self.is_mla = bool(storage_config.is_mla_model)
        self.is_writer = bool(storage_config.is_storage_writer)
        # MLA: every rank reads the writer's objects (rank == dcp_rank there, 0 without DCP).
        self.rank = int(storage_config.dcp_rank if self.is_mla else storage_config.tp_rank)
        sc = storage_config
        shape = f"pp{sc.pp_rank}of{sc.pp_size}.cp{sc.attn_cp_rank}of{sc.attn_cp_size}"
        self._shape = shape if self.is_mla else f"tp{sc.tp_size}.{shape}"
        # A pool whose KV is sharded over the ranks (an MHA draft pool of an MLA model) keeps
        # each rank's own objects, as an MHA model's pools do.
        self._sharded = (int(sc.tp_rank), f"tp{sc.tp_size}.{shape}")
        self.model = sglang_model(str(sc.model_name or ""), version=opts["model_version"])
        addr = opts["server"] or os.environ.get(ENV_ADDR)
        if addr:
            token = opts["token"] or os.environ.get(ENV_TOKEN)
            self.store = kvtier.L3Store.connect(addr, token=token, tenant=self.tenant,
                                                rpc_timeout_ms=opts["rpc_timeout_ms"])
            self.store_name = str(addr)
            self.store.is_exist("kvtier-sglang-hello")  # a bad address or token fails at launch
        else:
            self.store = kvtier.L3Store.embedded(
                opts["segment_bytes"], ssd_dir=opts["ssd_dir"], ssd_capacity_bytes=opts["ssd_capacity_bytes"],
                tenant=self.tenant, name=opts["name"],
            )
            self.store_name = opts["name"]
        self.prefetch_ssd = opts["prefetch_ssd"]
        self.registered_pools: Dict[Any, Any] = {}
        self._grids: Dict[str, _Grid] = {}
        # Store handles of the most recent salted tenants (a handle is cheap to make again:
        # a new salt per user or per request must not grow this), and the salted tenants this
        # backend wrote to since the last clear() (which must reach their pages).
        self._views: "collections.OrderedDict[str, kvtier.L3Store]" = collections.OrderedDict()
        self._written: Dict[str, int] = {}  # salted tenant -> its writes so far (clear() races)
        self._lock = threading.Lock()
        self.counters = _Counters()
        self._metrics = StorageMetrics()
        self.mem_pool_host = None

    # ---- registration ------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Takes the anchor host pool (SGLang calls this once, right after it builds the
        backend and before any page call). A page the store cannot hold is refused here
        (``SGLangBackendError``, nothing registered), not a failed backup per page for ever."""
        grid = _grid(mem_pool_host, self.is_mla)
        self._check_page_fits(grid)
        super().register_mem_pool_host(mem_pool_host)
        self._grids[str(PoolName.KV)] = grid

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Side pools of hybrid models (v2 calls): any pool with a ``kv_buffer`` in a known
        layout (one whose page the store cannot hold is refused, as the anchor pool's);
        others are kept and answered with failures by the v2 calls."""
        try:
            grid: Optional[_Grid] = _grid(host_pool, self.is_mla)
        except UnsupportedPoolError as e:
            logger.warning("kvtier: pool %s not served: %s", host_pool_name, e)
            grid = None
        if grid is not None:
            self._check_page_fits(grid)
            if self.is_mla and not grid.replicated and int(self.storage_config.tp_size) > 1:
                # SGLang 0.5.23 backs up an MLA model's side pools on its one writer rank only
                logger.warning("kvtier: pool %s of this MLA model holds per-rank KV (%s); SGLang backs it up "
                               "on the writer rank only, so other ranks miss it in L3", host_pool_name,
                               type(host_pool).__name__)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if grid is not None:
            self._grids[str(host_pool_name)] = grid

    def _check_page_fits(self, grid: _Grid) -> None:
        """A page is ``len(parts)`` objects of ``chunk_bytes``, all in DRAM for the page to be
        read: the store must take an object of a chunk's size and hold a whole page. Asked of
        the store's limits, writing nothing (l3_limits.py)."""
        key_len = max(len(_object_key(_SAMPLE_NAMESPACE, _SAMPLE_PAGE, self._rank_of(grid), p))
                      for p in grid.parts)
        page_charge = len(grid.parts) * kvtier.l3_charge(grid.chunk_bytes, key_len)
        try:
            why = object_refusal(self.store, grid.chunk_bytes, key_len)
            cap = int(self.store.stats()["mem_capacity_bytes"])
        except kvtier.L3Error as e:
            why, cap = repr(e), 0
        if why is None and page_charge > cap:
            why = (f"a page of {grid.page_bytes} bytes (charged {page_charge} with its keys and metadata) is "
                   f"larger than the store's DRAM capacity {cap}")
        if why is not None:
            raise SGLangBackendError(
                f"kvtier: the L3 store cannot hold one page of this host pool ({len(grid.parts)} chunk(s) of "
                f"{grid.chunk_bytes} bytes): {why}")

    # ---- keys and input checks ---------------------------------------------------------

    def _tenant_of(self, extra_info: Optional[HiCacheStorageExtraInfo]) -> str:
        info = getattr(extra_info, "extra_info", None) if extra_info is not None else None
        salt = info.get("cache_salt") if isinstance(info, dict) else None
        return salt_tenant(self.tenant, salt)

    def _view(self, tenant: str) -> kvtier.L3Store:
        if tenant == self.tenant:
            return self.store
        with self._lock:
            v = self._views.get(tenant)
            if v is None:
                v = self._views[tenant] = self.store.with_tenant(tenant)
                if len(self._views) > VIEW_CACHE:
                    self._views.popitem(last=False)
            else:
                self._views.move_to_end(tenant)
            return v

    def books(self) -> Dict[str, int]:
        """What this backend keeps per cache salt: store handles of the most recent salted
        tenants (at most ``VIEW_CACHE``) and the salted tenants it wrote to since the last
        ``clear()`` (a name each; ``clear()`` forgets them). Before, a handle per salt ever
        seen stayed for good (docs/sglang.md, "What kvtier keeps per request")."""
        with self._lock:
            return {"views": len(self._views), "written_tenants": len(self._written)}

    def _rank_of(self, g: _Grid) -> int:
        """The rank field of a pool's keys: the writer's for replicated MLA KV, else this rank's."""
        return self.rank if g.replicated else self._sharded[0]

    def _writes(self, g: _Grid) -> bool:
        """Whether this rank stores a pool's pages (replicated MLA KV: its one writer only)."""
        return self.is_writer or not g.replicated

    def namespace(self, tenant: Optional[str] = None, pool: str = "kv") -> str:
        """The L3 key namespace of ``tenant``'s pages of the registered pool ``pool``."""
        g = self._grid_of(pool)
        # The bytes of a page's part: two pools of one model with other head counts (or
        # another layer split) hold other bytes under the same page hash.
        start = int(getattr(g.pool, "start_layer", 0) or 0)
        shape = self._shape if g.replicated else self._sharded[1]
        layout = (f"sglang.{g.layout}.{'mla' if g.mla else 'mha'}.{shape}.{pool}"
                  f".c{g.chunk_bytes}" + (f".l{start}" if start else ""))
        return l3_namespace(self.model, g.dtype, layout, tenant or self.tenant)

    def object_keys(self, keys: Sequence[str], tenant: Optional[str] = None, pool: str = "kv") -> List[str]:
        """The L3 object keys of pages ``keys`` (SGLang's page hashes), page-major."""
        g = self._grid_of(pool)
        ns = self.namespace(tenant, pool)
        rank = self._rank_of(g)
        return [_object_key(ns, k, rank, p) for k in keys for p in g.parts]

    def _grid_of(self, pool: str) -> _Grid:
        g = self._grids.get(str(pool))
        if g is None:
            raise PoolNotRegisteredError(f"no host pool registered as {pool!r}")
        return g

    def _check_keys(self, keys: Any, bounded: bool = True) -> List[str]:
        """``keys`` as a list of non-empty str; ``bounded``: at most ``max_batch_pages`` of them
        (reads and writes; an existence query of any length is probed in slices)."""
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) and k for k in keys):
            raise SGLangBackendError("keys must be a list of non-empty str")
        if bounded and len(keys) > self.max_batch_pages:
            raise BatchTooLargeError(f"{len(keys)} pages in one call; max_batch_pages is {self.max_batch_pages}")
        return list(keys)

    def page_ids(self, keys: Any, host_indices: Any, pool: str = "kv", *, for_read: bool = False) -> np.ndarray:
        """Checks a v1 call's input and returns its page numbers; raises a
        ``SGLangBackendError`` subclass (nothing read or written) when it is not whole,
        in-range pages of the pool, one per key."""
        keys = self._check_keys(keys)
        g = self._grid_of(pool)
        if not isinstance(host_indices, torch.Tensor):
            raise HostIndicesError(f"host_indices must be a torch.Tensor, not {type(host_indices).__name__}")
        if host_indices.dtype.is_floating_point or host_indices.dtype.is_complex or host_indices.dtype == torch.bool:
            raise HostIndicesError(f"host_indices must be an integer tensor, not {host_indices.dtype}")
        if host_indices.dim() != 1 or host_indices.numel() != len(keys) * g.page_size:
            raise HostIndicesError(
                f"{tuple(host_indices.shape)} host_indices for {len(keys)} pages of {g.page_size} tokens"
            )
        idx = host_indices.detach().to("cpu", torch.int64).numpy().reshape(len(keys), g.page_size)
        if idx.size and (idx.min() < 0 or idx.max() >= g.pages * g.page_size):
            raise HostIndicesError(f"host_indices outside the pool's {g.pages * g.page_size} tokens")
        starts = idx[:, 0]
        if np.any(starts % g.page_size) or np.any(idx != starts[:, None] + np.arange(g.page_size)):
            raise HostIndicesError("host_indices are not whole pages (aligned, consecutive tokens)")
        pages = starts // g.page_size
        if for_read and len(np.unique(pages)) != len(pages):
            raise HostIndicesError("one host page named twice in a read")
        return pages

    # ---- the zero-copy calls -----------------------------------------------------------

    def _io_pages(self, op: str, keys: List[str], pages: np.ndarray, pool: str, tenant: str) -> List[bool]:
        g = self._grid_of(pool)
        if not keys:
            return []
        okeys = self.object_keys(keys, tenant, pool)
        ids = g.chunk_ids(pages)
        store = self._view(tenant)
        if op == "set" and tenant != self.tenant:
            with self._lock:
                # before the write: clear() must reach what lands
                self._written[tenant] = self._written.get(tenant, 0) + 1
        t0 = time.perf_counter()
        try:
            if op == "set":
                codes = store.batch_put_pages(okeys, g.flat, ids, g.chunk_bytes)
                ok = ((codes == 0) | (codes == _EXISTS)).reshape(len(keys), -1).all(axis=1)
            else:
                codes = store.batch_get_pages(okeys, g.flat, ids, g.chunk_bytes)
                ok = (codes == g.chunk_bytes).reshape(len(keys), -1).all(axis=1)
        except kvtier.L3Error as e:
            self.counters.store_errors += 1
            logger.warning("kvtier: batch %s of %d pages failed: %r", op, len(keys), e)
            return [False] * len(keys)
        dt = max(time.perf_counter() - t0, 1e-9)
        n = int(ok.sum())
        gb = n * g.page_bytes / (1 << 30)
        if op == "set":
            self.counters.pages_written += n
            self._metrics.backup_pgs.append(len(keys))
            self._metrics.backup_bandwidth.append(gb / dt)
        else:
            self.counters.pages_read += n
            self.counters.read_misses += len(keys) - n
            self._metrics.prefetch_pgs.append(len(keys))
            self._metrics.prefetch_bandwidth.append(gb / dt)
        return ok.tolist()

    def _v1(self, op: str, keys: Any, host_indices: Any, extra_info: Any, pool: str = "kv") -> List[bool]:
        n = _answers_for(keys)
        try:
            pages = self.page_ids(keys, host_indices, pool, for_read=(op == "get"))
            tenant = self._tenant_of(extra_info)
        except SGLangBackendError as e:
            self.counters.rejected_batches += 1
            logger.warning("kvtier: batch_%s refused: %s", op, e)
            return [False] * n
        if op == "set" and not self._writes(self._grid_of(pool)):
            self.counters.skipped_non_writer += n
            return [True] * n  # MLA: the writer rank stores the (replicated) page
        return self._io_pages(op, list(keys), pages, pool, tenant)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Reads pages ``keys`` into the host pool at ``host_indices``; per page whether it
        was read whole. Bad input: all False, the pool untouched."""
        return self._v1("get", keys, host_indices, extra_info)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Writes host pages ``host_indices`` as pages ``keys`` (present pages count as
        written); per page whether it is stored. Bad input: all False, nothing written."""
        return self._v1("set", keys, host_indices, extra_info)

    def _present(self, keys: List[str], tenant: str, pool: str = "kv", leading: bool = False) -> np.ndarray:
        """Per page of ``keys``, whether every part is stored, asked of the store in slices of
        ``max_batch_pages`` pages (SGLang 0.5.23's HiCache asks about a prompt's whole span in
        one call). ``leading``: stop after the first slice with a missing page (the answer
        is then shorter than ``keys``) and, with ``prefetch_ssd``, promote the leading run's
        SSD-only pages to DRAM, the pages SGLang reads next (not those past a gap)."""
        g = self._grid_of(pool)
        store = self._view(tenant)
        out = []
        for start in range(0, len(keys), self.max_batch_pages):
            part = keys[start:start + self.max_batch_pages]
            okeys = self.object_keys(part, tenant, pool)
            self.counters.probes += 1
            # 1 is present; 0 missing and a negative code (a key the store refuses) are not
            have = (np.asarray(store.batch_is_exist(okeys)) == 1).reshape(len(part), len(g.parts)).all(axis=1)
            out.append(have)
            if not leading:
                continue
            run = int(np.argmin(have)) if not have.all() else len(part)
            if self.prefetch_ssd and run:
                store.batch_is_exist(okeys[: run * len(g.parts)], prefetch_to_memory=True)
                self.counters.ssd_prefetches += 1
            if run < len(part):
                break
        return np.concatenate(out) if out else np.zeros(0, dtype=bool)

    def _leading(self, keys: List[str], tenant: str, pool: str = "kv") -> int:
        present = self._present(keys, tenant, pool, leading=True)
        return int(np.argmin(present)) if not present.all() else len(present)

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many of ``keys``, from the first, are stored whole (a page with a missing
        part ends the run). Any number of keys (the store is asked ``max_batch_pages`` pages
        at a time). Takes no lease; with ``prefetch_ssd`` the run is promoted from SSD to
        DRAM. Bad input or a store error: 0."""
        try:
            keys = self._check_keys(keys, bounded=False)
            return self._leading(keys, self._tenant_of(extra_info)) if keys else 0
        except (SGLangBackendError, kvtier.L3Error) as e:
            self.counters.rejected_batches += 1
            logger.warning("kvtier: batch_exists refused: %s", e)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- the value calls (SGLang's generic path: flat pages) -----------------------------

    def _values(self, op: str, keys: Any, values: Any) -> List[bool]:
        keys = self._check_keys(keys)
        g = self._grid_of("kv")
        if not isinstance(values, (list, tuple)) or len(values) != len(keys):
            raise SGLangBackendError("one value tensor per key")
        bufs: List[np.ndarray] = []
        for v in values:
            if not isinstance(v, torch.Tensor) or v.device.type != "cpu" or not v.is_contiguous():
                raise SGLangBackendError("values must be contiguous CPU tensors")
            if v.numel() * v.element_size() != g.page_bytes:
                raise SGLangBackendError(f"a flat page is {g.page_bytes} bytes, got {v.numel() * v.element_size()}")
            b = v.view(-1).view(torch.uint8).numpy()
            bufs.extend(b[i * g.chunk_bytes:(i + 1) * g.chunk_bytes] for i in range(len(g.parts)))
        if op == "get":
            spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in values)
            if any(start < end for (_, end), (start, _) in zip(spans, spans[1:])):
                raise SGLangBackendError("two value tensors overlap: one read cannot land two pages in one place")
        if op == "set" and not self._writes(g):
            return [True] * len(keys)
        store = self._view(self.tenant)
        okeys = self.object_keys(keys)
        try:
            if op == "set":
                codes = store.batch_put_from(okeys, bufs)
                ok = (codes == 0) | (codes == _EXISTS)
            else:
                ok = store.batch_get_into(okeys, bufs) == g.chunk_bytes
        except kvtier.L3Error as e:
            self.counters.store_errors += 1
            logger.warning("kvtier: %s of %d pages failed: %r", op, len(keys), e)
            return [False] * len(keys)
        return ok.reshape(len(keys), -1).all(axis=1).tolist()

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        """Reads flat pages into ``target_locations`` (tensors); each the tensor or None."""
        try:
            ok = self._values("get", keys, target_locations)
        except SGLangBackendError as e:
            self.counters.rejected_batches += 1
            logger.warning("kvtier: batch_get refused: %s", e)
            return [None] * _answers_for(keys)
        assert target_locations is not None  # _values refuses None (one tensor per key)
        return [t if o else None for t, o in zip(target_locations, ok)]

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Writes flat pages; True when every one is stored."""
        try:
            return all(self._values("set", keys, values))
        except SGLangBackendError as e:
            self.counters.rejected_batches += 1
            logger.warning("kvtier: batch_set refused: %s", e)
            return False

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        return self.batch_get([key], [target_location])[0]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    # ---- v2: per-pool transfers (hybrid models) -----------------------------------------

    def _pool_keys(self, name: Any, keys: List[str]) -> List[str]:
        return list(keys) if str(name) == str(PoolName.KV) else [f"{k}.{name}" for k in keys]

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """The KV run, cut to what every side pool can restore (SGLang's hit policies:
        ALL_PAGES: every page of the run; TRAILING_PAGES: the last ``len(keys)`` pages)."""
        kv = self.batch_exists(keys, extra_info)
        if not kv:
            # Nothing to restore, or input batch_exists refused (a salt that is not a str):
            # 0 hits, as every other call answers it, never an exception in SGLang's thread.
            return PoolTransferResult(0, {}, [])
        hits: Dict[str, int] = {str(PoolName.KV): kv}
        restorable = set(range(1, kv + 1))
        tenant = self._tenant_of(extra_info)
        for t in pool_transfers or []:
            if not restorable:
                break
            name = str(t.name)
            try:
                have = self._present(self._pool_keys(name, keys[:kv]), tenant, name)
            except (SGLangBackendError, kvtier.L3Error):
                have = np.zeros(kv, bool)
            if t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                w = max(1, len(t.keys) if t.keys else 1)
                ok = {p for p in range(1, kv + 1) if have[max(0, p - w):p].all()}
            else:
                run = int(np.argmin(have)) if not have.all() else kv
                ok = set(range(1, run + 1))
            if ok:
                hits[name] = max(ok)
            restorable &= ok
        final = sorted(restorable)
        return PoolTransferResult(final[-1] if final else 0, hits, final)

    def _v2(self, op: str, transfers: List[PoolTransfer], extra_info: Any) -> Dict[str, List[bool]]:
        out: Dict[str, List[bool]] = {}
        for t in transfers:
            name = str(t.name)
            keys = list(t.keys or [])
            out[name] = self._v1(op, self._pool_keys(name, keys), t.host_indices, extra_info, pool=name)
        return out

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[str, List[bool]]:
        return self._v2("get", transfers, extra_info)

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[str, List[bool]]:
        return self._v2("set", transfers, extra_info)

    # ---- housekeeping ------------------------------------------------------------------

    def clear(self) -> None:
        """Removes this backend's objects (leased ones too): every registered pool's
        namespace under each of its tenants, not the tenant's whole store (before, another
        model's pages on a shared server went too)."""
        with self._lock:
            seen = dict(self._written)
            tenants = [self.tenant, *seen]
            pools = list(self._grids)
        for t in tenants:
            for pool in pools:
                ns = self.namespace(t, pool)
                self._view(t).remove_by_regex(f"^{re.escape(ns)}:", True)
            with self._lock:
                if t in seen and self._written.get(t) == seen[t]:
                    del self._written[t]  # cleared, and nothing written there since the snapshot

    def get_stats(self) -> StorageMetrics:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s per batch), with
        ``.kvtier``: cumulative counters and the store's own stats."""
        m, self._metrics = self._metrics, StorageMetrics()
        m.kvtier = dict(vars(self.counters))
        try:
            m.kvtier.update({f"store_{k}": v for k, v in self.store.stats().items()})
        except kvtier.L3Error:
            pass
        return m

    def close(self) -> None:
        pass
