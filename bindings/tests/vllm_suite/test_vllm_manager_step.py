"""What kvtier's manager does at every engine step, and the answers it keeps to do it cheaply.

vLLM's scheduler ends every step with ``on_schedule_end`` and asks for stats; with kvtier's L3
below the host tier that is where backups are planned and finished jobs polled. Most steps
change nothing, so the manager keeps answers while its native manager is unchanged (its
``generation``): the host tree's occupancy for the stats, and the fact that the backup queue
was emptied. These tests drive the real vLLM scheduler (harness.py) through random work and
check, after every step, that what the manager reported and planned is what the full path
would have: every stats payload folded equals the manager's counters and the tree's
occupancy now, and no backup is left queued."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any, Dict, List

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manager_engines import l3_engine, prompt, run_checked
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics

from kvtier.vllm.manager_metrics import _COUNTERS, MANAGER_PREFIX

_GAUGES = {MANAGER_PREFIX + "host_cached_chunks": 0, MANAGER_PREFIX + "host_free_chunks": 1,
           MANAGER_PREFIX + "host_locked_chunks": 2}
_CPU_GAUGES = {CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC,
               CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC}


class Folded:
    """Every stats payload the manager returned, in order: counters summed, gauges as last set
    (what vLLM's Prometheus logger would show)."""

    def __init__(self) -> None:
        self.counters: Counter = Counter()
        self.gauges: Dict[str, Any] = {}

    def add(self, stats: Any) -> None:
        if stats is None:
            return
        flat = OffloadingConnectorStats(data=stats.data).reduce()
        for name, v in flat.items():
            if name in _GAUGES or name in _CPU_GAUGES or not name.startswith(MANAGER_PREFIX):
                self.gauges[name] = v
            else:
                self.counters[name] += v


def _record_stats(e) -> Folded:
    folded = Folded()
    real = e.manager.get_stats

    def recording():
        s = real()
        folded.add(s)
        return s

    e.manager.get_stats = recording  # vLLM's scheduler's calls and the test's, in order
    return folded


def _check_step(e, folded: Folded) -> None:
    m = e.manager
    m.get_stats()  # the recording wrapper (_record_stats) folds what it returns
    for name in _COUNTERS:
        assert folded.counters[MANAGER_PREFIX + name] == getattr(m.counters, name), name
    occ = m.native.occupancy()
    for name, i in _GAUGES.items():
        assert folded.gauges.get(name) == occ[i], (name, folded.gauges.get(name), occ)
    assert m.native.usage()["backups_queued"] == 0, "a backup left queued past the step"
    m.check()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(work=st.lists(st.tuples(st.sampled_from(["add", "reset", "idle"]), st.integers(1, 5), st.integers(1, 5)),
                     min_size=1, max_size=7))
def test_every_step_reports_the_trees_occupancy_and_leaves_no_backup_queued(tmp_path, work):
    """Random prompts (some shared, some again after a GPU cache reset: loads from host and
    prefetches from L3), idle steps between them, through 8 host slots over kvtier's L3."""
    e = l3_engine(tmp_path, uuid.uuid4().hex, chunks=8)
    try:
        folded = _record_stats(e)
        for n, (op, conv, chunks) in enumerate(work):
            if op == "reset":
                e.reset_gpu_cache()
            elif op == "idle":
                for _ in range(conv):
                    e.manager.on_schedule_end(None)
                    _check_step(e, folded)
                continue
            e.add(f"r{n}", prompt(conv, chunks, shared=1))
            while e.sched.has_requests() or e.manager.has_pending_work():
                e.step()
                _check_step(e, folded)
        run_checked(e)
        _check_step(e, folded)
    finally:
        e.close()


def test_an_idle_step_plans_no_backup_and_a_store_is_backed_up_in_its_step(tmp_path, monkeypatch):
    """The step's backup planning is skipped while the manager is unchanged since the last
    plan (which took the whole queue), and runs again after any change."""
    e = l3_engine(tmp_path, uuid.uuid4().hex)
    try:
        e.add("a", prompt(1, 4))
        run_checked(e)
        planned: List[int] = []
        native = e.manager.native

        class Counted:
            def __getattr__(self, name):
                if name == "plan_backups":
                    planned.append(native.generation)
                return getattr(native, name)

        monkeypatch.setattr(e.manager, "native", Counted())
        e.manager.on_schedule_end(None)
        before = len(planned)
        for _ in range(4):
            e.manager.on_schedule_end(None)
        assert len(planned) == before, "an unchanged manager was asked to plan backups again"
        e.add("b", prompt(2, 4))
        run_checked(e)
        assert len(planned) > before
        assert e.manager.l3.counters.chunks_stored == 8
        assert native.usage()["backups_queued"] == 0
    finally:
        e.close()
