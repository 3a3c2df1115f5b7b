"""kvtier's L3 as vLLM's secondary offloading tier, against the real vLLM 0.34 on CPU
(harness.py): two engines share chunks through the embedded store and through a
token-protected ``kvtier-l3`` server; models, dtypes, layouts and salts never share; an
evicting store, a chunk lost between lookup and load, and a killed server give misses and
failed jobs while every request finishes with the right bytes; config errors stop startup."""

from __future__ import annotations

import logging
import time
import uuid

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import TransferJob

from harness import BLOCK, Engine
from kvtier.vllm import VllmTierConfigError
from kvtier.vllm.tier import prefix_order
from l3proc import L3Process

PROMPT = list(range(100, 100 + BLOCK * 8 + 5))  # 8 full blocks = 4 chunks of 2 blocks
FULL = BLOCK * 8


def tier(**kw):
    return {"type": "KvtierSecondaryTier", "module_path": "kvtier.vllm", **kw}


def embedded(**kw):
    kw.setdefault("name", f"t-{uuid.uuid4().hex[:8]}")
    return tier(segment_bytes="64MB", **kw)


def serve(engine: Engine, prompts, salt=None):
    for i, p in enumerate(prompts):
        engine.add(f"r{i}-{uuid.uuid4().hex[:6]}", p, cache_salt=salt)
    engine.run()
    return [engine.finished[r] for r in list(engine.finished)[-len(prompts):]]


@pytest.fixture
def engines(tmp_path):
    made = []

    def make(tiers, **kw):
        e = Engine(str(tmp_path), tiers, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


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


def test_kv_events_name_the_chunks_the_tier_stored(engines):
    """With vLLM's KV events on, the tier's stores reach vLLM's published event batches as
    BlockStored on the STORAGE medium, for exactly the chunks the host cache stored (what a
    KV-aware router reads)."""
    e = engines([embedded()], kv_events=True)
    serve(e, [PROMPT])
    events = [ev for b in e.published for ev in b.events]

    def stored(medium):
        return [h for ev in events if type(ev).__name__ == "BlockStored" and ev.medium == medium
                for h in ev.block_hashes]

    assert len(stored("STORAGE")) == 4 and set(stored("STORAGE")) == set(stored("CPU"))
    off = engines([embedded()])
    serve(off, [PROMPT])
    assert not off.tier.take_events(), "no events unless vLLM's KV events are on"


def test_storage_events_announce_each_put_once_and_every_loss(engines):
    """An adversarial tester's router view: in tier mode the STORAGE events announced again
    every chunk whose put found it stored already (136 duplicates in one run), and never a
    removal: against an 8 MB store the events held three times what it could. A put that
    finds the chunk there is not announced again; with ``loss_journal`` the chunks the store
    reports lost are announced removed. Where kvtier's manager owns the tier, no event is
    queued at all (nobody takes them: the queue grew by one per store)."""
    e = engines([embedded(loss_journal=True)], kv_events=True)
    serve(e, [PROMPT])
    okeys = e.tier_keys_of(PROMPT)
    events = [ev for b in e.published for ev in b.events if getattr(ev, "medium", None) == "STORAGE"]
    assert sorted(h for ev in events if type(ev).__name__ == "BlockStored" for h in ev.block_hashes) \
        == sorted(set(h for ev in events for h in ev.block_hashes)), "each chunk announced once"
    # the same chunks put again (a re-cascade): stored, "already exists", not announced
    e.tier._store_job(10_000, okeys, np.arange(len(okeys)))
    assert e.tier.take_events() == []
    # the store loses one chunk: announced removed, once
    e.tier.store.remove(e.tier.key(okeys[0]), True)
    (gone,) = e.tier.take_events()
    assert gone.removed and list(gone.keys) == [okeys[0]]
    assert e.tier.take_events() == []
    # kvtier's manager with L3 and vLLM's events on: its tier queues nothing
    from test_vllm_manager import kvtier_config

    spec = Engine(e.root, [], kv_config=kvtier_config(8, kvtier_l3={"segment_bytes": "64MB"}),
                  kv_events=True)
    try:
        serve(spec, [PROMPT])
        (t,) = spec.manager.l3_ranks
        assert t.counters.chunks_stored >= 1 and t._events is None
    finally:
        spec.close()


def _tracks_residency() -> bool:
    """Whether this vLLM's self-describing KV events keep a chunk's metadata per residency:
    ``OffloadingEvent`` carries ``ownership`` and ``removal_expected`` and the connector has
    ``OffloadingEventsTracker`` (0.32, 0.33 and 0.34 all do)."""
    import dataclasses

    from vllm.v1.kv_offload.base import OffloadingEvent

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (  # noqa: F401
            OffloadingEventsTracker,
        )
    except ImportError:
        return False
    return {"ownership", "removal_expected"} <= {f.name for f in dataclasses.fields(OffloadingEvent)}


def test_a_lost_chunk_is_removed_under_the_block_hashes_it_was_stored_with(engines):
    """A router's stale index under vLLM's self-describing KV events
    (``self_describing_kv_events``): vLLM's ``OffloadingEventsTracker`` keeps a chunk's
    metadata (its block hashes, tokens, parent) only while a residency holds it — the host
    cache's, set by the scheduler, or a secondary tier's ``(medium, ownership)``, set only by
    a stored event with ``removal_expected``. kvtier's tier set neither, so once the host cache
    evicted a chunk the tracker forgot it, and the tier's later removal of its STORAGE copy
    (the store lost it: ``loss_journal``) was published under the offload key's placeholder
    hash, not the chunk's block hashes its ``BlockStored`` had named: a router never removed
    them. Driven through vLLM's own scheduler, connector and tiering manager: engine stores a
    prompt (host cache and kvtier's store), a second prompt evicts it from the 4-chunk host
    cache, the store loses one chunk. Skipped only on a vLLM without per-residency event
    metadata (none of 0.32, 0.33, 0.34: it runs on each)."""
    if not _tracks_residency():
        pytest.skip("this vLLM's OffloadingEvent has no ownership / removal_expected")
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.request import Request
    from vllm.sampling_params import SamplingParams

    e = engines([embedded(loss_journal=True)], kv_events=True, cpu_bytes=4 * 2 * 4096,
                extra={"self_describing_kv_events": True})
    assert e.page * e.bpc == 2 * 4096  # four host chunks: the next prompt evicts PROMPT's
    serve(e, [PROMPT])
    other = [t + 5000 for t in PROMPT]
    serve(e, [other])
    okeys = e.tier_keys_of(PROMPT)
    r = Request("h", list(PROMPT), SamplingParams(max_tokens=1), pooling_params=None, block_hasher=e.hasher)
    chunk = [maybe_convert_block_hash(h) for h in r.block_hashes[:e.bpc]]  # chunk 0's blocks

    def of(kind, medium):
        return [ev for b in e.published for ev in b.events
                if type(ev).__name__ == kind and getattr(ev, "medium", None) == medium]

    assert any(set(chunk) <= set(ev.block_hashes) for ev in of("BlockRemoved", "CPU")), \
        "the host cache evicted PROMPT's first chunk"
    (stored,) = [ev for ev in of("BlockStored", "STORAGE") if chunk[-1] in ev.block_hashes]
    assert list(stored.block_hashes) == chunk and list(stored.token_ids) == PROMPT[:e.bpc * BLOCK], \
        "kvtier's STORAGE copy announced with the chunk's own block hashes and tokens"
    assert not of("BlockRemoved", "STORAGE")
    # the store loses chunk 0 (evicted, removed): the next step's events announce it removed
    e.tier.store.remove(e.tier.key(okeys[0]), True)
    e.step()
    (removed,) = of("BlockRemoved", "STORAGE")
    assert list(removed.block_hashes) == chunk, \
        f"removed under {removed.block_hashes}, stored under {chunk}: a router keeps the chunk"
    assert removed.ownership == stored.ownership


@pytest.mark.parametrize("journal", ["off", "server keeps none", "server restarted without one"])
def test_without_a_loss_journal_vllm_keeps_no_block_hashes_for_the_tier(engines, journal):
    """The other side of the test above: vLLM keeps a stored chunk's block hashes until its
    removal is announced, so the tier asks for that (``removal_expected``) only where it will
    announce one. Without ``loss_journal`` it never does. With it, against a ``kvtier-l3``
    run without a journal (``--loss-journal-keys 0``), the tier learns so at its first read of
    the journal (a step after the engine's first, before any chunk is stored); against one
    restarted without a journal, after it announced chunks: it then lets vLLM drop their
    hashes without announcing a removal (``metadata_only``, vLLM 0.33 on; 0.32 has no such
    event, and that case is skipped there). Either way, once the host cache evicted the
    prompt, vLLM's tracker holds none of its chunks and no STORAGE removal was published."""
    if not _tracks_residency():
        pytest.skip("this vLLM's OffloadingEvent has no ownership / removal_expected")
    from kvtier.vllm.compat import event_has

    srv = None
    if journal == "off":
        t = embedded()
    else:
        if journal == "server restarted without one" and not event_has("metadata_only"):
            pytest.skip("vLLM 0.32 has no metadata_only event to let go of a chunk without a removal")
        srv = L3Process(token=None, extra=["--loss-journal-keys", "0"] if journal == "server keeps none" else [])
        t = tier(server=srv.addr, loss_journal=True)
    try:
        e = engines([t], kv_events=True, cpu_bytes=4 * 2 * 4096, extra={"self_describing_kv_events": True})
        okeys = e.tier_keys_of(PROMPT)
        serve(e, [PROMPT])
        if journal == "server restarted without one":
            assert e.tier._journal and e.tier._announced == set(okeys)  # announced, removal expected
            srv.kill()
            srv = L3Process(token=None, addr=srv.addr, extra=["--loss-journal-keys", "0"])
        serve(e, [[t + 5000 for t in PROMPT]])  # evicts PROMPT from the 4-chunk host cache
        for _ in range(4):  # a server's journal is read on an I/O thread, answered a step later
            e.step()
            time.sleep(0.05)
        events = [ev for b in e.published for ev in b.events]
        assert any(type(ev).__name__ == "BlockStored" and ev.medium == "STORAGE" for ev in events)
        assert not [ev for ev in events if type(ev).__name__ == "BlockRemoved" and ev.medium == "STORAGE"]
        held = e.cs._events_tracker._pending_event_metadata  # noqa: SLF001 (vLLM's own state)
        kept = len(set(okeys) & set(held))
        assert kept == 0, f"vLLM keeps {kept} evicted chunks' block hashes for a removal never coming"
        assert not e.tier._journal and not e.tier._announced
    finally:
        if srv is not None:
            srv.kill()


def _store_snapshot(replay: str, topic: bytes = b"") -> set:
    """The STORAGE hashes a ``kvtier-l3 --kv-events`` stream holds now: its replay socket's
    snapshot (kvtier's request -2), each batch decoded with vLLM's own msgspec classes; every
    batch must name ``topic``."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored, KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context()
    try:
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.RCVTIMEO, 5000)
        d.connect(replay)
        d.send_multipart([b"", (-2).to_bytes(8, "big", signed=True)])
        out: set = set()
        while True:
            empty, got, seq, payload = d.recv_multipart()  # vLLM 0.32's replies
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                return out
            assert got == topic, (got, topic)
            for ev in decoder.decode(payload).events:
                if isinstance(ev, AllBlocksCleared):
                    out.clear()
                else:
                    assert isinstance(ev, BlockStored) and ev.medium == "STORAGE", ev
                    out.update(ev.block_hashes)
    finally:
        ctx.destroy(linger=0)


def test_the_stores_stream_names_every_engines_chunks_as_vllm_does(engines, tmp_path):
    """The shared store's own stream (``kvtier-l3 --kv-events``) publishes each chunk kvtier's
    tier wrote under the hash vLLM's scheduler publishes for that chunk — the one a router
    indexing vLLM's events already holds — for every engine that shares the store, where each
    engine's stream names only its own stores; a chunk the store dropped leaves the stream."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.kv_offload.base import get_offload_block_hash

    replay = f"ipc://{tmp_path}/store-replay"
    srv = L3Process(token="k", extra=["--kv-events", f"ipc://{tmp_path}/store-events",
                                      "--kv-events-replay", replay])
    try:
        a = engines([tier(server=srv.addr, token="k")], kv_events=True)
        b = engines([tier(server=srv.addr, token="k")], kv_events=True)
        other = list(range(5000, 5000 + BLOCK * 6 + 3))  # 3 chunks of its own
        serve(a, [PROMPT])
        serve(b, [other])

        def storage(e):
            return {h for batch in e.published for ev in batch.events
                    if type(ev).__name__ == "BlockStored" and ev.medium == "STORAGE" for h in ev.block_hashes}

        def vllm_hashes(e, tokens):
            return {maybe_convert_block_hash(get_offload_block_hash(k)) for k in e.tier_keys_of(tokens)}

        want_a, want_b = vllm_hashes(a, PROMPT), vllm_hashes(b, other)
        assert len(want_a) == 4 and len(want_b) == 3 and not want_a & want_b
        assert storage(a) == want_a and storage(b) == want_b, "each engine names its own stores"
        deadline = time.monotonic() + 10
        while _store_snapshot(replay) != want_a | want_b and time.monotonic() < deadline:
            time.sleep(0.05)  # the store publishes every 10 ms
        assert _store_snapshot(replay) == want_a | want_b
        # A chunk the store no longer holds leaves its stream (the engines cannot know).
        gone = a.tier.key(a.tier_keys_of(PROMPT)[-1])
        a.tier.store.remove(gone, False)
        last = maybe_convert_block_hash(get_offload_block_hash(a.tier_keys_of(PROMPT)[-1]))
        deadline = time.monotonic() + 10
        while last in _store_snapshot(replay) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _store_snapshot(replay) == (want_a - {last}) | want_b
    finally:
        srv.kill()


def test_two_models_on_one_server_each_get_the_stream_their_tier_logs(engines, tmp_path, caplog):
    """The namespace is a hash an operator cannot guess: each tier logs it at startup as the
    ``--kv-events-stream`` value for its model. Given those, one ``kvtier-l3`` publishes a
    stream per model (its topic the namespace): the same prompt served by a float32 and a
    bfloat16 engine (equal vLLM block hashes) reaches each model's stream only when that
    model stored it."""
    import re

    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.kv_offload.base import get_offload_block_hash

    def logged(**kw):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvtier.vllm.tier"):
            e = engines([embedded()], **kw)
        m = re.search(r"--kv-events-stream (\S+)=PUB", caplog.text)
        assert m and m.group(1) == e.tier.namespace, caplog.text
        return m.group(1)

    ns_a, ns_b = logged(), logged(dtype="bfloat16")
    assert ns_a != ns_b
    rep = {ns: f"ipc://{tmp_path}/{i}-replay" for i, ns in enumerate((ns_a, ns_b))}
    extra = []
    for i, ns in enumerate((ns_a, ns_b)):
        extra += ["--kv-events-stream", f"{ns}=ipc://{tmp_path}/{i}-events,{rep[ns]}"]
    srv = L3Process(token=None, extra=extra)
    try:
        a = engines([tier(server=srv.addr)])
        b = engines([tier(server=srv.addr)], dtype="bfloat16")
        assert (a.tier.namespace, b.tier.namespace) == (ns_a, ns_b)
        want = {maybe_convert_block_hash(get_offload_block_hash(k)) for k in a.tier_keys_of(PROMPT)}
        assert want == {maybe_convert_block_hash(get_offload_block_hash(k)) for k in b.tier_keys_of(PROMPT)}

        def snapshot_becomes(ns, expect):
            deadline = time.monotonic() + 10
            while _store_snapshot(rep[ns], ns.encode()) != expect and time.monotonic() < deadline:
                time.sleep(0.05)  # the store publishes every 10 ms
            return _store_snapshot(rep[ns], ns.encode())

        serve(a, [PROMPT])
        assert snapshot_becomes(ns_a, want) == want
        assert snapshot_becomes(ns_b, set()) == set(), "the bfloat16 model stored nothing"
        serve(b, [PROMPT])
        assert snapshot_becomes(ns_b, want) == want
    finally:
        srv.kill()


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
