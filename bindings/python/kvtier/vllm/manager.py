"""kvtier's scheduler as vLLM's offloading manager: ``KvtierOffloadingSpec``.

Why: with a tier and a policy (tier.py, policy.py) vLLM's own manager decides what to load,
store and keep; kvtier only stores bytes and ranks evictions. Here vLLM's
``OffloadingConnector`` asks kvtier instead: ``KvtierOffloadingManager`` answers every
manager call from ``kvtier.OffloadManager`` (the scheduler crate's offloading-manager mode:
the radix tree over the host tier, prefix-closed residency, kvtier's eviction policy, locks
on what a copy reads or extends). vLLM keeps its GPU prefix cache and its GPU↔host copy
worker (``CPUOffloadingSpec``'s, over the same host slots), so the spec subclasses
``CPUOffloadingSpec`` and replaces only the manager.

How: ``chunks.py`` turns a request's offload keys (positions in its ``ReqContext``) into one
page-hash chain per KV group; host slot ids are vLLM's CPU chunk ids. ``prepare_store`` stores
the longest run of offered chunks right after the chain's host-resident prefix (kvtier's
choice; the rest are not stored, so vLLM does not copy them) and reports the evicted keys;
``complete_store`` / ``complete_load`` find the kvtier jobs by the key set vLLM passes back.
Requests use vLLM's ``REQUEST_LEVEL`` offload policy so that chunks vLLM found in its GPU
prefix cache are offered too: kvtier's host tier holds prefixes, not loose chunks. With
``kvtier_l3`` in the config, kvtier's L3 goes below the host tier (manager_l3.py).
"""

from __future__ import annotations

from typing import Any, Collection, Dict, Iterable, List, Optional, Tuple

from vllm.v1.kv_offload.base import (
    CacheHitSource,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from .. import OffloadManager
from .chunks import Chain, ChunkChains
from .cpu_copy import CpuCopyMixin
from .manager_l3 import L3Plan
from .manager_metrics import ManagerCounters, ManagerMetrics, definitions
from .shm import scheduler_region, worker_region
from .spec_config import (ROOM_WAIT_MS, KvtierSpecConfigError, check_spec_keys, eviction_of, host_chunks_of, l3_of,
                          quotas_of, refuse_non_prefix_groups, room_wait_of, tenant_of)

__all__ = ["KvtierOffloadingManager", "KvtierOffloadingSpec", "KvtierSpecConfigError"]

_LOOKUP = {"hit": LookupResult.HIT, "pending": LookupResult.HIT_PENDING}


def _positions(ctx: ReqContext) -> Dict[bytes, int]:
    # vLLM (0.32 to 0.34) records every key's end-token position here (set_offload_key_position) and
    # offers only a per-key getter; the chain needs them all.
    return ctx._offload_key_positions  # noqa: SLF001


class KvtierOffloadingManager(L3Plan, ManagerMetrics, OffloadingManager):
    """vLLM's ``OffloadingManager`` answered by kvtier's radix tree over ``num_chunks`` host
    slots (see the module docs); with ``l3`` (one ``KvtierSecondaryTier`` per
    tensor-parallel rank, each over its shard of the host slots) kvtier's L3 below them
    (manager_l3.py)."""

    def __init__(self, num_chunks: int, tokens_per_chunk: Dict[int, int], policy: str = "lru",
                 enable_events: bool = False, l3: Optional[List[Any]] = None,
                 tenant_quotas: Optional[Dict[str, int]] = None, room_wait_s: float = ROOM_WAIT_MS / 1e3):
        self.policy = policy
        self._backups = "off" if not l3 else "write-through"
        # One agreement per rank's tier (manager_l3.py): the manager plans for that many ranks,
        # so a direct loss report is refused and every agreement must count them all.
        self._tp_ranks = len(l3) if l3 else 1
        self.tenant_quotas = dict(tenant_quotas or {})
        self.native = self._new_native(num_chunks)
        self.counters = ManagerCounters()  # vLLM's stats hooks (manager_metrics.py)
        self._l3_init(l3, room_wait_s)
        self.host_view: Optional[memoryview] = None  # the host slots, when mapped here (L3)
        self.tokens_per_chunk = dict(tokens_per_chunk)
        self.events: Optional[List[OffloadingEvent]] = [] if enable_events else None
        self.medium = Medium.CPU
        self._key_of: Dict[bytes, bytes] = {}  # page hash -> offload key, for host pages
        self._pending: Dict[bytes, bytes] = {}  # the same, for pages being stored
        self._stores: Dict[frozenset, List[List[int]]] = {}  # vLLM key set -> kvtier jobs
        self._loads: Dict[frozenset, List[List[int]]] = {}
        self._drained: Optional[int] = None  # the native generation last drained (_drain)

    def _new_native(self, num_chunks: int) -> OffloadManager:
        native = OffloadManager(num_chunks, self.policy, self._backups, tp_ranks=self._tp_ranks)
        for name, cap in self.tenant_quotas.items():
            native.set_tenant_cap(name, cap)
        return native

    # ----- chains ---------------------------------------------------------------------

    def _chains(self, ctx: ReqContext) -> ChunkChains:
        c = ctx.get_state(ChunkChains)
        if c is None:
            c = ChunkChains(self.tokens_per_chunk)
            ctx.set_state(c)
        return c

    def _by_chain(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> List[Tuple[Chain, List[int]]]:
        """The keys that are pages, grouped by chain (group order), as sorted indices."""
        cc = self._chains(ctx)
        chains = cc.update(_positions(ctx))
        out: Dict[int, List[int]] = {}
        for k in keys:
            g = cc.group(k)
            if g is None:
                continue  # a group kvtier does not offload
            c = chains.get(g)
            i = None if c is None else c.index.get(bytes(k))
            if i is not None:
                out.setdefault(g, []).append(i)
        return [(chains[g], sorted(ix)) for g, ix in sorted(out.items())]

    # ----- vLLM's manager API -----------------------------------------------------------

    def _host_prefix(self, chain: Chain) -> int:
        """How many leading pages of ``chain`` are on host, kept in the chain while the
        manager is unchanged (its ``generation``): vLLM looks a request's chunks up one at a
        time from the first, and a page is a hit exactly when it lies in that prefix, so a
        request costs one walk of the tree, not one per chunk (O(chunks²) pages)."""
        gen = self.native.generation
        kept = chain.host
        # The kept prefix holds while the manager is unchanged, unless the chain grew past a
        # prefix that covered all of it (a page past a missing one is not on host either).
        if kept is not None and kept[0] == gen and (kept[1] < kept[2] or kept[2] == len(chain.pages)):
            return kept[1]
        n = self.native.host_prefix(chain.pages)
        chain.host = (gen, n, len(chain.pages))
        return n

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self.counters.lookups += 1
        cc = self._chains(req_context)
        positions = _positions(req_context)
        kept = cc.on_host
        # A key found in its chain's host prefix stays a hit while the manager and the
        # request's keys are unchanged: vLLM asks about a request's chunks one at a time, and
        # after the first answer each of the others is a set membership.
        if (kept is not None and type(key) is bytes and key in kept[2] and kept[0] == self.native.generation
                and kept[1] == len(positions)):
            self.counters.lookup_hits += 1
            return LookupResult.HIT
        loc = cc.locate(positions, key)
        if loc is None:
            return LookupResult.MISS
        chain, i = loc
        host = self._host_prefix(chain)
        if i < host:
            gen, seen = self.native.generation, len(positions)
            keys = frozenset(chain.keys[:host])
            if kept is not None and kept[0] == gen and kept[1] == seen:
                keys |= kept[2]  # another group's chain, kept in the same state
            cc.on_host = (gen, seen, keys)
            self.counters.lookup_hits += 1
            return LookupResult.HIT
        r = self.native.lookup(chain.pages[: i + 1], i)
        if r == "in-l3":
            return self._prefetch(chain, i, req_context)
        if r == "miss":
            return self._l3_lookup(chain, i, bytes(key), req_context) or LookupResult.MISS
        self.counters.lookup_hits += int(r == "hit")
        return _LOOKUP[r]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> CPULoadStoreSpec:
        slot_of: Dict[bytes, int] = {}
        jobs: List[int] = []
        try:
            for chain, ix in self._by_chain(keys, req_context):
                lo, hi = ix[0], ix[-1] + 1
                job, slots = self.native.prepare_load(chain.pages[:hi], lo, hi)
                jobs.append(job)
                for i in ix:
                    slot_of[chain.keys[i]] = slots[i - lo]
            spec = CPULoadStoreSpec([slot_of[bytes(k)] for k in keys])
        except Exception:
            for j in jobs:
                self.native.complete_load(j)
            raise
        self._loads.setdefault(frozenset(bytes(k) for k in keys), []).append(jobs)
        self._release_holds(req_context)  # the load's own locks pin what they held
        self.counters.load_jobs += 1
        self.counters.chunks_loaded += len(keys)
        return spec

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for j in self._pop(self._loads, keys):
            self.native.complete_load(j)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for chain, ix in self._by_chain(keys, req_context):
            self.native.touch(chain.pages[: ix[-1] + 1])

    def _all_on_host(self, keys: Collection[OffloadKey], ctx: ReqContext) -> bool:
        """Whether no offered key is a page past its chain's host prefix, answered from the
        kept host prefix without grouping the keys (one group; else False: the full path
        decides). Under ``REQUEST_LEVEL`` vLLM offers a request's loaded chunks again, all
        on host already, so most stores are this: nothing to store, nothing evicted."""
        cc = ctx.get_state(ChunkChains)
        if cc is None:
            return False
        chains = cc.update(_positions(ctx))
        if len(chains) != 1:
            return False
        (chain,) = chains.values()
        host = self._host_prefix(chain)
        index = chain.index
        for k in keys:
            if type(k) is not bytes:
                return False  # the full path converts it
            i = index.get(k)  # None: not a page of the chain (partial, past a hole, another
            if i is not None and i >= host:  # group): the full path skips it too
                return False
        return True

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Optional[PrepareStoreOutput]:
        if self._all_on_host(keys, req_context):
            return PrepareStoreOutput(keys_to_store=[], store_spec=CPULoadStoreSpec([]), evicted_keys=[])
        to_store: List[bytes] = []
        slots: List[int] = []
        evicted: List[bytes] = []
        jobs: List[int] = []
        refused = False
        for chain, ix in self._by_chain(keys, req_context):
            offered = set(ix)
            start = self._host_prefix(chain)
            # Past the chunks whose store is in flight (chunked prefill offers a prompt step
            # by step, each step's chunks before the last step's store lands): the native plan
            # stores from there too. Starting at the host prefix found the first chunk not
            # offered and stored nothing, and every later chunk then followed a hole.
            while start < len(chain.pages) and chain.pages[start] in self._pending:
                start += 1
            end = start
            while end in offered:
                end += 1
            if end == start:
                continue  # on host already, or its prefix is not: kvtier does not store it
            displaced = self.native.holds_displaced
            # Held L3 prefetches of waiting requests give way to pages L3 lacks (else vLLM,
            # which offers each chunk once, would never have them stored): offload_hold.rs.
            plan = self.native.prepare_store(chain.pages[:end], end, tenant_of(req_context))
            self.counters.holds_displaced += self.native.holds_displaced - displaced
            if plan is None:
                # No slot: vLLM offers these chunks again next step only if the store is
                # refused (None), else never. Refused when a chunk of the run is in no tier
                # (held prefetches still landing may give way once landed); a run L3 holds
                # whole is left to L3.
                refused = refused or self._lacks_l3(chain, start, end)
                continue
            job, frm, got, gone = plan
            jobs.append(job)
            for off, slot in enumerate(got):
                key = chain.keys[frm + off]
                to_store.append(key)
                slots.append(slot)
                self._pending[chain.pages[frm + off]] = key
            evicted.extend(self._key_of[p] for p in gone if p in self._key_of)
        self._drain()
        if not jobs and refused:
            return None  # every slot is pinned by copies in flight: vLLM retries later
        if jobs:
            self._stores.setdefault(frozenset(to_store), []).append(jobs)
        return PrepareStoreOutput(keys_to_store=to_store, store_spec=CPULoadStoreSpec(slots),
                                  evicted_keys=evicted)

    def _lacks_l3(self, chain: Chain, start: int, end: int) -> bool:
        """Whether a page of ``chain[start:end]`` (none on host) is in no tier: kvtier
        answers ``"miss"`` for it (``"in-l3"``: L3 has it; ``"pending"``: being stored)."""
        return any(self.native.lookup(chain.pages[: i + 1], i) == "miss" for i in range(start, end))

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        outcome = "done" if success else "failed"
        for j in self._pop(self._stores, keys):
            self.native.complete_store(j, outcome)
        self._drain()
        self._l3_backups()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        for t in self.l3_ranks:
            t.on_schedule_end(context)  # its probes of the step, in one batch
        self._l3_step()

    def has_pending_work(self) -> bool:
        return self._l3_busy()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._release_holds(req_context)
        for t in self.l3_ranks:
            t.on_request_finished(req_context)

    def shutdown(self) -> None:
        for t in self.l3_ranks:
            t.shutdown()
        if self.host_view is not None:
            self.host_view.release()

    def take_events(self) -> Iterable[OffloadingEvent]:
        # Drained at the call (a list, not a generator: vLLM calls it every step, and a
        # generator would cost more than an empty answer and drain only when iterated).
        if self.native.generation != self._drained:  # _drain's own test, without its call
            self._drain()
        if not self.events:
            return ()
        out, self.events = self.events, []
        return out

    def reset_cache(self) -> None:
        # vLLM's contract (as its CPU manager's): everything goes, pinned or not; jobs issued
        # before the reset are never reported, and vLLM flushes them to its workers before
        # any new store can reuse a slot (``on_reset_flushed``).
        self._l3_reset()
        self.native = self._new_native(int(self.native.usage()["capacity"]))
        for table in (self._key_of, self._pending, self._stores, self._loads):
            table.clear()

    # ----- kvtier ---------------------------------------------------------------------

    def check(self) -> None:
        """kvtier's consistency check, plus this adapter's own books: every host page has
        its key, every in-flight kvtier job is one vLLM job's."""
        self.native.check()
        u = self.native.usage()
        if (len(self._key_of), len(self._pending)) != (u["cached"], u["storing"]):
            raise AssertionError(f"keys known for {len(self._key_of)} host / {len(self._pending)} pending pages, "
                                 f"kvtier has {u['cached']} / {u['storing']}")
        stores = sum(len(j) for js in self._stores.values() for j in js) + self._l3_unreported()
        loads = sum(len(j) for js in self._loads.values() for j in js)
        if (stores, loads) != (u["stores"], u["loads"]):
            raise AssertionError(f"jobs: vLLM {stores} stores / {loads} loads, kvtier {u['stores']} / {u['loads']}")
        holds = sum(len(j) for j in self._holds.values())
        if holds != sum(self.native.holds()):
            raise AssertionError(f"held prefetches: {holds} of requests, kvtier has {self.native.holds()}")

    def books(self) -> Dict[str, int]:
        """The size of every per-request and per-job book this manager (and its L3 tiers)
        keeps, and the native manager's jobs, holds and in-flight pages: all 0 once the
        engine is idle (no request, no copy in flight), whatever ended the requests — finished,
        aborted, preempted, failed copies (docs/vllm.md, "What kvtier keeps per request").
        What stays is bounded by the host slots (``_key_of``) or by L3 (the tiers' known
        keys), not by the requests served."""
        u = self.native.usage()
        out = {
            "stores": len(self._stores), "loads": len(self._loads), "pending_pages": len(self._pending),
            "native_stores": u["stores"], "native_loads": u["loads"], "native_storing": u["storing"],
            "native_backups": u["backups"], "native_holds": sum(self.native.holds()),
            "native_locked": u["locked"],
        }
        out.update(self._l3_books())
        return out

    def _pop(self, table: Dict[frozenset, List[Any]], keys: Collection[OffloadKey]) -> Any:
        k = frozenset(bytes(x) for x in keys)
        if not table.get(k):
            return []
        jobs = table[k].pop(0)
        if not table[k]:
            del table[k]
        return jobs

    def _drain(self) -> None:
        # Events and dropped pages come only from calls that change the manager, each of
        # which renews its generation (taking them out does not): none since the last drain.
        gen = self.native.generation
        if gen == self._drained:
            return
        self._drained = gen
        for p in self.native.take_dropped():
            self._pending.pop(p, None)
        for removed, pages in self.native.drain_events():
            if not removed:
                for p in pages:
                    if p in self._pending:
                        self._key_of[p] = self._pending.pop(p)
            if removed:
                self.counters.chunks_evicted += len(pages)
            else:
                self.counters.chunks_stored += len(pages)
            keys = [self._key_of[p] for p in pages if p in self._key_of]
            if removed:
                for p in pages:
                    self._key_of.pop(p, None)
            if self.events is not None and keys:
                self.events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=removed))


class KvtierOffloadingSpec(CpuCopyMixin, CPUOffloadingSpec):
    """vLLM's CPU offloading (its host slots and GPU↔host worker) with kvtier's manager. When
    vLLM runs on CPU the worker is kvtier's CPU copy path (cpu_copy.py).

    ``--kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec", "spec_module_path":
    "kvtier.vllm", "cpu_bytes_to_use": ..., "kvtier_eviction": "freq-depth"}}'``
    """

    _manager: Optional[OffloadingManager]  # vLLM's spec's (None until get_manager)

    def __init__(self, config: Any):
        check_spec_keys(config.extra_config)  # a misspelt kvtier_ key is refused, never ignored
        refuse_non_prefix_groups(config)
        super().__init__(config)
        host_chunks_of(self.num_chunks, self.extra_config.get("cpu_bytes_to_use"))
        self.kvtier_eviction = eviction_of(self.extra_config.get("kvtier_eviction"))
        self.kvtier_l3 = l3_of(self.extra_config.get("kvtier_l3"))  # KvtierSecondaryTier's keys, or None
        if self.kvtier_l3 is not None and self.num_chunks == 0:
            # (it failed later, blaming a /dev/shm region "removed or on another node")
            raise KvtierSpecConfigError(
                f"cpu_bytes_to_use {self.extra_config.get('cpu_bytes_to_use')!r} holds no host chunk: kvtier's L3 "
                "moves chunks through host slots, so give at least one chunk's bytes")
        self.tenant_quotas = quotas_of(self.extra_config.get("kvtier_tenant_quotas"), self.num_chunks)
        self.room_wait_s = room_wait_of(self.extra_config.get("kvtier_room_wait_ms"))
        self._scheduler_mmap = None
        self.tokens_per_chunk = {int(g.group_id): int(g.tokens_per_block) * int(self.blocks_per_chunk)
                                 for g in config.groups}

    @classmethod
    def build_metric_definitions(cls, extra_config: Dict[str, Any]) -> Dict[str, Any]:
        """vLLM's CPU offloading metrics (the spec fills its occupancy gauges) and kvtier's
        manager's (and its L3 tier's): manager_metrics.py."""
        return {**super().build_metric_definitions(extra_config), **definitions(extra_config)}

    def get_manager(self) -> OffloadingManager:
        if not self._manager:
            self._manager = KvtierOffloadingManager(
                self.num_chunks, self.tokens_per_chunk, self.kvtier_eviction,
                enable_events=self.kv_events_config.enable_kv_cache_events, l3=self._l3_tier(),
                tenant_quotas=self.tenant_quotas, room_wait_s=self.room_wait_s)
            self._manager.host_view = getattr(self, "kv_view", None)
        return self._manager

    def _cpu_region(self):
        """On CPU: the host slots the worker writes; with kvtier's L3, a /dev/shm region the
        scheduler maps too (shm.py: its name stays until the scheduler has mapped it)."""
        if self.kvtier_l3 is None or self.num_chunks == 0:
            return None
        return worker_region(self)

    def create_worker(self, kv_caches: Any):
        """On a GPU with kvtier's L3: vLLM's worker over a region whose name outlives the
        workers' own mapping (vLLM's spec unlinks it once the workers mapped it, before the
        scheduler could; shm.py). Otherwise vLLM's."""
        if self.kvtier_l3 is None or self.num_chunks == 0:
            return super().create_worker(kv_caches)
        from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker

        region = worker_region(self)
        try:
            return CPUOffloadingWorker(kv_caches=kv_caches, blocks_per_chunk=self.blocks_per_chunk,
                                       num_cpu_chunks=self.num_chunks, mmap_region=region)
        except Exception:
            region.cleanup()
            raise

    def _l3_tier(self):
        """kvtier's L3 tiers over the host slots, mapped in this (the scheduler's) process as
        vLLM's tiering spec maps them: one per tensor-parallel rank, over its shard of each
        slot (manager_l3.py), or one over whole rows when rows are not sharded (one rank,
        vLLM's replicated or canonical layouts); None without ``kvtier_l3``."""
        if self.kvtier_l3 is None:
            return None
        from .tier import KvtierSecondaryTier

        # The workers' region (never a new one: shm.RegionError), its name removed once mapped.
        self._scheduler_mmap = scheduler_region(self)
        self.kv_view = self._scheduler_mmap.create_kv_memoryview()
        world = int(self.config.parallel.world_size)
        sharded = world > 1 and not self.replicated_layout and not self.config.canonical_layout
        shards = [(r, r * self.cpu_page_size_per_worker, self.cpu_page_size_per_worker) for r in range(world)]
        return [KvtierSecondaryTier(offloading_spec=self, primary_kv_view=self.kv_view, tier_type="kvtier",
                                    shard=shard, loss_journal=True, events=False, **dict(self.kvtier_l3))
                for shard in (shards if sharded else [None])]
