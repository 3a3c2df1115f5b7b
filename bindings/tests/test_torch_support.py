"""What kvtier.torch serves and what it refuses (issue 21 item 2 and the refusal list of
docs/torch.md): sliding windows are served (Mistral with a window shorter than the prompts,
through every tier, equal to ``generate()``; pages wholly before the window are never read);
every attention feature the paged glue does not implement is a typed
``UnsupportedModelError`` naming it, never a silently wrong token."""

import pytest
from hypothesis import given, settings, strategies as st
import torch
import transformers

import kvtier
from kvtier.engine import KvtierL3Backend
from kvtier.torch import DevicePool, TorchEngine, UnsupportedModelError
from kvtier.torch.model import PagedRow, layout_of, run_row, use_paged_attention
from kvtier.torch.support import check_model
from conftest import full_last_logits, paged_last_logits, tiny_llama, tiny_mistral
from test_torch_model import check_against_transformers, config, conversations, named_scheduler, serve


def test_sliding_window_multi_turn_through_every_tier_matches_generate():
    system, users = conversations(seed=9)
    ref = tiny_mistral(seed=4)
    store = kvtier.L3Store.embedded(1 << 24)
    with TorchEngine(named_scheduler(config(), "mistral", ref), tiny_mistral(seed=4), KvtierL3Backend(store)) as a:
        prompts = serve(a, system, users)
        assert a.executor.stats.ops.get("LoadBack", 0) > 0 and a.s.stats()["host_hit_tokens"] > 0
        check_against_transformers(a, prompts, ref)
    with TorchEngine(named_scheduler(config(), "mistral", ref), tiny_mistral(seed=4), KvtierL3Backend(store)) as b:
        prompts = serve(b, system, users, first_id=100)
        assert b.s.stats()["l3_hit_tokens"] > 0
        check_against_transformers(b, prompts, ref)


def test_pages_wholly_before_the_window_are_not_read():
    """Positions before the window hold NaN: a read of any of them would poison the logits."""
    model = tiny_mistral(seed=4, window=6)
    lay = layout_of(model.config, page_size=4, dtype=torch.float32)
    pool = DevicePool.allocate(lay, 16)
    prompt = list(range(1, 25))
    pages = torch.arange(6)
    with use_paged_attention(model):
        run_row(model, PagedRow(pool, pages, 0), prompt[:20])
        for l in range(lay.num_layers):  # positions 0..11 (pages 0..2): before the window of position 20 (15..20)
            pool.k(l)[:3] = float("nan")
            pool.v(l)[:3] = float("nan")
        got = run_row(model, PagedRow(pool, pages, 20), prompt[20:])
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, -1]
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def test_use_paged_attention_checks_the_model():
    with pytest.raises(UnsupportedModelError, match="softcapping"):
        cfg = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        TorchEngine(config(l3_enabled=False), transformers.Gemma2ForCausalLM(cfg))


@pytest.mark.parametrize("name,kw,feature", [
    ("T5Config", {}, "encoder-decoder"),
    ("Llama4TextConfig", {}, "chunked attention"),
    ("Qwen3NextConfig", {}, "linear_attention"),
    ("Gemma2Config", {}, "softcapping"),
    ("DeepseekV32Config", {}, "MLA variant"),
])
def test_refused_configs_name_the_feature(name, kw, feature):
    with pytest.raises(UnsupportedModelError, match=feature):
        check_model(getattr(transformers, name)(**kw))


def test_attention_sinks_are_refused_at_the_first_forward():
    """GPT-OSS's config looks like any sliding-window model; its attention passes learned
    sinks (``s_aux``) that paged attention does not add: refused, not ignored."""
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                                    num_experts_per_tok=1, sliding_window=4, dtype=torch.float32)
    model = transformers.GptOssForCausalLM(cfg).eval()
    pool = DevicePool.allocate(layout_of(cfg, 4, torch.float32), 8)
    with use_paged_attention(model):
        with pytest.raises(UnsupportedModelError, match="s_aux"):
            run_row(model, PagedRow(pool, torch.arange(8), 0), [1, 2, 3])


def test_non_causal_attention_is_refused():
    model = tiny_llama()
    model.model.layers[0].self_attn.is_causal = False
    pool = DevicePool.allocate(layout_of(model.config, 4, torch.float32), 8)
    with use_paged_attention(model):
        with pytest.raises(UnsupportedModelError, match="not causal"):
            run_row(model, PagedRow(pool, torch.arange(8), 0), [1, 2, 3])


def _tiny(name, **kw):
    torch.manual_seed(0)
    cfg = getattr(transformers, name)(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, dtype=torch.float32, **kw)
    return getattr(transformers, name.replace("Config", "ForCausalLM"))(cfg).eval()


def _paged_logits(model, prompt, chunk):
    return paged_last_logits(model, prompt, 4, [chunk])


@pytest.mark.parametrize("name,kw", [
    ("MistralConfig", dict(sliding_window=5)),
    ("Qwen2Config", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),  # window on layer 1 only
])
def test_windowed_models_match_a_full_forward(name, kw):
    model = _tiny(name, **kw)
    prompt = list(range(3, 26))
    got = _paged_logits(model, prompt, chunk=7)
    assert torch.allclose(got, full_last_logits(model, prompt), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name,kw", [
    ("Qwen2MoeConfig", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2, num_experts=2,
                            num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16)),
    ("PhimoeConfig", dict(sliding_window=4, num_local_experts=2, num_experts_per_tok=1)),
])
def test_a_window_kept_only_in_the_mask_is_refused(name, kw):
    """These models put the window into the attention mask alone, which paged attention does
    not read: served as they are, they would attend past the window."""
    with pytest.raises(UnsupportedModelError, match="sliding window"):
        _paged_logits(_tiny(name, **kw), list(range(3, 12)), chunk=9)


def test_torch_engine_refuses_at_construction_and_gives_the_model_back():
    """Features refused only at a forward are found by the engine's one-token probe, before
    any request is accepted; the model keeps its own attention."""
    model = _tiny("Qwen2MoeConfig", use_sliding_window=True, sliding_window=4, max_window_layers=2, num_experts=2,
                  num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    impl = model.config._attn_implementation
    with pytest.raises(UnsupportedModelError, match="sliding window"):
        TorchEngine(config(l3_enabled=False), model)
    assert model.config._attn_implementation == impl
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 64)


@settings(max_examples=25, deadline=None)
@given(window=st.integers(1, 12), page_size=st.sampled_from([1, 2, 4, 16]), n=st.integers(2, 30),
       chunks=st.lists(st.integers(1, 9), min_size=1, max_size=8), perm_seed=st.integers(0, 1000))
def test_paged_window_attention_equals_a_full_forward(window, page_size, n, chunks, perm_seed):
    """Any window, page size, chunking (prefixes ending mid-page) and page order."""
    model = _tiny("MistralConfig", sliding_window=window)
    prompt = [(7 * i + 3) % 64 for i in range(n)]
    got = paged_last_logits(model, prompt, page_size, chunks, perm_seed, spare=3)
    assert torch.allclose(got, full_last_logits(model, prompt), atol=1e-5, rtol=0)


def test_an_is_causal_false_argument_is_refused():
    model = tiny_llama()
    pool = DevicePool.allocate(layout_of(model.config, 4, torch.float32), 8)
    with use_paged_attention(model):
        with pytest.raises(UnsupportedModelError, match="non-causal"):
            model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False, is_causal=False,
                  kvtier_row=PagedRow(pool, torch.arange(8), 0))
