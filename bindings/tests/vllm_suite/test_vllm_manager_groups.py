"""KV cache groups under ``KvtierOffloadingSpec``: kvtier's radix tree keeps chunks with their
whole prefix, so a model with a sliding-window (or chunked-local, or Mamba) group is refused
with a typed error when vLLM builds the spec; groups of full attention are served, each its
own chain. Built from real vLLM KV-cache configs of two groups through vLLM's own
``OffloadingConnector`` (which builds the offloading config and the spec). vLLM 0.32's
offloading config does not carry the window: kvtier finds it itself (compat.py), so the
refusal is the same on 0.32, 0.33 and 0.34."""

from __future__ import annotations

import pytest
import torch
from harness import BLOCK, Engine
from manager_engines import kvtier_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

from kvtier.vllm import KvtierOffloadingManager, KvtierSpecConfigError
from kvtier.vllm.compat import group_windows


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
        if hasattr(cfg.groups[0], "sliding_window_size_in_chunks"):  # vLLM 0.33 and later
            assert [g.sliding_window_size_in_chunks for g in cfg.groups] == [None, 2]
        with pytest.raises(KvtierSpecConfigError, match="group 1 keeps a window of 2 chunk") as err:
            OffloadingConnector(e.vllm_config, KVConnectorRole.SCHEDULER, _two_groups(e, swa))
        # It names what serves the model: vLLM's tiering, and on vLLM's CPU build (where
        # vLLM's own TieringOffloadingSpec does not start) kvtier's spec of it.
        assert "TieringOffloadingSpec" in str(err.value) and "KvtierTieringOffloadingSpec" in str(err.value)
        # Beside a full-attention group, vLLM without its hybrid KV cache manager gives the
        # sliding layers full-attention blocks, which the spec serves: the message says how.
        assert "--disable-hybrid-kv-cache-manager" in str(err.value)
        full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16)
        conn = OffloadingConnector(e.vllm_config, KVConnectorRole.SCHEDULER, _two_groups(e, full))
        manager = conn.connector_scheduler.manager
        assert isinstance(manager, KvtierOffloadingManager)
        assert manager.tokens_per_chunk == {0: 2 * BLOCK, 1: 2 * BLOCK}
        conn.shutdown()
        kv_cache_config = _two_groups(e, swa)  # what vLLM 0.32's connector holds when it builds the spec
        assert group_windows(build_offloading_config(e.vllm_config, kv_cache_config)) == {0: None, 1: 2}
    finally:
        e.close()


def test_a_window_past_max_model_len_never_slides_and_is_served(tmp_path):
    """A sliding window longer than any prompt the engine takes (Mistral-7B-v0.1's 4096
    tokens at a max_model_len of 4096 or less) never slides: vLLM keeps and stores every
    chunk of the group, a prefix, so the spec serves it (it was refused; the real engine
    serves such a Mistral exact: vllm_engine/test_vllm_engine_archs.py). One chunk shorter
    than that, it is refused."""
    e = Engine(str(tmp_path), [], kv_config=kvtier_config(16))
    try:
        max_len = int(e.vllm_config.model_config.max_model_len)
        chunk = 2 * BLOCK
        for window_tokens, served in ((max_len + chunk, True), (max_len, False)):
            swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16,
                                    sliding_window=window_tokens)
            if served:
                conn = OffloadingConnector(e.vllm_config, KVConnectorRole.SCHEDULER, _two_groups(e, swa))
                assert isinstance(conn.connector_scheduler.manager, KvtierOffloadingManager)
                conn.shutdown()
            else:
                with pytest.raises(KvtierSpecConfigError, match="group 1 keeps a window"):
                    OffloadingConnector(e.vllm_config, KVConnectorRole.SCHEDULER, _two_groups(e, swa))
    finally:
        e.close()
