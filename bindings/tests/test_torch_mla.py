"""MLA (DeepSeek-V3) served through kvtier.torch: the compressed latent and the rope key of
each token live in a ``KVLayout.mla`` pool, and the turns that read their prefix back from
host (load-back), from L3 (a second, empty engine: prefetch) and after retraction produce
exactly transformers' ``generate()`` tokens and first-token logits.

Issue 21 item 1: before, the glue reshaped the pool with the expanded key's head count and
head dim (``RuntimeError: shape '[-1, 4, 24]' is invalid`` with nope 16 / rope 8 / v 8) or
read V with the key's head dim (nope 8 / rope 8 / v 16: wrong tokens after a load-back, no
error), and ``layout_of`` took DeepSeek-V3's ``head_dim`` (the rope dim) as the KV head dim."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import kvtier
from kvtier.engine import KvtierL3Backend
from kvtier.torch import Attention, DevicePool, KVLayout, PoolLayoutError, TorchEngine
from kvtier.torch.model import PagedRow, layout_of, run_row, use_paged_attention
from conftest import full_last_logits, paged_last_logits, tiny_deepseek_v3, tiny_llama
from test_torch_model import check_against_transformers, config, conversations, named_scheduler, serve

DIMS = [(8, 8, 16), (16, 8, 8)]  # (qk_nope, qk_rope, v): V wider and narrower than the key


@pytest.mark.parametrize("nope,rope,v", DIMS)
def test_layout_of_a_deepseek_v3_config_is_the_latent(nope, rope, v):
    m = tiny_deepseek_v3(nope=nope, rope=rope, v=v)
    lay = layout_of(m.config, page_size=4, dtype=torch.float32)
    assert lay.attention == Attention.MLA
    assert lay.chunk_shape == (4, 16 + rope)  # kv_lora_rank + qk_rope_head_dim, not heads x head_dim


@pytest.mark.parametrize("nope,rope,v", DIMS)
def test_mla_multi_turn_through_every_tier_matches_generate(nope, rope, v):
    mla_through_every_tier((nope, rope, v), "cpu", "torch")


def mla_through_every_tier(dims, device, mover):
    nope, rope, v = dims
    system, users = conversations(seed=5)
    store = kvtier.L3Store.embedded(1 << 24)
    ref = tiny_deepseek_v3(seed=2, nope=nope, rope=rope, v=v, device=device)

    def engine():
        model = tiny_deepseek_v3(seed=2, nope=nope, rope=rope, v=v, device=device)
        return TorchEngine(named_scheduler(config(), "mla", model), model, KvtierL3Backend(store), mover=mover)

    with engine() as a:
        assert a.device_pool.layout.attention == Attention.MLA
        prompts = serve(a, system, users)
        ops = a.executor.stats.ops
        assert ops.get("LoadBack", 0) > 0 and ops.get("BackUp", 0) > 0
        assert a.s.stats()["host_hit_tokens"] > 0 and a.executor.stats.failed_ops == 0
        check_against_transformers(a, prompts, ref)
    with engine() as b:  # empty, on the same L3: prefetches
        prompts = serve(b, system, users, first_id=1000)
        assert b.s.stats()["l3_hit_tokens"] > 0 and b.executor.stats.ops.get("Prefetch", 0) > 0
        check_against_transformers(b, prompts, ref)
        b.s.check()


def test_an_mla_model_on_a_kv_pool_and_a_kv_model_on_an_mla_pool_are_typed_errors():
    mla = tiny_deepseek_v3()
    kv_pool = DevicePool.allocate(KVLayout.mha(2, 4, 24, 4, torch.float32), 8)
    with use_paged_attention(mla):
        with pytest.raises(PoolLayoutError):
            run_row(mla, PagedRow(kv_pool, torch.arange(8), 0), [1, 2, 3])
    llama = tiny_llama()
    mla_pool = DevicePool.allocate(KVLayout.mla(2, 24, 4, torch.float32), 8)
    with use_paged_attention(llama):
        with pytest.raises(PoolLayoutError):
            run_row(llama, PagedRow(mla_pool, torch.arange(8), 0), [1, 2, 3])
        wrong_dim = DevicePool.allocate(KVLayout.mha(2, 2, 4, 4, torch.float32), 8)  # head_dim 8 in the model
        with pytest.raises(PoolLayoutError):
            run_row(llama, PagedRow(wrong_dim, torch.arange(8), 0), [1, 2, 3])


@settings(max_examples=20, deadline=None)
@given(page_size=st.sampled_from([1, 3, 4, 16]), n=st.integers(2, 30),
       chunks=st.lists(st.integers(1, 9), min_size=1, max_size=8), perm_seed=st.integers(0, 1000),
       dims=st.sampled_from(DIMS))
def test_paged_mla_equals_a_full_forward(page_size, n, chunks, perm_seed, dims):
    """Any page size, chunking (prefixes ending mid-page) and page order: the latents read back
    from the pool give a full forward's logits."""
    nope, rope, v = dims
    model = tiny_deepseek_v3(seed=1, nope=nope, rope=rope, v=v)
    prompt = [(5 * i + 1) % 128 for i in range(n)]
    got = paged_last_logits(model, prompt, page_size, chunks, perm_seed)
    assert torch.allclose(got, full_last_logits(model, prompt), atol=1e-4, rtol=0)


def test_deepseek_v2_is_served_too():
    """DeepSeek-V2 hands its latents to the cache the same way (no rope interleave, q LoRA)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.DeepseekV2Config(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, dtype=torch.float32)
    model = transformers.DeepseekV2ForCausalLM(cfg).eval()
    assert layout_of(cfg, 4, torch.float32).chunk_shape == (4, 24)
    prompt = list(range(1, 23))
    got = paged_last_logits(model, prompt, 4, [5, 3], perm_seed=7)
    assert torch.allclose(got, full_last_logits(model, prompt), atol=1e-4, rtol=0)
