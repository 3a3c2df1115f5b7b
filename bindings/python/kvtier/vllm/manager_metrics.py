"""kvtier's manager in vLLM's metrics: what ``KvtierOffloadingSpec`` reports through vLLM's
stats hooks.

Why: a vLLM deployment watches its offloading through vLLM's own Prometheus logger, which
registers what the spec declares (``build_metric_definitions``) and exports what the manager
reports every step (``get_stats``). With kvtier deciding, the interesting numbers are
kvtier's: how often its host tree answered, what it stored and evicted, what it prefetched
from L3 — so they go through the same hooks as vLLM's own CPU manager's (whose occupancy
gauges the spec fills too) and kvtier's tier's (``vllm:kv_offload_kvtier_*``, one set summed
over the tensor-parallel ranks' tiers).

How: the manager counts in a ``ManagerCounters``; ``get_stats`` reports the increases since
its last call, the host tree's occupancy as gauges when it changed (a gauge keeps its last
value; vLLM asks every engine step), and merges each rank's tier stats; nothing new is None,
answered before any stats object is built (the common step: nothing offloaded).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Dict, List, Optional, Tuple

from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics

import kvtier

__all__ = ["MANAGER_PREFIX", "ManagerCounters", "ManagerMetrics", "add_increases", "definitions",
           "new_connector_stats"]

MANAGER_PREFIX = "vllm:kv_offload_kvtier_manager_"
_COUNTER_DOCS = {
    "lookups": "Chunk lookups kvtier's manager answered.",
    "lookup_hits": "Lookups answered HIT (the chunk and its prefix on host).",
    "chunks_stored": "Chunks kvtier's host tree took (stores and prefetches that landed).",
    "chunks_evicted": "Chunks kvtier's host tree evicted.",
    "load_jobs": "Host-to-GPU load jobs kvtier handed to vLLM's worker.",
    "chunks_loaded": "Chunks in those load jobs.",
    "prefetch_jobs": "Prefetches from kvtier's L3 (one job read by every tensor-parallel rank).",
    "chunks_prefetched": "Chunks in those prefetches.",
    "backup_jobs": "Backups of host chunks to kvtier's L3.",
    "room_waits": "Lookups answered RETRY: an L3 prefetch waiting for a host slot held by a copy in flight.",
    "holds_displaced": "L3 prefetches held for waiting requests that gave way to a store of chunks L3 lacks.",
}
_GAUGE_DOCS = {
    "host_cached_chunks": "Chunks in kvtier's host tree.",
    "host_free_chunks": "Free host slots.",
    "host_locked_chunks": "Host chunks pinned by a copy (load, backup) or as a store's prefix.",
}


@dataclass
class ManagerCounters:
    lookups: int = 0
    lookup_hits: int = 0
    chunks_stored: int = 0
    chunks_evicted: int = 0
    load_jobs: int = 0
    chunks_loaded: int = 0
    prefetch_jobs: int = 0
    chunks_prefetched: int = 0
    backup_jobs: int = 0
    room_waits: int = 0
    holds_displaced: int = 0


def definitions(extra_config: Dict[str, Any]) -> Dict[str, Any]:
    """The manager's metric definitions (and its tier's, with ``kvtier_l3``)."""
    defs: Dict[str, Any] = {MANAGER_PREFIX + k: OffloadingCounterMetadata(v) for k, v in _COUNTER_DOCS.items()}
    defs.update({MANAGER_PREFIX + k: OffloadingGaugeMetadata(v) for k, v in _GAUGE_DOCS.items()})
    if extra_config.get("kvtier_l3") is not None:
        from .tier import KvtierSecondaryTier

        defs.update(KvtierSecondaryTier.build_metric_definitions(extra_config))
    return defs


_COUNTERS = tuple(_COUNTER_DOCS)
_counter_values = attrgetter(*_COUNTERS)  # the counters as a tuple, in one C call
_connector_stats = None  # vLLM's OffloadingConnectorStats, imported on first use


def new_connector_stats() -> Any:
    """A new ``OffloadingConnectorStats`` (vLLM's stats payload), its class imported once."""
    global _connector_stats
    if _connector_stats is None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        _connector_stats = OffloadingConnectorStats
    return _connector_stats()


def add_increases(stats: Any, prefix: str, names: Tuple[str, ...], now: Tuple[int, ...],
                  last: Tuple[int, ...]) -> None:
    """Each counter that moved since ``last``, as an increase in ``stats``."""
    for k, n, was in zip(names, now, last):
        if n != was:
            stats.increase_counter(prefix + k, n - was)


class ManagerMetrics:
    """``get_stats`` of ``KvtierOffloadingManager`` (a mixin: uses its ``native`` and
    ``l3_ranks``, and ``counters``, which the manager increments)."""

    counters: ManagerCounters
    native: kvtier.OffloadManager  # the manager's
    l3_ranks: List[Any]  # the manager's L3 tiers (KvtierSecondaryTier), one per rank
    _reported: Tuple[int, ...] = ()
    _gauges: Optional[Tuple[int, ...]] = None
    _gauges_gen: Optional[int] = None  # the native generation ``_gauges`` were read at

    def get_stats(self) -> Optional[Any]:
        # vLLM asks every engine step: when nothing changed (no counter moved, the host
        # tree's occupancy is what was reported, no L3 tier has news) the answer is None
        # before any stats object is built. The occupancy is a function of the host tree,
        # so it is read again only when the tree changed (its generation: process-wide
        # stamps, so a new tree after a reset never passes for the old one).
        now = _counter_values(self.counters)
        last = self._reported or (0,) * len(now)
        gen = self.native.generation
        # (cached, free, locked, held, capacity)
        occ = self._gauges if gen == self._gauges_gen else self.native.occupancy()
        merged = None  # the ranks' tiers: counters summed, the shared store's gauges once
        for t in self.l3_ranks:
            s = t.get_stats()
            if s is not None:
                merged = s if merged is None else merged.aggregate(s)
        if now == last and occ == self._gauges and merged is None:
            self._gauges_gen = gen
            return None
        stats = new_connector_stats()
        self._reported = now
        add_increases(stats, MANAGER_PREFIX, _COUNTERS, now, last)
        if occ != self._gauges:
            # Only when they changed: a Prometheus gauge keeps its last value, and vLLM asks
            # every engine step (six gauges set here and again in vLLM's logger, per step).
            assert occ is not None  # None only as the initial _gauges, which occ differs from
            self._gauges = occ
            cached, free, locked, held, capacity = occ
            cap = max(capacity, 1)
            stats.set_gauge(MANAGER_PREFIX + "host_cached_chunks", cached)
            stats.set_gauge(MANAGER_PREFIX + "host_free_chunks", free)
            stats.set_gauge(MANAGER_PREFIX + "host_locked_chunks", locked)
            # vLLM's CPU manager's gauges (declared by CPUOffloadingSpec): pinned by transfers.
            stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, held / cap)
            stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, locked / cap)
            stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, (held + locked) / cap)
        self._gauges_gen = gen
        if merged is not None:
            stats.aggregate(merged)
        return None if stats.is_empty() else stats
