"""An MLA model (DeepSeek-V2's latent KV) on vLLM's CPU build with kvtier's offloading: refused
when the engine starts.

Why: vLLM's CPU platform turns prefix caching and chunked prefill off for MLA (without AMX
MLA its CPU attention cannot prefill a suffix over cached KV), and offloading on CPU is only
there through kvtier's CPU copy path, so nothing stopped kvtier from loading a reused prefix
and the engine from prefilling over it: an adversarial tester's tiny DeepSeek-V2 gave wrong
tokens from the first one in every reused prompt, in every mode (host tier, L3, tiering,
vLLM's own manager), while the bytes kvtier moved were exact. A refusal at startup, naming
why, is the only right answer there; on a GPU (or with AMX MLA, which keeps prefix caching)
MLA is served."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import model_dir, offloading, prompts, run_engine  # noqa: E402

# A small DeepSeek-V2 with random weights: latent KV of 512 + 64 rope dims a token, 3 layers.
DSV2 = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 512,
        "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8, "num_hidden_layers": 3,
        "vocab_size": 8192, "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
        "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.2, "tie_word_embeddings": False,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 4, "moe_intermediate_size": 256, "rope_theta": 10000.0}
HOST = 3 * 512 * 3456  # three 512-token prefixes (3 layers x 576 values x 2 bytes a token)


@pytest.mark.parametrize("spec", ["KvtierOffloadingSpec", "KvtierTieringOffloadingSpec"])
def test_an_mla_model_on_cpu_is_refused_at_startup(tmp_path_factory, spec):
    md = model_dir(str(tmp_path_factory.getbasetemp() / "models"), DSV2)
    extra = {}
    if spec == "KvtierTieringOffloadingSpec":
        extra = {"secondary_tiers": [{"type": "KvtierSecondaryTier", "module_path": "kvtier.vllm",
                                      "segment_bytes": "64MB"}]}
    kt = offloading(spec, HOST, **extra)
    kt["engine_id"] = f"kvtier-mla-{uuid.uuid4().hex[:8]}"
    job = {"model": md, "dtype": "bfloat16", "kv_blocks": 38, "max_model_len": 576, "kv_transfer_config": kt,
           "phases": [{"name": "r1", "prompts": prompts(1, n=1), "max_tokens": 4}]}
    with pytest.raises(RuntimeError) as e:
        run_engine(job, timeout=600)
    log = str(e.value)
    assert "KvtierSpecConfigError" in log and "MLA" in log and "prefix caching" in log, log[-3000:]
