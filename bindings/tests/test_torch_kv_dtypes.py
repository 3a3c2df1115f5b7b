"""kvtier.torch's model glue with KV pools of another dtype than the model's: what the model
writes lands in the pool as the pool's dtype (bit for bit the model's K/V cast to it), and
what it reads back is that, on CPU, FP8 included."""

import pytest
import torch

from kvtier.torch import TorchEngine
from conftest import small_config, tiny_deepseek_v3, tiny_llama

PROMPT = [5, 17, 99, 3, 42, 8, 61]  # 7 tokens: two whole pages of 3 and one partial


def engine(model, kv_dtype):
    cfg = small_config(page_size=3, device_pages=16, host_pages=16, max_context_tokens=48)
    return TorchEngine(cfg, model, None, kv_dtype=kv_dtype, stop_token_ids=())


def layer0(eng):
    """Layer 0's pool tensors over the request's pages, in token order (layer 0's K/V
    depend on the embeddings only, so any KV dtype holds the fp32 KV cast to it)."""
    pages = torch.as_tensor(eng.tables[1], dtype=torch.long)
    return [t[pages].reshape(-1, *t.shape[2:])[: len(PROMPT)] for t in eng.device_pool.tensors[0]]


@pytest.mark.parametrize("make", [tiny_llama, tiny_deepseek_v3], ids=["mha", "mla"])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16])
def test_kv_pools_of_a_narrower_float_dtype_hold_the_models_kv_cast_to_it(make, kv_dtype):
    model = make(0)
    with engine(model, torch.float32) as ref:
        ref.submit(1, PROMPT, 1)
        for _ in range(3):  # the prefill, its forward done; the table still names the pages
            ref.step(0)
        want = [t.to(kv_dtype) for t in layer0(ref)]
        want_logits = ref.first_logits[1]
    with engine(model, kv_dtype) as eng:
        eng.submit(1, PROMPT, 1)
        for _ in range(3):
            eng.step(0)
        got = layer0(eng)
        assert all(g.dtype == kv_dtype for g in got)
        for g, w in zip(got, want):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
        logits = eng.first_logits[1]
    assert torch.isfinite(logits).all()
    # rounding KV to 3 mantissa bits moves the logits a little, not to other values
    cos = torch.nn.functional.cosine_similarity(logits, want_logits, dim=0)
    assert cos > 0.95, float(cos)


@pytest.mark.parametrize("make", [tiny_llama, tiny_deepseek_v3], ids=["mha", "mla"])
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.uint8, torch.int32])
def test_integer_kv_pools_are_refused_not_served_truncated(make, kv_dtype):
    """The glue casts the model's K/V to the pool's dtype: into integers that truncates them
    (an int8 cache needs quantization scales the glue does not have), wrong tokens with no
    error. Refused when the engine is built, the model given its attention back."""
    from kvtier.torch import PoolLayoutError

    model = make(0)
    impl = model.config._attn_implementation
    with pytest.raises(PoolLayoutError, match="integer"):
        engine(model, kv_dtype)
    assert model.config._attn_implementation == impl


@pytest.mark.parametrize("field,value", [("dtype", "float16"), ("layout", "mha:2L:2x8:page4:tp1"),
                                         ("layout", "mla:2L:24:page3:tp1")])
def test_a_callers_namespace_naming_another_kv_dtype_or_layout_is_refused(field, value):
    """A Scheduler built by the caller whose namespace names a KV dtype or layout other than
    the engine's pools (copied from another engine's config): its L3 pages would be read by
    that engine as its own KV (bf16 bytes read as fp16), wrong tokens with no error."""
    import kvtier
    from kvtier.engine import KvtierL3Backend
    from kvtier.torch import NamespaceError

    model = tiny_llama(0)
    cfg = small_config(page_size=3, device_pages=16, host_pages=16, max_context_tokens=48, l3_enabled=True)
    store = KvtierL3Backend(kvtier.L3Store.embedded(1 << 22))
    from kvtier.torch import torch_namespace
    from kvtier.torch.model import layout_of

    own = torch_namespace(model, layout_of(model.config, 3, torch.bfloat16))
    ok = {"model": "llama-test", "dtype": own["dtype"], "layout": own["layout"]}
    with pytest.raises(NamespaceError, match=field):
        TorchEngine(kvtier.Scheduler(cfg.replace(namespace={**ok, field: value})), model, store,
                    kv_dtype=torch.bfloat16)
    # the engine's own fields are served
    TorchEngine(kvtier.Scheduler(cfg.replace(namespace=ok)), model, store, kv_dtype=torch.bfloat16).close()


@pytest.mark.parametrize("missing", [("dtype",), ("layout",), ("dtype", "layout")])
def test_a_callers_namespace_leaving_the_kv_dtype_or_layout_empty_is_refused(missing):
    """A Scheduler built by the caller naming the model but leaving ``dtype`` or ``layout``
    empty was served: two such engines of one model with fp16 and bf16 pools (or other page
    layouts) on one store keyed their pages alike and read each other's L3 pages as their
    own KV, wrong tokens with no error. With L3 the KV fields must be named, and be the
    pools' (a SchedulerConfig still gets them filled in)."""
    import kvtier
    from kvtier.engine import KvtierL3Backend
    from kvtier.torch import NamespaceError, torch_namespace
    from kvtier.torch.model import layout_of

    model = tiny_llama(0)
    cfg = small_config(page_size=3, device_pages=16, host_pages=16, max_context_tokens=48, l3_enabled=True)
    store = KvtierL3Backend(kvtier.L3Store.embedded(1 << 22))
    own = torch_namespace(model, layout_of(model.config, 3, torch.float16))
    ns = {"model": "llama-test", **{k: own[k] for k in ("dtype", "layout") if k not in missing}}
    with pytest.raises(NamespaceError, match=missing[0]):
        TorchEngine(kvtier.Scheduler(cfg.replace(namespace=ns)), model, store, kv_dtype=torch.float16)
    # without L3 nothing is shared: the fields are not needed
    TorchEngine(kvtier.Scheduler(cfg.replace(namespace=ns, l3_enabled=False)), model, None,
                kv_dtype=torch.float16).close()
    # a SchedulerConfig leaving them empty gets the pools' own
    with TorchEngine(cfg.replace(namespace={"model": "llama-test"}), model, store, kv_dtype=torch.float16) as e:
        assert {k: e.s.config()["namespace"][k] for k in ("dtype", "layout")} == \
            {k: own[k] for k in ("dtype", "layout")}
