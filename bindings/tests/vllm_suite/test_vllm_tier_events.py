"""kvtier's L3 tier in vLLM 0.34 (harness.py) and KV events: the tier's events name the
chunks it stored, the store's own stream announces each put once and every loss under the
block hashes vLLM stored them with, and names every engine's chunks as vLLM does (one
stream per model on a shared server)."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from harness import BLOCK, Engine
from l3proc import L3Process

from tier_engines import PROMPT, embedded, serve, tier


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
    from manager_engines import kvtier_config

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
