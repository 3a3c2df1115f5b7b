"""kvtier's L3 as vLLM's secondary offloading tier, against the real vLLM 0.34 on CPU
(harness.py): two engines share chunks through the embedded store and through a
token-protected ``kvtier-l3`` server; models, dtypes, layouts and salts never share; an
evicting store, a chunk lost between lookup and load, and a killed server give misses and
failed jobs while every request finishes with the right bytes; config errors stop startup."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import TransferJob

from harness import BLOCK
from kvtier.vllm import VllmTierConfigError
from kvtier.vllm.tier import prefix_order
from l3proc import L3Process

from tier_engines import FULL, PROMPT, embedded, serve, tier


def test_two_engines_share_chunks_through_the_embedded_store(engines):
    t = embedded()
    e1 = engines([t])
    (a,) = serve(e1, [PROMPT])
    assert a.external_tokens == 0 and a.gpu_ok
    keys = [e1.tier.key(k) for k in e1.tier_keys_of(PROMPT)]
    assert len(keys) == 4 and all(e1.tier.store.is_exist(k) for k in keys)
    offloaded = [e1.tier.store.get(k) for k in keys]

    e2 = engines([t])  # a new engine id, an empty host cache, the same L3
    assert e2.vllm_config.kv_transfer_config.engine_id != e1.vllm_config.kv_transfer_config.engine_id
    (b,) = serve(e2, [PROMPT])
    assert b.external_tokens == FULL, "engine 2 loads every full block from L3"
    assert b.gpu_ok
    assert e2.tier.counters.chunks_loaded == 4 and e2.dma.loads >= 1
    # The bytes that reached engine 2's "GPU" blocks are engine 1's offloaded chunks.
    assert e2.gpu_bytes_of(b.req_id, PROMPT) == b"".join(offloaded)


def test_two_engines_share_a_kvtier_l3_server_with_a_token(engines):
    srv = L3Process(token="s3cret")
    try:
        t = tier(server=srv.addr, token="s3cret")
        e1 = engines([t])
        serve(e1, [PROMPT])
        assert e1.tier.counters.chunks_stored == 4 and not e1.tier.is_embedded
        e2 = engines([t])
        (b,) = serve(e2, [PROMPT])
        assert b.external_tokens == FULL and b.gpu_ok
        assert e2.tier.counters.chunks_loaded == 4
        with pytest.raises(VllmTierConfigError, match="did not accept"):
            engines([tier(server=srv.addr, token="wrong")])
        with pytest.raises(VllmTierConfigError, match="did not accept"):
            engines([tier(server=srv.addr)])
    finally:
        srv.kill()


@pytest.mark.parametrize("what", ["model", "dtype", "layout", "layers"])
def test_different_model_dtype_or_layout_never_hits(engines, what):
    t = embedded()
    e1 = engines([t])
    serve(e1, [PROMPT])
    other = {"model": dict(model="other-llama"), "dtype": dict(dtype="bfloat16"), "layout": dict(bpc=4),
             "layers": dict(layers=3)}[what]
    e2 = engines([t], **other)
    (b,) = serve(e2, [PROMPT])
    assert b.external_tokens == 0 and b.gpu_ok
    assert e2.tier.counters.lookup_hits == 0 and e2.tier.counters.chunks_loaded == 0
    assert e2.tier.namespace != e1.tier.namespace
    # The same engine shape does hit (the test can fail).
    e3 = engines([t], **other)
    (c,) = serve(e3, [PROMPT])
    assert c.external_tokens == FULL and c.gpu_ok


def test_a_different_cache_salt_never_hits(engines):
    t = embedded()
    serve(engines([t]), [PROMPT], salt="alice")
    (b,) = serve(engines([t]), [PROMPT], salt="bob")
    assert b.external_tokens == 0
    (c,) = serve(engines([t]), [PROMPT], salt="alice")
    assert c.external_tokens == FULL and c.gpu_ok


def test_tenants_are_separate_maps(engines):
    t = embedded()
    serve(engines([dict(t, tenant="a")]), [PROMPT])
    (b,) = serve(engines([dict(t, tenant="b")]), [PROMPT])
    assert b.external_tokens == 0
    (c,) = serve(engines([dict(t, tenant="a")]), [PROMPT])
    assert c.external_tokens == FULL


@pytest.mark.parametrize("where", ["embedded", "server"])
def test_starting_an_engine_on_a_full_store_evicts_nothing(engines, where):
    """An engine checks at startup that one chunk fits the store, without writing one: the
    probe put it made before evicted real chunks from a full store for every engine started
    (and made the evicting-store test below flaky)."""
    seg = 6 * 8192 + 4096
    srv = L3Process(token=None, segment_bytes=seg) if where == "server" else None
    try:
        t = tier(server=srv.addr) if srv else tier(segment_bytes=seg, name=f"t-{uuid.uuid4().hex[:8]}")
        prompts = [list(range(1000 * i, 1000 * i + FULL + 3)) for i in range(3)]
        e1 = engines([t])
        serve(e1, prompts)
        held = [e1.tier.key(k) for p in prompts for k in e1.tier_keys_of(p)
                if e1.tier.store.is_exist(e1.tier.key(k))]
        assert len(held) >= 4, "the store is full of chunks"
        for _ in range(3):
            engines([t])
        assert [k for k in held if e1.tier.store.is_exist(k)] == held
    finally:
        if srv:
            srv.kill()


def test_an_evicting_store_gives_misses_never_wrong_bytes(engines):
    # Room for ~6 chunks of 8 KiB: 12 prompts of 4 chunks each evict most of each other.
    t = tier(segment_bytes=6 * 8192 + 4096, name=f"t-{uuid.uuid4().hex[:8]}")
    prompts = [list(range(1000 * i, 1000 * i + FULL + 3)) for i in range(12)]
    e1 = engines([t])
    serve(e1, prompts)
    held = e1.tier.stats()["store_objects"]
    assert 0 < held < 12 * 4, "the store evicted"
    # What eviction left of each prompt is a prefix of it (the L3 ranks a batch's first key
    # most recent): a surviving chunk whose head was evicted is one no lookup can reach.
    # Before, the heads went first, and under concurrent store jobs no prompt kept a prefix.
    kept = []
    for p in prompts:
        left = [e1.tier.store.is_exist(e1.tier.key(k)) for k in e1.tier_keys_of(p)]
        assert left == sorted(left, reverse=True), f"a tail outlived its head: {left}"
        kept.append(sum(left))
    assert sum(kept) == held
    # Engine 2 first serves the prompt with the longest surviving prefix, alone (its lookup
    # comes before any store of engine 2's could evict it): it loads exactly that prefix.
    # Which prompt that is depends on how the four I/O threads interleaved engine 1's stores.
    best = max(range(12), key=kept.__getitem__)
    e2 = engines([t])
    (first,) = serve(e2, [prompts[best]])
    assert first.gpu_ok
    assert first.external_tokens == kept[best] * (FULL // 4), (kept, first.external_tokens)
    # The rest, newest first, while engine 2's stores evict what it might have hit: misses
    # and partial hits, never wrong bytes.
    done = serve(e2, [p for i, p in enumerate(prompts) if i != best][::-1])
    assert len(done) == 11 and all(f.gpu_ok for f in done)
    assert sum(f.external_tokens for f in done) < 11 * FULL, "the store could not hold every prompt"


def test_a_chunk_lost_between_lookup_and_load_is_recomputed(engines):
    t = embedded()
    e1 = engines([t])
    serve(e1, [PROMPT])
    e2 = engines([t])
    lost = [e1.tier.key(k) for k in e1.tier_keys_of(PROMPT)][2:]
    submit = e2.tier.submit_load

    def evict_then_load(job):  # the store evicts chunks 3 and 4 after lookup said HIT
        for k in lost:
            e2.tier.store.remove(k, True)
        submit(job)

    e2.tier.submit_load = evict_then_load
    (b,) = serve(e2, [PROMPT])
    assert b.gpu_ok, "recomputed, never wrong bytes"
    assert b.external_tokens == 2 * 2 * BLOCK, "the two chunks before the loss are kept"
    assert e2.tier.counters.load_failures == 1


def test_a_killed_server_fails_jobs_and_a_restart_resumes(engines):
    srv = L3Process(token="t0k")
    t = tier(server=srv.addr, token="t0k", rpc_timeout_ms=2000)
    try:
        e1 = engines([t])
        serve(e1, [PROMPT])
        srv.kill()
        fresh = list(range(5000, 5000 + FULL + 3))
        done = serve(e1, [PROMPT[:FULL] + [1, 2, 3, 4], fresh])  # lookups miss, stores fail
        assert all(f.gpu_ok for f in done) and len(done) == 2
        assert e1.tier.counters.store_failures >= 1
        srv = srv.restart()  # an empty server on the same address
        again = list(range(9000, 9000 + FULL + 3))
        serve(e1, [again])
        e3 = engines([t])
        (c,) = serve(e3, [again])
        assert c.external_tokens == FULL and c.gpu_ok, "service resumed after the restart"
    finally:
        srv.kill()


@pytest.mark.parametrize("bad,match", [
    (dict(segment_bytes="64MB", colour="blue"), "unknown config keys"),
    (dict(segment_bytes="lots"), "bad segment_bytes"),
    (dict(segment_bytes=4096), "cannot hold one vLLM chunk"),
    (dict(server="127.0.0.1:1"), "did not accept"),
    (dict(segment_bytes="64MB", io_threads=0), "io_threads"),
    (dict(segment_bytes="64MB", locality="moon"), "locality"),
    (dict(segment_bytes="64MB", io_threads="4"), "io_threads"),
    (dict(server="127.0.0.1:1", rpc_timeout_ms=-5), "rpc_timeout_ms"),
    (dict(segment_bytes="64MB", shard=[0, 0, 10 ** 9]), "shard is"),
    (dict(segment_bytes="64MB", shard="rank 1"), "shard is"),
    # sizes past u64 were an OverflowError from the extension (tier.py's _open)
    (dict(segment_bytes=2 ** 70), "segment_bytes"),
    (dict(segment_bytes="1000000000000TB"), "segment_bytes"),
    (dict(segment_bytes="64MB", ssd_capacity_bytes=2 ** 70), "ssd_capacity_bytes"),
    (dict(segment_bytes="64MB", tenant_quota_bytes=2 ** 70), "tenant_quota_bytes"),
    (dict(server="127.0.0.1:1", rpc_timeout_ms=2 ** 70), "rpc_timeout_ms"),
    # a quota under one chunk (8 KiB here): the tenant could never store a chunk
    (dict(segment_bytes="64MB", tenant_quota_bytes=8191), "tenant_quota_bytes"),
    (dict(segment_bytes="64MB", tenant_quota_bytes=0), "tenant_quota_bytes"),
    # an empty server gave an embedded 4 GB store (as kvtier_l3 "" did); not str: str(5)
    (dict(server=""), "server"),
    (dict(server=5), "server"),
    (dict(server="127.0.0.1:1", token=5), "token"),
    # a cap with no SSD tier to cap was ignored (an adversarial tester's case)
    (dict(segment_bytes="64MB", ssd_capacity_bytes="1GB"), "without ssd_dir"),
])
def test_config_errors_stop_startup(engines, bad, match):
    with pytest.raises(VllmTierConfigError, match=match):
        engines([tier(**bad)])


def test_a_refused_tier_leaves_no_store_behind(engines):
    """A tier refused for its quota opened nothing: a later tier of the same store name gets a
    store of its own segment only (a named embedded store adds every opener's segment)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    with pytest.raises(VllmTierConfigError, match="tenant_quota_bytes"):
        engines([embedded(name=name, tenant_quota_bytes=4096)])
    e = engines([embedded(name=name, tenant_quota_bytes=16384)])
    assert e.tier.store.stats()["mem_capacity_bytes"] == 64 << 20


def test_l3_objects_are_exactly_vllms_chunk_slots(engines):
    """Zero copy both ways: each L3 object is one host chunk slot's bytes."""
    t = embedded()
    e1 = engines([t])
    serve(e1, [PROMPT])
    for k in e1.tier_keys_of(PROMPT):
        obj = np.frombuffer(e1.tier.store.get(e1.tier.key(k)), dtype=np.uint8)
        assert obj.size == e1.tier.block_size_bytes


def test_jobs_run_off_the_scheduler_thread_and_drain(engines):
    """submit_* return at once; has_pending_work holds until the results are taken;
    drain_jobs waits for every job (vLLM's cache reset relies on it)."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    e = engines([embedded(io_threads=2)])
    t = e.tier
    keys = [bytes([i]) * 36 for i in range(8)]
    for j in range(4):
        t.submit_store(TransferJob(j, keys[2 * j:2 * j + 2], np.array([2 * j, 2 * j + 1]), False, ReqContext("x")))
    assert t.has_pending_work()
    t.drain_jobs()
    assert t.has_pending_work(), "finished but not yet handed to vLLM"
    done = list(t.get_finished_jobs())
    assert sorted(r.job_id for r in done) == [0, 1, 2, 3] and all(r.success for r in done)
    assert not t.has_pending_work() and t.counters.chunks_stored == 8
    t.submit_load(TransferJob(9, [keys[0], b"\xff" * 36], np.array([10, 11]), True, ReqContext("y")))
    t.drain_jobs()
    (r,) = t.get_finished_jobs()
    assert not r.success and list(r.successful_keys) == [keys[0]], "the missing second chunk fails the rest"


def test_metrics_through_vllms_hooks(engines):
    """The tier's metric definitions reach vLLM's spec (so its Prometheus logger registers
    them), and vLLM's scheduler reports the tier's counter increases and the embedded
    store's gauges in its stats every step."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvtier.vllm.tier import METRIC_PREFIX

    e = engines([embedded()])
    e.tier._clock = iter(range(0, 10**6, 2)).__next__  # a refresh interval passes every step
    defs = TieringOffloadingSpec.build_metric_definitions(e.vllm_config.kv_transfer_config.kv_connector_extra_config)
    assert METRIC_PREFIX + "chunks_stored" in defs and METRIC_PREFIX + "store_objects" in defs
    serve(e, [PROMPT])
    flats = [OffloadingConnectorStats(data=p).reduce() for p in e.stats_payloads]
    assert sum(f.get(METRIC_PREFIX + "chunks_stored", 0) for f in flats) == 4, "increases, summed: the total"
    assert [f[METRIC_PREFIX + "store_objects"] for f in flats if METRIC_PREFIX + "store_objects" in f][-1] == 4
    # vLLM asks every step: an idle tier reports nothing (a gauge keeps its last value; before,
    # the store's gauges were set on every step's payload).
    e.tier.get_stats()
    assert e.tier.get_stats() is None


def test_the_tier_asks_its_store_at_most_once_per_refresh_interval(engines):
    """vLLM asks for stats every engine step, and an embedded store's ``stats()`` walks every
    object under the store's lock (118 µs a call at a few thousand objects, measured in
    bindings/bench/vllm_manager_cost.py's tiering row; it was called at every step whose
    counters moved). The tier reports its own counter increases every step without calling
    the store, and asks the store for its gauges at most once per ``GAUGE_REFRESH_S``: what
    its own stores and what another user of the store (another rank's tier: here a remove
    from outside the tier) changed is reported at the first step after the interval, busy or
    idle."""
    from kvtier.vllm.tier import GAUGE_REFRESH_S, METRIC_PREFIX

    e = engines([embedded()])
    asked = []
    now = [1000.0]

    class Counted:  # the tier's store, counting calls of stats()
        def __init__(self, store):
            self._store = store

        def stats(self):
            asked.append(1)
            return self._store.stats()

        def __getattr__(self, name):
            return getattr(self._store, name)

    e.tier.store = Counted(e.tier.store)
    e.tier._clock = lambda: now[0]
    e.tier.get_stats()
    asked.clear()
    for _ in range(5):
        assert e.tier.get_stats() is None
    assert not asked, "an idle step called into the store"
    serve(e, [PROMPT])  # the tier stores 4 chunks over several steps: its counters move
    got = e.tier.get_stats()  # (vLLM's own steps asked too: whatever is left is reported)
    assert not asked, "a busy step within the interval called into the store"
    assert e.tier.counters.chunks_stored == 4
    now[0] += GAUGE_REFRESH_S
    got = e.tier.get_stats()
    assert len(asked) == 1 and got is not None and got.reduce()[METRIC_PREFIX + "store_objects"] == 4
    asked.clear()
    e.tier.store.remove(e.tier.key(e.tier_keys_of(PROMPT)[0]), False)
    assert e.tier.get_stats() is None and not asked, "within the refresh interval: not asked"
    now[0] += GAUGE_REFRESH_S
    got = e.tier.get_stats()
    assert asked and got is not None and got.reduce()[METRIC_PREFIX + "store_objects"] == 3


def test_a_server_tier_answers_its_own_chunks_without_a_probe_and_forgets_lost_ones(engines):
    """Against a server, chunks this engine stored are HIT at once (no RETRY step); after
    vLLM resets its GPU and host caches (which drains the tier's jobs) they load from L3.
    When the server lost them (restart), that HIT's load fails, vLLM recomputes with the
    right bytes, and the next lookup probes instead of trusting the stale knowledge."""
    srv = L3Process(token="k")
    try:
        e = engines([tier(server=srv.addr, token="k")])
        serve(e, [PROMPT])
        assert e.sched.reset_prefix_cache(reset_connector=True)
        retries = e.tier.counters.lookup_retries
        (b,) = serve(e, [PROMPT])
        assert b.external_tokens == FULL and b.gpu_ok
        assert e.tier.counters.lookup_retries == retries, "no probe for chunks it stored"
        srv = srv.restart()  # an empty server: the engine's knowledge is stale
        assert e.sched.reset_prefix_cache(reset_connector=True)
        (c,) = serve(e, [PROMPT])
        assert c.gpu_ok and c.external_tokens == 0 and e.tier.counters.load_failures >= 1
        assert e.sched.reset_prefix_cache(reset_connector=True)
        retries = e.tier.counters.lookup_retries
        (d,) = serve(e, [PROMPT])  # c's recompute stored the chunks again: hits once more
        assert d.gpu_ok and d.external_tokens == FULL
    finally:
        srv.kill()


def test_a_tenant_quota_keeps_one_tenant_to_its_share_of_the_store(engines):
    # Chunks are 8 KiB: tenant "a" may hold two of them; tenant "b" has no cap.
    name = f"t-{uuid.uuid4().hex[:8]}"
    ea = engines([embedded(name=name, tenant="a", tenant_quota_bytes=2 * 8192)])
    eb = engines([dict(embedded(name=name), tenant="b")])
    serve(eb, [PROMPT])
    prompts = [list(range(5000 * (i + 1), 5000 * (i + 1) + FULL + 3)) for i in range(6)]
    serve(ea, prompts)
    held = [k for p in prompts for k in ea.tier_keys_of(p) if ea.tier.store.is_exist(ea.tier.key(k))]
    assert 0 < len(held) <= 2, held
    # The uncapped tenant kept everything, and a new engine of it hits in full.
    (b2,) = serve(engines([dict(embedded(name=name), tenant="b")]), [PROMPT])
    assert b2.external_tokens == FULL and b2.gpu_ok


def test_a_tenant_quota_is_for_embedded_stores_only(engines):
    with pytest.raises(VllmTierConfigError, match="--tenant-quota"):
        engines([tier(server="127.0.0.1:1", tenant_quota_bytes="1GB")])
    with pytest.raises(VllmTierConfigError, match="tenant_quota_bytes"):
        engines([embedded(tenant_quota_bytes="lots")])


def test_a_failed_load_does_not_resolve_a_probe_in_flight():
    """Against a server, a failed load marks its keys missing in vLLM's lookup cache. If a
    newer probe of one of them is in flight (another request asked after the load began,
    then the server died), vLLM 0.32's ``mark_miss`` forced it to RESOLVED and the probe's
    result then tripped ``drain_results``' assert: the engine died (the real-engine test
    that SIGKILLs the server saw it under load). Now the probe's own result lands."""
    import threading

    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.async_lookup import LookupPhase

    from kvtier.vllm.tier import _ServerLookups

    gate = threading.Event()
    asked = threading.Event()

    class Store:
        def batch_is_exist(self, keys):
            return [1] * len(keys)

    class Tier:
        tier_type = "kvtier"

        def key(self, k):
            return bytes(k).hex()

        def _io(self, call):
            asked.set()
            gate.wait(30)
            return call(Store())

    lookups = _ServerLookups(Tier())
    try:
        key = b"\x01" * 36
        assert lookups.lookup(key, ReqContext(req_id="b")) is None  # a probe, queued
        lookups.flush()  # in flight: the worker is inside batch_lookup
        assert asked.wait(30) and lookups._lookup_state[key].phase is LookupPhase.IN_FLIGHT
        lookups.mark_miss([key])  # request a's load of the key failed meanwhile
        gate.set()
        for _ in range(3000):
            if not lookups._pending_results.empty():
                break
            threading.Event().wait(0.01)
        assert lookups.lookup(key, ReqContext(req_id="b")) is True  # drained: the probe's verdict
        lookups.mark_miss([key])  # a resolved verdict is overridden by a failed load
        assert lookups.lookup(key, ReqContext(req_id="b")) is False
    finally:
        gate.set()
        lookups.shutdown()


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 12), known=st.lists(st.booleans(), min_size=12, max_size=12), perm=st.randoms())
def test_a_job_reaches_the_store_head_first(n, known, perm):
    # vLLM hands a job's keys in no order (a set of finished chunks); the tier puts them in
    # the order of their end-token positions, chunk ids alongside; keys vLLM gave no position
    # keep their order after the rest.
    keys = [make_offload_key(i.to_bytes(4, "big"), 0) for i in range(n)]
    ctx = ReqContext(req_id="r")
    for i, k in enumerate(keys):
        if known[i]:
            ctx.set_offload_key_position(k, (i + 1) * 32)
    shuffled = list(range(n))
    perm.shuffle(shuffled)
    job = TransferJob(job_id=1, keys=[keys[i] for i in shuffled], chunk_ids=np.array([100 + i for i in shuffled]),
                      is_promotion=False, req_context=ctx)
    out, ids = prefix_order(job)
    placed = [i for i in range(n) if known[i]]
    unplaced = [i for i in shuffled if not known[i]]
    assert out == [keys[i] for i in placed + unplaced]
    assert ids.tolist() == [100 + i for i in placed + unplaced]
