"""TorchEngine on an L3 store (issue 21 items 3, 4, 5): the namespace keeps two models'
pages apart; demotion with L3 backs device pages up (staged through host pages); the store's
loss journal reaches the scheduler every step. Outputs stay equal to ``generate()``."""

import numpy as np
import torch
from hypothesis import given, settings, strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import kvtier
from kvtier.engine import KvtierL3Backend
from kvtier.torch import KVLayout, NamespaceError, TorchEngine, torch_namespace
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


class Probe:
    def __init__(self, cfg):
        self.config = cfg


@settings(max_examples=40, deadline=None)
@given(st.tuples(st.sampled_from([48, 64]), st.sampled_from([1e4, 5e5]), st.sampled_from([4, 16]),
                 st.sampled_from([torch.float32, torch.bfloat16])),
       st.tuples(st.sampled_from([48, 64]), st.sampled_from([1e4, 5e5]), st.sampled_from([4, 16]),
                 st.sampled_from([torch.float32, torch.bfloat16])))
def test_namespaces_differ_exactly_when_kv_is_incompatible(x, y):
    def ns(inter, theta, ps, dtype):
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=inter, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, rope_theta=theta)
        return torch_namespace(Probe(cfg), KVLayout.mha(2, 2, 8, ps, dtype))

    assert (ns(*x) == ns(*y)) == (x == y)


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
        return TorchEngine(named_scheduler(cfg, "llama"), tiny_llama(seed=3, device=device), KvtierL3Backend(store),
                           mover=mover)

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
    with TorchEngine(named_scheduler(config(max_context_tokens=48), "llama"), tiny_llama(seed=3),
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
