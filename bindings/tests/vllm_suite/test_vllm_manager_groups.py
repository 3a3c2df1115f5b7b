"""KV cache groups under ``KvtierOffloadingSpec``: kvtier's radix tree keeps chunks with their
whole prefix, so a model with a sliding-window (or chunked-local, or Mamba) group is refused
with a typed error when vLLM builds the spec; groups of full attention are served, each its
own chain. Built from real vLLM KV-cache configs of two groups through vLLM's own
``build_offloading_config`` and ``OffloadingSpecFactory``."""

from __future__ import annotations

import pytest
import torch
from harness import BLOCK, Engine
from test_vllm_manager import kvtier_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvtier.vllm import KvtierOffloadingSpec, KvtierSpecConfigError


def _two_groups(engine: Engine, second) -> KVCacheConfig:
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16)
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"], full),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], second),
    ])


def test_a_sliding_window_group_is_refused_when_vllm_builds_the_spec(tmp_path):
    e = Engine(str(tmp_path), [], kv_config=kvtier_config(16))
    try:
        swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16,
                                sliding_window=4 * BLOCK)
        cfg = build_offloading_config(e.vllm_config, _two_groups(e, swa))
        assert [g.sliding_window_size_in_chunks for g in cfg.groups] == [None, 2]
        with pytest.raises(KvtierSpecConfigError, match="group 1 keeps a window of 2 chunk"):
            OffloadingSpecFactory.create_spec(cfg)
        full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16)
        spec = OffloadingSpecFactory.create_spec(build_offloading_config(e.vllm_config, _two_groups(e, full)))
        assert isinstance(spec, KvtierOffloadingSpec) and spec.tokens_per_chunk == {0: 2 * BLOCK, 1: 2 * BLOCK}
    finally:
        e.close()
