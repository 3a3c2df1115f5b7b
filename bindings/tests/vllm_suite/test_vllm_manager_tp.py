"""kvtier's manager under tensor parallelism: TP 2 through the real vLLM scheduler (it counts
``world_size`` completions of every job), two ``OffloadingConnectorWorker`` ranks, each with
its own "GPU" (its KV heads: different bytes per rank) and its own shard of every host slot,
and vLLM's ``KVOutputAggregator`` merging their outputs (harness.py). With kvtier's L3 each
rank's shard goes to and comes from L3 under its own key, and the two ranks' outcomes are
agreed by ``kvtier.RankAgreement`` (manager_l3.py). kvtier's check runs after every engine
step, and every request's forward checks the bytes of its loaded blocks on both ranks."""

from __future__ import annotations

import threading
import time
import uuid

from harness import BLOCK, Engine
from l3proc import L3Process
from manager_engines import kvtier_config, prompt, run_checked
from vllm.v1.request import RequestStatus

from kvtier.vllm import KvtierOffloadingManager, page_of

CHUNK = 2 * BLOCK


def tp_engine(root, chunks: int = 64, l3_name=None, **kw) -> Engine:
    extra = {} if l3_name is None else {"kvtier_l3": {"segment_bytes": "64MB", "name": l3_name}}
    e = Engine(str(root), [], kv_config=kvtier_config(chunks, **extra), tp=2, **kw)
    assert isinstance(e.manager, KvtierOffloadingManager)
    assert e.vllm_config.parallel_config.world_size == 2
    return e


def test_tp2_host_tier_counts_both_ranks_and_loads_each_ranks_own_bytes(tmp_path):
    e = tp_engine(tmp_path)
    try:
        p = prompt(1, 4)
        e.ranks[1].dma.hold_stores = True  # rank 1's copy to host is slow
        e.add("a", p)
        for _ in range(4):
            e.step()
            e.manager.check()
        pages = [page_of(k) for k in e.tier_keys_of(p)]
        assert e.manager.native.lookup(pages, 3) == "pending", "rank 0 alone does not complete a store"
        e.ranks[1].dma.release()
        run_checked(e)
        assert e.manager.native.lookup(pages, 3) == "hit"
        e.reset_gpu_cache()
        e.add("b", p)
        run_checked(e)
        f = e.finished["b"]
        assert f.gpu_ok and f.external_tokens == 4 * CHUNK, f
        assert [rk.dma.loads for rk in e.ranks] == [1, 1]
        assert e.ranks[0].read["b"] != e.ranks[1].read["b"], "each rank loaded its own shard"
    finally:
        e.close()


def test_tp2_an_abort_while_one_rank_still_loads_unpins_and_loads_again(tmp_path):
    e = tp_engine(tmp_path, chunks=32)
    try:
        p = prompt(1, 4)
        e.add("a", p)
        run_checked(e)
        e.reset_gpu_cache()
        e.ranks[1].dma.hold_loads = True
        e.add("b", p)
        for _ in range(3):
            e.step()
            e.manager.check()
        assert e.manager.native.usage()["loads"] == 1
        e.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        e.manager.check()
        e.ranks[1].dma.release()
        run_checked(e)
        u = e.manager.native.usage()
        assert (u["loads"], u["locked"]) == (0, 0), u
        e.reset_gpu_cache()
        e.add("c", p)
        run_checked(e)
        assert e.finished["c"].gpu_ok and e.finished["c"].external_tokens == 4 * CHUNK
    finally:
        e.close()


def _offload_and_evict(e: Engine, p) -> None:
    """Runs ``p`` (backed up to L3 by both ranks), then two other prompts through the 8 host
    slots, so that ``p`` is in L3 only."""
    e.add("a", p)
    run_checked(e)
    for i in (2, 3):
        e.add(f"x{i}", prompt(i, 4))
        run_checked(e)
    pages = [page_of(k) for k in e.tier_keys_of(p)]
    assert e.manager.native.host_prefix(pages) == 0 and e.manager.native.lookup(pages, 3) == "in-l3"


def test_tp2_each_rank_backs_up_and_prefetches_its_own_shard(tmp_path):
    name = uuid.uuid4().hex
    p = prompt(1, 4)
    e1 = tp_engine(tmp_path, chunks=8, l3_name=name)
    try:
        _offload_and_evict(e1, p)
        tiers = e1.manager.l3_ranks
        assert len(tiers) == 2 and [t.shard[0] for t in tiers] == [0, 1]
        keys = e1.tier_keys_of(p)
        assert tiers[0].key(keys[0]) != tiers[1].key(keys[0]) and tiers[1].key(keys[0]).endswith(":1")
        for t in tiers:
            assert all(int(c) == 1 for c in t.store.batch_is_exist([t.key(k) for k in keys]))
            assert t.counters.chunks_stored == 12 and t.counters.bytes_written == 12 * t.chunk_bytes
        assert tiers[0].chunk_bytes == tiers[1].chunk_bytes == e1.page * e1.bpc, "a shard, not the row"
        e1.reset_gpu_cache()
        e1.add("c", p)  # prefetched back from L3: both ranks' shards
        run_checked(e1)
        f = e1.finished["c"]
        assert f.gpu_ok and f.external_tokens == 4 * CHUNK, f
        assert [t.counters.chunks_loaded for t in tiers] == [4, 4]
    finally:
        e1.close()
    e2 = tp_engine(tmp_path, chunks=8, l3_name=name)  # a new engine, empty host: L3 only
    try:
        e2.add("b", p)
        run_checked(e2)
        f = e2.finished["b"]
        assert f.gpu_ok and f.external_tokens == 4 * CHUNK, f
    finally:
        e2.close()


def test_tp2_a_prefetch_is_a_hit_only_once_every_ranks_shard_landed(tmp_path):
    e = tp_engine(tmp_path, chunks=8, l3_name=uuid.uuid4().hex)
    gate = threading.Event()
    try:
        p = prompt(1, 4)
        _offload_and_evict(e, p)
        slow = e.manager.l3_ranks[1]
        load_job = slow._load_job
        slow._load_job = lambda *a: (gate.wait(60), load_job(*a))[1]  # rank 1's read is slow
        e.reset_gpu_cache()
        e.add("c", p)
        pages = [page_of(k) for k in e.tier_keys_of(p)]
        deadline = time.monotonic() + 30
        while e.manager.l3_ranks[0].counters.chunks_loaded < 4 and time.monotonic() < deadline:
            e.step()
            e.manager.check()
            time.sleep(0.001)
        for _ in range(5):
            e.step()
            e.manager.check()
        assert e.manager.l3_ranks[0].counters.chunks_loaded == 4, "rank 0's shards landed"
        assert e.manager.native.lookup(pages, 3) == "pending" and "c" not in e.finished
        gate.set()
        run_checked(e)
        f = e.finished["c"]
        assert f.gpu_ok and f.external_tokens == 4 * CHUNK, f
    finally:
        gate.set()
        e.close()


def test_tp2_a_shard_one_rank_reads_missing_is_recomputed_on_both(tmp_path):
    """The loss is found by rank 1's read (a store that keeps no loss journal: kvtier learns
    of it only then): the prefetch lands with the chunks both ranks read."""
    e = tp_engine(tmp_path, chunks=8, l3_name=uuid.uuid4().hex)
    try:
        p = prompt(1, 4)
        _offload_and_evict(e, p)
        keys = e.tier_keys_of(p)
        for t in e.manager.l3_ranks:
            t._journal = False  # as against a server run with --loss-journal-keys 0
        r1 = e.manager.l3_ranks[1]
        r1.store.remove(r1.key(keys[2]), True)  # rank 1's shard of chunk 2 leaves L3
        e.reset_gpu_cache()
        e.add("c", p)
        run_checked(e)
        f = e.finished["c"]
        # Chunks 0-1: every rank read its shard; 2-3: rank 1 could not, so both ranks compute
        # them (and each rank's bytes are its own, checked on both).
        assert f.gpu_ok and f.external_tokens == 2 * CHUNK, f
        assert [t.counters.chunks_loaded for t in e.manager.l3_ranks] == [4, 2]
        pages = [page_of(k) for k in keys]
        assert e.manager.native.host_prefix(pages) == 4, "computed chunks stored again"
        assert int(r1.store.batch_is_exist([r1.key(keys[2])])[0]) == 1, "and backed up again by rank 1"
        e.reset_gpu_cache()
        e.add("d", p)
        run_checked(e)
        assert e.finished["d"].gpu_ok and e.finished["d"].external_tokens == 4 * CHUNK
    finally:
        e.close()


def test_tp2_engines_sharing_a_kvtier_l3_server_probe_every_ranks_shard(tmp_path):
    """Against a ``kvtier-l3`` server, another engine's chunks are found by probes (RETRY
    while a probe runs): a chunk is a hit only once every rank's probe found its shard. With
    rank 1's shards removed from the server, the new engine computes on both ranks."""
    srv = L3Process(token="tk")
    l3 = {"server": srv.addr, "token": "tk", "rpc_timeout_ms": 2000}
    e1 = Engine(str(tmp_path), [], kv_config=kvtier_config(8, kvtier_l3=l3), tp=2)
    try:
        p, q = prompt(1, 4), prompt(2, 4)
        for r, x in (("a", p), ("b", q)):
            e1.add(r, x)
            run_checked(e1)
        e2 = Engine(str(tmp_path), [], kv_config=kvtier_config(8, kvtier_l3=l3), tp=2)
        try:
            e2.add("c", p)
            run_checked(e2)
            f = e2.finished["c"]
            assert f.gpu_ok and f.external_tokens == 4 * CHUNK, f
            assert e2.manager.l3_ranks[1].counters.lookup_retries > 0, "found by a probe"
            r1 = e1.manager.l3_ranks[1]
            for k in e1.tier_keys_of(q):
                r1.store.remove(r1.key(k), True)
            e2.add("d", q)
            run_checked(e2)
            f = e2.finished["d"]
            assert f.gpu_ok and f.external_tokens == 0, f
        finally:
            e2.close()
    finally:
        e1.close()
        srv.kill()


def test_tp2_a_shard_one_rank_s_store_reports_lost_is_forgotten_for_both(tmp_path):
    """The loss is reported by rank 1's store (its loss journal): agreed with rank 0 in the
    next step, so neither rank tries to read the chunk (no failed read) and both compute it."""
    e = tp_engine(tmp_path, chunks=8, l3_name=uuid.uuid4().hex)
    try:
        p = prompt(1, 4)
        _offload_and_evict(e, p)
        keys, pages = e.tier_keys_of(p), [page_of(k) for k in e.tier_keys_of(p)]
        r0, r1 = e.manager.l3_ranks
        r1.store.remove(r1.key(keys[2]), True)
        e.step()  # an idle step: the manager polls its ranks' stores
        e.manager.check()
        assert [e.manager.native.lookup(pages, i) for i in range(4)] == ["in-l3", "in-l3", "miss", "in-l3"]
        e.reset_gpu_cache()
        e.add("c", p)
        run_checked(e)
        f = e.finished["c"]
        assert f.gpu_ok and f.external_tokens == 2 * CHUNK, f
        assert [t.counters.chunks_loaded for t in (r0, r1)] == [2, 2]
        assert [t.counters.load_failures for t in (r0, r1)] == [0, 0], "nobody read the lost chunk"
        assert int(r1.store.batch_is_exist([r1.key(keys[2])])[0]) == 1, "backed up again"
    finally:
        e.close()


def test_tp2_preempted_requests_resume_with_both_ranks_bytes_right(tmp_path):
    """A GPU too small for three growing requests: vLLM preempts and resumes them; both
    ranks' blocks stay right, kvtier's check holds after every step, nothing stays pinned."""
    e = tp_engine(tmp_path, chunks=64, num_gpu_blocks=48, max_num_seqs=3)
    try:
        for i in range(3):
            e.add(f"a{i}", prompt(i, 6, shared=2), max_tokens=150)
        run_checked(e, timeout_s=300)
        assert set(e.finished) == {"a0", "a1", "a2"} and all(f.gpu_ok for f in e.finished.values())
        assert sum(e.preemptions.values()) > 0, "the test must preempt"
        u = e.manager.native.usage()
        assert (u["held"], u["locked"], u["stores"], u["loads"]) == (0, 0, 0, 0), u
    finally:
        e.close()
