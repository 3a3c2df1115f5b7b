"""``KvtierOffloadingSpec``'s own keys in vLLM's ``kv_connector_extra_config`` (the
``kvtier_`` ones; every other key is vLLM's and left alone): a key kvtier does not have, a
malformed ``kvtier_l3`` or a quota a tenant can store nothing under is a
``KvtierSpecConfigError`` when vLLM builds the spec (the engine does not start), never a key
silently ignored, an L3 nobody asked for, or a late untyped crash. Built from a real vLLM
0.34 config (harness.py) through vLLM's own ``build_offloading_config``."""

from __future__ import annotations

import contextlib

import pytest
from harness import Engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manager_engines import kvtier_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config

from kvtier.vllm import KvtierOffloadingManager, KvtierOffloadingSpec, KvtierSpecConfigError
from kvtier.vllm.tier import TIER_KEYS

CHUNKS = 16
SPEC_KEYS = ("kvtier_eviction", "kvtier_l3", "kvtier_tenant_quotas", "kvtier_room_wait_ms")
# vLLM's own keys the offloading config and CPUOffloadingSpec read (the property tests'
# foreign keys stay off them)
VLLM_KEYS = ("cpu_bytes_to_use", "block_size", "blocks_per_chunk", "spec_name", "spec_module_path",
             "eviction_policy", "cache_policy_module_path", "store_threshold", "max_tracker_size",
             "offload_prompt_only", "self_describing_kv_events", "secondary_tiers", "tier_poll_interval_s")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    e = Engine(str(tmp_path_factory.mktemp("spec")), [], kv_config=kvtier_config(CHUNKS))
    yield e
    e.close()


@contextlib.contextmanager
def extra_config(e: Engine, **over):
    """``e``'s extra config with its kvtier keys replaced by ``over`` (vLLM's kept)."""
    ktc = e.vllm_config.kv_transfer_config
    saved = ktc.kv_connector_extra_config
    ktc.kv_connector_extra_config = {**{k: v for k, v in saved.items() if not k.startswith("kvtier_")}, **over}
    try:
        yield
    finally:
        ktc.kv_connector_extra_config = saved


def spec(e: Engine, **over) -> KvtierOffloadingSpec:
    with extra_config(e, **over):
        return KvtierOffloadingSpec(build_offloading_config(e.vllm_config, e.kv_cache_config))


def test_the_spec_keys_are_the_ones_it_reads(engine):
    from kvtier.vllm import spec_config

    assert tuple(spec_config.SPEC_KEYS) == SPEC_KEYS
    s = spec(engine, kvtier_eviction="freq-depth", kvtier_tenant_quotas={"a": 4}, kvtier_room_wait_ms=5)
    assert (s.kvtier_eviction, s.tenant_quotas, s.room_wait_s, s.kvtier_l3) == ("freq-depth", {"a": 4}, 0.005, None)


@pytest.mark.parametrize("key", ["kvtier_l3_adress", "kvtier_evictoin", "kvtier_tenant_quota", "kvtier_tenant",
                                 "kvtier_", "KVTIER_L3", "Kvtier_eviction"])
def test_a_misspelt_kvtier_key_is_refused_naming_the_valid_ones(engine, key):
    with pytest.raises(KvtierSpecConfigError, match=f"unknown kvtier key.*{key}") as e:
        spec(engine, **{key: "x"})
    for k in SPEC_KEYS:
        assert k in str(e.value)


@pytest.mark.parametrize("bad", ["", "127.0.0.1:50051", False, True, 0, 1, ["server"], "embedded"])
def test_kvtier_l3_is_an_object_of_tier_keys_or_absent(engine, bad):
    # "" gave a 4 GB embedded store nobody asked for; False a bare TypeError; a str an
    # untyped ValueError from dict()
    with pytest.raises(KvtierSpecConfigError, match="kvtier_l3"):
        spec(engine, kvtier_l3=bad)


def test_kvtier_l3_null_is_no_l3_and_an_object_is_checked_at_once(engine):
    assert spec(engine, kvtier_l3=None).kvtier_l3 is None
    assert spec(engine).kvtier_l3 is None
    assert spec(engine, kvtier_l3={}).kvtier_l3 == {}
    assert spec(engine, kvtier_l3={"segment_bytes": "64MB", "name": "x"}).kvtier_l3 == {"segment_bytes": "64MB",
                                                                                       "name": "x"}
    # a tier key kvtier does not have, or one the spec sets itself (shard: a TypeError from
    # the keyword call before), is refused when the spec is built, not when vLLM asks for
    # the manager
    for bad in ({"segmnt_bytes": "64MB"}, {"shard": [0, 0, 8]}, {"loss_journal": True}, {1: 2}):
        with pytest.raises(KvtierSpecConfigError, match="kvtier_l3.*unknown"):
            spec(engine, kvtier_l3=bad)


@pytest.mark.parametrize("bad", ["mru", 5, "", "freq-depth:x"])
def test_a_bad_eviction_policy_is_refused_at_the_spec(engine, bad):
    # before: str(5) == "5", refused by OffloadManager only when vLLM asked for the manager
    with pytest.raises(KvtierSpecConfigError, match="kvtier_eviction"):
        spec(engine, kvtier_eviction=bad)


@pytest.mark.parametrize("bad", [{"a": 0}, {"a": 2 ** 70}, {"a": 2 ** 32}, {"a": 0.0}])
def test_a_quota_no_chunk_fits_or_past_any_host_tier_is_refused(engine, bad):
    # 0 chunks: the tenant can never store anything; 2**70: an OverflowError from the
    # extension when vLLM asked for the manager
    with pytest.raises(KvtierSpecConfigError, match="kvtier_tenant_quotas"):
        spec(engine, kvtier_tenant_quotas=bad)


def test_host_chunks_past_kvtiers_host_tier_are_refused_at_the_spec(engine):
    # cpu_bytes_to_use 2**70: OverflowError from OffloadManager when vLLM asked for the manager
    with extra_config(engine):
        ex = engine.vllm_config.kv_transfer_config.kv_connector_extra_config
        ex["cpu_bytes_to_use"] = 2 ** 70
        with pytest.raises(KvtierSpecConfigError, match="cpu_bytes_to_use"):
            KvtierOffloadingSpec(build_offloading_config(engine.vllm_config, engine.kv_cache_config))


def test_a_host_tier_of_no_chunk_with_l3_is_refused_at_the_spec(engine):
    """An adversarial tester's misleading error: with ``kvtier_l3`` and ``cpu_bytes_to_use``
    under one chunk the engine failed later, blaming a /dev/shm region "removed or on another
    node"; vLLM's tiering spec with kvtier's CPU copy path failed with "cannot mmap an empty
    file". Both name ``cpu_bytes_to_use`` at the spec now."""
    from kvtier.vllm.specs import KvtierTieringOffloadingSpec

    with extra_config(engine, kvtier_l3={}):
        ex = engine.vllm_config.kv_transfer_config.kv_connector_extra_config
        ex["cpu_bytes_to_use"] = 1000
        with pytest.raises(KvtierSpecConfigError, match="cpu_bytes_to_use 1000 holds no host chunk"):
            KvtierOffloadingSpec(build_offloading_config(engine.vllm_config, engine.kv_cache_config))
    tiering = object.__new__(KvtierTieringOffloadingSpec)
    tiering.num_chunks, tiering.extra_config = 0, {"cpu_bytes_to_use": 1000}
    with pytest.raises(KvtierSpecConfigError, match="holds no host chunk"):
        tiering._cpu_region()


_valid_quota = st.one_of(st.integers(1, 2 ** 32 - 1), st.floats(min_value=1e-3, max_value=1.0))
_valid = st.fixed_dictionaries({}, optional={
    "kvtier_eviction": st.sampled_from(["lru", "freq-depth", "adaptive"]),
    "kvtier_tenant_quotas": st.dictionaries(st.text(min_size=1, max_size=8), _valid_quota, max_size=3),
    "kvtier_room_wait_ms": st.one_of(st.integers(0, 10 ** 6), st.floats(0, 1e6)),
    "kvtier_l3": st.one_of(st.none(), st.dictionaries(st.sampled_from(TIER_KEYS), st.just("1MB"), max_size=2)),
})
# keys that are vLLM's (or anybody's but kvtier's): never refused by kvtier
_foreign = st.dictionaries(
    st.text(min_size=1, max_size=12).filter(lambda k: not k.lower().startswith("kvtier_") and k not in VLLM_KEYS),
    st.integers(), max_size=3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(valid=_valid, foreign=_foreign)
def test_property_every_valid_kvtier_config_is_accepted_and_foreign_keys_left_alone(engine, valid, foreign):
    s = spec(engine, **valid, **foreign)
    assert s.kvtier_eviction == valid.get("kvtier_eviction", "lru")
    assert s.kvtier_l3 == valid.get("kvtier_l3")
    if s.kvtier_l3 is None:  # the manager too (with an L3 it maps the workers' region)
        m = s.get_manager()
        assert isinstance(m, KvtierOffloadingManager) and m.native.usage()["capacity"] == CHUNKS


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(valid=_valid, suffix=st.text(max_size=12), upper=st.booleans())
def test_property_any_other_kvtier_key_is_refused(engine, valid, suffix, upper):
    key = ("KVTIER_" if upper else "kvtier_") + suffix
    if key in SPEC_KEYS:
        return
    with pytest.raises(KvtierSpecConfigError, match="unknown kvtier key"):
        spec(engine, **valid, **{key: 1})
