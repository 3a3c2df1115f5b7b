"""The engine workload of kvtier's vLLM end-to-end tests and benchmark: long shared prefixes
that do not fit the engine's KV, then rounds that reuse them with new suffixes.

Why: a prefix the engine's own KV still holds is served by vLLM's prefix cache, and nothing
of kvtier's is exercised; with ``PREFIXES`` prefixes of ``PREFIX_TOKENS`` each and a KV budget
of ``KV_BLOCKS`` blocks (less than two prefixes), round 2 finds its prefix only where an
offloading tier kept it. Greedy decoding of a model with fixed random weights: the same KV
gives the same tokens, so every mode's outputs must equal the reference's.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
BLOCK = 32
KV_BLOCKS = 24  # 768 tokens: one prefix and its suffix, not two
PREFIX_TOKENS = 512
SUFFIX_TOKENS = 32
PREFIXES = 6
MAX_TOKENS = 8
CHUNK_TOKENS = 64  # offloading chunk (vLLM's ``block_size`` in kv_connector_extra_config)

# A small Llama with random weights (no download); vLLM's CPU attention needs head_dim 64/128.
# ``initializer_range`` 0.2: with vLLM's dummy weights (±1e-3) or the usual 0.02 the residual
# stream is the current token's embedding and the prefix barely matters, so wrong KV would
# still give the right tokens; at 0.2 the next token depends on the prefix (checked by the
# tests: one suffix after different prefixes gives different outputs).
MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
         "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4,
         "vocab_size": 8192, "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
         "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.2, "tie_word_embeddings": False}


# A second architecture for the tests past the first model: Qwen2 (biases on q/k/v, tied
# embeddings, 2 KV heads for 8 query heads, 3 layers), served in bfloat16.
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 512,
         "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 3,
         "vocab_size": 8192, "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
         "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.2, "tie_word_embeddings": True,
         "use_sliding_window": False, "rope_theta": 10000.0}


def model_dir(root: str, base: Optional[Dict[str, Any]] = None, **over: Any) -> str:
    """A directory with the model (config.json and random weights, seed 0, from
    transformers' own initialisation of ``base``'s architecture: ``MODEL``, the Llama, by
    default)."""
    base = MODEL if base is None else base
    cfg = {**base, **over}
    name = "llama" if base is MODEL else base["model_type"]
    path = Path(root) / (name + "-" + "-".join(f"{k}{v}" for k, v in sorted(over.items())) if over else name)
    if not (path / "model.safetensors").exists():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        path.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        conf = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items()
                                                          if k not in ("architectures", "model_type")})
        model = AutoModelForCausalLM.from_config(conf)
        model.to(torch.bfloat16).save_pretrained(str(path), safe_serialization=True)
        (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def lora_dir(root: str, name: str, seed: int, rank: int = 8, base: Optional[Dict[str, Any]] = None) -> str:
    """A PEFT LoRA adapter for ``base`` (``MODEL`` by default) in ``root/name``: random A and B
    (seed ``seed``) on every layer's q, k and v projections, so the adapter changes the KV
    itself (an adapter on the MLP alone would change the tokens but not the cache). Both
    factors non-zero: PEFT's own initialisation (B = 0) is the identity."""
    import torch
    from safetensors.torch import save_file

    base = MODEL if base is None else base
    path = Path(root) / name
    if (path / "adapter_model.safetensors").exists():
        return str(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    hidden = base["hidden_size"]
    head = hidden // base["num_attention_heads"]
    outs = {"q_proj": base["num_attention_heads"] * head, "k_proj": base["num_key_value_heads"] * head,
            "v_proj": base["num_key_value_heads"] * head}
    tensors = {}
    for layer in range(base["num_hidden_layers"]):
        for module, out in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, hidden, generator=g) * 0.2).contiguous()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * 0.2).contiguous()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "target_modules": list(outs),
        "base_model_name_or_path": "random", "bias": "none", "fan_in_fan_out": False, "lora_dropout": 0.0,
        "modules_to_save": None, "use_rslora": False, "use_dora": False}))
    return str(path)


def prompts(seed: int, n: int = PREFIXES, prefix: int = PREFIX_TOKENS, suffix: int = SUFFIX_TOKENS,
            round_: int = 1) -> List[List[int]]:
    """``n`` prompts: prefix ``i`` (fixed by ``seed``) plus a suffix new to each round."""
    out = []
    for i in range(n):
        pre = random.Random(seed * 1000 + i).choices(range(100, 8000), k=prefix)
        suf = random.Random(seed * 1000 + i + 10_000 * round_).choices(range(100, 8000), k=suffix)
        out.append(pre + suf)
    return out


def offloading(spec: str, cpu_bytes: int = 64 << 20, **extra: Any) -> Dict[str, Any]:
    """An ``OffloadingConnector`` config with one of kvtier's specs (``spec_module_path``
    kvtier.vllm) or vLLM's own (``CPUOffloadingSpec``, ``TieringOffloadingSpec``)."""
    ex = {"spec_name": spec, "cpu_bytes_to_use": cpu_bytes, "block_size": CHUNK_TOKENS, **extra}
    if spec.startswith("Kvtier"):
        ex["spec_module_path"] = "kvtier.vllm"
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": ex}


def small_host_bytes(model: Dict[str, Any], dtype_bytes: int, prefixes: int = 2) -> int:
    """Host bytes for ``prefixes`` of the workload's prefixes of ``model`` (K and V of every
    layer's KV heads, ``dtype_bytes`` a value, in ``CHUNK_TOKENS``-token chunks)."""
    head = model["hidden_size"] // model["num_attention_heads"]
    chunk = 2 * model["num_hidden_layers"] * model["num_key_value_heads"] * head * CHUNK_TOKENS * dtype_bytes
    return prefixes * (PREFIX_TOKENS // CHUNK_TOKENS) * chunk


def three_modes(base: Dict[str, Any], host_bytes: int, tag: str) -> Dict[str, Dict[str, Any]]:
    """Engine jobs over ``base`` (model, phases, ...): ``ref`` (no offloading, a KV holding
    everything), ``spec_l3`` (``KvtierOffloadingSpec`` + an embedded ``kvtier_l3``) and
    ``tier`` (vLLM's tiering + ``KvtierSecondaryTier`` + ``KvtierFreqDepthPolicy``, 128-token
    chunks), both with ``host_bytes`` of host tier and waiting for room (reuse must not depend
    on speed). ``tag`` names the engines."""

    def cfg(spec: str, **extra: Any) -> Dict[str, Any]:
        c = offloading(spec, cpu_bytes=host_bytes, **extra)
        c["engine_id"] = f"kvtier-e2e-{tag}-{uuid.uuid4().hex[:8]}"
        return c

    return {
        "ref": {**base, "kv_blocks": 200, "max_model_len": 2048},
        "spec_l3": {**base, "kv_transfer_config": cfg("KvtierOffloadingSpec", kvtier_l3={"segment_bytes": "256MB"},
                                                      kvtier_room_wait_ms=120_000)},
        "tier": {**base, "kv_transfer_config": cfg(
            "KvtierTieringOffloadingSpec", block_size=2 * CHUNK_TOKENS, eviction_policy="KvtierFreqDepthPolicy",
            cache_policy_module_path="kvtier.vllm",
            secondary_tiers=[{"type": "KvtierSecondaryTier", "module_path": "kvtier.vllm",
                              "segment_bytes": "256MB"}])},
    }


def run_together(jobs: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Runs every job's engine at once; each one's result by name (an engine left running
    when one fails is killed)."""
    started = {name: run_engine(job, wait=False) for name, job in jobs.items()}
    try:
        with cf.ThreadPoolExecutor(len(started)) as pool:
            return dict(zip(started, pool.map(lambda po: finish(*po), started.values())))
    finally:
        for p, _ in started.values():
            if p.poll() is None:
                p.kill()


def run_engine(job: Dict[str, Any], python: Optional[str] = None, timeout: float = 900,
               wait: bool = True) -> Any:
    """Runs engine_driver.py on ``job`` in its own process; its JSON result (or, with
    ``wait=False``, ``(process, out_path)``)."""
    job = {"kv_blocks": KV_BLOCKS, "max_model_len": KV_BLOCKS * BLOCK - BLOCK, **job}
    d = tempfile.mkdtemp(prefix="kvtier-engine-")
    jp, op = os.path.join(d, "job.json"), os.path.join(d, "out.json")
    with open(jp, "w") as f:
        json.dump(job, f)
    log = open(os.path.join(d, "log"), "w")
    p = subprocess.Popen([python or sys.executable, str(HERE / "engine_driver.py"), jp, op], stdout=log,
                         stderr=subprocess.STDOUT)
    if not wait:
        return p, op
    return finish(p, op, timeout)


def finish(p: subprocess.Popen, out_path: str, timeout: float = 900) -> Dict[str, Any]:
    rc = p.wait(timeout=timeout)
    log = Path(out_path).with_name("log").read_text()
    if rc != 0 or not os.path.exists(out_path):
        raise RuntimeError(f"engine failed (rc {rc}):\n{log[-6000:]}")
    with open(out_path) as f:
        res = json.load(f)
    res["log"] = log
    return res
