"""kvtier as SGLang's radix-cache backend, starting up: its configuration
(``$KVTIER_SGLANG_CONFIG``) refused with typed errors before SGLang serves a request, the
plugin entry point and the documented launch command through SGLang's own parser, pools it
cannot serve refused when SGLang builds the cache, and the namespace following the
checkpoint (against the real sglang 0.5.23 on CPU)."""

from __future__ import annotations

import json
import os
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from sglang_engine import PS, Engine, kvtier_cache, prompts, publish_server_args, sglang_radix

from kvtier.sglang import radix as kr


def test_config_errors_are_typed_at_startup(server):
    with pytest.raises(kr.RadixConfigError, match="unknown"):
        kr.RadixBackendConfig.from_dict({"host_page": 3})
    # a string or number where a bool or an int is due was taken by truthiness ("false"
    # probed L3) or failed later untyped (rpc_timeout_ms -1: OverflowError)
    for bad in ({"policy": "mru"}, {"io_threads": 4}, {"host_pages": 0}, {"l3": "tape"},
                {"prefetch_wait_ms": -1}, {"host_bytes": "lots"}, {"write_policy": "write_around"},
                {"probe_l3": "false"}, {"probe_l3": 0}, {"host_pages": True}, {"io_threads": 1.0},
                {"io_threads": True}, {"prefetch_wait_ms": True}, {"rpc_timeout_ms": -1},
                {"rpc_timeout_ms": "abc"}, {"token": 123}, {"name": 5}, {"segment_bytes": "lots"}):
        with pytest.raises(kr.RadixConfigError):
            kr.RadixBackendConfig.from_dict(bad)
    with pytest.raises(kr.UnsupportedPageSizeError):  # no page fits the host pool
        Engine(kvtier_cache(host_bytes="256"))  # a page is 512 bytes
    # a config made by its constructor, not from_dict, is checked by the backend too (a bad
    # host_bytes was a TypeError: None // page bytes)
    unchecked = kr.RadixBackendConfig(host_bytes="lots", io_threads=0)
    with pytest.raises(kr.RadixConfigError, match="host_bytes"):
        Engine(lambda params: kr.KvtierRadixCache(params, unchecked, model="model-a"))
    small = kvtier.L3Server(1 << 24, max_object_bytes=1024)
    try:
        Engine(kvtier_cache(host_pages=4, l3="server", server=small.addr), page_size=1)  # 64-byte pages fit
        with pytest.raises(kr.UnsupportedPageSizeError, match="page_size 64"):
            Engine(kvtier_cache(host_pages=4, l3="server", server=small.addr), page_size=64)
    finally:
        small.shutdown()


def test_sizes_no_host_can_have_are_refused_at_config():
    # host_bytes 2**70: a torch error deep in the cache's constructor ("Storage size
    # calculation overflowed"); segment_bytes and tenant caps past u64 an OverflowError
    for bad, key in (({"host_bytes": 2 ** 70}, "host_bytes"), ({"host_bytes": "100000000000TB"}, "host_bytes"),
                     ({"host_pages": 2 ** 32}, "host_pages"), ({"segment_bytes": 2 ** 70}, "segment_bytes"),
                     ({"tenant_caps": {"salt-a": 2 ** 70}}, "tenant_caps"),
                     ({"tenant_caps": {"salt-a": True}}, "tenant_caps"),
                     ({"tenant_caps": {"salt-a": 2 ** 32}}, "tenant_caps")):
        with pytest.raises(kr.RadixConfigError, match=key):
            kr.RadixBackendConfig.from_dict(bad)
    kr.RadixBackendConfig.from_dict({"host_bytes": "64GB", "host_pages": 2 ** 32 - 1, "tenant_caps": {"salt-a": 2 ** 32 - 1}})


@settings(max_examples=100, deadline=None)
@given(n=st.one_of(st.integers(-(2 ** 70), 2 ** 70), st.sampled_from([0, 1, 2 ** 32 - 1, 2 ** 32, 2 ** 64 - 1, 2 ** 64])),
       key=st.sampled_from(["host_bytes", "segment_bytes", "host_pages", "tenant_caps"]))
def test_property_a_count_or_size_is_accepted_exactly_within_its_range(n, key):
    most = 2 ** 32 - 1 if key in ("host_pages", "tenant_caps") else 2 ** 64 - 1
    cfg = {key: {"salt-a": n} if key == "tenant_caps" else n}
    if 0 < n <= most:
        kr.RadixBackendConfig.from_dict(cfg)
    else:
        with pytest.raises(kr.RadixConfigError, match=key):
            kr.RadixBackendConfig.from_dict(cfg)


def test_a_host_pool_larger_than_this_machine_is_refused_before_it_is_allocated():
    """host_bytes or host_pages past this machine's memory: torch's allocator failed in the
    constructor (an untyped RuntimeError). Refused before the store opens or SGLang's tree
    is built; a named embedded store gets no segment from the refused backend."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    name = f"big-{os.getpid()}"
    for cfg, key in (({"host_bytes": mem + (1 << 30)}, "host_bytes"), ({"host_bytes": "100TB"}, "host_bytes"),
                     ({"host_pages": 2 ** 31}, "host_pages")):  # 2**31 pages of 512 bytes: 1 TiB
        with pytest.raises(kr.RadixConfigError, match=key):
            Engine(kvtier_cache(**cfg, l3="embedded", segment_bytes="1MB", name=name))
    e = Engine(kvtier_cache(host_pages=4, l3="embedded", segment_bytes="1MB", name=name))
    assert e.cache.store.stats()["mem_capacity_bytes"] == 1 << 20


def test_the_backend_logs_its_namespace_as_the_stores_stream_value(caplog):
    """An operator cannot guess the namespace (a hash of model, dtype, layout and tenant): the
    backend logs it at startup as the ``kvtier-l3 --kv-events-stream`` value of its model; two
    layouts, two namespaces."""
    import logging
    import re

    seen = []
    for ps in (4, 8):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvtier.sglang.radix"):
            e = Engine(kvtier_cache(host_pages=8, l3="embedded", segment_bytes="16MB"), page_size=ps)
        m = re.search(r"--kv-events-stream (\S+)=PUB", caplog.text)
        assert m and m.group(1) == e.cache.namespace, caplog.text
        seen.append(m.group(1))
    assert seen[0] != seen[1]


@pytest.mark.parametrize("where", ["embedded", "server"])
def test_starting_a_backend_on_a_full_store_evicts_nothing(where):
    """The page-size check at startup writes nothing: the probe put it made before evicted
    real pages from a full store for every backend started."""
    page = PS * 64  # this file's engine shape: 64 bytes per token
    seg = 1 << 20
    srv = kvtier.L3Server(seg) if where == "server" else None
    name = f"full-{where}-{os.getpid()}"
    try:
        store = kvtier.L3Store.connect(srv.addr) if srv else kvtier.L3Store.embedded(seg, name=name)
        # Filled to one page below the high watermark (0.9): one more page's put evicts (each
        # page charged its bytes, its key and the store's metadata).
        per = kvtier.l3_charge(page, len("other:0000"))
        keys = [f"other:{i:04d}" for i in range(int(seg * 0.9) // per)]
        for k in keys:
            store.put(k, bytes(page))
        assert store.stats()["mem_used_bytes"] + per > 0.9 * store.stats()["mem_capacity_bytes"]
        cfg = dict(l3="server", server=srv.addr) if srv else dict(l3="embedded", segment_bytes=str(seg), name=name)
        for _ in range(3):
            Engine(kvtier_cache(host_pages=8, **cfg))
        assert all(c == 1 for c in store.batch_is_exist(keys)), "a backend's startup evicted pages"
    finally:
        if srv:
            srv.shutdown()


def test_plugin_entry_point_registers_the_backend_and_sglang_builds_it():
    """kvtier's ``sglang.srt.plugins`` entry point, loaded as SGLang loads plugins, registers
    ``kvtier``; SGLang's own ``create_tree_cache`` builds it for ``--radix-cache-backend
    kvtier`` and refuses SWA and Mamba models with typed errors."""

    from sglang.srt.mem_cache import registry
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert "kvtier" in plugins
    plugins["kvtier"][0]()
    plugins["kvtier"][0]()  # idempotent (the launcher and each scheduler call it)
    assert "kvtier" in registry.registered_radix_cache_backends()
    e = Engine(sglang_radix)
    publish_server_args(["--model-path", "dummy", "--device", "cpu", "--radix-cache-backend", "kvtier"])

    def ctx(**over):
        kw = dict(server_args=None, params=e.params, is_hybrid_swa=False, is_hybrid_ssm=False,
                  enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None,
                  model_config=types.SimpleNamespace(model_path="m"), tp_size=1, tp_rank=0, tp_group=None)
        kw.update(over)
        return registry.TreeCacheBuildContext(**kw)

    cache = registry.create_tree_cache(ctx())
    assert isinstance(cache, kr.KvtierRadixCache)
    with pytest.raises(kr.UnsupportedModelError, match="SWA"):
        registry.create_tree_cache(ctx(is_hybrid_swa=True))
    with pytest.raises(kr.UnsupportedModelError, match="Mamba"):
        registry.create_tree_cache(ctx(is_hybrid_ssm=True))
    with pytest.raises(kr.RadixConfigError, match="hierarchical"):
        registry.create_tree_cache(ctx(enable_hierarchical_cache=True))
    publish_server_args()


def test_the_documented_launch_command_parses_and_builds_the_backend(monkeypatch):
    """docs/sglang.md's radix-backend command as a user pastes it: SGLang's own argument parser
    takes it, the config in it is valid, and SGLang's create_tree_cache builds kvtier's backend
    from the parsed ServerArgs (the L3 server swapped for a local one, the host pool shrunk)."""
    import argparse
    import json
    import pathlib
    import re
    import shlex

    from sglang.srt.mem_cache import registry
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    from kvtier.sglang import plugin

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "sglang.md").read_text()
    blocks = [b for b in re.findall(r"^```sh\n(.*?)^```", doc, re.S | re.M) if "--radix-cache-backend" in b]
    assert len(blocks) == 1
    words = shlex.split(blocks[0].replace("\\\n", " "), comments=True)
    env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
    cfg = kr.RadixBackendConfig.from_dict(json.loads(env[kr.ENV_CONFIG]))
    assert cfg.l3_mode() == "server" and cfg.policy == "freq-depth"
    args = words[words.index("sglang.launch_server") + 1:]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(args)
    assert ns.radix_cache_backend == "kvtier" and ns.page_size == 64 and not ns.enable_hierarchical_cache
    plugin.register()
    e = Engine(sglang_radix, page_size=64, device_tokens=256)
    get_context().set_server_args(ServerArgs.from_cli_args(ns))
    srv = kvtier.L3Server(1 << 24)
    try:
        local = dict(json.loads(env[kr.ENV_CONFIG]), server=srv.addr, host_bytes="4MB")
        monkeypatch.setenv(kr.ENV_CONFIG, json.dumps(local))
        ctx = registry.TreeCacheBuildContext(
            server_args=ServerArgs.from_cli_args(ns), params=e.params, is_hybrid_swa=False, is_hybrid_ssm=False,
            enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None,
            model_config=types.SimpleNamespace(model_path=ns.model_path), tp_size=1, tp_rank=0, tp_group=None)
        cache = registry.create_tree_cache(ctx)
        assert isinstance(cache, kr.KvtierRadixCache) and cache.store is not None
        assert cache.config.policy == "freq-depth" and cache.host_slots == (4 << 20) // cache.page_bytes
        assert cache._pool is not None
        cache.release_host_resources()  # SGLang's teardown hook; twice is fine
        cache.release_host_resources()
        assert cache._pool is None and cache.host.numel() == 0
    finally:
        srv.shutdown()
        publish_server_args()


def test_a_tenant_cap_naming_no_tenant_is_refused():
    """A cap keyed by the bare salt (``{"alice": 2}``) was accepted and capped nothing: a
    salted request's host tenant is ``salt-<cache_salt>`` (three of alice's 16-token prompts
    took 9 host pages of 12, her charge uncapped), and unsalted requests have no tenant to
    cap. Refused at config, naming the form a tenant takes."""
    for bad in ({"alice": 2}, {"salt-": 2}, {"default": 2}):
        with pytest.raises(kr.RadixConfigError, match="salt-<cache_salt>"):
            kr.RadixBackendConfig.from_dict({"tenant_caps": bad})
    e = Engine(kvtier_cache(host_pages=12, tenant_caps={"salt-alice": 2}), device_tokens=40)
    e.run([e.request(p, salt="alice") for p in prompts(15, 3, 16)])
    assert e.cache.manager.tenant_charge("salt-alice") <= 2


def test_the_namespace_follows_the_checkpoint_and_its_overrides_not_only_the_path(tmp_path, monkeypatch):
    """One path, other weights (a new fine-tune there), or ``--json-model-override-args``
    changing RoPE, changes every page's KV: the factory's namespace changed with neither (the
    model path alone), so a shared L3 served the old pages (the vLLM tester's case, the same
    code here). Same checkpoint, same namespace: copies share."""

    from sglang.srt.mem_cache import registry
    from sglang.srt.server_args import ServerArgs

    from test_model_identity import _ckpt, _weights

    e = Engine(sglang_radix)
    monkeypatch.setenv(kr.ENV_CONFIG, json.dumps({"host_pages": 16}))

    def namespace(path, *extra):
        sa = ServerArgs.from_cli_args(_parse(["--model-path", path, "--device", "cpu", *extra]))
        ctx = registry.TreeCacheBuildContext(
            server_args=sa, params=e.params, is_hybrid_swa=False, is_hybrid_ssm=False,
            enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None,
            model_config=types.SimpleNamespace(model_path=path), tp_size=1, tp_rank=0, tp_group=None)
        return kr.kvtier_radix_cache_factory(ctx).namespace

    live = _ckpt(tmp_path / "live", _weights(1))
    before = namespace(live)
    assert namespace(_ckpt(tmp_path / "copy", _weights(1))) != before  # another path: another name
    assert namespace(live) == before
    rope = namespace(live, "--json-model-override-args", '{"rope_theta": 1000000.0}')
    assert rope != before
    _ckpt(tmp_path / "live", _weights(2))  # the new fine-tune over the old files
    assert namespace(live) not in (before, rope)
    now = namespace(live)
    monkeypatch.setenv(kr.ENV_CONFIG, json.dumps({"host_pages": 16, "model_version": "v2"}))
    assert namespace(live) != now, "an operator's model_version is part of it"


def _parse(args):
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(args)


def _pool_params(kv, page_size=PS, device_tokens=40):
    """SGLang's CacheInitParams over a device KV pool built by the caller."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    publish_server_args(page_size=page_size)
    alloc = PagedTokenToKVPoolAllocator(device_tokens, page_size, kv.dtype, "cpu", kv, False)
    return CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(8, 512, "cpu", False),
                           token_to_kv_pool_allocator=alloc, page_size=page_size)


def test_pools_whose_buffers_are_not_a_tokens_kv_whole_are_refused_at_startup(monkeypatch):
    """An adversarial tester's two wrong-KV cases, both accepted before: an FP4 pool keeps
    per-token scale factors in ``k_scale_buffer``/``v_scale_buffer`` that kvtier never moved
    (reused prefixes had another token's scales: 12 of 12 reused scale buffers wrong), and
    with ``SGLANG_USE_HND_KVCACHE=1`` a buffer's rows are pages, not token slots (page_bytes
    2,048 for a 512-byte page; loaded-back prefixes held wrong KV, or an IndexError). Both
    are ``UnsupportedModelError`` when SGLang builds the cache; the plain pool still builds."""
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import FP4MXBlock16KVCacheMethod
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    conf = kr.RadixBackendConfig.from_dict({"host_pages": 16, "io_threads": 0})
    fp4 = MHATokenToKVPool(40, PS, torch.uint8, 2, 32, 2, "cpu", False, quant_method=FP4MXBlock16KVCacheMethod())
    assert fp4.k_scale_buffer is not None
    with pytest.raises(kr.UnsupportedModelError, match="scale"):
        kr.KvtierRadixCache(_pool_params(fp4), conf)
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    hnd = MHATokenToKVPool(40, PS, torch.float32, 2, 8, 2, "cpu", False)
    assert hnd.kv_cache_layout == "hnd"
    with pytest.raises(kr.UnsupportedModelError, match="hnd"):
        kr.KvtierRadixCache(_pool_params(hnd), conf)
    monkeypatch.delenv("SGLANG_USE_HND_KVCACHE")
    plain = MHATokenToKVPool(40, PS, torch.float32, 2, 8, 2, "cpu", False)
    assert kr.KvtierRadixCache(_pool_params(plain), conf).page_bytes == 2 * 2 * 2 * 8 * 4 * PS
    assert issubclass(kr.UnsupportedModelError, kvtier.KvtierError)


def _built_by_sglang(e, *flags, **ctx_fields):
    """SGLang's ``create_tree_cache`` for ``--radix-cache-backend kvtier`` plus ``flags`` (parsed
    and published as a launch would), over ``e``'s pools (``ctx_fields``: the build context's
    own, such as ``tp_size``)."""
    from sglang.srt.mem_cache import registry

    from kvtier.sglang import plugin

    plugin.register()
    args = publish_server_args(["--model-path", "dummy", "--device", "cpu", "--radix-cache-backend", "kvtier",
                                *flags])
    ctx = registry.TreeCacheBuildContext(
        server_args=args, params=e.params, is_hybrid_swa=False, is_hybrid_ssm=False,
        enable_hierarchical_cache=False, tp_worker=None, model_config=types.SimpleNamespace(model_path="m"),
        **{"tp_size": 1, "tp_rank": 0, "tp_group": None, "disable_radix_cache": False, **ctx_fields})
    return registry.create_tree_cache(ctx)

@pytest.mark.parametrize("algo", ["STANDALONE", "DFLASH", "UNO", "DSPARK"])
def test_speculative_decoding_with_a_draft_kv_pool_is_refused_at_startup(algo):
    """``--speculative-algorithm STANDALONE`` (and DFLASH, UNO, DSPARK) runs a draft model whose
    KV lives in its own device pool at the target's token slots; these are not EAGLE (no bigram
    keys, ``params.is_eagle`` False), and without HiCache SGLang hands the tree no draft pool.
    kvtier loads a host or L3 prefix into the target's pool only, so the draft attended to
    whatever those slots held before: SGLang's ``create_tree_cache`` built the backend for them
    (this test failed). Now ``UnsupportedModelError`` naming the algorithm; NGRAM (no draft
    model, the target's pool only) is still built."""
    e = Engine(sglang_radix)

    def build(spec):
        return _built_by_sglang(e, "--speculative-algorithm", spec, "--speculative-draft-model-path", "d")

    try:
        with pytest.raises(kr.UnsupportedModelError, match=f"{algo}.*draft"):
            build(algo)
        assert isinstance(build("NGRAM"), kr.KvtierRadixCache)
    finally:
        publish_server_args()


def test_a_decode_servers_host_pool_retraction_backup_is_refused_at_startup():
    """A PD-disaggregation decode server with its radix cache on
    (``--disaggregation-decode-enable-radix-cache``) and
    ``--disaggregation-decode-retraction-backup host_pool`` backs a retracted request's KV up
    to HiCache's host pool: ``release_req`` casts the tree cache to ``UnifiedRadixCache`` and
    calls its ``backup_kv_cache``, which kvtier's backend does not have. SGLang's
    ``create_tree_cache`` built the backend (this test failed) and the first retraction raised
    AttributeError mid-serving. Now ``RadixConfigError`` naming the flag; ``cpu_tensor`` (the
    request's KV copied to a CPU tensor, no tree involved) is built."""
    from sglang.srt.mem_cache.common import backup_kv_cache

    e = Engine(sglang_radix)

    def build(backup):
        return _built_by_sglang(e, "--disaggregation-mode", "decode", "--disaggregation-decode-retraction-backup", backup)

    try:
        with pytest.raises(kr.RadixConfigError, match="retraction-backup host_pool"):
            build("host_pool")
        cache = build("cpu_tensor")
        assert isinstance(cache, kr.KvtierRadixCache)
        # what SGLang's retraction did with host_pool over kvtier's backend
        with pytest.raises(AttributeError, match="backup_kv_cache"):
            backup_kv_cache(e.request([1, 2, 3]), cache, e.r2t, e.alloc, "host_pool")
    finally:
        publish_server_args()


def test_a_decode_servers_host_receive_is_refused_at_startup():
    """``--disaggregation-decode-host-receive-threshold`` below 1 has a decode server receive
    KV into HiCache's host pool, which it takes from the tree cache (``host_pool_group``):
    kvtier's backend has none, and SGLang's decode queue died at startup with an untyped
    AttributeError after the backend was built (this test failed: built). Now
    ``RadixConfigError`` naming the flag; the default threshold 1 is built."""
    e = Engine(sglang_radix)
    decode = ("--disaggregation-mode", "decode", "--disaggregation-decode-retraction-backup", "cpu_tensor")
    try:
        with pytest.raises(kr.RadixConfigError, match="host-receive-threshold"):
            _built_by_sglang(e, *decode, "--disaggregation-decode-host-receive-threshold", "0.5")
        cache = _built_by_sglang(e, *decode)
        assert not hasattr(cache, "host_pool_group")
    finally:
        publish_server_args()


@pytest.mark.parametrize("tp,attn_tp,rank", [(2, 1, 1), (4, 2, 3)])
def test_attention_dp_ranks_agree_within_their_attention_tp_group(tp, attn_tp, rank):
    """With attention DP (``--attn-dp-size``, DeepSeek's usual deployment) each DP rank's
    scheduler serves its own requests over its attention-TP group's KV shards. SGLang's build
    context names the whole TP group, and the backend took it: its ranks' agreements (an
    all-reduce in a match that probes L3) paired ranks that serve other requests (by analysis:
    a hang, or one DP rank's probe cut by another's), and its keys and namespace named a TP
    shard layout the pool does not have (this test failed: the whole group's size and rank).
    Now the attention-TP size, rank and SGLang's ``tp_cache_group`` (``get_dp_tp_group``) are
    the backend's."""
    from sglang.srt.runtime_context import get_parallel

    e = Engine(sglang_radix)
    e.params.tp_cache_group = group = object() if attn_tp > 1 else None
    whole = object()
    try:
        publish_server_args(["--model-path", "dummy", "--device", "cpu", "--tp", str(tp), "--attn-dp-size", "2"])
        with get_parallel().override(tp_rank=rank, attn_tp_rank=rank % attn_tp, attn_dp_rank=rank // attn_tp,
                                     attn_cp_rank=0):
            cache = _built_by_sglang(e, "--tp", str(tp), "--attn-dp-size", "2", tp_size=tp, tp_rank=rank,
                                     tp_group=whole)
        assert (cache.tp_size, cache.tp_rank) == (attn_tp, rank % attn_tp)
        assert cache._group is group
        assert cache.l3_keys([bytes(32)])[0].endswith(f":{rank % attn_tp}")
    finally:
        publish_server_args()


def test_a_disabled_radix_cache_is_sglangs_own_not_kvtiers(monkeypatch):
    """With the radix cache disabled (``--disable-radix-cache``, and a PD decode server's
    default) there are no prefixes for kvtier to tier, and SGLang's own choice for it is its
    ``UnifiedRadixCache`` (which a decode server's ``host_pool`` retraction backup needs).
    kvtier's factory built its backend anyway: a host pool (4 GB by default, pinned on a GPU)
    and an L3 connection for nothing, and on a decode server the first retraction's backup
    raised, or (since the refusal above) the server did not start (this test failed). Now
    the factory hands a disabled cache to SGLang's default, and a decode server starts."""
    from sglang.srt.mem_cache import registry
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    e = Engine(sglang_radix)
    e.params.disable = True
    try:
        cache = _built_by_sglang(e, disable_radix_cache=True)
        assert isinstance(cache, UnifiedRadixCache) and not isinstance(cache, kr.KvtierRadixCache)
        # A decode server's host_pool backup: SGLang's default builds a HiCache host pool (CUDA
        # only), so here the hand-over itself is what is checked.
        built = []
        monkeypatch.setattr(registry, "default_radix_cache_factory", lambda ctx: built.append(ctx) or sglang_radix(e.params))
        decode = ("--disaggregation-mode", "decode", "--disaggregation-decode-retraction-backup", "host_pool")
        cache = _built_by_sglang(e, *decode, disable_radix_cache=True)
        assert not isinstance(cache, kr.KvtierRadixCache) and len(built) == 1
    finally:
        publish_server_args()
