"""kvtier's L3 as a secondary tier of vLLM's ``TieringOffloadingSpec``.

Why: vLLM's offloading keeps a host cache (chunk slots in /dev/shm) and cascades every chunk
it stores there to its *secondary tiers*; on a host miss it asks them and promotes a hit
back into host slots. With kvtier's L3 as that tier, a vLLM deployment gets a store that is
shared by engines (embedded in the engine, or one ``kvtier-l3`` server for many), has a DRAM
and an SSD tier, survives a crash of an engine, and keeps tenants apart — enabled by one
``--kv-transfer-config`` (docs/vllm.md), nothing in vLLM patched.

How: vLLM calls the tier from its scheduler loop and wants every call light. So
``submit_store`` / ``submit_load`` only queue a job on kvtier's I/O threads, which move the
chunk slots straight between vLLM's /dev/shm region and the store
(``L3Store.batch_put_pages`` / ``batch_get_pages``: the extension releases the GIL and
copies from / into the ``primary_kv_view`` memory, no staging copy); ``get_finished_jobs``
hands back what finished. ``lookup`` of an embedded store answers in-process (no round
trip); against a server it uses vLLM's own ``AsyncLookupManager``: the first lookup of a key
returns RETRY, the step's keys are probed in one batch on a background thread, and the next
step's lookup answers from the result; chunks this engine stored itself are answered HIT at
once. A load that finds an object gone (evicted, the server
restarted) fails its job from that chunk on (vLLM keeps the chunks before it and recomputes
the rest) and marks the key a miss; a store the store refuses fails its job (vLLM drops the
chunk from L3, nothing else changes). Keys: ``keys.py``.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Collection, Dict, Iterable, List, Optional, Tuple

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager, LookupPhase
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

import kvtier

from ..l3_limits import object_refusal
from ..mooncake_compat._setup import parse_size
from .compat import event_has, offloading_event
from .keys import l3_key, model_identity, namespace_of
from .manager_metrics import add_increases, new_connector_stats

logger = logging.getLogger(__name__)

METRIC_PREFIX = "vllm:kv_offload_kvtier_"
# Counters (cumulative in TierCounters; get_stats reports the increase since its last call)
# and, for an embedded store, gauges of the store's own statistics.
_COUNTER_DOCS = {
    "chunks_stored": "Chunks kvtier's tier stored in its L3 store.",
    "chunks_loaded": "Chunks kvtier's tier loaded from its L3 store into host slots.",
    "store_failures": "Store jobs of kvtier's tier that failed (whole or in part).",
    "load_failures": "Load jobs of kvtier's tier that failed (whole or in part).",
    "lookups": "Lookups answered by kvtier's tier (RETRY included).",
    "lookup_hits": "Lookups kvtier's tier answered with HIT.",
    "reconnects": "New connections to the kvtier-l3 server after a failed one.",
}
_GAUGE_DOCS = {
    "store_objects": "Objects in the embedded kvtier L3 store.",
    "store_mem_used_bytes": "DRAM bytes used by the embedded kvtier L3 store.",
}
_TIER_COUNTERS = tuple(_COUNTER_DOCS)
_tier_counter_values = attrgetter(*_TIER_COUNTERS)  # the counters as a tuple, in one C call
# Seconds after which an idle tier asks its embedded store for its gauges again (get_stats).
GAUGE_REFRESH_S = 1.0
ENV_ADDR = "KVTIER_L3_ADDR"
ENV_TOKEN = "KVTIER_L3_TOKEN"
_EXISTS = int(kvtier._native.ERROR_CODES["OBJECT_ALREADY_EXISTS"])
_JOURNAL_KEYS = 65_536  # an embedded store's loss journal, when kvtier's manager reads it
# The ``ownership`` of the tier's KV events: vLLM's self-describing events keep a chunk's block
# hashes while some residency holds it, a secondary tier's being its (medium, ownership).
OWNERSHIP = "kvtier"

# The tier's own keys in the secondary_tiers entry (vLLM passes every other key through).
TIER_KEYS = (
    "server", "token", "segment_bytes", "ssd_dir", "ssd_capacity_bytes", "name", "tenant",
    "rpc_timeout_ms", "io_threads", "locality", "known_keys", "tenant_quota_bytes", "model_version",
)


class VllmTierConfigError(kvtier.KvtierError, ValueError):
    """A ``secondary_tiers`` entry kvtier cannot run with (unknown key, bad size, a server
    that does not answer or refuses the token, a chunk the store cannot hold); raised when
    vLLM builds the tier, so the engine does not start."""


@dataclass
class TierCounters:
    """Cumulative counters (also in ``get_stats``/Prometheus via vLLM's hooks)."""

    chunks_stored: int = 0
    chunks_loaded: int = 0
    store_failures: int = 0
    load_failures: int = 0
    lookups: int = 0
    lookup_hits: int = 0
    lookup_retries: int = 0
    reconnects: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


def _int(config: Dict[str, Any], key: str, default: int, minimum: int, maximum: Optional[int] = None) -> int:
    v = config.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum or (maximum is not None and v > maximum):
        within = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise VllmTierConfigError(f"kvtier tier: {key} must be an integer {within}, got {v!r}")
    return v


_MAX_BYTES = 2 ** 64 - 1  # the store's sizes are u64


def _size(config: Dict[str, Any], key: str) -> Optional[int]:
    """``config[key]`` in bytes (an int or a text size as Mooncake's), None when absent;
    unreadable, negative or past u64 (an OverflowError from the extension before) is refused
    naming the key."""
    v = config.get(key)
    if v is None:
        return None
    n = parse_size(v)
    if n is None or n > _MAX_BYTES:
        raise VllmTierConfigError(f"kvtier tier: bad {key} {v!r} (a size in bytes up to 2**64 - 1, or text "
                                  "as \"64MB\")")
    return n


class _ServerLookups(AsyncLookupManager):
    """vLLM's async lookup manager over one batched existence probe per step."""

    def __init__(self, tier: "KvtierSecondaryTier"):
        self._tier = tier
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: List[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        okeys = [self._tier.key(k) for k in keys]
        codes = self._tier._io(lambda s: s.batch_is_exist(okeys))
        return (np.asarray(codes) == 1).tolist()

    def mark_miss(self, keys: Collection[OffloadKey]) -> None:
        """A failed load's keys become misses, unless a newer probe of the key is still
        pending or in flight (its own result will land): vLLM 0.33's ``mark_miss``. vLLM
        0.32's forces such a probe to RESOLVED, and when its result lands
        ``drain_results`` asserts IN_FLIGHT and the engine dies (a server killed while
        a request probed the chunks an earlier load of the same keys was reading)."""
        for key in keys:
            state = self._lookup_state.get(key)
            if state is not None and state.phase is LookupPhase.RESOLVED:
                state.result = False


def prefix_order(job: TransferJob) -> Tuple[List[OffloadKey], np.ndarray]:
    """A job's keys and chunk ids, head of the prompt first.

    Why: vLLM hands a job's keys in no particular order (a store job's keys come from the
    set of chunks that finished storing), and kvtier's L3 ranks a batch's first key as its
    most recent, so that an eviction takes a prompt's tail before its head (a chunk is
    reusable only with every chunk before it; l3/src/batch_order.rs). vLLM's scheduler records
    each key's end-token position in the request's context (``get_offload_key_position``, in
    0.32 to 0.34; vLLM's own CPU manager sorts by it too); keys without one keep their
    place after those with one.
    """
    keys = list(job.keys)
    ids = np.asarray(job.chunk_ids, dtype=np.int64)
    position = getattr(getattr(job, "req_context", None), "get_offload_key_position", None)
    if position is None or len(keys) < 2:
        return keys, ids
    at = [position(k) for k in keys]
    order = sorted(range(len(keys)), key=lambda i: (at[i] is None, at[i] or 0))
    return [keys[i] for i in order], ids[order]


class KvtierSecondaryTier(SecondaryTierManager):
    """vLLM ``SecondaryTierManager`` over a kvtier L3 store (see the module doc; config keys
    in docs/vllm.md)."""

    medium = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, shard: Optional[Tuple[int, int, int]] = None,
                 loss_journal: bool = False, events: bool = True, **config: Any):
        unknown = sorted(set(config) - set(TIER_KEYS))
        if unknown:
            raise VllmTierConfigError(f"kvtier tier: unknown config keys {unknown}; known: {list(TIER_KEYS)}")
        for key in ("server", "token", "name", "ssd_dir", "tenant", "model_version"):
            v = config.get(key)
            may_be_empty = key in ("token", "name", "model_version")
            # "" for a server gave an embedded 4 GB store; a number was taken as its str
            if v is not None and (not isinstance(v, str) or not (v or may_be_empty)):
                kind = "str" if may_be_empty else "non-empty str"
                raise VllmTierConfigError(f"kvtier tier: {key} must be a {kind}, got {v!r}")
        threads = _int(config, "io_threads", 4, 1)
        self._known_cap = _int(config, "known_keys", 65_536, 0)
        self._rpc_timeout_ms = _int(config, "rpc_timeout_ms", 10_000, 1, 2 ** 32 - 1)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.tenant = str(config.get("tenant", "default"))
        try:
            self.locality = None if config.get("locality") is None else Locality(config["locality"])
        except ValueError as e:
            raise VllmTierConfigError(f"kvtier tier: bad locality {config.get('locality')!r}") from e
        self._flat = np.asarray(primary_kv_view).view(np.uint8).reshape(-1)
        # One tensor-parallel rank's shard of every slot (kvtier's manager under TP,
        # manager_l3.py): bytes [offset, offset + nbytes) of each row, under keys suffixed by
        # the rank (docs/page-keys.md); None: whole rows, as vLLM's tiering moves them.
        self._rows = self._flat.reshape(len(primary_kv_view), -1)
        if shard is not None:
            ok = (isinstance(shard, (tuple, list)) and len(shard) == 3
                  and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shard)
                  and shard[2] > 0 and shard[1] + shard[2] <= self._rows.shape[1])
            if not ok:
                raise VllmTierConfigError(f"kvtier tier: shard is (rank, offset, bytes) within a slot, got {shard!r}")
            shard = (shard[0], shard[1], shard[2])
        self.shard = shard
        self.chunk_bytes = self.block_size_bytes if shard is None else int(shard[2])
        self._suffix = "" if shard is None else f":{int(shard[0])}"
        # the checkpoint's content, not only its name (keys.py): another fine-tune at one path
        # served this one's KV
        self.model_identity = model_identity(offloading_spec.config, str(config.get("model_version") or ""))
        self.namespace = namespace_of(offloading_spec.config, self.block_size_bytes, self.tenant,
                                      self.model_identity)
        # the length of this tier's L3 keys (vLLM's offload keys are 32-byte block hashes): what
        # the store charges a chunk besides its bytes depends on it (l3_limits.py)
        self._key_len = len(self.key(bytes(32)))
        # kvtier's manager reads the store's loss journal (lost_keys); vLLM's tiering does not.
        self._journal = bool(loss_journal)
        self._loss_read: Optional[cf.Future] = None
        self.store = self._open(config)
        self._check_chunk_fits()
        # What an operator needs to give the store's event stream of this model's chunks
        # (docs/l3/kv-events.md): the namespace is a hash, not a name.
        logger.info("kvtier: L3 namespace %s (tenant %s): a kvtier-l3 event stream of this model's "
                    "chunks is --kv-events-stream %s=PUB[,REPLAY]", self.namespace, self.tenant, self.namespace)
        self.is_embedded = bool(self.store.is_embedded)
        self._pool = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtier-vllm-io")
        self._futures: Dict[int, cf.Future] = {}
        self._done: "queue.SimpleQueue[JobResult]" = queue.SimpleQueue()
        self._missed: "queue.SimpleQueue[List[OffloadKey]]" = queue.SimpleQueue()
        # Server mode: chunks this engine stored and has not seen fail since, answered HIT
        # without a probe (most recent last, at most known_keys). A chunk the store dropped
        # since fails its load, which vLLM recomputes, and is forgotten here.
        self._known: "OrderedDict[OffloadKey, None]" = OrderedDict()
        self._stored: "queue.SimpleQueue[List[OffloadKey]]" = queue.SimpleQueue()
        # KV events (vLLM's --kv-events-config), for routers: each chunk this tier put into the
        # store, once (a put that found it there already is not announced again: 136
        # duplicates in a tester's run), and, with ``loss_journal``, its removal when the
        # store reports it lost (before: never, so a router saw three times what an 8 MB store
        # held). Off where kvtier's manager owns the tier (``events=False``: nobody takes them,
        # and the queue grew by one event per store for good). The queue holds each put's
        # new keys; take_events makes the events.
        self._events: Optional["queue.SimpleQueue[List[OffloadKey]]"] = (
            queue.SimpleQueue() if events and offloading_spec.kv_events_config.enable_kv_cache_events else None)
        self._announced: set = set()  # chunks announced stored and not removed (with the journal)
        self._lookups: Optional[_ServerLookups] = None if self.is_embedded else _ServerLookups(self)
        self._lock = threading.Lock()
        self._reconnect_lock = threading.Lock()
        self.counters = TierCounters()
        # get_stats: the counters last reported, the store's gauges and when they were read
        self._reported: Tuple[int, ...] = ()
        self._gauges: Optional[Tuple[int, ...]] = None
        self._gauges_at = float("-inf")
        self._clock = time.monotonic  # (tests replace it)

    # ---- setup --------------------------------------------------------------------------

    def _open(self, config: Dict[str, Any]) -> kvtier.L3Store:
        addr = config.get("server") or os.environ.get(ENV_ADDR)
        self._server: Optional[Dict[str, Any]] = None
        quota = config.get("tenant_quota_bytes")
        if addr:
            if quota is not None:
                raise VllmTierConfigError(
                    "kvtier tier: tenant_quota_bytes caps an embedded store; a kvtier-l3 server's "
                    "tenants are capped by its own --tenant-quota NAME=BYTES")
            token = config.get("token") or os.environ.get(ENV_TOKEN)
            self._server = dict(addr=str(addr), token=token, tenant=self.tenant,
                                rpc_timeout_ms=self._rpc_timeout_ms)
            try:
                store = self._connect()
            except kvtier.L3Error as e:
                raise VllmTierConfigError(f"kvtier tier: L3 server {addr} did not accept us: {e!r}") from e
            return store
        seg = _size({"segment_bytes": "4GB", **config}, "segment_bytes")
        if not seg:
            raise VllmTierConfigError(f"kvtier tier: bad segment_bytes {config.get('segment_bytes')!r}")
        cap_b = _size(config, "ssd_capacity_bytes")
        if cap_b is not None and config.get("ssd_dir") is None:
            raise VllmTierConfigError("kvtier tier: ssd_capacity_bytes without ssd_dir: the store has no SSD tier "
                                      "to cap (give ssd_dir, or drop ssd_capacity_bytes)")
        quota_b = _size(config, "tenant_quota_bytes")
        # what one chunk costs the store: its bytes, its key and the store's metadata
        chunk_charge = kvtier.l3_charge(self.chunk_bytes, self._key_len)
        if quota_b is not None and quota_b < chunk_charge:
            # checked before the store opens (a named store adds every opener's segment)
            raise VllmTierConfigError(
                f"kvtier tier: tenant_quota_bytes {quota!r} is less than one vLLM chunk as the store charges it "
                f"({self.chunk_bytes} bytes, {chunk_charge} with its key and metadata): tenant {self.tenant!r} could "
                f"never store a chunk")
        ssd = config.get("ssd_dir")
        try:
            return kvtier.L3Store.embedded(seg, ssd_dir=None if ssd is None else str(ssd), ssd_capacity_bytes=cap_b,
                                           tenant=self.tenant, name=str(config.get("name", "")),
                                           tenant_quota_bytes=None if quota_b is None else {self.tenant: quota_b},
                                           loss_journal_keys=_JOURNAL_KEYS if self._journal else 0)
        except (kvtier.L3Error, ValueError) as e:
            raise VllmTierConfigError(f"kvtier tier: cannot open the embedded store: {e!r}") from e

    def _connect(self) -> kvtier.L3Store:
        s = self._server or {}
        store = kvtier.L3Store.connect(s["addr"], token=s["token"], tenant=s["tenant"],
                                       rpc_timeout_ms=s["rpc_timeout_ms"])
        store.is_exist(f"{self.namespace}:hello")  # a wrong token answers here
        return store

    def _io(self, call):
        """``call(store)`` on an I/O thread; a server connection that failed (the server
        died or restarted) is replaced by a new one for the next call."""
        store = self.store
        try:
            return call(store)
        except kvtier.RpcFailError:
            if self._server is not None:
                with self._reconnect_lock:
                    if self.store is store:
                        try:
                            self.store = self._connect()
                            with self._lock:
                                self.counters.reconnects += 1
                        except kvtier.L3Error as e:
                            logger.warning("kvtier: L3 server %s still unreachable: %r", self._server["addr"], e)
            raise

    def _check_chunk_fits(self) -> None:
        """A store that cannot hold vLLM's chunk (object or segment limit) is a startup error,
        not a failed job per chunk forever after; asked of the store's limits, writing
        nothing (l3_limits.py)."""
        try:
            why = object_refusal(self.store, self.chunk_bytes, self._key_len)
        except kvtier.L3Error as e:
            why = repr(e)
        if why is not None:
            raise VllmTierConfigError(
                f"kvtier tier: the L3 store cannot hold one vLLM chunk of {self.chunk_bytes} bytes: {why}")

    def key(self, offload_key: OffloadKey) -> str:
        return l3_key(self.namespace, offload_key) + self._suffix

    def _shards(self, ids: np.ndarray) -> List[np.ndarray]:
        assert self.shard is not None  # only a sharded tier splits its slots
        off, n = int(self.shard[1]), int(self.shard[2])
        return [self._rows[int(c), off:off + n] for c in ids]

    def _put(self, store: kvtier.L3Store, keys: List[str], ids: np.ndarray):
        if self.shard is None:
            return store.batch_put_pages(keys, self._flat, ids, self.block_size_bytes)
        return store.batch_put_from(keys, self._shards(ids))

    def _get(self, store: kvtier.L3Store, keys: List[str], ids: np.ndarray):
        if self.shard is None:
            return store.batch_get_pages(keys, self._flat, ids, self.block_size_bytes)
        return store.batch_get_into(keys, self._shards(ids))

    # ---- lookups ------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self.counters.lookups += 1
        if self._lookups is not None:
            if key in self._known:
                self._known.move_to_end(key)
                self.counters.lookup_hits += 1
                return LookupResult.HIT
            hit = self._lookups.lookup(key, req_context)
            if hit is None:
                self.counters.lookup_retries += 1
                return LookupResult.RETRY
        else:
            try:
                hit = int(self.store.batch_is_exist([self.key(key)])[0]) == 1
            except kvtier.L3Error:
                hit = False
        self.counters.lookup_hits += int(hit)
        return LookupResult.HIT if hit else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self._lookups is not None:
            self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._lookups is not None:
            self._lookups.flush()

    # ---- jobs ---------------------------------------------------------------------------

    def _submit(self, job: TransferJob, fn) -> None:
        keys, ids = prefix_order(job)
        self._futures[job.job_id] = self._pool.submit(fn, job.job_id, keys, ids)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._store_job)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._load_job)

    def _store_job(self, job_id: int, okeys: List[OffloadKey], ids: np.ndarray) -> None:
        t0 = time.perf_counter()
        keys = [self.key(k) for k in okeys]
        try:
            codes = np.asarray(self._io(lambda s: self._put(s, keys, ids)))
            ok = (codes == 0) | (codes == _EXISTS)
        except (kvtier.L3Error, ValueError) as e:
            logger.warning("kvtier: store of %d chunks failed: %r", len(keys), e)
            ok = np.zeros(len(keys), dtype=bool)
        n = int(ok.sum())
        stored = [k for k, good in zip(okeys, ok) if good]
        if stored and not self.is_embedded:
            self._stored.put(stored)
        new = [k for k, c in zip(okeys, codes) if c == 0] if n else []
        if self._events is not None and new:
            self._events.put(new)
        with self._lock:
            self.counters.chunks_stored += n
            self.counters.bytes_written += n * self.chunk_bytes
            self.counters.store_failures += int(not ok.all())
        self._done.put(JobResult(job_id=job_id, success=bool(ok.all()), transfer_time=time.perf_counter() - t0,
                                 transfer_bytes=n * self.chunk_bytes))

    def _load_job(self, job_id: int, okeys: List[OffloadKey], ids: np.ndarray) -> None:
        t0 = time.perf_counter()
        keys = [self.key(k) for k in okeys]
        try:
            codes = np.asarray(self._io(lambda s: self._get(s, keys, ids)))
            ok = codes == self.chunk_bytes
        except (kvtier.L3Error, ValueError) as e:
            logger.warning("kvtier: load of %d chunks failed: %r", len(keys), e)
            ok = np.zeros(len(keys), dtype=bool)
        # vLLM keeps the chunks a failed promotion loaded before its first failure.
        run = len(keys) if ok.all() else int(np.argmin(ok))
        with self._lock:
            self.counters.chunks_loaded += run
            self.counters.bytes_read += run * self.chunk_bytes
            self.counters.load_failures += int(run < len(keys))
        if run < len(keys):
            self._missed.put(okeys[run:])
        self._done.put(JobResult(job_id=job_id, success=run == len(keys),
                                 successful_keys=None if run == len(keys) else tuple(okeys[:run]),
                                 transfer_time=time.perf_counter() - t0, transfer_bytes=run * self.chunk_bytes))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        if not self._futures:
            # No job in flight: nothing finished. (A job's result, its stored keys and its
            # missed keys are all put before its future can be taken out here, so none is
            # left behind once every future is.) vLLM's loop asks every step.
            return ()
        out: List[JobResult] = []
        while not self._done.empty():
            r = self._done.get_nowait()
            self._futures.pop(r.job_id, None)
            out.append(r)
        # A failed load's missing keys: their cached lookup verdicts become misses, so vLLM
        # does not promote them again (on the scheduler thread, as vLLM's fs tier does).
        while not self._stored.empty():
            for k in self._stored.get_nowait():
                self._known[k] = None
                self._known.move_to_end(k)
        while len(self._known) > self._known_cap:
            self._known.popitem(last=False)
        while not self._missed.empty():
            missed = self._missed.get_nowait()
            for k in missed:
                self._known.pop(k, None)
            if self._lookups is not None:
                self._lookups.mark_miss(missed)
        return out

    def take_events(self) -> Iterable[OffloadingEvent]:
        """With vLLM's KV events on: ``BlockStored`` for each chunk this tier put into the
        store (once), and, with ``loss_journal``, ``BlockRemoved`` for announced chunks the
        store reports lost (all of them when its report overflowed). For a store several
        engines share, publish STORAGE from the store's own stream (``kvtier-l3
        --kv-events``) instead: each engine announces only what it put.

        Every event is owned by the tier (``ownership`` ``"kvtier"``), and a stored one is
        ``removal_expected`` exactly when its removal will be announced (the journal on):
        vLLM's self-describing events (``self_describing_kv_events``) keep a chunk's block
        hashes for the removal only while a residency holds it, and a tier's residency is set
        only so. Without it, a chunk the host cache had evicted was announced removed from
        STORAGE under a placeholder hash, not the block hashes its ``BlockStored`` named (a
        router kept them); and where no removal will come, vLLM would keep them for good."""
        out: List[OffloadingEvent] = []
        if self._events is None:
            return out
        journal = self._journal
        while not self._events.empty():
            keys = self._events.get_nowait()
            if journal:
                self._announced.update(keys)
            out.append(self._event(keys, removed=False, removal_expected=journal))
        if self._journal:
            lost, over = self.lost_keys()
            gone = list(self._announced) if over else [k for k in lost if k in self._announced]
            if gone:
                self._announced.difference_update(gone)
                out.append(self._event(gone, removed=True))
            if not self._journal and self._announced:
                # The store keeps no journal after all (a server run, or restarted, without
                # one): no removal will come, so vLLM lets go of the announced chunks' block
                # hashes now, not announcing a removal (``metadata_only``, vLLM 0.33 on; 0.32
                # has no such event and keeps them).
                if event_has("metadata_only"):
                    out.append(self._event(list(self._announced), removed=True, metadata_only=True))
                self._announced.clear()
        return out

    def _event(self, keys: List[OffloadKey], removed: bool, **more: Any) -> OffloadingEvent:
        return offloading_event(keys, self.medium, removed, self.locality, ownership=OWNERSHIP, **more)

    def has_pending_work(self) -> bool:
        return bool(self._futures)

    def drain_jobs(self) -> None:
        cf.wait(list(self._futures.values()))

    def lost_keys(self) -> Tuple[List[OffloadKey], bool]:
        """vLLM offload keys of this tier's chunks (this rank's shard) that its store lost
        since the last call (evicted, removed, a restarted node), and whether some went
        unreported (the journal overflowed). An embedded store's journal is read here
        (in-process); a server's on an I/O thread, one read in flight, its result returned by
        a later call. Nothing without ``loss_journal`` or when the store keeps no journal."""
        if not self._journal:
            return [], False
        try:
            if self.is_embedded:
                keys, over = self.store.drain_losses()
            elif self._loss_read is None:
                self._loss_read = self._pool.submit(self._io, lambda st: st.drain_losses())
                return [], False
            elif not self._loss_read.done():
                return [], False
            else:
                read, self._loss_read = self._loss_read, None
                keys, over = read.result()
        except kvtier.UnavailableError:
            self._journal = False  # the store keeps no journal (a server run without one)
            return [], False
        except kvtier.L3Error:
            return [], False  # the server is gone: its failed reads tell the same
        if not keys:
            return [], bool(over)  # most steps: nothing lost
        prefix, suffix = self.namespace + ":", self._suffix
        out: List[OffloadKey] = []
        for k in keys:
            body = k[len(prefix):len(k) - len(suffix)] if k.startswith(prefix) and k.endswith(suffix) else ":"
            if ":" not in body:
                try:
                    out.append(bytes.fromhex(body))
                except ValueError:
                    pass
        return out, bool(over)

    def shutdown(self) -> None:
        if self._lookups is not None:
            self._lookups.shutdown()
        self._pool.shutdown(wait=True)
        # our views of vLLM's /dev/shm region, dropped so that vLLM can unmap it (an exported
        # buffer keeps the whole region mapped)
        self._flat = np.zeros(0, dtype=np.uint8)
        self._rows = np.zeros((0, 0), dtype=np.uint8)

    # ---- metrics (vLLM's hooks) ----------------------------------------------------------

    @classmethod
    def build_metric_definitions(cls, extra_config: Dict[str, Any]) -> Dict[str, Any]:
        defs: Dict[str, Any] = {METRIC_PREFIX + k: OffloadingCounterMetadata(v) for k, v in _COUNTER_DOCS.items()}
        defs.update({METRIC_PREFIX + k: OffloadingGaugeMetadata(v) for k, v in _GAUGE_DOCS.items()})
        return defs

    def get_stats(self) -> Any:
        """vLLM's stats payload: counter increases since the last call; for an embedded
        store also its object count and DRAM use when they changed (vLLM asks every engine
        step; a server's are on its own --metrics, and asking it here would be a round trip
        in the scheduler loop). Nothing new: None.

        The store is asked for its gauges at most once per ``GAUGE_REFRESH_S`` (its own
        stores, and what another user of an embedded store, another rank's tier, changed):
        the store's ``stats()`` walks its objects under its lock, and vLLM's scheduler loop
        waits for the answer. The counters cost no call into the store."""
        # Read without the lock the I/O threads update them under: a job's counters read
        # half-updated are reported in two steps, each increase once (``_reported``).
        now = _tier_counter_values(self.counters)
        last = self._reported or (0,) * len(now)
        t = self._clock()
        ask_store = self.is_embedded and t - self._gauges_at >= GAUGE_REFRESH_S
        if now == last and not ask_store:
            return None
        self._reported = now
        stats = new_connector_stats()
        add_increases(stats, METRIC_PREFIX, _TIER_COUNTERS, now, last)
        if ask_store:
            self._gauges_at = t
            st = self.store.stats()
            gauges = tuple(st.get(k[len("store_"):], 0) for k in _GAUGE_DOCS)
            if gauges != self._gauges:  # a gauge keeps its last value
                self._gauges = gauges
                for k, v in zip(_GAUGE_DOCS, gauges):
                    stats.set_gauge(METRIC_PREFIX + k, v)
        return None if stats.is_empty() else stats

    def books(self) -> Dict[str, int]:
        """The size of this tier's per-job and per-request books: jobs in flight, finished
        results and failed keys not yet taken, and (server) vLLM's async lookups: the keys
        each live request looked up, and the verdicts kept while a request that asked for
        them lives or their probe is in flight. All 0 once the engine is idle; ``known``
        (chunks answered HIT without a probe) is bounded by ``known_keys``, ``announced``
        (chunks announced stored, with events and the loss journal) by the store."""
        out = {"futures": len(self._futures), "results": self._done.qsize(), "missed": self._missed.qsize(),
               "known": len(self._known), "announced": len(self._announced)}
        if self._lookups is not None:
            out["lookup_requests"] = len(self._lookups._req_keys)  # noqa: SLF001 (vLLM's own books)
            out["lookup_verdicts"] = len(self._lookups._lookup_state)  # noqa: SLF001
        return out

    def stats(self) -> Dict[str, int]:
        """The tier's counters and the store's own statistics."""
        with self._lock:
            out = dict(vars(self.counters))
        try:
            out.update({f"store_{k}": v for k, v in self.store.stats().items()})
        except kvtier.L3Error:
            pass
        return out
