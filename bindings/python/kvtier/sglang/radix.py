"""kvtier decides SGLang's cache: a radix-cache backend (``--radix-cache-backend kvtier``).

Why: with the storage backend (``storage.py``) SGLang's HiCache decides what the host tier
and L3 keep, evict, load and prefetch, and kvtier only stores bytes. Here kvtier decides:
SGLang keeps its device tree (``RadixCache``: device matching, locks, device eviction), and
kvtier's ``OffloadManager`` owns the tiers below it: which pages go to host and which host
pages are evicted for them (kvtier's eviction policies and tenant caps), which host pages
are backed up to L3 (write-through) and which L3 pages are prefetched to host, under
kvtier's namespaces (model, dtype, page size, parallel shape, tenant; the page hashes are
salted by the request's ``cache_salt`` and LoRA ``extra_key``, so two models or salts never
share bytes).

How (the two-phase pattern of SGLang's ``FlexKVRadixCache``):

- ``match_prefix`` matches the device tree, then asks kvtier how many following pages are
  on host (``host_hit_length``); pages L3 holds beyond the host prefix (known from kvtier's
  backups or from a probe of the store) start a prefetch into host slots and are *not*
  reported: admission never waits for L3, the request's next match sees them on host.
- ``init_load_back`` (called by SGLang's ``PrefillAdder``) allocates device slots, copies
  the host pages in and inserts them into the device tree; all promised pages or none (a
  page evicted from host meanwhile: ``(0, node)``, the request recomputes).
- ``checkpoint`` (SGLang's insert) stores the request's new device pages to host slots
  kvtier hands out (write-through to host).
- ``flush_pending_backups`` (SGLang calls it after every batch) is the per-step hook: it
  finishes L3 reads and writes, reads kvtier's host events and the store's loss journal, and
  starts the backups kvtier plans (``l3_io.py``: the L3 I/O and the ranks' agreement).
- Tensor parallelism: every rank runs this over its KV shard and SGLang makes the same calls
  on every rank; what one rank's store answers and another's may not (a probe's run, a
  prefetch's or backup's outcome, a loss) is agreed over SGLang's TP CPU group (an
  all-reduce MIN; kvtier's ``RankAgreement``), so every rank's ``OffloadManager`` takes the
  same decisions.

Bytes: a host page is the page's rows of every device KV buffer (K and V of each layer; the
latent buffer for MLA), as bytes, in a host pool this class owns (pinned where the device
is a GPU, plain on CPU); copies are index copies on CPU and kvtier.torch's movers on a GPU
(``copies.py``). An L3 object is one host page
under ``{namespace}:{page hash}:{tp rank}``.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

import kvtier

from ..l3_limits import object_refusal
from ..mooncake_compat._setup import parse_size
from ..namespace import l3_namespace
from .config import (  # noqa: F401  (re-exported: kvtier.sglang.radix is where users look)
    BACKEND_NAME,
    ENV_CONFIG,
    MAX_PAGES,
    RadixBackendConfig,
    RadixConfigError,
    UnsupportedModelError,
    UnsupportedPageSizeError,
)
from .copies import make_copier
from .l3_io import L3Io, _Job, _leading_hits
from .storage import ENV_ADDR, ENV_TOKEN, sglang_model

logger = logging.getLogger(__name__)

_U32 = 1 << 32


def device_buffers(kvcache: Any) -> List[torch.Tensor]:
    """The device KV pool's per-layer buffers as ``[token slots, row bytes]`` uint8 views:
    K then V of each layer (MHA), or the latent buffer of each layer (MLA).

    Refused (``UnsupportedModelError``), because copying these buffers would not copy a
    token's KV whole: a pool laid out other than token-major (``kv_cache_layout`` "hnd",
    ``SGLANG_USE_HND_KVCACHE=1``, or ROCm's "vectorized_5d", "page_major": a buffer's
    leading dimension is pages, not token slots, and host copies took the wrong bytes), and a
    pool that keeps per-token scale factors beside its data (``--kv-cache-dtype`` fp4 / nvfp4
    / mxfp8: ``k_scale_buffer`` and the like; reused prefixes were dequantized with another
    token's scales). FP8 caches with per-tensor scales keep no such buffer and are served."""
    layout = str(getattr(kvcache, "kv_cache_layout", "nhd") or "nhd").lower()
    if layout != "nhd":
        raise UnsupportedModelError(
            f"device KV pool {type(kvcache).__name__}: kv_cache_layout {layout!r} (token-major 'nhd' only; "
            "unset SGLANG_USE_HND_KVCACHE / SGLANG_AITER_KV_CACHE_LAYOUT)")
    scales = sorted(name for name, v in vars(kvcache).items()
                    if "scale_buffer" in name and v is not None and not (isinstance(v, (list, tuple)) and not v))
    if scales:
        raise UnsupportedModelError(
            f"device KV pool {type(kvcache).__name__} keeps per-token scale factors ({', '.join(scales)}): "
            "a quantized KV cache (fp4 / nvfp4 / mxfp8) is not served; fp8 with per-tensor scales, bf16 and fp16 are")
    if hasattr(kvcache, "k_buffer") and hasattr(kvcache, "v_buffer"):
        bufs = list(kvcache.k_buffer) + list(kvcache.v_buffer)
    elif hasattr(kvcache, "kv_buffer") and isinstance(kvcache.kv_buffer, (list, tuple)):
        bufs = list(kvcache.kv_buffer)
    else:
        raise UnsupportedModelError(f"device KV pool {type(kvcache).__name__} (MHA and MLA pools only)")
    out = []
    for b in bufs:
        if not isinstance(b, torch.Tensor) or not b.is_contiguous():
            raise UnsupportedModelError(f"device KV pool {type(kvcache).__name__}: a buffer is not a contiguous tensor")
        out.append(b.view(b.shape[0], -1).view(torch.uint8))
    return out


@dataclass
class _Marker:
    """From a host-hit ``match_prefix`` to its ``init_load_back``: the host-resident chain and a
    detached key of it (the live key aliases ``req.fill_ids``)."""

    chain: List[bytes]
    key: RadixKey
    device_len: int


@dataclass
class HitRecord:
    """Where one request's cached prefix came from, in tokens."""

    rid: str
    device: int = 0
    host: int = 0
    l3: int = 0


@dataclass
class Counters:
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    l3_hit_tokens: int = 0
    load_backs: int = 0
    load_back_fallbacks: int = 0
    stored_pages: int = 0
    prefetches: int = 0
    prefetched_pages: int = 0
    prefetch_lost_pages: int = 0
    backups: int = 0
    backed_up_pages: int = 0
    backup_failures: int = 0
    probes: int = 0
    written_back_pages: int = 0
    l3_lost_pages: int = 0
    store_errors: int = 0
    # L3 jobs reset or shutdown dropped unrun after the store stopped answering
    dropped_jobs: int = 0


def _l3_key(namespace: str, page_hash: bytes, tp_rank: int) -> str:
    """The L3 object key of one page of one tensor-parallel rank."""
    return f"{namespace}:{page_hash.hex()}:{tp_rank}"


def _check_host_pool(cfg: RadixBackendConfig, slots: int, page_bytes: int) -> None:
    """The host pool within kvtier's page numbers and this machine's memory, checked before
    the store opens and anything is allocated: torch's allocator failed deep in the
    constructor (an untyped RuntimeError), and a pinned pool past the memory cannot be had."""
    key = "host_pages" if cfg.host_pages is not None else "host_bytes"
    given = cfg.host_pages if cfg.host_pages is not None else cfg.host_bytes or "4GB"
    if slots > MAX_PAGES:
        raise RadixConfigError(f"{key} {given!r}: {slots} host pages of {page_bytes} bytes; kvtier's host tier "
                               f"holds at most {MAX_PAGES}")
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # not known here
        return
    if slots * page_bytes > mem:
        raise RadixConfigError(f"{key} {given!r}: a host pool of {slots} pages of {page_bytes} bytes "
                               f"({slots * page_bytes} bytes) is larger than this machine's memory ({mem} bytes)")


class KvtierRadixCache(L3Io, RadixCache):
    """SGLang's ``RadixCache`` (the device tree) with kvtier deciding host and L3 (module doc)."""

    def __init__(
        self,
        params: Any,
        config: Optional[RadixBackendConfig] = None,
        *,
        model: str = "",
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
        store: Optional[kvtier.L3Store] = None,
    ) -> None:
        cfg = config if config is not None else RadixBackendConfig.from_env()
        cfg.validate()  # a config made by its constructor was not (from_dict checks)
        if params.page_size <= 0:
            raise UnsupportedPageSizeError(f"page_size {params.page_size}")
        if getattr(params, "is_eagle", False):
            raise UnsupportedModelError("EAGLE's bigram keys are not served (kvtier pages hash plain tokens)")
        if getattr(params, "sliding_window_size", None):
            raise UnsupportedModelError("sliding-window (SWA) models are not served: full-attention models only")
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise RadixConfigError(f"tp_rank {tp_rank} of tp_size {tp_size}")
        # The ranks agree over SGLang's CPU group (a GroupCoordinator's cpu_group, or a gloo group).
        group = getattr(tp_group, "cpu_group", tp_group)
        if tp_size > 1 and group is None:
            raise RadixConfigError(f"tp_size {tp_size} needs the tensor-parallel CPU process group")
        kv = params.token_to_kv_pool_allocator.get_kvcache()
        bufs = device_buffers(kv)
        ps = int(params.page_size)
        page_bytes = sum(int(b.shape[1]) * ps for b in bufs)
        if cfg.host_pages is not None:
            slots = cfg.host_pages
        else:
            host_bytes = parse_size(cfg.host_bytes or "4GB")
            assert host_bytes is not None  # validate() checked it
            slots = host_bytes // page_bytes
        if slots <= 0:
            raise UnsupportedPageSizeError(
                f"a page is {page_bytes} bytes ({ps} tokens): no host page fits in host_bytes {cfg.host_bytes!r}"
            )
        _check_host_pool(cfg, slots, page_bytes)
        mode = cfg.l3_mode()
        if store is None and mode == "embedded":
            seg = parse_size(cfg.segment_bytes)
            if not seg:
                raise RadixConfigError(f"bad segment_bytes {cfg.segment_bytes!r}")
            store = kvtier.L3Store.embedded(seg, tenant=cfg.tenant, name=cfg.name)
        elif store is None and mode == "server":
            addr = cfg.server or os.environ[ENV_ADDR]
            store = kvtier.L3Store.connect(
                str(addr), token=cfg.token or os.environ.get(ENV_TOKEN), tenant=cfg.tenant,
                rpc_timeout_ms=int(cfg.rpc_timeout_ms),
            )
        dtype = str(getattr(kv, "dtype", "")).replace("torch.", "")
        kind = "mha" if hasattr(kv, "k_buffer") else "mla"
        layout = f"sglang-radix.{kind}.ps{ps}.rows{'-'.join(str(b.shape[1]) for b in bufs)}.tp{tp_size}"
        # A pipeline stage holds other layers' KV under the same tokens: its own namespace
        # (two stages on one server shared keys, and one loaded the other's pages).
        pp_rank, pp_size = int(getattr(params, "pp_rank", 0) or 0), int(getattr(params, "pp_size", 1) or 1)
        start_layer = int(getattr(kv, "start_layer", 0) or 0)
        if not 0 <= pp_rank < pp_size:
            raise RadixConfigError(f"pp_rank {pp_rank} of pp_size {pp_size}")
        if pp_size > 1 or start_layer:
            layout += f".pp{pp_rank}of{pp_size}.layer{start_layer}"
        self.namespace = l3_namespace(model, dtype, layout, cfg.tenant)
        if store is not None:
            self._check_page_fits(store, page_bytes, ps, len(_l3_key(self.namespace, bytes(32), tp_rank)))
            # the namespace is a hash: what the store's event stream of this model needs
            logger.info("kvtier: L3 namespace %s (tenant %s): a kvtier-l3 event stream of this model's "
                        "pages is --kv-events-stream %s=PUB[,REPLAY]", self.namespace, cfg.tenant, self.namespace)
        super().__init__(params)
        self.config = cfg
        self.model = model
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self._group = group
        self._agreement = kvtier.RankAgreement()
        self._agreeing: Dict[int, _Job] = {}
        self.store = store
        self.page_bytes = page_bytes
        self.host_slots = slots
        pin = any(b.device.type == "cuda" for b in bufs) and torch.cuda.is_available()
        try:
            self.host = torch.zeros((slots, page_bytes), dtype=torch.uint8, pin_memory=pin)
        except RuntimeError as e:  # within the machine's memory, and still not to be had
            raise RadixConfigError(f"the host pool ({slots} pages of {page_bytes} bytes) could not be "
                                   f"allocated: {e}") from None
        self._host_flat = self.host.numpy().reshape(-1)
        self.copier = make_copier(cfg.mover, bufs, self.host, ps)
        self.counters = Counters()
        self.hit_log: Deque[HitRecord] = collections.deque(maxlen=4096)
        self._hits: Dict[str, HitRecord] = {}
        self._markers: Dict[Any, _Marker] = {}
        self._probed: Dict[Any, int] = {}
        self._waited: Dict[Any, float] = {}
        self._jobs: List[_Job] = []
        self._from_l3: set = set()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-l3") if cfg.io_threads and store else None
        self.agreements = 0
        self._journal = store is not None  # off once the store says it keeps no loss journal
        self._new_manager()

    # ---- setup -------------------------------------------------------------------------

    def _new_manager(self) -> None:
        self.manager = kvtier.OffloadManager(
            self.host_slots, self.config.policy, "write-through" if self.store is not None else "off",
            tp_ranks=self.tp_size,
        )
        for tenant, cap in self.config.tenant_caps.items():
            self.manager.set_tenant_cap(tenant, cap)

    def _check_page_fits(self, store: kvtier.L3Store, page_bytes: int, ps: int, key_len: int) -> None:
        """One page is one L3 object: a store that refuses an object of a page's size cannot
        serve this page size (``UnsupportedPageSizeError`` at startup, not at the first backup).
        Asked of the store's limits, writing nothing (l3_limits.py)."""
        try:
            why = object_refusal(store, page_bytes, key_len)
        except kvtier.L3Error as e:
            why = repr(e)
        if why is not None:
            raise UnsupportedPageSizeError(
                f"page_size {ps}: a page is {page_bytes} bytes, which the L3 store refuses to hold ({why})")

    def reset(self) -> None:
        super().reset()
        if hasattr(self, "manager"):  # RadixCache.__init__ resets before our fields exist
            # SGLang's flush_cache, on its scheduler thread: a store that stopped answering
            # costs the job running and the next, not every queued job's RPC timeout in turn
            # (13 queued jobs held a flush 73 s at a 3 s timeout).
            self._drain_io(drop_when_unanswered=True)
            self._markers.clear()
            self._probed.clear()
            self._waited.clear()
            self._from_l3.clear()
            self._new_manager()

    def shutdown(self) -> None:
        """Finishes the L3 I/O in flight (applied, agreed under TP), then stops the I/O thread.
        Once the store fails to answer a job, the jobs not yet begun are dropped (``dropped_jobs``)."""
        self._drain_io(drop_when_unanswered=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def release_host_resources(self) -> None:
        """SGLang's teardown hook (the scheduler process's ``finally``): stops the I/O thread
        without waiting on other ranks (no collective: a rank may be gone) and drops the host
        pool (pinned on a GPU machine). Idempotent; the cache serves nothing afterwards."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._jobs.clear()
        self.host = torch.zeros((0, 0), dtype=torch.uint8)
        self.copier = None
        self._host_flat = np.zeros(0, dtype=np.uint8)

    # ---- keys --------------------------------------------------------------------------

    def _tenant(self, salt: Optional[str]) -> Optional[str]:
        return None if not salt else f"salt-{salt}"

    def _chain(self, tokens: Any, extra_key: Optional[str], salt: Optional[str]) -> Optional[List[bytes]]:
        toks = np.asarray(tokens, dtype=np.int64)
        n = (len(toks) // self.page_size) * self.page_size
        if n == 0 or toks.min(initial=0) < 0 or toks.max(initial=0) >= _U32:
            return None  # kvtier pages hash u32 tokens: anything else stays device-only
        # extra_key "" is not None: SGLang's own tree keeps them apart, so the tiers below do too
        h = kvtier.page_hashes(toks[:n].astype(np.uint32), self.page_size, cache_salt=salt or None,
                               adapter=extra_key)
        return [bytes(r) for r in h]

    def l3_keys(self, chain: List[bytes]) -> List[str]:
        return [_l3_key(self.namespace, h, self.tp_rank) for h in chain]

    # ---- bytes -------------------------------------------------------------------------

    def _copy_to_host(self, dev_idx: torch.Tensor, slots: List[int]) -> None:
        self.copier.to_host(dev_idx, slots)

    def _copy_to_device(self, slots: List[int], dev_idx: torch.Tensor) -> None:
        self.copier.to_device(slots, dev_idx)

    # ---- match and load ----------------------------------------------------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        base = super().match_prefix(params)
        req = params.req
        if self.disable or req is None or len(params.key) == 0:
            return base
        key = params.key.page_aligned(self.page_size)
        tokens = key.raw_token_ids()[: len(key)]
        handle = req.cache_request_handle
        rec = self._hits[req.rid] = HitRecord(req.rid, device=base.device_prefix_len)
        self._markers.pop(handle, None)
        chain = self._chain(tokens, key.extra_key, key.cache_salt)
        if chain is None:
            return base
        d = base.device_prefix_len // self.page_size
        h = self.manager.host_prefix(chain)
        if self.store is not None and h < len(chain):
            tenant = self._tenant(key.cache_salt)
            self._maybe_prefetch(handle, chain, h, d, tenant)
            probing = any(j.kind == "probe" and j.handle == handle for j in self._jobs)
            if self._await_prefetch(handle):
                if probing:  # the probe ended within the budget: the prefetch of what it found
                    self._maybe_prefetch(handle, chain, h, d, tenant)
                    self._await_prefetch(handle)
                h = self.manager.host_prefix(chain)
        if h <= d:
            return base
        rec.host = (h - d) * self.page_size
        snap = RadixKey(tokens[: h * self.page_size], key.extra_key, cache_salt=key.cache_salt)
        self._markers[handle] = _Marker(chain[:h], snap, base.device_prefix_len)
        return base._replace(host_hit_length=(h - d) * self.page_size)

    def _maybe_prefetch(self, handle: Any, chain: List[bytes], h: int, d: int, tenant: Optional[str]) -> None:
        """Starts a prefetch of the L3 run after the host prefix ``h`` when it can reach past the
        device match ``d`` (pages the device holds are written to host by the next checkpoint)."""
        if self.store is None:
            return  # no L3 (the caller checks too)
        if d >= len(chain) or (d > h and self.manager.lookup(chain, d) not in ("in-l3", "miss")):
            return
        state = self.manager.lookup(chain, h)
        if state == "miss" and self.config.probe_l3 and self._probed.get(handle) != h:
            self._probed[handle] = h
            self.counters.probes += 1
            keys, store = self.l3_keys(chain[h:]), self.store
            if self._io_off_thread():
                # On the I/O thread: a store that answers late delays only this request's use
                # of its pages (up to its budget), never the scheduler thread.
                self._start(_Job("probe", 0, len(keys), lambda: store.batch_is_exist(keys), handle=handle,
                                 page_hashes=chain[h:]))
                return
            try:
                found = np.asarray(store.batch_is_exist(keys))
            except kvtier.L3Error as e:
                self.counters.store_errors += 1
                logger.warning("kvtier: L3 probe failed: %r", e)
                found = np.zeros(0, dtype=np.int64)  # a miss (every rank still joins the agreement)
            run = _leading_hits(found)
            if self.tp_size > 1:
                self._agree_found(chain[h:h + run])
            elif run:
                self.manager.l3_found(chain[h:h + run])
            state = self.manager.lookup(chain, h)
        if state != "in-l3" or (d > h and self.manager.lookup(chain, d) != "in-l3"):
            return
        plan = self.manager.prepare_prefetch(chain, h, tenant)
        if plan is None:
            return
        job, first, slots, _evicted = plan
        pages = chain[first:first + len(slots)]
        keys = self.l3_keys(pages)
        store, flat, pb = self.store, self._host_flat, self.page_bytes
        ids = np.asarray(slots, dtype=np.int64)

        def read() -> int:
            codes = np.asarray(store.batch_get_pages(keys, flat, ids, pb))
            ok = codes == pb
            return int(np.argmin(ok)) if not ok.all() else len(ok)

        self.counters.prefetches += 1
        self._start(_Job("prefetch", job, len(slots), read, handle=handle, page_hashes=pages))

    def _agree_found(self, pages: List[bytes]) -> None:
        """Every rank probes its own shard: the pages every rank found (the shortest run) are
        marked on every rank alike (the manager refuses a rank's own ``l3_found``). Collective:
        every rank's probe of the same pages reaches it, found or not."""
        self._agreement.found_pages(pages)
        self._agreement.agree_found(self.manager, self._all_gather)

    def _await_prefetch(self, handle: Any) -> bool:
        """Waits for this request's prefetch within its budget (``prefetch_wait_ms`` over all
        its matches); True when it finished."""
        budget = self.config.prefetch_wait_ms / 1000 - self._waited.get(handle, 0.0)
        jobs = [j for j in self._jobs if j.handle == handle]
        if self.config.prefetch_wait_ms <= 0 or not jobs:
            return False
        if self.tp_size > 1:
            # A deadline would let ranks see different outcomes: under TP a request waits for its
            # own prefetch to end (reads are bounded by the store's rpc timeout), then the ranks agree.
            self._poll_io(block=True)
            return True
        if budget <= 0:
            return False
        t0 = time.perf_counter()
        done = True
        for j in jobs:
            if j.future is None:
                try:
                    r, e = j.run(), None
                except Exception as ex:  # noqa: BLE001 (typed in _finish)
                    r, e = None, ex
            else:
                try:
                    r = j.future.result(timeout=max(budget - (time.perf_counter() - t0), 0))
                    e = None
                except FutureTimeout:
                    done = False
                    continue
                except Exception as ex:  # noqa: BLE001
                    r, e = None, ex
            self._jobs.remove(j)
            self._finish(j, r, e)
        self._agree()
        self._waited[handle] = self._waited.get(handle, 0.0) + time.perf_counter() - t0
        return done

    def init_load_back(self, params: InitLoadBackParams) -> Tuple[int, Any]:
        req = params.req
        last = params.best_match_node
        marker = self._markers.pop(req.cache_request_handle, None) if req is not None else None
        want = int(params.host_hit_length)
        if marker is None or want <= 0:
            return 0, last
        ps = self.page_size
        to = (marker.device_len + want) // ps
        if to > len(marker.chain):
            return self._fallback(req, last)
        # The device tree may have grown since the match (another request of this step
        # loaded the same pages): load only what it still lacks, under the deepest node.
        cur = super().match_prefix(MatchPrefixParams(key=marker.key[: to * ps]))
        start, node = cur.device_prefix_len // ps, cur.last_device_node
        if start >= to:
            self._account_load(req, marker.chain, want, 0, to)
            return want, node
        try:
            job, slots = self.manager.prepare_load(marker.chain, start, to)
        except kvtier.OffloadManagerError:
            return self._fallback(req, last)  # evicted from host since the match
        need = (to - start) * ps
        self.inc_lock_ref(node)
        try:
            if self.token_to_kv_pool_allocator.available_size() < need:
                self.evict(EvictParams(num_tokens=need))
            dev = self.token_to_kv_pool_allocator.alloc(need)
        finally:
            self.dec_lock_ref(node)
        if dev is None:
            self.manager.complete_load(job)
            return self._fallback(req, last)
        try:
            self._copy_to_device(slots, dev)
        except BaseException:
            self.token_to_kv_pool_allocator.free(dev)  # the slots it took go back
            raise
        finally:
            self.manager.complete_load(job)
        self.manager.touch(marker.chain[:to])
        new = TreeNode(priority=node.priority)
        new.key = marker.key[start * ps:to * ps]
        new.value = dev.to(torch.int64)
        new.parent = node
        node.children[new.key.child_key(ps)] = new
        self.evictable_size_ += need
        self._update_leaf_status(node)
        self._update_leaf_status(new)
        self.kv_events.record_store(new)
        self._account_load(req, marker.chain, want, start, to)
        return want, new

    def _fallback(self, req: Any, last: Any) -> Tuple[int, Any]:
        self.counters.load_back_fallbacks += 1
        rec = self._hits.get(req.rid) if req is not None else None
        if rec is not None:
            rec.host = rec.l3 = 0
        return 0, last

    def _account_load(self, req: Any, chain: List[bytes], want: int, start: int, to: int) -> None:
        self.counters.load_backs += 1
        from_l3 = 0
        for h in chain[start:to]:
            if h in self._from_l3:
                self._from_l3.discard(h)
                from_l3 += self.page_size
        rec = self._hits.setdefault(req.rid, HitRecord(req.rid))
        rec.l3, rec.host = from_l3, want - from_l3
        # SGLang's own per-tier hit metrics (PrefillAdder's log_*_hit_tokens) read these.
        req.storage_hit_length = from_l3
        req.storage_hit_start = None
        req.host_hit_is_storage = False

    # ---- store -------------------------------------------------------------------------

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        super().checkpoint(req, up_to=up_to)
        if self.disable or self.config.write_policy != "write_through":
            return
        n = req.kv.cache_protected_len
        chain = self._chain(req.full_untruncated_fill_ids[:n], req.extra_key, req.cache_salt)
        if chain is not None:
            self._store(chain, self.req_to_token_pool.req_to_token[req.kv.req_pool_idx], req.cache_salt)

    def _store(self, chain: List[bytes], dev_idx: torch.Tensor, salt: Optional[str]) -> int:
        """Device pages of ``chain`` (its tokens at device slots ``dev_idx``) not on host yet
        go to the host slots kvtier hands out (evicting by its policy); returns how many."""
        plan = self.manager.prepare_store(chain, len(chain), self._tenant(salt))
        if plan is None:
            return 0
        job, first, slots, _evicted = plan
        ps = self.page_size
        try:
            self._copy_to_host(dev_idx[first * ps:(first + len(slots)) * ps], slots)
        except Exception:
            self.manager.complete_store(job, "failed")
            raise
        self.manager.complete_store(job, "done")
        self.counters.stored_pages += len(slots)
        return len(slots)

    def _delete_leaf(self, node: Any) -> None:
        """SGLang's device eviction drops ``node``: with ``write_back`` its path goes to host
        first. ``RadixCache.evict`` calls this right after giving the node's slots back to the
        allocator and before anything can allocate them again, so they still hold its KV."""
        if self.config.write_policy == "write_back" and node.value is not None and len(node.value):
            keys, n = [], node
            while n is not self.root_node:
                keys.append(n.key.raw_token_ids()[: len(n.key)])
                n = n.parent
            tokens = [t for k in reversed(keys) for t in k]
            chain = self._chain(tokens, node.key.extra_key, node.key.cache_salt)
            if chain is not None:
                stored = self._store(chain, self.path_device_indices(node), node.key.cache_salt)
                self.counters.written_back_pages += stored
                if stored and self.store is not None:
                    # Host now holds the only copy: its backup starts (and pins the pages) now, not
                    # at the step's end, or a prefetch for a later match of this step evicted them.
                    self._start_backups()
        super()._delete_leaf(node)

    # ---- metrics -----------------------------------------------------------------------

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        self._markers.pop(req.cache_request_handle, None)
        self._probed.pop(req.cache_request_handle, None)
        self._waited.pop(req.cache_request_handle, None)
        rec = self._hits.pop(req.rid, None)
        if rec is None:
            return
        self.hit_log.append(rec)
        self.counters.device_hit_tokens += rec.device
        self.counters.host_hit_tokens += rec.host
        self.counters.l3_hit_tokens += rec.l3

    def release_aborted_request(self, handle: Any) -> None:
        self._hits.pop(handle.rid, None)
        self._markers.pop(handle, None)
        self._probed.pop(handle, None)
        self._waited.pop(handle, None)

    def books(self) -> Dict[str, int]:
        """The size of every per-request and per-job book this cache keeps, and the native
        manager's jobs, holds and in-flight pages: all 0 once SGLang is idle and the L3 I/O
        ended (``wait_io``), whatever ended the requests (finished, aborted before or after
        their prefetch started, retracted) or the jobs (failed reads and writes) —
        docs/sglang.md, "What kvtier keeps per request". What stays is bounded by the host
        pool (``_from_l3``: pages read from L3 not yet loaded) or fixed (``hit_log``)."""
        u = self.manager.usage()
        return {"hits": len(self._hits), "markers": len(self._markers), "probed": len(self._probed),
                "waited": len(self._waited), "jobs": len(self._jobs), "agreeing": len(self._agreeing),
                "agreement_events": self._agreement.pending(), "native_stores": u["stores"],
                "native_loads": u["loads"], "native_storing": u["storing"], "native_backups": u["backups"],
                "native_holds": sum(self.manager.holds()), "native_locked": u["locked"]}

    def stats(self) -> Dict[str, Any]:
        """Cumulative counters, the host pool's use (kvtier's ``usage``)."""
        out: Dict[str, Any] = dict(vars(self.counters))
        out.update({f"host_{k}": v for k, v in self.manager.usage().items()})
        out["mover"] = getattr(self.copier, "name", None)
        out["mover_fallbacks"] = getattr(self.copier, "fallbacks", 0)
        return out




# Speculative algorithms that keep no draft KV of their own (the target's pool is all there is).
_NO_DRAFT_KV = ("NONE", "NGRAM")


def _refuse_draft_kv_pools(ctx: Any) -> None:
    """A draft model (STANDALONE, DFLASH, UNO, DSPARK, a plugin's algorithm) keeps its KV in its
    own device pool at the target's token slots, and without HiCache SGLang gives the tree no
    handle on it: a prefix kvtier loads from host or L3 would fill the target's rows only and
    leave the draft attending to whatever those slots held before. EAGLE is refused by its
    bigram keys (``params.is_eagle``) in the constructor."""
    algo = getattr(ctx.server_args, "speculative_algorithm", None)
    if algo is None:
        try:
            from sglang.srt.runtime_context import get_spec

            algo = get_spec().speculative_algorithm
        except Exception:  # noqa: BLE001 (an SGLang without the config bag: nothing published)
            algo = None
    name = str(getattr(algo, "name", algo) or "NONE").upper()
    if name not in _NO_DRAFT_KV:
        raise UnsupportedModelError(
            f"--speculative-algorithm {name}: its draft model's KV pool sits beside the target's, and "
            "kvtier loads prefixes into the target's pool only (the draft would read stale rows); "
            "NGRAM or no speculative decoding")


def _refuse_host_pool_retraction() -> None:
    """A PD-disaggregation decode server's uses of HiCache's host pool, which kvtier's backend
    replaces (with its radix cache on; a disabled one is SGLang's own): the ``host_pool``
    retraction backup calls
    ``UnifiedRadixCache.backup_kv_cache`` on the tree cache at the first retraction (an
    AttributeError mid-serving), and host receive (a threshold below 1) takes the tree cache's
    ``host_pool_group`` (an AttributeError at startup)."""
    try:
        from sglang.srt.runtime_context import get_disagg

        backup = get_disagg().disaggregation_decode_retraction_backup
        receive = float(get_disagg().disaggregation_decode_host_receive_threshold)
    except Exception:  # noqa: BLE001 (an SGLang without the config bag: no such options)
        return
    if backup == "host_pool":
        raise RadixConfigError(
            "--disaggregation-decode-retraction-backup host_pool backs retracted "
            "requests up through HiCache's host pool, which kvtier's backend replaces: pass "
            "--disaggregation-decode-retraction-backup cpu_tensor")
    if receive < 1:
        raise RadixConfigError(
            f"--disaggregation-decode-host-receive-threshold {receive} receives KV into HiCache's host pool, "
            "which kvtier's backend replaces: leave it at 1")


def kvtier_radix_cache_factory(ctx: Any) -> Any:
    """SGLang's ``TreeCacheBuildContext`` → the backend (``KvtierRadixCache``); refuses what it
    cannot serve with a typed error at startup (hybrid SWA, Mamba, DSA models; a speculative
    draft model's KV pool; HiCache on top). A disabled radix cache (``--disable-radix-cache``, a PD decode server's
    default) has no prefixes to tier: SGLang's own cache for it, no host pool, no L3."""
    if ctx.disable_radix_cache:
        from sglang.srt.mem_cache.registry import default_radix_cache_factory

        logger.info("kvtier: the radix cache is disabled: SGLang's own cache serves, kvtier's tiers are not built")
        return default_radix_cache_factory(ctx)
    if ctx.is_hybrid_swa:
        raise UnsupportedModelError("hybrid sliding-window (SWA) models are not served: full-attention models only")
    if ctx.is_hybrid_ssm:
        raise UnsupportedModelError("Mamba (hybrid SSM) models are not served: full-attention models only")
    if getattr(ctx, "is_dsa", False):
        raise UnsupportedModelError("DSA (sparse attention) models are not served")
    _refuse_draft_kv_pools(ctx)
    _refuse_host_pool_retraction()
    if ctx.enable_hierarchical_cache:
        raise RadixConfigError(
            "--enable-hierarchical-cache puts SGLang's HiCache over the host tier kvtier decides: drop it "
            "(or use kvtier as HiCache's storage backend instead)"
        )
    model = getattr(ctx.model_config, "model_path", None) or getattr(ctx.server_args, "model_path", "") or ""
    cfg = RadixBackendConfig.from_env()
    # the model's identity, not only its path: another fine-tune there read these pages
    tp_size, tp_rank, tp_group = _kv_shard_group(ctx)
    return KvtierRadixCache(ctx.params, cfg, model=sglang_model(str(model), ctx.server_args, cfg.model_version),
                            tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)


def _kv_shard_group(ctx: Any) -> Tuple[int, int, Any]:
    """The ranks that see this scheduler's requests and split its KV: with attention DP, the DP
    rank's attention-TP group (SGLang's ``tp_cache_group``, ``get_dp_tp_group``: its own
    requests, heads split over ``attn_tp_size``), not the whole TP group the build context
    names (agreements paired ranks serving other requests); otherwise the TP group."""
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        dp = bool(p.attn_dp_enabled)
    except Exception:  # noqa: BLE001 (an SGLang without the parallel context, or none published)
        dp = False
    if not dp:
        return int(ctx.tp_size), int(ctx.tp_rank), ctx.tp_group
    try:
        return int(p.attn_tp_size), int(p.attn_tp_rank), getattr(ctx.params, "tp_cache_group", None)
    except Exception as e:  # noqa: BLE001 (SGLang's unwritten-rank error)
        raise RadixConfigError(f"attention DP: this rank's place in its attention-TP group is not known: {e}") from None
