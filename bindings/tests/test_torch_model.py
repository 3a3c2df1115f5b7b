"""A real model served through kvtier.torch on CPU: a small Hugging Face Llama whose KV lives
only in kvtier's pools, driven only by kvtier's plans, against transformers' own
``generate()`` (greedy) on the full prompts and a full recompute of the first token's logits.

Pools are small so that every path runs: write-back on finish, load-back of host prefixes
(``keep_device_after_write_back=False``), retraction under device pressure, and a second
engine that starts empty on the same L3 store and prefetches. A second run delays every
copy and L3 call at random and stops prefetches early (``best_effort``), so the ordering
rules are exercised by the scheduler's own plans, not only by hand-built ops."""

import random
import time

import numpy as np
import pytest
import torch

import kvtier
from kvtier.engine import KvtierL3Backend
from kvtier.torch import LoadWait, TorchEngine, TorchMover
from conftest import greedy_reference, small_config, tiny_llama

MAX_NEW = 6


def config(**over):
    base = dict(
        page_size=4,
        device_pages=14,  # 56 tokens for 3 concurrent conversations: retraction
        host_pages=64,
        max_batch_size=3,
        token_budget=48,
        chunked_prefill_size=24,
        max_context_tokens=56,
        l3_enabled=True,
        prefetch_threshold=2,
        keep_device_after_write_back=False,  # turn k+1 loads turn k's prefix back from host
    )
    base.update(over)
    return small_config(**base)


def named_scheduler(cfg, name, model, kv_dtype=None):
    """A scheduler built by the caller, with an explicit L3 namespace (the override of the
    one TorchEngine derives from a SchedulerConfig): ``name``, and the KV dtype and layout of
    ``model``'s pools, which TorchEngine requires with L3 (``kv_fields``)."""
    from kvtier.torch.model import layout_of
    from kvtier.torch.namespace import kv_fields

    dtype = kv_dtype or next(model.parameters()).dtype
    kv = kv_fields(layout_of(model.config, cfg.page_size, dtype))
    return kvtier.Scheduler(cfg.replace(namespace={"model": name, **kv}))


def conversations(n=3, turns=3, seed=7):
    """Per turn, per conversation: the full prompt (shared system prompt + history + new user
    message). Answers are filled in as the engine produces them."""
    rng = np.random.default_rng(seed)
    system = rng.integers(1, 128, size=14).tolist()
    users = [[rng.integers(1, 128, size=5).tolist() for _ in range(turns)] for _ in range(n)]
    return system, users


def serve(engine, system, users, first_id=0):
    """Runs every turn of every conversation (conversations concurrent within a turn)."""
    hist = {c: list(system) for c in range(len(users))}
    prompts = {}
    rid = first_id
    for turn in range(len(users[0])):
        ids = {}
        for c in range(len(users)):
            hist[c] += users[c][turn]
            engine.submit(rid, hist[c], MAX_NEW)
            prompts[rid] = list(hist[c])
            ids[rid] = c
            rid += 1
        engine.run_to_idle()
        for r, c in ids.items():
            hist[c] += engine.generated(r)
    return prompts


def check_against_transformers(engine, prompts, ref):
    dev = next(ref.parameters()).device
    for r, p in prompts.items():
        ids = torch.tensor([p], device=dev)
        want = greedy_reference(ref, p, MAX_NEW)
        assert engine.generated(r) == want, f"request {r}"
        with torch.no_grad():
            full = ref(ids).logits[0, -1].float().cpu()
        assert torch.allclose(engine.first_logits[r], full, atol=1e-4, rtol=0), f"request {r}"


@pytest.fixture(scope="module")
def ref():
    return tiny_llama(seed=3)


def test_multi_turn_through_every_tier_matches_generate(ref):
    multi_turn_through_every_tier(ref, "cpu", "torch")


def multi_turn_through_every_tier(ref, device, mover):
    system, users = conversations()
    store = kvtier.L3Store.embedded(1 << 24)
    model = tiny_llama(seed=3, device=device)
    with TorchEngine(config(), model, KvtierL3Backend(store), mover=mover) as a:
        prompts = serve(a, system, users)
        st = a.s.stats()
        ops = a.executor.stats.ops
        assert ops.get("WriteBack", 0) > 0 and ops.get("LoadBack", 0) > 0 and ops.get("BackUp", 0) > 0
        assert st["retracted"] > 0 and st["host_hit_tokens"] > 0
        assert a.executor.stats.failed_ops == 0
        check_against_transformers(a, prompts, ref)
        a.s.check()
    # A second engine, empty, on the same L3: the shared prefixes come from L3.
    model = tiny_llama(seed=3, device=device)
    with TorchEngine(config(), model, KvtierL3Backend(store), mover=mover) as b:
        prompts_b = serve(b, system, users, first_id=1000)
        assert b.s.stats()["l3_hit_tokens"] > 0 and b.executor.stats.l3_pages_read > 0
        assert b.executor.stats.ops.get("Prefetch", 0) > 0
        check_against_transformers(b, prompts_b, ref)
        b.s.check()


class Jittery(KvtierL3Backend):
    """The embedded store with L3 calls that take a random 0 to 20 ms."""

    def __init__(self, store, rng):
        super().__init__(store)
        self.rng = rng

    def get_with_query(self, q, offset, pool, page_ids):
        time.sleep(self.rng.uniform(0, 0.02))
        return super().get_with_query(q, offset, pool, page_ids)

    def put(self, keys, pool, page_ids):
        time.sleep(self.rng.uniform(0, 0.02))
        return super().put(keys, pool, page_ids)


def test_random_copy_delays_and_early_terminated_prefetches_keep_outputs_exact(ref):
    """The scheduler's own plans with every copy and L3 call slowed at random, prefetches
    stopped at the next plan (``best_effort``) and load-backs waited for per layer."""
    rng = random.Random(5)
    random_delays(ref, "cpu", TorchMover(delay=lambda d, layers: time.sleep(rng.uniform(0, 0.01))), rng)


def random_delays(ref, device, mover, rng):
    system, users = conversations(seed=11)
    store = kvtier.L3Store.embedded(1 << 24)
    with TorchEngine(config(), tiny_llama(seed=3, device=device), KvtierL3Backend(store),
                     mover=mover) as a:
        serve(a, system, users)
    cfg = config(prefetch_stop="best_effort")
    with TorchEngine(cfg, tiny_llama(seed=3, device=device), Jittery(store, rng), mover=mover,
                     loads=LoadWait.PER_LAYER, prefetch_chunk_pages=1) as b:
        prompts = serve(b, system, users, first_id=500)
        assert b.executor.stats.ops.get("Prefetch", 0) > 0
        assert b.terminated > 0  # some prefetches were stopped while reading
        check_against_transformers(b, prompts, ref)
        b.s.check()
