"""Held L3 prefetches against a running request's stores (``KvtierOffloadingSpec`` with
kvtier's L3), through vLLM's real scheduler and connector (harness.py).

Why: while a request's prefix loads, vLLM looks up the requests waiting behind it, and kvtier
prefetches their prefixes from L3 and holds them on host until they load
(``prepare_prefetch_held``). With a small host tier those holds took every slot the running
request's new chunks needed; vLLM offers each chunk once, so the chunks were never stored
and the extended prompt was reused only up to its old prefix the next time (the real engine:
1 of 6 extended prompts reused whole, vllm_engine/test_vllm_engine_extend.py). A store of
chunks L3 does not hold now displaces the landed holds of waiting requests (their pages are
in L3 by construction: the waiting request prefetches them again), newest first; and a store
of such chunks that finds no slot (holds still landing) is refused, so vLLM offers it again.
"""

from __future__ import annotations

import hashlib
import uuid

from harness import BLOCK, Engine
from hypothesis import given, settings
from hypothesis import strategies as st
from manager_engines import kvtier_config, prompt, run_checked
from vllm.v1.kv_offload.base import ReqContext

from kvtier.vllm import KvtierOffloadingManager, page_of

CHUNK = 2 * BLOCK
PREFIX, EXTENDED = 4, 6  # chunks: four prefixes of 4 chunks through 8 host slots, then 6 each


def _engine(tmp_path) -> Engine:
    kv = kvtier_config(8, kvtier_l3={"segment_bytes": "64MB", "name": uuid.uuid4().hex}, kvtier_room_wait_ms=60_000)
    # One request at a time, a KV budget of one extended prompt: a request waits behind the
    # running one, looked up (and prefetched for) while the running one loads.
    return Engine(str(tmp_path), [], kv_config=kv, max_num_seqs=1, num_gpu_blocks=EXTENDED * 2 + 2)


N = 4  # prompts


def _three_rounds(tmp_path, reset_gpu: bool):
    """Round 1: the four prefixes one at a time (the host keeps the last two, L3 all four);
    round 2: each extended by two chunks, added at once (after vLLM's GPU prefix cache is
    reset, or not: then the last prefix is still in it); round 3, after a reset: the extended
    prompts again. The engine, ready for more checks, and the chunks each request of rounds 2
    and 3 reused; kvtier's check ran after every step, every forward read the right bytes,
    and nothing stays held or locked."""
    e = _engine(tmp_path)
    try:
        for i in range(N):
            e.add(f"a{i}", prompt(i, PREFIX))
            run_checked(e)
        if reset_gpu:
            e.reset_gpu_cache()
        for i in range(N):
            e.add(f"b{i}", prompt(i, EXTENDED))
        run_checked(e)
        e.reset_gpu_cache()
        for i in range(N):
            e.add(f"c{i}", prompt(i, EXTENDED, extra=7))
        run_checked(e)
        assert all(f.gpu_ok for f in e.finished.values())
        assert e.manager.native.holds() == (0, 0, 0) and e.manager.native.usage()["locked"] == 0
        return e, [[e.finished[f"{r}{i}"].external_tokens // CHUNK for i in range(N)] for r in "bc"]
    finally:
        e.close()


def test_a_running_requests_new_chunks_displace_held_prefetches_of_waiting_requests(tmp_path):
    e, (r2, r3) = _three_rounds(tmp_path, reset_gpu=True)
    assert r2 == [PREFIX] * N, r2
    assert e.manager.counters.holds_displaced > 0  # the waiting requests' holds gave way
    assert r3 == [EXTENDED] * N, r3  # every extended prefix was kept (host or L3), whole


def _keys(p: int, n: int):
    return [hashlib.sha256(b"holds-%d-%d" % (p, i)).digest() + (0).to_bytes(4, "big") for i in range(n)]


_OPS = st.lists(st.one_of(
    st.tuples(st.just("store"), st.integers(0, 3), st.integers(1, 6)),  # a request offers a prompt's chunks
    st.tuples(st.just("complete"), st.integers(0, 7), st.booleans()),  # a store's copy ends (ok or not)
    st.tuples(st.just("l3"), st.integers(0, 3), st.integers(1, 6)),  # L3 found a prompt's first chunks
    st.tuples(st.just("hold"), st.integers(0, 3), st.integers(1, 6)),  # a waiting request's held prefetch
    st.tuples(st.just("land"), st.integers(0, 7), st.integers(0, 6)),  # it lands (that many pages read)
    st.tuples(st.just("release"), st.integers(0, 7)),  # its requester loads, or ends
), max_size=40)


@settings(max_examples=200, deadline=None)
@given(slots=st.integers(2, 8), ops=_OPS)
def test_vllm_moves_past_an_offered_chunk_only_if_a_tier_holds_it(slots, ops):
    """vLLM offers each chunk once: an answer that stores nothing moves it past the chunks.
    Under any interleaving of stores, their completions, held prefetches (landing, landed,
    released) and chunks found in L3, ``prepare_store`` stores nothing only when every offered
    chunk is on host, being stored or in L3; and it refuses (None: vLLM offers them again)
    only when one of them is in no tier. kvtier's check holds after every call."""
    m = KvtierOffloadingManager(slots, {0: 64})
    n = m.native
    stores, holds = [], []  # (keys stored, request); held prefetch jobs (landing or not)
    for step, op in enumerate(ops):
        kind = op[0]
        if kind == "store":
            keys = _keys(op[1], op[2])
            ctx = ReqContext(req_id=f"r{step}")
            for i, k in enumerate(keys):
                ctx.set_offload_key_position(k, 64 * (i + 1))
            out = m.prepare_store(keys, ctx)
            pages = [page_of(k) for k in keys]
            where = [n.lookup(pages[: i + 1], i) for i in range(len(pages))]
            if out is None:
                assert "miss" in where, (where, n.usage())
            elif not out.keys_to_store:
                assert "miss" not in where, (where, n.usage())
            else:
                stores.append((list(out.keys_to_store), ctx))
        elif kind == "complete" and stores:
            keys, ctx = stores.pop(op[1] % len(stores))
            m.complete_store(keys, ctx, success=op[2])
        elif kind == "l3":
            n.l3_found([page_of(k) for k in _keys(op[1], op[2])])
        elif kind == "hold":
            pages = [page_of(k) for k in _keys(op[1], op[2])]
            host = n.host_prefix(pages)
            if host < len(pages) and n.lookup(pages[: host + 1], host) == "in-l3":
                plan = n.prepare_prefetch_held(pages, host + 1)
                if plan is not None:
                    holds.append((plan[0], len(plan[2]), False))
        elif kind == "land":
            landing = [i for i, h in enumerate(holds) if not h[2]]
            if landing:
                i = landing[op[1] % len(landing)]
                job, size, _ = holds[i]
                n.complete_prefetch(job, min(op[2], size))
                holds[i] = (job, size, True)
        elif kind == "release" and holds:
            job, _, landed = holds.pop(op[1] % len(holds))
            n.release_hold(job)
            if not landed:
                n.complete_prefetch(job, 0)  # its copy ends too (the engine dropped it)
        n.check()
