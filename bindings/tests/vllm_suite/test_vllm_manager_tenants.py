"""Tenant quotas on ``KvtierOffloadingSpec`` (``kvtier_tenant_quotas`` in the extra config, a
request's tenant as ``kvtier_tenant`` in its ``kv_transfer_params``): through the real vLLM
scheduler, a tenant within its quota keeps its host chunks while another tenant's burst
fills the host tier; without quotas the same burst evicts them (the control)."""

from __future__ import annotations

import pytest
from harness import BLOCK, Engine
from manager_engines import kvtier_config, prompt, run_checked

from kvtier.vllm import KvtierSpecConfigError


def _burst(root, quotas):
    extra = {} if quotas is None else {"kvtier_tenant_quotas": quotas}
    e = Engine(str(root), [], kv_config=kvtier_config(16, **extra))
    try:
        a = [prompt(i, 4) for i in (1, 2)]  # tenant a: 8 chunks
        for i, p in enumerate(a):
            e.add(f"a{i}", p, kv_params={"kvtier_tenant": "a"})
            run_checked(e)
        for i in range(4):  # tenant b: 16 chunks, more than the whole host tier
            e.add(f"b{i}", prompt(10 + i, 4), kv_params={"kvtier_tenant": "b"})
            run_checked(e)
        e.reset_gpu_cache()
        for i, p in enumerate(a):
            e.add(f"again{i}", p, kv_params={"kvtier_tenant": "a"})
            run_checked(e)
        assert all(f.gpu_ok for f in e.finished.values())
        charge = e.manager.native.tenant_charge("b")
        return [e.finished[f"again{i}"].external_tokens for i in range(2)], charge
    finally:
        e.close()


def test_a_tenant_within_its_quota_keeps_its_host_chunks_under_another_tenants_burst(tmp_path):
    hits, b_charge = _burst(tmp_path, {"a": 8, "b": 0.5})
    assert hits == [4 * 2 * BLOCK] * 2, hits
    assert b_charge is not None and b_charge <= 8
    control, _ = _burst(tmp_path, None)
    assert control == [0, 0], control


def test_bad_quotas_stop_the_engine_at_startup(tmp_path):
    for bad in ({"a": -1}, {"a": "lots"}, [8]):
        with pytest.raises(KvtierSpecConfigError):
            Engine(str(tmp_path), [], kv_config=kvtier_config(16, kvtier_tenant_quotas=bad))


def test_a_bad_room_wait_stops_the_engine_at_startup(tmp_path):
    for bad in (-1, "soon", True, float("nan"), float("inf")):  # inf: accepted before
        with pytest.raises(KvtierSpecConfigError, match="kvtier_room_wait_ms"):
            Engine(str(tmp_path), [], kv_config=kvtier_config(16, kvtier_room_wait_ms=bad))
