"""kvtier's manager through vLLM's stats hooks: ``KvtierOffloadingSpec`` declares its metrics
(vLLM's CPU offloading gauges, kvtier's manager's, its L3 tier's) for vLLM's Prometheus
logger, and the stats vLLM's scheduler reports every step carry them — under TP 2, the two
ranks' L3 tiers summed."""

from __future__ import annotations

import uuid

from harness import BLOCK
from manager_engines import run_checked
from test_vllm_manager_tp import _offload_and_evict, prompt, tp_engine
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics

from kvtier.vllm import KvtierOffloadingSpec
from kvtier.vllm.manager_metrics import MANAGER_PREFIX
from kvtier.vllm.tier import METRIC_PREFIX


def test_the_managers_metrics_reach_vllms_stats(tmp_path):
    e = tp_engine(tmp_path, chunks=8, l3_name=uuid.uuid4().hex)
    try:
        defs = KvtierOffloadingSpec.build_metric_definitions(e.vllm_config.kv_transfer_config.kv_connector_extra_config)
        for name in (MANAGER_PREFIX + "lookups", MANAGER_PREFIX + "host_cached_chunks", METRIC_PREFIX + "chunks_stored",
                     CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC):
            assert name in defs, name
        p = prompt(1, 4)
        _offload_and_evict(e, p)  # 12 chunks stored on host and backed up by both ranks
        e.reset_gpu_cache()
        e.add("c", p)  # prefetched from L3 in one job, then loaded
        run_checked(e)
        assert e.finished["c"].gpu_ok and e.finished["c"].external_tokens == 4 * 2 * BLOCK
        flats = [OffloadingConnectorStats(data=d).reduce() for d in e.stats_payloads]

        def total(name):
            return sum(f.get(name, 0) for f in flats)

        assert total(MANAGER_PREFIX + "chunks_stored") == 12 + 4
        assert total(MANAGER_PREFIX + "chunks_evicted") >= 4
        assert (total(MANAGER_PREFIX + "prefetch_jobs"), total(MANAGER_PREFIX + "chunks_prefetched")) == (1, 4)
        assert (total(MANAGER_PREFIX + "load_jobs"), total(MANAGER_PREFIX + "chunks_loaded")) == (1, 4)
        assert total(MANAGER_PREFIX + "lookup_hits") >= 4 and total(MANAGER_PREFIX + "lookups") >= 4
        assert total(METRIC_PREFIX + "chunks_stored") == 2 * 12, "both ranks' tiers, summed"
        assert total(METRIC_PREFIX + "chunks_loaded") == 2 * 4
        last = [f for f in flats if MANAGER_PREFIX + "host_cached_chunks" in f][-1]
        assert last[MANAGER_PREFIX + "host_cached_chunks"] == e.manager.native.usage()["cached"]
    finally:
        e.close()


def test_the_managers_gauges_are_reported_when_they_change():
    """vLLM asks for stats every engine step; a Prometheus gauge keeps its last value. So an
    idle manager reports nothing (before: its six gauges every step, set again in vLLM's
    logger: the manager's one per-step cost above vLLM's own CPU manager's), and a change of
    the host tree's occupancy is reported at the next step."""
    from kvtier.vllm.manager import KvtierOffloadingManager

    m = KvtierOffloadingManager(8, {0: 64})
    first = m.get_stats()
    assert first is not None and first.reduce()[MANAGER_PREFIX + "host_free_chunks"] == 8
    assert m.get_stats() is None  # nothing changed since
    m.counters.lookups += 2
    assert m.get_stats().reduce() == {MANAGER_PREFIX + "lookups": 2}  # a counter alone
    pages = [bytes([i]) * 32 for i in range(3)]
    job, _, slots, _ = m.native.prepare_store(pages, 3)
    assert len(slots) == 3
    m.native.complete_store(job, "done")
    got = m.get_stats().reduce()
    assert (got[MANAGER_PREFIX + "host_cached_chunks"], got[MANAGER_PREFIX + "host_free_chunks"]) == (3, 5)
    assert got[CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC] == 0
    assert m.get_stats() is None
