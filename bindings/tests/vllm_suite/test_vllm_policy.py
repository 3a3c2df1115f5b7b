"""kvtier's eviction policies as vLLM's host-cache ``CachePolicy``: built by vLLM's factory,
atomic evictions (hypothesis), the freq-depth rule, and host hit rates side by side with
vLLM's ``lru`` and ``arc`` on one replay of the public conversation trace through vLLM's
scheduler (harness.py)."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
from harness import BLOCK, Engine
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

import kvtier
from kvtier.vllm import KvtierFreqDepthPolicy, KvtierLruPolicy

ROOT = pathlib.Path(__file__).resolve().parents[3]
TRACE = ROOT / "traces" / "conversation_trace.jsonl"


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\0"


def ctx(req: str, keys=(), tokens_per_chunk: int = 64) -> ReqContext:
    c = ReqContext(req_id=req)
    for i, k in enumerate(keys):
        c.set_offload_key_position(k, (i + 1) * tokens_per_chunk)
    return c


def ready(i: int) -> ChunkStatus:
    c = ChunkStatus(i)
    c.ref_cnt = 0
    return c


@pytest.mark.parametrize("name", ["KvtierFreqDepthPolicy", "KvtierLruPolicy"])
def test_built_by_vllms_factory(name):
    cls = CachePolicyFactory.get_cache_policy_cls(name, "kvtier.vllm")
    p = cls(8)
    p.insert(key(1), ready(0), ctx("a"))
    assert p.get(key(1)).chunk_id == 0 and p.evict(1, set())[0][0] == key(1)


@pytest.mark.parametrize("cls", [KvtierFreqDepthPolicy, KvtierLruPolicy])
def test_vllm_032_insert_without_a_context_learns_depth_when_the_request_finishes(cls):
    """vLLM 0.32 calls ``insert(key, chunk)``, 0.33 and 0.34 ``insert(key, chunk, req_context)``: the
    same chunks end with the same ranks either way once their request finished."""
    keys = [key(i) for i in range(4)]
    old, new = cls(8), cls(8)
    for i, k in enumerate(keys):
        old.insert(k, ready(i))
        new.insert(k, ready(i), ctx("r", keys))
    for p in (old, new):
        p.on_request_finished([keys], set(), set(), ctx("r", keys))
    assert list(old._end[:4]) == list(new._end[:4]) == [1, 2, 3, 4]
    assert [k for k, _ in old.evict(4, set())] == [k for k, _ in new.evict(4, set())]


def test_bad_policy_and_columns_are_typed_errors():
    with pytest.raises(kvtier.ConfigError):
        kvtier.eviction_ranks("mru", [0], [0], [0], [0])
    with pytest.raises(ValueError):
        kvtier.eviction_ranks("lru", [0, 1], [0], [0], [0])


def test_freq_depth_keeps_a_reused_prefix_over_one_off_tails():
    """A chunk read again outlives chunks never read again even if those were used later;
    LRU evicts by recency alone."""
    shared = [key(i) for i in range(4)]
    for cls, survivor in ((KvtierFreqDepthPolicy, True), (KvtierLruPolicy, False)):
        p = cls(64)
        for i, k in enumerate(shared):
            p.insert(k, ready(i), ctx("r0", shared))
        p.on_request_finished([shared], set(shared), set(), ctx("r0", shared))
        p.on_request_finished([shared], set(), set(shared), ctx("r1", shared))  # a reuse
        for r in range(2, 6):  # one-off prompts, used after the shared prefix
            own = [key(100 * r + i) for i in range(4)]
            for i, k in enumerate(own):
                p.insert(k, ready(100 * r + i), ctx(f"r{r}", own))
            p.on_request_finished([own], set(own), set(), ctx(f"r{r}", own))
        evicted = {k for k, _ in p.evict(8, set())}
        assert (not evicted & set(shared)) == survivor, cls.__name__


def _reread_after_eviction(cls):
    """A prefix read three times, evicted, stored again by the request that missed it; then a
    newer one-off prompt of the same length: which is evicted first?"""
    shared = [key(i) for i in range(4)]
    p = cls(64)
    for i, k in enumerate(shared):
        p.insert(k, ready(i), ctx("r0", shared))
    p.on_request_finished([shared], set(shared), set(), ctx("r0", shared))
    for r in range(1, 4):
        p.on_request_finished([shared], set(), set(shared), ctx(f"r{r}", shared))
    assert {k for k, _ in p.evict(4, set())} == set(shared)
    for i, k in enumerate(shared):
        p.insert(k, ready(i), ctx("r4", shared))
    p.on_request_finished([shared], set(shared), set(), ctx("r4", shared))
    own = [key(100 + i) for i in range(4)]
    for i, k in enumerate(own):
        p.insert(k, ready(100 + i), ctx("r5", own))
    p.on_request_finished([own], set(own), set(), ctx("r5", own))
    return {k for k, _ in p.evict(4, set())}, set(shared)


def test_freq_depth_remembers_the_reads_of_an_evicted_prefix():
    """As kvtier's radix tree (radix/src/memory.rs): a chunk stored again after its eviction
    starts with the reads it had, plus the one that brought it back, so it outlives a newer
    one-off; LRU keeps no memory and evicts the older prefix."""
    evicted, shared = _reread_after_eviction(KvtierFreqDepthPolicy)
    assert not evicted & shared
    evicted, shared = _reread_after_eviction(KvtierLruPolicy)
    assert evicted == shared


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "finish", "evict"]), st.integers(0, 40)), max_size=120))
def test_the_use_memory_is_bounded(ops):
    """However chunks come and go, the memory holds at most its capacity, and only keys not
    in the cache."""
    p = KvtierFreqDepthPolicy(4)
    for op, i in ops:
        k = key(i)
        if op == "insert" and p.get(k) is None:
            p.insert(k, ready(i), ctx("x", [k]))
        elif op == "finish":
            p.on_request_finished([[k]], set(), {k}, ctx("f", [k]))
        elif op == "evict":
            p.evict(1, set())
        assert len(p._memory) <= p._memory_capacity
        assert not any(p.get(m) is not None for m in p._memory)


OPS = st.lists(st.tuples(st.sampled_from(["insert", "pin", "unpin", "touch", "finish", "evict", "remove"]),
                         st.integers(0, 15), st.integers(0, 4)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS, st.sampled_from([KvtierFreqDepthPolicy, KvtierLruPolicy]))
def test_evict_is_exact_and_atomic(ops, cls):
    """``evict(n, protected)`` returns n ready, unprotected, unpinned chunks and forgets
    them, or None and changes nothing — after any sequence of vLLM's calls."""
    p = cls(8)
    chunks = {}
    for op, i, n in ops:
        k = key(i)
        if op == "insert" and p.get(k) is None:
            chunks[k] = ready(i)
            p.insert(k, chunks[k], ctx("x", [k]))
        elif op == "pin" and p.get(k) is not None and chunks[k].ref_cnt == 0:
            chunks[k].ref_cnt = 1
            p.mark_non_evictable(k)
        elif op == "unpin" and p.get(k) is not None and chunks[k].ref_cnt == 1:
            chunks[k].ref_cnt = 0
            p.mark_evictable(k)
        elif op == "touch":
            p.touch([k, key((i + 1) % 16)], ctx("t"))
        elif op == "finish":
            ks = [key(j) for j in range(i, min(16, i + n + 1))]
            p.on_request_finished([ks], set(), set(ks[:1]), ctx("f", ks))
        elif op == "remove" and p.get(k) is not None and chunks[k].ref_cnt == 0:
            p.remove(k)
        elif op == "evict":
            protected = {key(j) for j in range(i, i + 2)}
            before = {kk for kk in chunks if p.get(kk) is not None}
            eligible = {kk for kk in before if chunks[kk].ref_cnt == 0 and kk not in protected}
            out = p.evict(n, protected)
            after = {kk for kk in chunks if p.get(kk) is not None}
            if out is None:
                assert len(eligible) < n and after == before
            else:
                got = {kk for kk, _ in out}
                assert len(out) == n and got <= eligible and after == before - got
                assert all(c is chunks[kk] for kk, c in out)
        assert len(p) == sum(1 for kk in chunks if p.get(kk) is not None)


MAX_TRACE_BLOCKS = 96  # longer prompts are cut (the engine's max_model_len is 4096 tokens)


def trace_prompts(n: int, tokens_per_block: int):
    """The first ``n`` requests of the public conversation trace, each 512-token trace
    block scaled to ``tokens_per_block`` distinct tokens (same reuse structure), prompts cut
    at ``MAX_TRACE_BLOCKS`` blocks."""
    out = []
    with open(TRACE) as f:
        for line in f:
            ids = json.loads(line)["hash_ids"][:MAX_TRACE_BLOCKS]
            out.append([h * tokens_per_block + j for h in ids for j in range(tokens_per_block)])
            if len(out) == n:
                break
    return out


def replay(root: str, policy: str, module, prompts, cpu_chunks: int) -> dict:
    e = Engine(root, [], policy=policy, policy_module=module, content=False, num_gpu_blocks=512,
               cpu_bytes=cpu_chunks * 2 * 4096, max_num_seqs=4)
    try:
        for i in range(0, len(prompts), 4):
            for j, p in enumerate(prompts[i:i + 4]):
                e.add(f"r{i + j}", p, max_tokens=1)
            e.run()
        total = sum(len(p) // BLOCK * BLOCK for p in prompts)
        host = sum(f.external_tokens for f in e.finished.values())
        return {"policy": policy, "host_hit_tokens": host, "prompt_tokens": total, "host_hit_rate": host / total}
    finally:
        e.close()


def test_host_hit_rates_side_by_side_with_vllms_lru_and_arc(tmp_path):
    n = int(os.environ.get("KVTIER_VLLM_REPLAY", "3000"))
    prompts = trace_prompts(n, 2 * BLOCK)  # one trace block = one 2-block chunk
    seen, reusable = set(), 0
    for p in prompts:
        for b in range(len(p) // (2 * BLOCK)):
            h = tuple(p[: (b + 1) * 2 * BLOCK])[-1]
            reusable += 2 * BLOCK if h in seen else 0
            seen.add(h)
    rows = [replay(str(tmp_path), pol, mod, prompts, cpu_chunks=1500) for pol, mod in
            (("lru", None), ("arc", None), ("KvtierLruPolicy", "kvtier.vllm"), ("KvtierFreqDepthPolicy", "kvtier.vllm"))]
    print("\n" + "\n".join(f"{r['policy']:>24}: host hit rate {r['host_hit_rate']:.4f}" for r in rows))
    out = os.environ.get("KVTIER_VLLM_REPLAY_JSON")
    if out:
        pathlib.Path(out).write_text(json.dumps({"requests": n, "host_chunks": 1500, "rows": rows}, indent=1))
    for r in rows:
        assert 0 < r["host_hit_tokens"] <= reusable, r


def test_a_promoted_chunk_is_not_evicted_before_its_request_used_it():
    """The tier's livelock (docs/vllm/host-hit-rates.md): promoting a request's later chunks
    evicted its earlier, just-promoted ones (deep chunks never used rank first under
    freq-depth), so the request never found all of its chunks on host at once. A chunk
    inserted and not yet used by a finished request is evicted only after every other
    candidate."""
    for cls in (KvtierFreqDepthPolicy, KvtierLruPolicy):
        p = cls(64)
        old = [key(i) for i in range(4)]  # a finished request's shallow chunks
        for i, k in enumerate(old):
            p.insert(k, ready(i), ctx("r0", old))
        p.on_request_finished([old], set(old), set(), ctx("r0", old))
        deep = [key(100 + i) for i in range(4)]
        c1 = ctx("r1", [key(1000 + i) for i in range(200)] + deep)  # deep in a long prompt
        p.insert(deep[0], ready(100), c1)
        p.insert(deep[1], ready(101), c1)
        evicted = [k for k, _ in p.evict(2, {deep[1]})]
        assert deep[0] not in evicted and set(evicted) <= set(old), cls.__name__
        # Once its request finished with it, it is ranked like any other chunk.
        p.on_request_finished([deep[:2]], set(), set(deep[:2]), c1)
        p.evict(2, set())  # the other two old chunks
        assert {k for k, _ in p.evict(2, set())} == set(deep[:2])
        # Nothing pending is left behind: all of it can still be evicted when nothing else is.
        p.insert(deep[2], ready(102), c1)
        assert p.evict(1, set())[0][0] == deep[2]
