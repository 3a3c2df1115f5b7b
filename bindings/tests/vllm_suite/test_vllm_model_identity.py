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
