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

import uuid

from harness import BLOCK, Engine
from test_vllm_manager import kvtier_config, prompt, run_checked

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


def test_a_store_short_of_slots_while_holds_land_is_retried_not_dropped(tmp_path):
    """The last request of round 1 stays in vLLM's GPU prefix cache, so in round 2 it runs at
    once, computing its two new chunks, while the prefetches of the requests ahead of it
    are still landing and take every host slot (a landing hold cannot give way: its bytes
    are being written). Its prefix left the host but is in L3, and kvtier answered its store
    with nothing to store: vLLM moved past the chunks and never offered them again (the
    real engine: 5 of 6 extended prompts reused whole, under load). A store of chunks L3
    lacks that finds no slot is now refused (vLLM offers it again next step), and lands once
    the holds landed and gave way."""
    _, (r2, r3) = _three_rounds(tmp_path, reset_gpu=False)
    assert r2 == [PREFIX] * N, r2
    assert r3 == [EXTENDED] * N, r3
