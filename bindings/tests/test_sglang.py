"""kvtier.sglang against the real SGLang package (0.5.23 from PyPI): its ``HiCacheStorage``
base class, its dynamic backend factory, its real host pools (``MHATokenToKVPoolHost``,
``MLATokenToKVPoolHost``) on CPU, and its own Mooncake backend pointed at
``kvtier.mooncake_compat`` for a side-by-side check. Bytes are compared page by page through
``get_data_page``, so a page read into the wrong slot, a torn layer or a write outside the
named pages fails."""

import sys
import time
import types
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from conftest import prompt, small_config
from sglang_pools import (LAYOUTS, PS, backend, fill, make_pool, mha_pool, mla_pool, page_bytes, page_indices, salt,
                          snapshot, storage_config)

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402  (after sglang_pools: warnings)
    HiCacheStorage,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvtier import sglang as ks
from kvtier.sglang import KvtierHiCacheStorage


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_through_a_real_host_pool(layout, mla):
    src, dst = make_pool(layout, mla), make_pool(layout, mla)
    fill(src, 1)
    b = backend(src, mla=mla, name=f"rt-{layout}-{mla}")
    keys = [f"page-{i}" for i in range(3)]
    assert b.batch_set_v1(keys, page_indices([2, 5, 7], PS)) == [True] * 3
    assert b.batch_exists(keys) == 3
    reader = backend(dst, mla=mla, name=b.store_name)  # another instance on the same store
    assert reader.batch_get_v1(keys, page_indices([9, 0, 4], PS)) == [True] * 3
    for got, want in [(9, 2), (0, 5), (4, 7)]:
        assert page_bytes(dst, got) == page_bytes(src, want)
    written = {p for p in range(16) if dst.get_data_page(p * PS).view(torch.int16).ne(0).any()}
    assert written == {9, 0, 4}, "only the named pages were written"
    # SGLang's value path (flat pages) reads the very same objects.
    t = dst.get_dummy_flat_data_page()
    assert b.batch_get(["page-1"], [t])[0] is t and t.view(torch.int16).numpy().tobytes() == page_bytes(src, 5)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_partial_hits_misses_and_the_leading_run(layout):
    src, dst = mha_pool(layout), mha_pool(layout)
    fill(src, 2)
    b = backend(src)
    keys = [f"k{i}" for i in range(5)]
    assert b.batch_set_v1([keys[0], keys[1], keys[3]], page_indices([0, 1, 3], PS)) == [True] * 3
    assert b.batch_exists(keys) == 2  # k2 is missing: k3 does not count
    assert b.batch_exists(keys[3:]) == 1 and b.batch_exists(["nope"]) == 0 and b.batch_exists([]) == 0
    assert b.exists("k3") and not b.exists("k2")
    b.register_mem_pool_host(dst)
    assert b.batch_get_v1(keys, page_indices([5, 6, 7, 8, 9], PS)) == [True, True, False, True, False]
    assert page_bytes(dst, 8) == page_bytes(src, 3)
    assert not dst.get_data_page(7 * PS).view(torch.int16).ne(0).any(), "a miss writes nothing"
    # A page with one part gone (evicted) ends the run and reads as a miss.
    b.store.remove(b.object_keys(["k1"])[-1], True)
    assert b.batch_exists(keys) == 1
    assert b.batch_get_v1(keys[:2], page_indices([10, 11], PS)) == [True, False]


def test_tenants_are_isolated():
    src, dst = mha_pool("page_first"), mha_pool("page_first")
    fill(src, 3)
    b = backend(src)
    keys = ["t0", "t1"]
    assert b.batch_set_v1(keys, page_indices([0, 1], PS), salt("alice")) == [True, True]
    assert b.batch_exists(keys, salt("alice")) == 2
    assert b.batch_exists(keys, salt("bob")) == 0 and b.batch_exists(keys) == 0
    b.register_mem_pool_host(dst)
    assert b.batch_get_v1(keys, page_indices([2, 3], PS), salt("bob")) == [False, False]
    assert not dst.kv_buffer.view(torch.int16).ne(0).any()
    assert b.batch_get_v1(keys, page_indices([2, 3], PS), salt("alice")) == [True, True]
    assert page_bytes(dst, 3) == page_bytes(src, 1)
    # Different tenants: different kvtier tenants and different key namespaces.
    assert ks.salt_tenant("default", "alice") != ks.salt_tenant("default", "bob")
    assert b.namespace(ks.salt_tenant("default", "alice")) != b.namespace("default")


@settings(max_examples=30, deadline=None)
@given(a=st.one_of(st.none(), st.text(max_size=6)), c=st.one_of(st.none(), st.text(max_size=6)),
       keys=st.lists(st.text("0123456789abcdef", min_size=1, max_size=8), min_size=1, max_size=4, unique=True))
def test_tenant_rule_property(prop_backend, a, c, keys):
    """Pages written under one cache salt are visible under exactly that salt."""
    b = prop_backend
    b.clear()
    n = len(keys)
    assert b.batch_set_v1(keys, page_indices(range(n), PS), salt(a)) == [True] * n
    assert b.batch_exists(keys, salt(c)) == (n if a == c else 0)
    ta, tc = ks.salt_tenant("default", a), ks.salt_tenant("default", c)
    assert (ta == tc) == (a == c)
    assert (set(b.object_keys(keys, ta)) == set(b.object_keys(keys, tc))) == (a == c)


@pytest.fixture(scope="module")
def prop_backend():
    p = mha_pool("page_first")
    fill(p, 4)
    return backend(p)


def test_namespace_is_kvtiers():
    """l3_namespace is the formula of docs/page-keys.md, as the native scheduler computes it
    (with the scheduler's page size; two page sizes never share a namespace)."""
    ns = {"model": "m/x", "dtype": "bf16", "layout": "page_first", "tenant": "t", "adapter": ""}
    s = kvtier.Scheduler(small_config(namespace=ns))
    key = s.l3_keys(prompt(1, 8))[0]
    assert kvtier.parse_l3_key(key)[0] == ks.l3_namespace("m/x", "bf16", "page_first", "t", page_size=4)
    s8 = kvtier.Scheduler(small_config(namespace=ns, page_size=8))
    assert kvtier.parse_l3_key(s8.l3_keys(prompt(1, 8))[0])[0] == ks.l3_namespace(
        "m/x", "bf16", "page_first", "t", page_size=8)
    assert len({ks.l3_namespace("m/x", "bf16", "page_first", "t", page_size=p) for p in (None, 4, 8)}) == 3
    src = mha_pool("page_first")
    b = backend(src)
    k = b.object_keys(["a" * 64])[0]
    assert kvtier.parse_l3_key(k.split("/")[0])[1] == bytes.fromhex("a" * 64)


def test_two_instances_share_one_server(monkeypatch):
    """Two backends (two SGLang instances) on one kvtier-l3 server on 127.0.0.1: pages one
    backs up are hits, byte for byte, for the other. A wrong token is refused."""
    srv = kvtier.L3Server(1 << 24, token="s3cret")
    try:
        a_pool, b_pool = mha_pool("layer_first"), mha_pool("layer_first")
        fill(a_pool, 5)
        a = backend(a_pool, server=srv.addr, token="s3cret")
        monkeypatch.setenv(ks.ENV_ADDR, srv.addr)
        monkeypatch.setenv(ks.ENV_TOKEN, "s3cret")
        b = backend(b_pool)  # address and token from the environment
        assert not b.store.is_embedded
        keys = [f"shared{i}" for i in range(4)]
        assert a.batch_set_v1(keys, page_indices([3, 1, 4, 2], PS)) == [True] * 4
        assert b.batch_exists(keys) == 4
        assert b.batch_get_v1(keys, page_indices([0, 1, 2, 3], PS)) == [True] * 4
        assert [page_bytes(b_pool, i) for i in range(4)] == [page_bytes(a_pool, p) for p in (3, 1, 4, 2)]
        monkeypatch.setenv(ks.ENV_TOKEN, "wrong")
        with pytest.raises(kvtier.IllegalClientError):  # at construction, not at the first page
            backend(mha_pool("layer_first"))
    finally:
        srv.shutdown()


def test_mla_only_the_writer_rank_writes_and_every_rank_reads():
    src, other = mla_pool("page_first"), mla_pool("page_first")
    fill(src, 6)
    r1 = backend(src, mla=True, tp_rank=1, tp_size=2, name="mla-tp")
    keys = ["m0", "m1"]
    assert r1.batch_set_v1(keys, page_indices([0, 1], PS)) == [True, True]
    assert r1.store.stats()["objects"] == 0 and r1.counters.skipped_non_writer == 2
    r0 = backend(src, mla=True, tp_rank=0, tp_size=2, name="mla-tp")
    assert r0.batch_set_v1(keys, page_indices([0, 1], PS)) == [True, True]
    r1.register_mem_pool_host(other)
    assert r1.batch_exists(keys) == 2 and r1.batch_get_v1(keys, page_indices([5, 6], PS)) == [True, True]
    assert page_bytes(other, 6) == page_bytes(src, 1)
    # MHA ranks hold different heads: rank 1 never sees rank 0's pages.
    m0 = backend(mha_pool("page_first"), tp_rank=0, tp_size=2, name="mha-tp")
    m1 = backend(mha_pool("page_first"), tp_rank=1, tp_size=2, name="mha-tp")
    assert m0.batch_set_v1(keys, page_indices([0, 1], PS)) == [True, True]
    assert m1.batch_exists(keys) == 0 and m0.batch_exists(keys) == 2


def test_value_calls_store_the_objects_v1_reads():
    src, dst = mha_pool("layer_first"), mha_pool("layer_first")
    fill(src, 9)
    b = backend(src)
    vals = [src.get_data_page(p * PS, flat=True).contiguous() for p in (4, 6)]
    assert b.batch_set(["f0", "f1"], vals) is True and b.set("f2", vals[0]) is True
    b.register_mem_pool_host(dst)
    assert b.batch_get_v1(["f0", "f1", "f2"], page_indices([0, 1, 2], PS)) == [True] * 3
    assert page_bytes(dst, 1) == page_bytes(src, 6) and page_bytes(dst, 2) == page_bytes(src, 4)
    t = dst.get_dummy_flat_data_page()
    assert b.get("missing", t) is None


def test_built_by_sglangs_dynamic_factory():
    pool = mha_pool("page_first")
    extra = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierHiCacheStorage",
             "interface_v1": 1, "segment_bytes": "16MB"}
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    assert isinstance(b, KvtierHiCacheStorage) and isinstance(b, HiCacheStorage)
    b.register_mem_pool_host(pool)
    assert b.interface is ks.Interface.ZERO_COPY
    fill(pool, 10)
    assert b.batch_set_v1(["d"], page_indices([1], PS)) == [True]
    m = b.get_stats()
    assert isinstance(m, StorageMetrics) and m.backup_pgs == [1] and m.kvtier["pages_written"] == 1
    assert b.get_stats().backup_pgs == []  # drained, as SGLang's metrics collector expects
    b.clear()
    assert b.batch_exists(["d"]) == 0


def test_v2_pool_transfers():
    kv_src, swa_src = mha_pool("page_first"), mha_pool("page_first", layers=1)
    kv_dst, swa_dst = mha_pool("page_first"), mha_pool("page_first", layers=1)
    fill(kv_src, 11)
    fill(swa_src, 12)
    b = backend(kv_src, name="v2")
    b.register_mem_host_pool_v2(kv_src, PoolName.KV)
    b.register_mem_host_pool_v2(swa_src, PoolName.SWA)
    keys = ["s0", "s1", "s2"]
    res = b.batch_set_v2([
        PoolTransfer(name=PoolName.KV, keys=keys, host_indices=page_indices([0, 1, 2], PS)),
        PoolTransfer(name=PoolName.SWA, keys=keys[2:], host_indices=page_indices([5], PS)),
    ])
    assert res == {"kv": [True] * 3, "swa": [True]}
    trailing = PoolTransfer(name=PoolName.SWA, keys=keys[2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    r = b.batch_exists_v2(keys, [trailing])
    assert r.kv_hit_pages == 3 and r.restorable_prefix_pages == [3] and r.extra_pool_hit_pages["swa"] == 3
    r = b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)])
    assert r.kv_hit_pages == 0  # SWA holds only the last page: no prefix is fully restorable
    b2 = backend(kv_dst, name=b.store_name)
    b2.register_mem_host_pool_v2(swa_dst, PoolName.SWA)
    res = b2.batch_get_v2([
        PoolTransfer(name=PoolName.KV, keys=keys, host_indices=page_indices([3, 4, 5], PS)),
        PoolTransfer(name=PoolName.SWA, keys=keys[2:], host_indices=page_indices([0], PS)),
    ])
    assert res == {"kv": [True] * 3, "swa": [True]}
    assert page_bytes(kv_dst, 5) == page_bytes(kv_src, 2) and page_bytes(swa_dst, 0) == page_bytes(swa_src, 5)


def _ssd_run(tmp_path, prefetch):
    pool = mha_pool("page_first", layers=4, heads=4, head_dim=64, page_size=16, host_pages=8)
    fill(pool, 13)
    b = KvtierHiCacheStorage(storage_config({"interface_v1": 1, "segment_bytes": 1 << 20, "ssd_dir": str(tmp_path),
                                             "prefetch_ssd": prefetch}), {})
    b.register_mem_pool_host(pool)
    keys = [f"ssd{i}" for i in range(4)]
    assert b.batch_set_v1(keys, torch.arange(4 * 16)) == [True] * 4
    b.store.flush()  # the SSD copies are durable
    filler = np.zeros(64 << 10, np.uint8)
    for i in range(24):  # push the pages out of DRAM, then make room again
        b.store.put(f"filler{i}", filler)
    b.store.flush()
    for i in range(24):
        if b.store.is_exist(f"filler{i}"):
            b.store.remove(f"filler{i}", True)
    st0 = b.store.stats()
    assert st0["disk_objects"] >= 8 and st0["mem_objects"] == 0, st0
    assert b.batch_exists(keys) == 4  # SSD-only pages exist
    # the promotion is asynchronous: wait for it (10 s at most on a loaded machine); the
    # control, which must stay at 0, is watched for 2.5 s
    deadline = time.monotonic() + (10.0 if prefetch else 2.5)
    while time.monotonic() < deadline:
        if b.store.stats()["mem_objects"] >= 8:
            break
        time.sleep(0.05)
    return b.store.stats()["mem_objects"]


def test_batch_exists_prefetches_ssd_only_pages_to_dram(tmp_path):
    assert _ssd_run(tmp_path / "on", True) == 8  # both parts of all 4 pages promoted
    assert _ssd_run(tmp_path / "off", False) == 0  # the control: without prefetch none is


# ---- side by side with SGLang's own Mooncake backend over kvtier.mooncake_compat ------------


@contextmanager
def mooncake_is_kvtier():
    """``mooncake.store`` is kvtier.mooncake_compat while SGLang's backend is built (it imports
    the class at construction), whatever Mooncake package is installed."""
    import kvtier.mooncake_compat as compat

    shim = types.ModuleType("mooncake.store")
    shim.__dict__.update({k: getattr(compat, k) for k in dir(compat) if not k.startswith("_")})
    pkg = types.ModuleType("mooncake")
    pkg.store = shim
    saved = {k: sys.modules.get(k) for k in ("mooncake", "mooncake.store")}
    sys.modules.update({"mooncake": pkg, "mooncake.store": shim})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def sglang_mooncake(pool, name, mla):
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    extra = {"master_server_address": f"embedded://{name}", "local_hostname": "127.0.0.1",
             "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "global_segment_size": 64 << 20,
             "check_server": False}
    with mooncake_is_kvtier():
        m = MooncakeStore(storage_config(extra, mla=mla, layout=pool.layout), pool)
    assert type(m.store).__module__.startswith("kvtier.mooncake_compat")
    m.register_mem_pool_host(pool)
    return m


@pytest.mark.parametrize("layout,mla", [("page_first", False), ("page_first", True), ("layer_first", True)])
def test_side_by_side_with_sglangs_mooncake_backend(layout, mla):
    """The same calls on SGLang's MooncakeStore (over kvtier.mooncake_compat) and on
    kvtier.sglang give the same answers and the same bytes in the pools."""
    pools = {}
    backends = {}
    for who in ("mooncake", "kvtier"):
        src, dst = make_pool(layout, mla), make_pool(layout, mla)
        fill(src, 14)
        pools[who] = (src, dst)
        backends[who] = sglang_mooncake(src, f"sbs-{layout}-{mla}", mla) if who == "mooncake" else backend(src, mla=mla)
    out = {}
    for who, b in backends.items():
        src, dst = pools[who]
        keys = [f"sbs{i}" for i in range(6)]
        r = [b.batch_set_v1(keys[:2] + keys[3:5], page_indices([1, 2, 3, 4], PS))]
        r.append(b.batch_set_v1(keys[:2], page_indices([1, 2], PS)))  # present pages: success
        r += [b.batch_exists(keys), b.batch_exists(keys[3:]), b.batch_exists(["none"])]
        b.register_mem_pool_host(dst)
        r.append(b.batch_get_v1(keys, page_indices([10, 11, 12, 13, 14, 15], PS)))
        r.append([page_bytes(dst, p) for p in range(16)])
        out[who] = r
    assert out["mooncake"] == out["kvtier"]
    assert out["kvtier"][:5] == [[True] * 4, [True] * 2, 2, 2, 0]
    assert out["kvtier"][5] == [True, True, False, True, True, False]


def test_the_documented_launch_flags_parse_and_build_the_backend():
    # docs/sglang.md's launch command, as a user pastes it: SGLang's own argument parser takes
    # it, and its extra config builds this backend through SGLang's dynamic factory.
    import argparse
    import json
    import pathlib
    import re
    import shlex

    from sglang.srt.server_args import ServerArgs

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "sglang.md").read_text()
    blocks = [b for b in re.findall(r"^```sh\n(.*?)^```", doc, re.S | re.M)
              if "sglang.launch_server" in b and "--hicache-storage-backend" in b]
    assert len(blocks) == 1
    words = shlex.split(blocks[0].replace("\\\n", " "), comments=True)
    args = words[words.index("sglang.launch_server") + 1 :]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(args)
    assert ns.enable_hierarchical_cache and ns.hicache_storage_backend == "dynamic"
    extra = json.loads(ns.hicache_storage_backend_extra_config)
    assert extra["interface_v1"] == 1
    extra["segment_bytes"] = "16MB"  # the documented size is for a real deployment
    pool = mha_pool("page_first")
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    assert isinstance(b, KvtierHiCacheStorage)
    b.register_mem_pool_host(pool)
    assert b.interface is ks.Interface.ZERO_COPY


def test_namespaces_tell_apart_what_the_host_pool_cannot():
    """Found by an adversarial tester: SGLang keeps every fp8 KV cache as uint8, so an
    fp8_e4m3 and an fp8_e5m2 deployment of one model had one namespace and each read the
    other's bytes as its own (e4m3 448.0 came back as e5m2 nan); two pools of one model
    with other head counts (other bytes per page) shared one too. The logical KV dtype
    (SGLang's --kv-cache-dtype) and the bytes of a page's part are in the namespace now."""
    from sglang_engine import publish_server_args

    keys = ["same-prompt-page-hash"]
    try:
        publish_server_args(["--model-path", "dummy", "--device", "cpu", "--kv-cache-dtype", "fp8_e4m3"])
        a = backend(mha_pool("page_first", dtype=torch.uint8), name="fp8")
        publish_server_args(["--model-path", "dummy", "--device", "cpu", "--kv-cache-dtype", "fp8_e5m2"])
        b = backend(mha_pool("page_first", dtype=torch.uint8), name="fp8")
        assert a.namespace() != b.namespace()
        assert a.batch_set_v1(keys, page_indices([0], PS)) == [True]
        assert b.batch_exists(keys) == 0 and b.batch_get_v1(keys, page_indices([0], PS)) == [False]
    finally:
        publish_server_args()
    two, four = mha_pool("page_first", heads=2), mha_pool("page_first", heads=4)
    c, d = backend(two, name="heads"), backend(four, name="heads")
    assert c.namespace() != d.namespace()
    assert c.batch_set_v1(keys, page_indices([0], PS)) == [True]
    assert d.batch_exists(keys) == 0


def test_clear_removes_this_backends_pages_only():
    """``clear()`` (SGLang's /clear_hicache_storage_backend) removed every object of the
    tenant on a shared server: another model's pages too (adversarial tester)."""
    srv = kvtier.L3Server(1 << 24)
    try:
        a = backend(mha_pool("page_first"), server=srv.addr, model="model-a")
        b = backend(mha_pool("page_first"), server=srv.addr, model="model-b")
        keys = [f"k{i}" for i in range(2)]
        assert a.batch_set_v1(keys, page_indices([0, 1], PS)) == [True] * 2
        assert b.batch_set_v1(keys, page_indices([0, 1], PS)) == [True] * 2
        a.clear()
        assert a.batch_exists(keys) == 0
        assert b.batch_exists(keys) == 2
    finally:
        srv.shutdown()


def test_an_error_code_is_not_a_present_page():
    """``batch_is_exist`` answers -400 for a key it refuses; ``.all()`` took it as present
    (batch_exists 2, exists True) while set and get refused the same keys."""
    b = backend(mha_pool("page_first"))
    bad = ["nul\0key", "x" * 5000]
    assert b.batch_exists(bad) == 0
    assert not b.exists(bad[0])


def test_value_reads_into_overlapping_tensors_are_refused_not_raised():
    """The value path's ``batch_get`` into one tensor twice (or overlapping views) let the
    extension's bare ValueError escape into SGLang's controller; it is a refused batch (every
    page None) like the zero-copy path's, and the tensor is left as it was."""
    src = mha_pool("page_first")
    fill(src, 1)
    b = backend(src, interface_v1=0)
    assert b.batch_set_v1(["a", "b"], page_indices([0, 1], PS)) == [True, True]
    t = src.get_dummy_flat_data_page()
    before = t.clone()
    for targets in ([t, t], [t, t.view(-1)[:]]):
        assert b.batch_get(["a", "b"], targets) == [None, None]
        assert torch.equal(t, before)
    assert b.counters.rejected_batches == 2


def test_the_storage_namespace_follows_the_checkpoint_not_only_the_name(tmp_path):
    """HiCache's storage backend named its namespace by ``model_name`` alone: a new fine-tune
    at the same ``--model-path``, or ``--json-model-override-args``, read the old pages.
    The checkpoint at the published ``--model-path`` is fingerprinted, the overrides and the
    operator's ``model_version`` go in too."""
    from sglang_engine import publish_server_args
    from test_model_identity import _ckpt, _weights

    src = mha_pool("page_first")
    live = _ckpt(tmp_path / "live", _weights(1))

    def ns(*args, **extra):
        publish_server_args(["--model-path", live, "--device", "cpu", *args])
        try:
            return backend(src, model="served-name", **extra).namespace()
        finally:
            publish_server_args()

    before = ns()
    assert ns() == before
    assert ns("--json-model-override-args", '{"rope_theta": 1000000.0}') != before
    assert ns(model_version="v2") != before
    # fp8 KV computed in bfloat16 and in float32: equal host pools (uint8, fp8_e4m3), other
    # bytes; they shared a namespace until 2026-12-06 (vLLM's case: wrong tokens)
    fp8 = ("--kv-cache-dtype", "fp8_e4m3")
    assert ns(*fp8, "--dtype", "bfloat16") != ns(*fp8, "--dtype", "float32")
    assert ns(*fp8, "--dtype", "float32") == ns(*fp8, "--dtype", "float32")
    _ckpt(tmp_path / "live", _weights(2))
    assert ns() != before
    with pytest.raises(ks.SGLangBackendError, match="model_version"):
        backend(src, model_version=3)


def test_a_prompt_longer_than_max_batch_pages_is_found_through_sglangs_controller(monkeypatch):
    """SGLang 0.5.23's HiCache (``UnifiedRadixCache`` over ``HybridCacheController``, also for
    full-attention models: ``build_kv_only_stack``) asks ``batch_exists`` once with every page
    hash of the span it may prefetch, not in ``STORAGE_BATCH_SIZE`` batches as its backups and
    reads go. A span longer than ``max_batch_pages`` (default 1024: 1,025 tokens at SGLang's
    default page size 1) was a refused batch, 0 hits: no L3 reuse for any long prompt. Runs
    SGLang's own backup, hit query and transfer code over the backend; bytes compared (the
    page hashes by Python's SHA-256: SGLang's native hash is a C++ extension built at runtime)."""
    import hashlib
    import queue
    import types as _types

    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller as hcc
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        HybridCacheController,
        PrefetchOperation,
        StorageOperation,
    )

    def get_storage_hash_str(tokens, prior_hash=None, page_size=1):
        out, h = [], prior_hash or ""
        for i in range(0, len(tokens) // page_size * page_size, page_size):
            h = hashlib.sha256((h + repr(list(tokens[i:i + page_size]))).encode()).hexdigest()
            out.append(h)
        return out

    monkeypatch.setattr(hcc, "get_storage_hash_str", get_storage_hash_str)

    pages = 1100
    src = mha_pool("page_first", host_pages=pages)
    dst = mha_pool("page_first", host_pages=pages)
    fill(src, 21)
    b = backend(src, name="long-span")
    assert b.max_batch_pages == 1024 < pages

    def controller(pool):
        c = object.__new__(HybridCacheController)
        c.page_size, c.storage_backend, c.storage_config = PS, b, b.storage_config
        c.page_set_func = _types.MethodType(HiCacheController._page_set_zero_copy, c)
        c.page_get_func = _types.MethodType(HiCacheController._page_get_zero_copy, c)
        c.prefetch_sync_queue = queue.Queue()
        b.register_mem_pool_host(pool)
        return c

    tokens = list(range(1, pages * PS + 1))
    writer = controller(src)
    hashes = get_storage_hash_str(tokens, None, page_size=PS)
    op = StorageOperation(torch.arange(pages * PS), tokens, hash_value=hashes)
    HiCacheController._page_backup(writer, op)  # SGLang's backup: batches of 128
    assert op.completed_tokens == pages * PS

    reader = controller(dst)
    handle = _types.SimpleNamespace(rid="long")
    pf = PrefetchOperation(handle, tokens)
    got, hit_tokens = HybridCacheController._storage_hit_query(reader, pf)
    assert hit_tokens == pages * PS and got == hashes  # 0 before: one refused batch of 1,100 pages
    pf.hash_value = got
    pf.host_indices = torch.arange(pages * PS)
    assert HiCacheController._page_transfer(reader, pf) == pages
    assert torch.equal(snapshot(dst), snapshot(src))
    # the v2 query of a hybrid model's KV pages answers the same run
    assert b.batch_exists_v2(hashes, []).kv_hit_pages == pages


def test_an_mha_draft_pool_of_an_mla_model_keeps_its_page_layout_and_its_ranks_apart():
    """SGLang 0.5.23 registers a draft model's KV as the DRAFT side pool (v2 calls), its host
    pool built from the draft's own device pool: an EAGLE MHA draft of an MLA model (what
    SGLang's Mooncake backend keys per rank) is an ``MHATokenToKVPoolHost`` with K and V
    halves. The backend took every pool of an MLA model as MLA: one chunk per page, so a
    draft page's 'chunk' was the K (or V) rows of two other pages and a read landed there;
    and one key for every rank, as for replicated MLA KV, so rank 1 read rank 0's heads."""
    kv_src, kv_dst = mla_pool("page_first"), mla_pool("page_first")
    d_src, d_dst = mha_pool("page_first"), mha_pool("page_first")
    fill(kv_src, 40)
    fill(d_src, 41)
    keys = ["d0", "d1"]

    def transfers(kv_pages, draft_pages):
        return [PoolTransfer(name=PoolName.KV, keys=keys, host_indices=page_indices(kv_pages, PS)),
                PoolTransfer(name=PoolName.DRAFT, keys=keys, host_indices=page_indices(draft_pages, PS))]

    w = backend(kv_src, mla=True, tp_rank=0, tp_size=2, name="mla-draft")
    w.register_mem_host_pool_v2(d_src, PoolName.DRAFT)
    assert w.batch_set_v2(transfers([0, 1], [2, 3])) == {"kv": [True] * 2, "draft": [True] * 2}
    r = backend(kv_dst, mla=True, tp_rank=0, tp_size=2, name="mla-draft")
    r.register_mem_host_pool_v2(d_dst, PoolName.DRAFT)
    before = [page_bytes(d_dst, p) for p in range(16)]
    assert r.batch_get_v2(transfers([5, 6], [7, 9])) == {"kv": [True] * 2, "draft": [True] * 2}
    assert page_bytes(kv_dst, 6) == page_bytes(kv_src, 1)
    assert page_bytes(d_dst, 7) == page_bytes(d_src, 2) and page_bytes(d_dst, 9) == page_bytes(d_src, 3)
    assert {p for p in range(16) if page_bytes(d_dst, p) != before[p]} == {7, 9}, "a read wrote other pages"
    # Rank 1 of the same deployment reads the writer's MLA KV, never rank 0's draft heads.
    d1 = mha_pool("page_first")
    r1 = backend(mla_pool("page_first"), mla=True, tp_rank=1, tp_size=2, name="mla-draft")
    r1.register_mem_host_pool_v2(d1, PoolName.DRAFT)
    assert r1.batch_get_v2(transfers([0, 1], [0, 1])) == {"kv": [True] * 2, "draft": [False] * 2}
    assert not d1.kv_buffer.view(torch.int16).ne(0).any()
    # its own draft shard it stores itself (the MLA KV it leaves to the writer)
    fill(d1, 42)
    assert r1.batch_set_v2(transfers([0, 1], [4, 5])) == {"kv": [True] * 2, "draft": [True] * 2}
    assert r1.batch_exists_v2(keys, [PoolTransfer(name=PoolName.DRAFT, keys=keys)]).kv_hit_pages == 2
    assert r.batch_exists_v2(keys, [PoolTransfer(name=PoolName.DRAFT, keys=keys)]).kv_hit_pages == 2
    assert r.object_keys(keys) == r1.object_keys(keys)  # MLA KV: one copy for all ranks
    assert r.object_keys(keys, pool="draft") != r1.object_keys(keys, pool="draft")


def test_a_host_pool_with_scales_beside_its_kv_buffer_is_refused():
    """SGLang's MXFP8 host pool (``MHATokenToKVPoolMXFP8Host``, ``--kv-cache-dtype mxfp8``)
    keeps each page's UE8M0 scales in ``k_scale_host`` / ``v_scale_host`` beside its
    ``kv_buffer``; SGLang's own flat-page calls refuse it ("does not expose flat storage
    (L3) pages yet"). The backend reads ``kv_buffer`` directly and took it: it stored the fp8
    payload without its scales, and a page read back kept the scales of whatever its host
    slot held before (wrong KV). Refused when SGLang registers it; as a side pool it is not
    served (every v2 call answers False)."""
    from sglang.srt.mem_cache.pool_host.mha_mxfp8 import MHATokenToKVPoolMXFP8Host

    def mxfp8_pool():
        # its constructor needs CUDA's JIT kernels: an MHA pool given the class and its scales
        p = mha_pool("page_first", dtype=torch.uint8)
        p.__class__ = MHATokenToKVPoolMXFP8Host
        p.k_scale_host = torch.ones(p.size // PS, p.layer_num, 16, dtype=torch.uint8)
        p.v_scale_host = torch.ones(p.size // PS, p.layer_num, 16, dtype=torch.uint8)
        return p

    with pytest.raises(ks.UnsupportedPoolError, match="k_scale_host, v_scale_host"):
        backend(mxfp8_pool())
    b = backend(mha_pool("page_first"))
    b.register_mem_host_pool_v2(mxfp8_pool(), PoolName.DRAFT)
    t = [PoolTransfer(name=PoolName.DRAFT, keys=["x"], host_indices=page_indices([0], PS))]
    assert b.batch_set_v2(t) == {"draft": [False]} and b.batch_get_v2(t) == {"draft": [False]}
    # a plain pool of either kind has no such state
    from kvtier.sglang.storage_pools import _state_outside_kv_buffer

    assert _state_outside_kv_buffer(mha_pool("page_first")) == []
    assert _state_outside_kv_buffer(mla_pool("page_first")) == []


def test_a_server_killed_mid_batch_and_restarted_never_raises_nor_serves_wrong_bytes():
    """The kvtier-l3 server SIGKILLed while SGLang's controller threads write and read through
    the backend (a reader and a writer thread, as HiCache's prefetch and backup threads), then
    restarted on the same address: every call answers (False / 0 while it is gone, no
    exception into the threads), and once it is back the backend serves again without being
    rebuilt, each page read holding the bytes written under its key."""
    import os
    import signal
    import threading

    from test_shm import Proc

    srv = Proc()
    addr = srv.addr
    src, dst = mha_pool("page_first", host_pages=64), mha_pool("page_first", host_pages=64)
    fill(src, 31)
    b = backend(src, server=addr, rpc_timeout_ms=3000)
    r = backend(dst, server=addr, rpc_timeout_ms=3000)
    errors, answers, stop = [], [], threading.Event()

    def loop(fn):
        i = 0
        while not stop.is_set():
            try:
                answers.append(fn(i))
            except BaseException as e:  # noqa: BLE001 (what escaped into SGLang's thread)
                errors.append(e)
            i += 1

    def write(i):
        keys = [f"w{i}-{j}" for j in range(32)]
        return b.batch_set_v1(keys, page_indices(range(32), PS))

    def read(i):
        keys = [f"w{max(i - 1, 0)}-{j}" for j in range(32)]
        dst.kv_buffer.zero_()
        got = r.batch_get_v1(keys, page_indices(range(32, 64), PS))
        assert len(got) == 32 and all(isinstance(x, bool) for x in got)
        for j, ok in enumerate(got):  # page w*-j was written from host page j
            if ok and page_bytes(dst, 32 + j) != page_bytes(src, j):
                raise AssertionError(f"page {keys[j]} read with other bytes")
        return r.batch_exists(keys), got

    threads = [threading.Thread(target=loop, args=(f,)) for f in (write, read)]
    srv2 = None
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
        os.kill(srv.p.pid, signal.SIGKILL)
        srv.p.wait()
        time.sleep(0.5)
        srv2 = Proc(base=("--listen", addr, "--segment-bytes", str(64 << 20)))
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    try:
        assert not errors, errors[:3]
        assert not any(t.is_alive() for t in threads), "a controller thread hung"
        assert b.counters.store_errors + r.counters.store_errors > 0, "the kill was never seen"
        # Back: the same backends (not rebuilt) write and read, bytes as written.
        keys = [f"after-{j}" for j in range(8)]
        assert b.batch_set_v1(keys, page_indices(range(8, 16), PS)) == [True] * 8
        assert r.batch_exists(keys) == 8
        assert r.batch_get_v1(keys, page_indices(range(40, 48), PS)) == [True] * 8
        for j in range(8):
            assert page_bytes(dst, 40 + j) == page_bytes(src, 8 + j)
        # what was written before the kill is gone with the server's memory: a miss, not garbage
        assert r.batch_exists(["w0-0"]) == 0
    finally:
        if srv2 is not None:
            srv2.close()


def test_page_head_round_trip_and_value_path():
    """``page_head`` (SGLang's layout for heterogeneous TP, one of the four the backend takes)
    was in no test: zero-copy pages land where asked and nowhere else, and the value path's
    flat pages (``get_data_page`` / ``set_from_flat_data_page``) are the same objects."""
    src, dst = mha_pool("page_head"), mha_pool("page_head")
    fill(src, 13)
    b = backend(src, name="page-head")
    keys = ["h0", "h1", "h2"]
    assert b.batch_set_v1(keys, page_indices([2, 5, 7], PS)) == [True] * 3
    r = backend(dst, name="page-head")
    assert r.batch_get_v1(keys, page_indices([9, 0, 4], PS)) == [True] * 3
    assert [page_bytes(dst, g) for g in (9, 0, 4)] == [page_bytes(src, w) for w in (2, 5, 7)]
    assert {p for p in range(16) if dst.get_data_page(p * PS).view(torch.int16).ne(0).any()} == {0, 4, 9}
    got = r.batch_get(["h1"], [dst.get_dummy_flat_data_page()])[0]
    other = mha_pool("page_head")
    other.set_from_flat_data_page(3 * PS, got)
    assert page_bytes(other, 3) == page_bytes(src, 5)
    assert b.batch_set(["h3"], [src.get_data_page(6 * PS, flat=True).contiguous()]) is True
    assert r.batch_get_v1(["h3"], page_indices([8], PS)) == [True] and page_bytes(dst, 8) == page_bytes(src, 6)


def test_cache_salts_leave_no_state_per_salt_beyond_what_clear_needs():
    """A long-running engine sees a new ``cache_salt`` per user or per request: the backend
    kept a store handle for every salt it ever looked up, read or wrote (``_tenants``), so it
    grew with the salts served. Now a salt that only looked up or read leaves nothing, a salt
    that wrote leaves its tenant's name until ``clear()`` (which must reach its pages) and
    ``clear()`` forgets them; handles are kept for the most recent salts only
    (``VIEW_CACHE``)."""
    from kvtier.sglang import storage as st

    b = backend(mha_pool("page_first"))
    keys = ["k0", "k1"]
    n = st.VIEW_CACHE + 40
    for i in range(n):
        assert b.batch_exists(keys, salt(f"reader-{i}")) == 0
        assert b.batch_get_v1(keys, page_indices([0, 1], PS), salt(f"reader-{i}")) == [False, False]
    assert b.books() == {"views": st.VIEW_CACHE, "written_tenants": 0}
    for i in range(3):
        assert b.batch_set_v1(keys, page_indices([0, 1], PS), salt(f"writer-{i}")) == [True, True]
    assert b.books()["written_tenants"] == 3
    b.clear()
    assert b.books()["written_tenants"] == 0
    assert all(b.batch_exists(keys, salt(f"writer-{i}")) == 0 for i in range(3))  # clear reached them all


def test_a_write_racing_clear_keeps_its_salted_tenant_for_the_next_clear():
    """``clear()`` forgets a salted tenant once its pages are removed, unless a write reached
    that tenant meanwhile (an I/O thread writing while SGLang's admin call clears): its page
    may land after the removal, so the next ``clear()`` must still reach it."""
    b = backend(mha_pool("page_first"))
    keys = ["k0", "k1"]
    assert b.batch_set_v1(keys, page_indices([0, 1], PS), salt("w")) == [True, True]
    view, raced = b._view, []

    class Racing:
        def __init__(self, store):
            self._store = store

        def __getattr__(self, name):
            return getattr(self._store, name)

        def remove_by_regex(self, pattern, force):
            n = self._store.remove_by_regex(pattern, force)
            if not raced:
                raced.append(True)
                assert b.batch_set_v1(keys, page_indices([0, 1], PS), salt("w")) == [True, True]
            return n

    b._view = lambda tenant: Racing(view(tenant))
    b.clear()
    b._view = view
    assert b.books()["written_tenants"] == 1
    b.clear()
    assert b.books()["written_tenants"] == 0 and b.batch_exists(keys, salt("w")) == 0
