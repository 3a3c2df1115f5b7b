"""kvtier's scheduler as vLLM's offloading manager (``KvtierOffloadingSpec``), through the
real vLLM scheduler and ``OffloadingConnector`` (harness.py; only the GPU DMA is stood in
for). After every engine step kvtier's consistency check runs (``KvtierOffloadingManager.check``:
the radix tree's invariants, locks and held slots against in-flight jobs, the adapter's books),
and every request's forward checks the bytes its loaded blocks hold."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pathlib
import shlex
import time
import uuid
from typing import Dict, Optional

import pytest
from harness import BLOCK, Engine, model_dir
from test_vllm_launch import DOC, parse
from test_vllm_policy import trace_prompts
from vllm.config import KVTransferConfig
from vllm.v1.request import RequestStatus

from kvtier.vllm import KvtierOffloadingManager, KvtierOffloadingSpec
from manager_engines import CHUNK_BYTES, engine, kvtier_config, offloaded, prompt, run_checked

def test_the_spec_is_built_by_vllms_factory_and_replaces_only_the_manager(tmp_path):
    e = engine(tmp_path, chunks=64)
    try:
        spec = e.cs.spec if hasattr(e.cs, "spec") else None
        assert spec is None or isinstance(spec, KvtierOffloadingSpec)
        assert e.manager.native.usage()["capacity"] == 64
        assert e.manager.tokens_per_chunk == {0: 2 * BLOCK}
    finally:
        e.close()


def test_the_documented_spec_config_builds_a_working_engine(tmp_path, monkeypatch):
    """docs/vllm.md's ``--kv-transfer-config`` for the spec, through vLLM's own parser."""
    lines = [ln for ln in DOC.read_text(encoding="utf-8").splitlines()
             if ln.startswith("--kv-transfer-config ") and "KvtierOffloadingSpec" in ln]
    assert len(lines) == 1
    args = parse(["vllm", "serve", "model", *shlex.split(lines[0])], model_dir(str(tmp_path)), monkeypatch)
    kv = copy.deepcopy(args.kv_transfer_config)
    kv.kv_connector_extra_config["cpu_bytes_to_use"] = 64 * 4 * CHUNK_BYTES  # 64 four-block chunks
    kv.engine_id = f"kvtier-mgr-{uuid.uuid4().hex[:12]}"
    e = Engine(str(tmp_path), [], kv_config=kv)
    try:
        assert isinstance(e.manager, KvtierOffloadingManager) and e.manager.policy == "freq-depth"
        p = list(range(300, 300 + 4 * 64 + 5))
        e.add("a", p)
        run_checked(e)
        e.reset_gpu_cache()
        e.add("b", p)
        run_checked(e)
        assert e.finished["b"].external_tokens == 4 * 64 and e.finished["b"].gpu_ok
    finally:
        e.close()


def test_a_rerun_loads_exactly_the_bytes_the_first_run_offloaded(tmp_path):
    e = engine(tmp_path)
    try:
        prompts = {f"a{i}": prompt(i, 6, shared=3) for i in range(3)}
        for r, p in prompts.items():
            e.add(r, p)
        run_checked(e)
        assert all(e.finished[r].gpu_ok for r in prompts)
        assert e.manager.native.usage()["cached"] == 3 + 3 * 3  # shared prefix once, tails each
        e.reset_gpu_cache()  # the GPU prefix cache forgets: hits must come from kvtier's host tier
        for r, p in prompts.items():
            e.add("b" + r[1:], p)
        run_checked(e)
        for r in prompts:
            f = e.finished["b" + r[1:]]
            assert f.gpu_ok, f
            assert f.external_tokens == 6 * 2 * BLOCK, f  # every full chunk, from host
        assert e.dma.loads > 0
    finally:
        e.close()


def test_a_small_host_cache_evicts_by_kvtiers_choice_and_reports_the_keys(tmp_path):
    e = engine(tmp_path, chunks=8, kv_events=True)
    try:
        for i in range(6):  # 6 prompts of 4 chunks through 8 slots: kvtier must evict
            e.add(f"a{i}", prompt(i, 4))
            run_checked(e)
        u = e.manager.native.usage()
        assert u["cached"] <= 8 and u["held"] == 0 and u["locked"] == 0
        removed = [ev for batch in e.published for ev in batch.events if type(ev).__name__ == "BlockRemoved"]
        assert removed, "kvtier's evictions reach vLLM's KV events"
        e.reset_gpu_cache()
        for i in (5, 4, 0):  # newest first (a cyclic order would evict each before its turn)
            e.add(f"b{i}", prompt(i, 4))
            run_checked(e)
        hits = {i: e.finished[f"b{i}"].external_tokens for i in (5, 4, 0)}
        assert all(e.finished[f"b{i}"].gpu_ok for i in (5, 4, 0))
        assert hits[5] == hits[4] == 4 * 2 * BLOCK, hits  # the two latest prompts were kept whole
        assert hits[0] == 0, hits  # the oldest was evicted (LRU)
    finally:
        e.close()


def rounds_from_host(e: Engine, reset_connector_after: Optional[int] = None) -> None:
    """Three rounds of 5 requests over 3 conversations sharing 2 chunks, 3 at a time on a
    small host tier, the GPU prefix cache reset after each (the next round's hits come from
    kvtier's host tier) and, after round ``reset_connector_after``, the connector too (a new
    native manager); every request's bytes are right and some came from host."""
    for rnd in range(3):
        for i in range(5):
            # some decode past several chunks: their stores land while they run
            e.add(f"r{rnd}-{i}", prompt(i % 3, 4 + i % 2, shared=2), max_tokens=8 if i % 2 else 100)
        run_checked(e)
        e.reset_gpu_cache()
        if rnd == reset_connector_after:
            assert e.sched.reset_prefix_cache(reset_connector=True)
            run_checked(e)
    assert all(f.gpu_ok for f in e.finished.values())
    assert sum(f.external_tokens for f in e.finished.values()) > 0, "some hits from host"


def test_a_kept_host_prefix_is_always_the_trees_answer(tmp_path, monkeypatch):
    """kvtier's lookups keep a chain's host prefix while the manager's generation is unchanged
    (one walk of the tree per request, not one per chunk). Every answer they use, kept or
    walked, equals a fresh walk of the tree, through vLLM's scheduler with shared prefixes,
    concurrent requests, evictions from a small host cache, GPU cache resets and a connector
    reset (a new native manager); and the kept answer is used, or this would test nothing."""
    walk = KvtierOffloadingManager._host_prefix
    used = {"kept": 0, "walked": 0}  # answers used: kept, or a walk of the tree

    def checked(self, chain):
        before = chain.host
        n = walk(self, chain)
        assert n == self.native.host_prefix(chain.pages), "a kept host prefix went stale"
        used["kept" if chain.host is before else "walked"] += 1
        return n

    monkeypatch.setattr(KvtierOffloadingManager, "_host_prefix", checked)
    e = engine(tmp_path, chunks=10, max_num_seqs=3)
    try:
        rounds_from_host(e, reset_connector_after=1)
        assert used["kept"] > 0 and used["walked"] > 0, used
    finally:
        e.close()


def test_kept_lookup_hits_and_stores_of_host_chunks_are_always_the_trees_answer(tmp_path, monkeypatch):
    """Two shortcuts of kvtier's manager, each checked at every use against the tree through
    vLLM's scheduler (shared prefixes, concurrent requests, evictions from a small host cache,
    GPU cache resets that send the next round to host): a lookup answered from the keys kept
    in a request's host prefix is a hit in a fresh walk of the tree, and a store vLLM offers
    (``REQUEST_LEVEL``: loaded chunks again) answered "nothing to store" without grouping its
    keys offers no page past its chain's host prefix; both are used, or this tests nothing."""
    from vllm.v1.kv_offload.base import LookupResult

    from kvtier.vllm.chunks import ChunkChains

    lookup, all_on_host = KvtierOffloadingManager.lookup, KvtierOffloadingManager._all_on_host
    used = {"kept hit": 0, "nothing to store": 0}

    def checked_lookup(self, key, ctx):
        cc = ctx.get_state(ChunkChains)
        kept = cc is not None and cc.on_host is not None and key in cc.on_host[2]
        r = lookup(self, key, ctx)
        if r == LookupResult.HIT:
            chain, i = ctx.get_state(ChunkChains).locate(ctx._offload_key_positions, key)  # noqa: SLF001
            assert self.native.lookup(chain.pages[: i + 1], i) == "hit", "a kept hit is not on host"
            used["kept hit"] += kept
        return r

    def checked_all_on_host(self, keys, ctx):
        r = all_on_host(self, keys, ctx)
        if r:
            for chain, ix in self._by_chain(keys, ctx):
                assert ix[-1] < self.native.host_prefix(chain.pages), "nothing to store, but a page is not on host"
            used["nothing to store"] += 1
        return r

    monkeypatch.setattr(KvtierOffloadingManager, "lookup", checked_lookup)
    monkeypatch.setattr(KvtierOffloadingManager, "_all_on_host", checked_all_on_host)
    e = engine(tmp_path, chunks=10, max_num_seqs=3)
    try:
        rounds_from_host(e)
        assert used["kept hit"] > 0 and used["nothing to store"] > 0, used
    finally:
        e.close()


def test_a_request_looked_up_again_sees_every_change_since():
    """vLLM looks a waiting request up again at later steps. A request whose chunks were all
    on host (its chain's host prefix kept as 4) and looked up again after another request's
    store evicted them, or after a connector reset (a new native manager), is answered from
    the tree as it is now, never from the kept answer; and a miss looked up again after
    another request stored the prompt is a hit."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    def keys_of(tag, n):
        return [hashlib.sha256(b"%s%d" % (tag, i)).digest() + (0).to_bytes(4, "big") for i in range(n)]

    def ctx(name, keys):
        c = ReqContext(req_id=name)
        for i, k in enumerate(keys):
            c.set_offload_key_position(k, 64 * (i + 1))
        return c

    def store(m, keys, name):
        c = ctx(name, keys)
        out = m.prepare_store(keys, c)
        m.complete_store(list(out.keys_to_store), c)
        return out

    HIT, MISS = LookupResult.HIT, LookupResult.MISS
    m = KvtierOffloadingManager(8, {0: 64})
    p = keys_of(b"p", 4)
    a, w = ctx("a", p), ctx("w", p)
    assert m.lookup(p[0], w) == MISS
    assert list(store(m, p, "b").keys_to_store) == p
    assert [m.lookup(k, a) for k in p] == [HIT] * 4
    assert [m.lookup(k, w) for k in p] == [HIT] * 4, "a miss, then stored by another: a hit"
    out = store(m, keys_of(b"q", 8), "c")  # 8 new chunks in 8 slots: p is evicted
    assert set(out.evicted_keys) == set(p)
    assert [m.lookup(k, a) for k in p] == [MISS] * 4, "evicted since the last lookup"
    store(m, p, "d")
    assert [m.lookup(k, a) for k in p] == [HIT] * 4
    m.reset_cache()
    assert [m.lookup(k, a) for k in p] == [MISS] * 4, "a reset since the last lookup"
    m.check()


def test_chunked_prefill_stores_every_chunk_while_earlier_ones_are_in_flight():
    """An adversarial tester's lost hits: under chunked prefill (vLLM's default) a prompt
    longer than the step's token budget is offered chunk by chunk, each step's chunks while
    the previous step's store is still in flight. The manager began its run at the chain's
    *host* prefix (0 while chunk 0 was storing), found chunk 0 not offered and stored
    nothing; every later chunk then followed a hole, and vLLM never offers a chunk twice: a
    552-token prompt kept 1 of its 8 chunks (round 2 reused 64 tokens of 512). A store
    follows the stores in flight before it (docs/vllm.md), as the native plan does."""
    from vllm.v1.kv_offload.base import ReqContext

    keys = [hashlib.sha256(b"c%d" % i).digest() + (0).to_bytes(4, "big") for i in range(8)]
    c = ReqContext(req_id="long")
    for i, k in enumerate(keys):
        c.set_offload_key_position(k, 64 * (i + 1))
    m = KvtierOffloadingManager(14, {0: 64})
    outs = []
    for step in ([0], [1, 2], [3, 4], [5, 6, 7]):  # offered step by step, none completed yet
        out = m.prepare_store([keys[i] for i in step], c)
        assert out is not None
        outs.append(out)
        assert list(out.keys_to_store) == [keys[i] for i in step], f"step {step}: {out.keys_to_store}"
    m.check()
    for out in outs:
        m.complete_store(list(out.keys_to_store), c)
    m.check()
    assert m.native.usage()["cached"] == 8
    # a failed store in the middle drops what followed it, never leaves a hole on host
    m2 = KvtierOffloadingManager(14, {0: 64})
    a = m2.prepare_store(keys[:2], c)
    b = m2.prepare_store(keys[2:4], c)
    m2.complete_store(list(a.keys_to_store), c, success=False)
    m2.complete_store(list(b.keys_to_store), c)
    m2.check()
    assert m2.native.usage()["cached"] == 0


def test_an_abort_mid_load_unpins_and_the_chunks_are_loaded_again(tmp_path):
    e, p = offloaded(tmp_path)
    try:
        e.reset_gpu_cache()
        e.dma.hold_loads = True  # the load's bytes land but it is not reported yet
        e.add("b", p)
        for _ in range(3):
            e.step()
            e.manager.check()
        assert e.manager.native.usage()["loads"] == 1, "the load pins its chunks in kvtier"
        e.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        e.manager.check()
        e.dma.release()
        run_checked(e)
        assert e.manager.native.usage()["loads"] == 0 and e.manager.native.usage()["locked"] == 0
        e.reset_gpu_cache()
        e.add("c", p)
        run_checked(e)
        assert e.finished["c"].gpu_ok and e.finished["c"].external_tokens == 4 * 2 * BLOCK
    finally:
        e.close()


def _replay(root, kv_config, prompts) -> dict:
    """Host hit rate = tokens vLLM's workers loaded from the host cache / prompt tokens (the
    GPU prefix cache answers first); loads per request = load jobs / requests."""
    e = Engine(str(root), [], kv_config=kv_config, content=False, num_gpu_blocks=512, max_num_seqs=4)
    loads_of: Dict[str, int] = {}  # request -> its load jobs
    starts: set = set()
    submit = e.dma.submit_load

    def counted(job_id, src, dst, expedited=False):
        rid = e.worker._load_jobs.get(job_id)  # noqa: SLF001 (vLLM's job -> request map)
        loads_of[rid] = loads_of.get(rid, 0) + 1
        starts.add(int(dst.block_indices[0]) // e.bpc)  # the chunk the load starts at
        return submit(job_id, src, dst, expedited)

    e.dma.submit_load = counted
    try:
        t0 = time.monotonic()
        for i in range(0, len(prompts), 4):
            for j, p in enumerate(prompts[i:i + 4]):
                e.add(f"r{i + j}", p, max_tokens=1)
            e.run()
        total = sum(len(p) // BLOCK * BLOCK for p in prompts)
        host = e.dma.loaded_blocks * BLOCK
        reused = sum(f.external_tokens for f in e.finished.values())  # GPU prefix cache + host
        return {"host_hit_tokens": host, "prompt_tokens": total, "host_hit_rate": host / total,
                "reused_rate": reused / total, "loads_per_request": e.dma.loads / len(prompts),
                "requests_with_loads": len(loads_of), "max_loads_per_request": max(loads_of.values(), default=0),
                "chunks_per_load": e.dma.loaded_blocks / max(e.dma.loads, 1) / e.bpc,
                "load_start_chunks": sorted(starts),
                "seconds": time.monotonic() - t0}
    finally:
        e.close()


L3 = {"segment_bytes": "2GB"}  # holds the whole replay: L3 hits are bounded by reuse only


def _tier_config(chunks: int) -> KVTransferConfig:
    """The tier of docs/vllm.md: vLLM's tiering with kvtier's policy and kvtier's L3."""
    ex = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": chunks * CHUNK_BYTES, "block_size": 2 * BLOCK,
          "eviction_policy": "KvtierFreqDepthPolicy", "cache_policy_module_path": "kvtier.vllm",
          "secondary_tiers": [{"type": "KvtierSecondaryTier", "module_path": "kvtier.vllm", "name": uuid.uuid4().hex,
                               **L3}], "tier_poll_interval_s": 0}
    return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=ex,
                            engine_id=f"kvtier-mgr-{uuid.uuid4().hex[:12]}")


def _vllm_config(policy: str, module, chunks: int) -> KVTransferConfig:
    ex = {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": chunks * CHUNK_BYTES, "block_size": 2 * BLOCK,
          "eviction_policy": policy}
    if module:
        ex["cache_policy_module_path"] = module
    return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=ex,
                            engine_id=f"kvtier-mgr-{uuid.uuid4().hex[:12]}")


@pytest.mark.skipif(os.environ.get("KVTIER_VLLM_REPLAY", "1") == "0", reason="KVTIER_VLLM_REPLAY=0")
def test_host_hit_rates_of_kvtiers_manager_beside_vllms_own(tmp_path):
    """The public trace through vLLM's scheduler: vLLM's CPU offloading (lru, arc), vLLM's
    manager with kvtier's policy, kvtier's manager (lru, freq-depth); then with an L3 below
    the host cache: the tier of docs/vllm.md, and kvtier's manager with its L3. Host hit
    rate counts every block loaded to the GPU, from host slots filled by a store or an L3
    prefetch."""
    n = int(os.environ.get("KVTIER_VLLM_MANAGER_REPLAY", "3000"))
    chunks = 1500
    prompts = trace_prompts(n, 2 * BLOCK)
    rows = []
    for name, cfg in (
        ("vLLM lru", _vllm_config("lru", None, chunks)),
        ("vLLM arc", _vllm_config("arc", None, chunks)),
        ("vLLM + KvtierFreqDepthPolicy", _vllm_config("KvtierFreqDepthPolicy", "kvtier.vllm", chunks)),
        ("kvtier manager lru", kvtier_config(chunks, "lru")),
        ("kvtier manager freq-depth", kvtier_config(chunks, "freq-depth")),
        ("kvtier manager freq-depth + L3", kvtier_config(chunks, "freq-depth", kvtier_l3={**L3, "name": uuid.uuid4().hex})),
        # The tier of docs/vllm.md: this replay found its livelock under load (a request's
        # promoted chunks evicting each other); run here so that it stays fixed.
        ("vLLM tiering + KvtierSecondaryTier (L3)", _tier_config(chunks)),
    ):
        print(f"replaying: {name}", flush=True)
        rows.append({"manager": name, **_replay(tmp_path, cfg, prompts)})
    print("\n" + "\n".join(f"{r['manager']:>30}: host hit rate {r['host_hit_rate']:.4f} "
                           f"(GPU + host {r['reused_rate']:.4f}), loads/request {r['loads_per_request']:.3f} "
                           f"({r['requests_with_loads']} requests, at most {r['max_loads_per_request']} each, "
                           f"{r['chunks_per_load']:.1f} chunks a load), "
                           f"{r['seconds']:.1f} s" for r in rows))
    out = os.environ.get("KVTIER_VLLM_MANAGER_JSON")
    if out:
        pathlib.Path(out).write_text(json.dumps({"requests": n, "host_chunks": chunks, "rows": rows}, indent=1))
    for r in rows:
        assert 0 < r["host_hit_tokens"] <= r["prompt_tokens"], r
        # One load job per request that hits (vLLM issues one; kvtier does not split them).
        assert r["max_loads_per_request"] == 1, r


def test_preempted_requests_resume_with_kvtiers_host_tier_consistent(tmp_path):
    """A GPU too small for three growing requests: vLLM preempts and resumes them (their
    prompts are found again in vLLM's GPU prefix cache here, so this exercises kvtier's
    books under vLLM's preemption fencing, not a load on resume); kvtier's check holds after
    every step and nothing stays pinned."""
    e = engine(tmp_path, chunks=64, num_gpu_blocks=48, max_num_seqs=3)
    try:
        for i in range(3):
            e.add(f"a{i}", prompt(i, 6, shared=2), max_tokens=150)
        run_checked(e, timeout_s=300)
        assert set(e.finished) == {"a0", "a1", "a2"}
        assert all(f.gpu_ok for f in e.finished.values())
        assert sum(r for r in e.preemptions.values()) > 0, "the test must preempt"
        u = e.manager.native.usage()
        assert (u["held"], u["locked"], u["stores"], u["loads"]) == (0, 0, 0, 0), u
    finally:
        e.close()


def test_a_connector_reset_empties_kvtiers_host_tier_and_it_fills_again(tmp_path):
    e, p = offloaded(tmp_path)
    try:
        assert e.manager.native.usage()["cached"] == 4
        assert e.sched.reset_prefix_cache(reset_connector=True)
        run_checked(e)
        assert e.manager.native.usage()["cached"] == 0
        e.add("b", p)  # nothing on host: computed, then stored again
        run_checked(e)
        assert e.finished["b"].external_tokens == 0 and e.manager.native.usage()["cached"] == 4
        e.reset_gpu_cache()
        e.add("c", p)
        run_checked(e)
        assert e.finished["c"].external_tokens == 4 * 2 * BLOCK and e.finished["c"].gpu_ok
    finally:
        e.close()


def test_a_reset_during_a_store_leaves_nothing_pinned(tmp_path):
    """vLLM never reports jobs issued before a connector reset: kvtier must not wait for them
    (before, a reset with a copy in flight kept every slot and lock of the old tree)."""
    e = engine(tmp_path, chunks=32)
    try:
        p = prompt(1, 4)
        e.dma.hold_stores = True
        e.add("a", p)
        for _ in range(4):
            e.step()
        assert "a" in e.finished and e.manager.native.usage()["held"] == 4
        assert e.sched.reset_prefix_cache(reset_connector=True)
        e.dma.release()
        run_checked(e)
        u = e.manager.native.usage()
        assert (u["stores"], u["locked"], u["held"], u["cached"]) == (0, 0, 0, 0), u
        e.add("b", p)
        run_checked(e)
        assert e.manager.native.usage()["cached"] == 4, "the emptied tier fills again"
    finally:
        e.close()
