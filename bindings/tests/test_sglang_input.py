"""kvtier.sglang's storage backend refusing bad input, against the real SGLang package: host
indices that are not whole pages of the registered pool, batches past ``max_batch_pages``,
salts and keys of the wrong type, a store that cannot hold one page, and SGLang's extra
config (``--hicache-storage-backend-extra-config``): misspelt keys refused, SGLang's own and
a later SGLang's left alone, every value checked and named. A refusal leaves the pool and the
store as they were."""

import difflib
import logging
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtier
from sglang_pools import PS, backend, fill, mha_pool, page_indices, salt, snapshot, storage_config

from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402  (after sglang_pools: warnings)

from kvtier import sglang as ks
from kvtier.sglang import KvtierHiCacheStorage


BAD = [
    ("float dtype", ks.HostIndicesError, lambda: page_indices([0, 1], PS).to(torch.float32)),
    ("bool dtype", ks.HostIndicesError, lambda: page_indices([0, 1], PS) > 3),
    ("numpy, not a tensor", ks.HostIndicesError, lambda: page_indices([0, 1], PS).numpy()),
    ("too few", ks.HostIndicesError, lambda: page_indices([0, 1], PS)[:-1]),
    ("2-D", ks.HostIndicesError, lambda: page_indices([0, 1], PS).reshape(2, PS)),
    ("past the pool", ks.HostIndicesError, lambda: page_indices([0, 16], PS)),
    ("negative", ks.HostIndicesError, lambda: page_indices([0, 1], PS) - PS),
    ("misaligned", ks.HostIndicesError, lambda: page_indices([0, 1], PS) + 1),
    ("not consecutive", ks.HostIndicesError, lambda: page_indices([0, 1], PS).flip(0)),
    ("huge", ks.HostIndicesError, lambda: page_indices([0, 1], PS) + (1 << 40)),
]


@pytest.mark.parametrize("what,err,make", BAD, ids=[b[0] for b in BAD])
def test_bad_indices_leave_pool_and_store_untouched(what, err, make):
    pool = mha_pool("page_first")
    fill(pool, 7)
    b = backend(pool)
    keys = ["x0", "x1"]
    assert b.batch_set_v1(keys, page_indices([0, 1], PS)) == [True, True]
    objects = b.store.stats()["objects"]
    before = snapshot(pool)
    idx = make()
    with pytest.raises(err):
        b.page_ids(keys, idx)
    assert b.batch_get_v1(keys, idx) == [False, False]
    assert torch.equal(snapshot(pool), before), "a refused read wrote into the pool"
    assert b.batch_set_v1(["y0", "y1"], idx) == [False, False]
    assert b.store.stats()["objects"] == objects and b.batch_exists(["y0"]) == 0
    assert b.counters.rejected_batches == 2


def test_other_bad_input_is_refused():
    pool = mha_pool("page_first", host_pages=136)
    fill(pool, 8)
    b = backend(pool, max_batch_pages=128)  # the least: SGLang's reads and writes are 128 pages
    before = snapshot(pool)
    over = [f"o{i}" for i in range(129)]
    with pytest.raises(ks.BatchTooLargeError):
        b.page_ids(over, page_indices(range(129), PS))
    assert b.batch_get_v1(over, page_indices(range(129), PS)) == [False] * 129
    assert b.batch_exists(over) == 0
    with pytest.raises(ks.HostIndicesError):  # one host page twice in a read
        b.page_ids(["a", "b"], page_indices([3, 3], PS), for_read=True)
    assert b.batch_get_v1(["a", "b"], page_indices([3, 3], PS)) == [False, False]
    assert b.batch_get_v1([1, 2], page_indices([0, 1], PS)) == [False, False]  # keys not str
    # keys in a numpy array (not a list): one answer per key, as for any refused batch (it
    # answered [] until 2026-12-06: a caller zipping keys with answers lost every page)
    import numpy as np

    assert b.batch_get_v1(np.array(["a", "b"]), page_indices([0, 1], PS)) == [False, False]
    assert b.batch_set_v1(np.array(["a", "b"]), page_indices([0, 1], PS)) == [False, False]
    assert b.batch_get(np.array(["a", "b"]), [None, None]) == [None, None]
    assert b.batch_get_v1(["a"], page_indices([0], PS), salt(42)) == [False]  # salt not str
    # batch_exists_v2 raised SGLangBackendError into SGLang's controller thread for a salt
    # that is not a str (an adversarial tester's case), where every other call answers 0
    b.batch_set_v1(["a"], page_indices([0], PS))
    for bad in (42, b"x"):
        r = b.batch_exists_v2(["a"], [], salt(bad))
        assert (r.kv_hit_pages, r.extra_pool_hit_pages, r.restorable_prefix_pages) == (0, {}, [])
        r = b.batch_exists_v2(["a"], None, salt(bad))
        assert r.kv_hit_pages == 0
    assert b.batch_exists_v2(["a"], []).kv_hit_pages == 1  # the same call with no salt finds it
    assert torch.equal(snapshot(pool), before)
    # Value calls: a wrong-size page is refused, nothing stored.
    assert b.batch_set(["v"], [torch.zeros(3, dtype=torch.bfloat16)]) is False and not b.exists("v")
    with pytest.raises(ks.PoolNotRegisteredError):
        backend().page_ids(["a"], page_indices([0], PS))
    assert backend().batch_get_v1(["a"], page_indices([0], PS)) == [False]
    with pytest.raises(ks.UnsupportedPoolError):
        backend(types.SimpleNamespace(layout="page_unified", kv_buffer=None))
    assert issubclass(ks.HostIndicesError, kvtier.KvtierError) and issubclass(ks.HostIndicesError, ValueError)


def test_an_unreadable_ssd_cap_is_refused_not_unlimited(tmp_path):
    """``ssd_capacity_bytes`` that does not parse ("2mib", "-2MB") meant no cap at all."""
    for bad in ("2mib", "-2MB", "2 GiB", "lots"):
        with pytest.raises(ks.SGLangBackendError, match="ssd_capacity_bytes"):
            backend(ssd_dir=str(tmp_path / bad.replace(" ", "_")), ssd_capacity_bytes=bad)
    backend(ssd_dir=str(tmp_path / "ok"), ssd_capacity_bytes="2MB")


def test_a_store_that_cannot_hold_one_page_is_refused_at_registration():
    """A page (here two 256-byte chunks) the store cannot hold: every backup failed, for
    ever, and the backend served nothing. SGLang registers the host pool right after it
    builds the backend, before serving; the refusal leaves the backend without a pool."""
    small = kvtier.L3Server(1 << 24, max_object_bytes=128)
    try:
        for extra in ({"segment_bytes": 64}, {"segment_bytes": 300}, {"server": small.addr}):
            pool = mha_pool("page_first")
            b = backend(**extra)
            with pytest.raises(ks.SGLangBackendError, match="one page"):
                b.register_mem_pool_host(pool)
            assert b.mem_pool_host is None and b.registered_pools == {}
            with pytest.raises(ks.PoolNotRegisteredError):
                b.page_ids(["a"], page_indices([0], PS))
            with pytest.raises(ks.SGLangBackendError, match="one page"):
                b.register_mem_host_pool_v2(pool, PoolName.KV)
        # exactly one page fits: its chunks as the store charges them (value, key, metadata)
        page = "0" * 64  # SGLang's page hashes are SHA-256 hex digests
        one_page = sum(kvtier.l3_charge(256, len(k)) for k in backend(mha_pool("page_first")).object_keys([page]))
        with pytest.raises(ks.SGLangBackendError, match="one page"):
            backend(mha_pool("page_first"), segment_bytes=one_page - 1)
        b = backend(mha_pool("page_first"), segment_bytes=one_page)
        assert b.batch_set_v1([page], page_indices([0], PS)) == [True]
    finally:
        small.shutdown()


# The extra config's keys that are SGLang's (0.5.23: its dynamic factory, its controller's
# interface switch, its host allocator, the file backend's path it adds; and those its
# parser pops before a backend sees them, in case a path does not).
SGLANG_KEYS = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierHiCacheStorage",
               "interface_v1": 1, "allocator": "default", "file_storage_path": "/tmp/x", "tp_lcm_size": 2,
               "prefetch_threshold": 256, "prefetch_timeout_base": 1, "prefetch_timeout_per_ki_token": 0.25,
               "hicache_storage_pass_prefix_keys": False}
BACKEND_KEYS = ("server", "token", "rpc_timeout_ms", "segment_bytes", "ssd_dir", "ssd_capacity_bytes", "name",
                "tenant", "max_batch_pages", "prefetch_ssd")


@pytest.mark.parametrize("key", ["segmnt_bytes", "prefetch_sdd", "max_batch_page", "Server", "ssd_capacity"])
def test_a_misspelt_key_is_refused_naming_the_known_ones(key):
    with pytest.raises(ks.SGLangBackendError, match=f"unknown extra config key.*{key}") as e:
        backend(**{key: "1MB"})
    for k in BACKEND_KEYS:
        assert k in str(e.value)


def test_sglangs_own_keys_are_left_alone():
    b = backend(**SGLANG_KEYS, segment_bytes="1MB")
    assert b.interface is ks.Interface.ZERO_COPY


@pytest.mark.parametrize("bad", ["false", "true", 0, 1, "no", None, [True]])
def test_prefetch_ssd_is_true_or_false(tmp_path, bad):
    # "false" was truthy: SSD promotion on for every batch_exists
    with pytest.raises(ks.SGLangBackendError, match="prefetch_ssd"):
        backend(ssd_dir=str(tmp_path), prefetch_ssd=bad)


def test_prefetch_ssd_defaults_to_on_with_an_ssd_tier(tmp_path):
    assert backend(ssd_dir=str(tmp_path / "a")).prefetch_ssd is True
    assert backend(ssd_dir=str(tmp_path / "b"), prefetch_ssd=False).prefetch_ssd is False
    assert backend().prefetch_ssd is False and backend(prefetch_ssd=True).prefetch_ssd is True


@pytest.mark.parametrize("bad,key", [
    ({"segment_bytes": 2 ** 70}, "segment_bytes"),  # OverflowError from L3Store.embedded
    ({"segment_bytes": "1000000000000TB"}, "segment_bytes"),
    ({"ssd_capacity_bytes": 2 ** 70}, "ssd_capacity_bytes"),
    ({"server": "127.0.0.1:1", "rpc_timeout_ms": 2 ** 70}, "rpc_timeout_ms"),  # OverflowError
    ({"server": "127.0.0.1:1", "rpc_timeout_ms": -1}, "rpc_timeout_ms"),  # OverflowError
    ({"server": "127.0.0.1:1", "rpc_timeout_ms": "soon"}, "rpc_timeout_ms"),  # ValueError from int()
    ({"max_batch_pages": "abc"}, "max_batch_pages"),  # ValueError from int()
    ({"max_batch_pages": True}, "max_batch_pages"),  # taken as 1
    ({"max_batch_pages": 2.5}, "max_batch_pages"),  # taken as 2
    # under SGLang's 128-page reads and writes: each refused, no L3 past the first 127 pages
    ({"max_batch_pages": 127}, "max_batch_pages"),
    ({"tenant": 5}, "tenant"),  # taken as "5"
    ({"tenant": ""}, "tenant"),  # taken as "default"
    ({"server": "127.0.0.1:1", "token": 5}, "token"),  # TypeError from the extension
    ({"server": 5}, "server"),
    ({"name": 5}, "name"),
    ({"ssd_dir": 5}, "ssd_dir"),
])
def test_bad_values_are_typed_errors_naming_the_key(tmp_path, bad, key):
    if "ssd_capacity_bytes" in bad:
        bad = dict(bad, ssd_dir=str(tmp_path))
    with pytest.raises(ks.SGLangBackendError, match=key):
        backend(**bad)


_NAME = "abcXYZ019-_.:@+"  # kvtier's tenant names' characters
_valid_extra = st.fixed_dictionaries({}, optional={
    "segment_bytes": st.sampled_from(["1MB", 1 << 20, "2m", "1.5MB"]),
    "name": st.text(_NAME, max_size=8),
    "tenant": st.text(_NAME, min_size=1, max_size=8),
    "max_batch_pages": st.integers(128, 1 << 40),
    "prefetch_ssd": st.booleans(),
    "interface_v1": st.sampled_from([0, 1, True, False]),
})


@settings(max_examples=40, deadline=None)
@given(valid=_valid_extra, sglang=st.sets(st.sampled_from(sorted(SGLANG_KEYS))))
def test_property_any_valid_extra_config_is_accepted(valid, sglang):
    extra = {**{k: SGLANG_KEYS[k] for k in sglang}, **valid}
    b = KvtierHiCacheStorage(storage_config(extra), {})
    assert b.prefetch_ssd is valid.get("prefetch_ssd", False)
    assert b.max_batch_pages == valid.get("max_batch_pages", 1024)


def test_a_key_unlike_any_of_ours_is_ignored_with_a_warning(caplog):
    # the extra config is SGLang's too: a later SGLang's own key must not stop the engine
    with caplog.at_level(logging.WARNING, logger="kvtier.sglang.storage"):
        b = backend(hicache_new_knob=3, segment_bytes="1MB")
    assert b.max_batch_pages == 1024
    assert "hicache_new_knob" in caplog.text


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(valid=_valid_extra, key=st.one_of(
    st.text(min_size=1, max_size=16),
    # misspellings: a backend key with one character dropped, doubled or swapped for another
    st.tuples(st.sampled_from(BACKEND_KEYS), st.integers(0, 30), st.sampled_from(["drop", "double", "x"])).map(
        lambda t: (lambda k, i, op: k[:i % len(k)] + {"drop": "", "double": k[i % len(k)] * 2, "x": "x"}[op]
                   + k[i % len(k) + 1:])(*t))))
def test_property_an_unknown_key_is_refused_exactly_when_it_misspells_one_of_ours(valid, key, caplog):
    if key in BACKEND_KEYS or key in SGLANG_KEYS:
        return
    close = any(difflib.SequenceMatcher(None, k, key.lower()).ratio() >= 0.75 for k in BACKEND_KEYS)
    caplog.clear()
    if close:
        with pytest.raises(ks.SGLangBackendError, match="unknown extra config key"):
            KvtierHiCacheStorage(storage_config({**valid, key: 1}), {})
    else:
        with caplog.at_level(logging.WARNING, logger="kvtier.sglang.storage"):
            KvtierHiCacheStorage(storage_config({**valid, key: 1}), {})
        assert repr(key) in caplog.text
