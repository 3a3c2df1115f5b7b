"""TorchEngine on an L3 store (issue 21 items 3, 4, 5; issue 33 item 5b): the namespace keeps
two models' pages apart, also two unnamed models of one config whose weights differ (the
weights' fingerprint); demotion with L3 backs device pages up (staged through host pages); the
store's loss journal reaches the scheduler every step. Outputs stay equal to ``generate()``."""

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import kvtier
from kvtier.engine import KvtierL3Backend
from kvtier.torch import KVLayout, NamespaceError, TorchEngine, torch_namespace, weights_fingerprint
from kvtier.torch.namespace import sample_positions
from conftest import greedy_reference, tiny_llama
from test_torch_model import check_against_transformers, config, conversations, named_scheduler, serve


def other_llama(seed=3):
    """A different Llama with the same KV layout as ``tiny_llama`` (2 layers, 2 KV heads of 8):
    its pages fit the first model's pools, so only the namespace keeps them apart."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      rope_theta=5000.0, dtype=torch.float32)
    m = LlamaForCausalLM(cfg).eval()
    m.generation_config.eos_token_id, m.generation_config.pad_token_id = None, 0
    return m


def test_a_scheduler_without_namespace_on_an_l3_store_is_refused():
    store = kvtier.L3Store.embedded(1 << 22)
    try:
        TorchEngine(kvtier.Scheduler(config()), tiny_llama(), KvtierL3Backend(store)).close()
    except NamespaceError:
        return
    raise AssertionError("an engine without namespace was built on an L3 store")


def test_two_models_on_one_store_never_hit_each_others_pages():
    system, users = conversations(seed=13)
    store = kvtier.L3Store.embedded(1 << 24)
    with TorchEngine(config(), tiny_llama(seed=3), KvtierL3Backend(store)) as a:
        serve(a, system, users)
        assert a.executor.stats.l3_pages_written > 0
    with TorchEngine(config(), other_llama(), KvtierL3Backend(store)) as b:
        # Its first turn is exactly the prompts whose pages the first model put in L3.
        prompts = serve(b, system, [u[:1] for u in users], first_id=100)
        assert b.s.config()["namespace"] != a.s.config()["namespace"]
        assert b.s.stats()["l3_hit_tokens"] == 0 and b.executor.stats.l3_pages_read == 0
        check_against_transformers(b, prompts, other_llama())
    with TorchEngine(config(), tiny_llama(seed=3), KvtierL3Backend(store)) as c:  # the same model shares
        prompts = serve(c, system, users, first_id=200)
        assert c.s.stats()["l3_hit_tokens"] > 0
        check_against_transformers(c, prompts, tiny_llama(seed=3))


def test_unnamed_models_of_one_config_share_l3_only_with_the_same_weights():
    """Issue 33 (5b): two models built in code from one config (``_name_or_path`` empty, no
    ``model_id``) with different random weights, on one embedded store. The second must not
    read the first one's pages (they are another model's KV: wrong tokens); a copy of the
    first one's weights must (same weights, same namespace: L3 is shared)."""
    system, users = conversations(seed=23)
    store = kvtier.L3Store.embedded(1 << 24)
    first = tiny_llama(seed=3)
    assert not first.config._name_or_path
    with TorchEngine(config(), first, KvtierL3Backend(store)) as a:
        serve(a, system, users)
        assert a.executor.stats.l3_pages_written > 0
        ns_a = a.s.config()["namespace"]
    with TorchEngine(config(), tiny_llama(seed=4), KvtierL3Backend(store)) as b:
        # Its first turn is exactly the prompts whose pages the first model put in L3.
        prompts = serve(b, system, [u[:1] for u in users], first_id=100)
        check_against_transformers(b, prompts, tiny_llama(seed=4))
        assert b.s.stats()["l3_hit_tokens"] == 0 and b.executor.stats.l3_pages_read == 0
        assert b.s.config()["namespace"] != ns_a
    twin = copy.deepcopy(tiny_llama(seed=3))  # the same weights, another object
    with TorchEngine(config(), twin, KvtierL3Backend(store)) as c:
        assert c.s.config()["namespace"] == ns_a
        prompts = serve(c, system, users, first_id=200)
        assert c.s.stats()["l3_hit_tokens"] > 0
        check_against_transformers(c, prompts, tiny_llama(seed=3))


def test_a_scheduler_of_a_tensor_parallel_group_is_refused():
    """Issue 33 (5a): TorchEngine serves one rank and reports the store's losses directly
    (``l3_lost``): a scheduler that is one rank of several is refused when the engine is built
    (``ConfigError`` naming ``tp_ranks``), for a config and for a built scheduler alike."""
    store = kvtier.L3Store.embedded(1 << 22)
    for sched in (config(rank=1, tp_ranks=2), named_scheduler(config(tp_ranks=2), "llama", tiny_llama())):
        with pytest.raises(kvtier.ConfigError, match="tp_ranks"):
            TorchEngine(sched, tiny_llama(), KvtierL3Backend(store))


def test_namespace_fields_set_by_the_caller_are_kept():
    cfg = config(l3_enabled=True)
    store = kvtier.L3Store.embedded(1 << 22)
    with TorchEngine(cfg.replace(namespace={"tenant": "t7"}), tiny_llama(), KvtierL3Backend(store)) as a:
        ns = a.s.config()["namespace"]
        assert ns["tenant"] == "t7" and "LlamaForCausalLM" in ns["model"] and ns["dtype"] == "float32"
    with TorchEngine(cfg.replace(namespace={"model": "mine"}), tiny_llama(), KvtierL3Backend(store)) as b:
        assert b.s.config()["namespace"]["model"] == "mine"
    try:  # a scheduler the caller built, naming a tenant but no model
        TorchEngine(kvtier.Scheduler(cfg.replace(namespace={"tenant": "t7"})), tiny_llama(), KvtierL3Backend(store))
    except NamespaceError:
        return
    raise AssertionError("a scheduler without a model namespace was accepted")


@settings(max_examples=40, deadline=None)
@given(st.tuples(st.sampled_from([48, 64]), st.sampled_from([1e4, 5e5]), st.sampled_from([4, 16]),
                 st.sampled_from([torch.float32, torch.bfloat16])),
       st.tuples(st.sampled_from([48, 64]), st.sampled_from([1e4, 5e5]), st.sampled_from([4, 16]),
                 st.sampled_from([torch.float32, torch.bfloat16])))
def test_namespaces_differ_exactly_when_kv_is_incompatible(x, y):
    def ns(inter, theta, ps, dtype):
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=inter, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, rope_theta=theta)
        torch.manual_seed(0)  # one config, one set of weights
        return torch_namespace(LlamaForCausalLM(cfg), KVLayout.mha(2, 2, 8, ps, dtype))

    assert (ns(*x) == ns(*y)) == (x == y)


_SHAPES = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple) | st.sampled_from([(300,), (17, 40)])
_DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64])


def _module(specs, seed=0):
    """A module of parameters ``(shape, dtype, transposed)``: transposed ones are not
    contiguous (as a tied or permuted weight may be)."""
    torch.manual_seed(seed)
    m = torch.nn.Module()
    for i, (shape, dtype, transposed) in enumerate(specs):
        t = torch.randn(shape).to(dtype)
        if transposed and t.dim() >= 2:
            t = t.transpose(0, 1)
        m.register_parameter(f"p{i}", torch.nn.Parameter(t, requires_grad=False))
    return m


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_SHAPES, _DTYPES, st.booleans()), min_size=1, max_size=5), st.data())
def test_weights_fingerprint_is_stable_under_copy_and_sees_every_sampled_element(specs, data):
    m = _module(specs)
    fp = weights_fingerprint(m)
    assert weights_fingerprint(copy.deepcopy(m)) == fp
    twin = torch.nn.Module()  # the same values in fresh, contiguous tensors
    for name, p in m.named_parameters():
        twin.register_parameter(name, torch.nn.Parameter(p.detach().contiguous().clone(), requires_grad=False))
    assert weights_fingerprint(twin) == fp
    i = data.draw(st.integers(0, len(specs) - 1))
    p = dict(m.named_parameters())[f"p{i}"]
    if p.numel() > 0:  # any sampled element changed: another fingerprint
        j = data.draw(st.sampled_from(sample_positions(p.numel())))
        at = torch.unravel_index(torch.tensor(j), p.shape) if p.dim() else ()
        with torch.no_grad():
            p[at] = 0.0 if float(p[at]) != 0.0 else 1.0
        assert weights_fingerprint(m) != fp
    else:  # an empty tensor of another shape: another fingerprint
        m.register_parameter(f"p{i}", torch.nn.Parameter(torch.empty(p.shape + (1,)), requires_grad=False))
        assert weights_fingerprint(m) != fp


def test_weights_fingerprint_sees_names_shapes_and_dtypes_and_refuses_meta_weights():
    m = _module([((4, 6), torch.float32, False)])
    fp = weights_fingerprint(m)
    renamed = torch.nn.Module()
    renamed.register_parameter("q0", m.p0)
    assert weights_fingerprint(renamed) != fp
    m.p0 = torch.nn.Parameter(m.p0.detach().reshape(6, 4), requires_grad=False)
    assert weights_fingerprint(m) != fp
    m.p0 = torch.nn.Parameter(m.p0.detach().reshape(4, 6).double(), requires_grad=False)
    assert weights_fingerprint(m) != fp
    cfg = tiny_llama().config
    with torch.device("meta"):
        ghost = LlamaForCausalLM(cfg)
    try:  # no weights to fingerprint: an L3 namespace cannot be derived
        torch_namespace(ghost, KVLayout.mha(2, 2, 8, 4, torch.float32))
    except NamespaceError as e:
        assert "meta" in str(e) and "namespace" in str(e)
    else:
        raise AssertionError("a model on the meta device got a namespace")


def test_weights_fingerprint_costs_milliseconds_on_a_few_hundred_mb_model():
    """The figure in docs/torch.md: a Llama of ~540 MB (fp32, 111 tensors)."""
    import time

    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4)
    m = LlamaForCausalLM(cfg).eval()
    params = list(m.parameters())
    mb = sum(p.numel() * p.element_size() for p in params) / 1e6
    weights_fingerprint(m)
    took = []
    for _ in range(5):
        t0 = time.perf_counter()
        weights_fingerprint(m)
        took.append(time.perf_counter() - t0)
    best, worst = min(took), max(took)
    print(f"weights_fingerprint: {len(params)} tensors, {mb:.0f} MB: best {best * 1e3:.2f} ms, worst {worst * 1e3:.2f} ms")
    assert best < 0.25, f"{best * 1e3:.1f} ms"


def test_demotion_with_l3_backs_device_pages_up_and_stays_exact():
    """``on-device-eviction`` admission plans BackUps from device pages on purpose (docs/
    scheduler.md); before, TorchEngine failed with ``ExecutorError: BackUp ... not device``."""
    demotion_with_l3("cpu", "torch")


def demotion_with_l3(device, mover):
    system, users = conversations(seed=17)
    store = kvtier.L3Store.embedded(1 << 24)
    ref = tiny_llama(seed=3, device=device)
    cfg = config(host_admission="on-device-eviction:2")

    def engine():
        model = tiny_llama(seed=3, device=device)
        return TorchEngine(named_scheduler(cfg, "llama", model), model, KvtierL3Backend(store), mover=mover)

    with engine() as a:
        prompts = serve(a, system, users)
        assert a.executor.stats.device_backups > 0 and a.executor.stats.failed_ops == 0
        check_against_transformers(a, prompts, ref)
        a.s.check()
    with engine() as b:  # reads what a backed up
        prompts = serve(b, system, users, first_id=100)
        assert b.s.stats()["l3_hit_tokens"] > 0
        check_against_transformers(b, prompts, ref)


def test_l3_losses_reach_the_scheduler_and_outputs_stay_exact():
    """A store of a few pages evicts while serving: every step, the engine drains the store's
    loss journal into the scheduler (``l3_lost``), as docs/scheduler.md asks of an engine."""
    system, users = conversations(seed=19)
    store = kvtier.L3Store.embedded(8 << 10, loss_journal_keys=256)  # 8 pages of 1 KiB
    ref = tiny_llama(seed=3)
    with TorchEngine(config(), tiny_llama(seed=3), KvtierL3Backend(store)) as a:
        prompts = serve(a, system, users)
        assert a.l3_losses_reported + a.l3_lost_all_reported > 0
        check_against_transformers(a, prompts, ref)
        a.s.check()


def test_a_page_the_store_lost_is_backed_up_again():
    """The store drops one page of a served prompt; nobody calls ``l3_lost`` by hand. The
    engine hears of it from the journal, so serving the prompt again backs the page up again
    (without the report the scheduler's stale "in L3" mark keeps it out for good)."""
    store = kvtier.L3Store.embedded(1 << 22, loss_journal_keys=64)
    prompt = list(range(1, 42))
    model = tiny_llama(seed=3)
    with TorchEngine(named_scheduler(config(max_context_tokens=48), "llama", model), model,
                     KvtierL3Backend(store)) as eng:
        eng.submit(1, prompt, 2)
        eng.run_to_idle()
        keys = eng.s.l3_keys(np.asarray(prompt, dtype=np.uint32))
        assert store.is_exist(keys[3])
        store.remove(keys[3], True)
        eng.submit(2, prompt, 2)
        eng.run_to_idle()
        assert store.is_exist(keys[3])
        assert eng.generated(2) == eng.generated(1) == greedy_reference(tiny_llama(seed=3), prompt, 2)


def test_the_engine_serves_exactly_while_its_l3_server_is_down():
    """TorchEngine over a real ``kvtier-l3`` process killed between two turns: the loss journal
    cannot be read, probes, reads and backups fail, and the engine serves on, its outputs
    equal to ``generate()``; once the server is back (empty), backups land again. Before, the
    unread loss journal's ``RpcFailError`` ended the engine's step."""
    from conftest import L3Process

    system, users = conversations(seed=17)
    srv = L3Process()
    try:
        store = kvtier.L3Store.connect(srv.addr, rpc_timeout_ms=2000)
        with TorchEngine(config(), tiny_llama(seed=3), KvtierL3Backend(store)) as e:
            serve(e, system, [u[:1] for u in users])
            srv.kill()
            prompts = serve(e, system, users, first_id=100)
            assert e.l3_errors > 0 and e.l3_lost_all_reported > 0 and e.executor.stats.failed_ops > 0
            check_against_transformers(e, prompts, tiny_llama(seed=3))
            srv = srv.restart()
            written = e.executor.stats.l3_pages_written
            serve(e, system, [u[:1] for u in users], first_id=300)
            assert e.executor.stats.l3_pages_written > written
    finally:
        srv.kill()
