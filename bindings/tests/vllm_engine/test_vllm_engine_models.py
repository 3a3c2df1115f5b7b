"""kvtier serving real tokens inside vLLM with a second model: the end-to-end tests of
test_vllm_engine.py past their Llama in float32. Qwen2 (biases on q/k/v, tied embeddings,
2 KV heads for 8 query heads, 3 layers: another KV layout per chunk) served in bfloat16 (2 bytes
a value: other chunk sizes in the host slots and in L3), with the same workload (6 prompts with
512-token prefixes an engine KV of 24 blocks cannot hold together, then a round reusing them
with new suffixes), against a Qwen2 reference whose KV holds everything:

- ``spec_l3``: ``KvtierOffloadingSpec`` with an embedded ``kvtier_l3``, a host tier of two of
  the six prefixes (round 2 comes mostly from L3), 64-token chunks;
- ``tier``: vLLM's tiering with ``KvtierSecondaryTier`` and ``KvtierFreqDepthPolicy``, the same
  host bytes in 128-token chunks (4 of vLLM's blocks a chunk).

Three engine processes at once (about 45 s on 2 cores)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import (  # noqa: E402
    BLOCK,
    CHUNK_TOKENS,
    MAX_TOKENS,
    PREFIXES,
    PREFIX_TOKENS,
    QWEN2,
    model_dir,
    prompts,
    run_together,
    small_host_bytes,
    three_modes,
)

SMALL_HOST = small_host_bytes(QWEN2, 2)  # two of the six prefixes, in bfloat16


def _phase(rnd: int):
    return {"name": f"r{rnd}", "prompts": prompts(1, round_=rnd), "max_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    md = model_dir(str(tmp_path_factory.mktemp("qwen2")), QWEN2)
    base = {"model": md, "dtype": "bfloat16", "phases": [_phase(1), _phase(2)]}
    return run_together(three_modes(base, SMALL_HOST, "qwen2"))


def outputs(run, name):
    return next(ph for ph in run["phases"] if ph["name"] == name)


def test_the_second_model_reads_its_prefix_and_its_kv_budget_holds_one(runs):
    """Sanity: one suffix after different prefixes gives different tokens; the reference's KV
    holds every prefix, the offloading engines' KV none of round 1's."""
    assert len({tuple(o) for o in outputs(runs["ref"], "r1")["outputs"]}) == PREFIXES
    assert outputs(runs["ref"], "r2")["cached"] == [PREFIX_TOKENS] * PREFIXES
    for e in ("spec_l3", "tier"):
        assert outputs(runs[e], "r1")["cached"] == [0] * PREFIXES, e
    assert 2 * CHUNK_TOKENS % BLOCK == 0


@pytest.mark.parametrize("engine", ["spec_l3", "tier"])
def test_every_mode_is_exact_on_qwen2_in_bfloat16_and_reuses_from_l3(runs, engine):
    for n in ("r1", "r2"):
        assert outputs(runs[engine], n)["outputs"] == outputs(runs["ref"], n)["outputs"], f"{engine} {n}"
    cached = outputs(runs[engine], "r2")["cached"]
    # The host tier holds two prefixes (the last two of round 1): the first two came from L3.
    assert cached[:2] == [PREFIX_TOKENS] * 2, cached
    if engine == "spec_l3":
        assert cached == [PREFIX_TOKENS] * PREFIXES, cached  # the rest wait for their prefetch
