"""TorchEngine as a new user meets it (issue 21 item 7): abort, stop tokens and EOS, a KV
dtype other than the model's, the model given back after the engine, and defaults that
validate for small pools."""

import numpy as np
import pytest
import torch

import kvtier
from kvtier.torch import TorchEngine
from kvtier.torch.model import use_paged_attention
from conftest import greedy_reference, tiny_llama
from test_torch_model import config

PROMPT = np.random.default_rng(3).integers(1, 128, size=18).tolist()


def test_small_pools_validate_with_the_default_context_limit():
    cfg = kvtier.SchedulerConfig(page_size=4, device_pages=16, host_pages=32)  # max_context_tokens left alone
    with TorchEngine(cfg, tiny_llama(seed=1)) as eng:
        assert eng.s.config()["max_context_tokens"] == 64
        eng.submit(1, PROMPT, 4)
        eng.run_to_idle()
        assert eng.generated(1) == greedy_reference(tiny_llama(seed=1), PROMPT, 4)


def test_abort_ends_a_running_request_and_releases_its_pages():
    with TorchEngine(config(l3_enabled=False), tiny_llama(seed=1)) as eng:
        eng.submit(1, PROMPT, 20)
        eng.submit(2, PROMPT[:9], 5)
        for now in range(3):
            eng.step(now)
        assert eng.generated(1)
        eng.abort(1)
        eng.run_to_idle(start_ms=3)
        outcome = dict(eng.ended)
        assert "abort" in outcome[1].lower() and outcome[1] != outcome[2], outcome
        assert len(eng.generated(1)) < 20
        assert eng.generated(2) == greedy_reference(tiny_llama(seed=1), PROMPT[:9], 5)
        eng.s.check()
        assert eng.s.live_requests() == 0


def test_stop_tokens_and_the_models_eos_end_requests():
    ref = tiny_llama(seed=1)
    full = greedy_reference(ref, PROMPT, 8)
    stop = full[3]
    want = full[: full.index(stop) + 1]
    model = tiny_llama(seed=1)
    model.generation_config.eos_token_id = stop  # the default stop set is the model's EOS
    with TorchEngine(config(l3_enabled=False), model) as eng:
        eng.submit(1, PROMPT, 8)
        eng.submit(2, PROMPT, 8, stop_token_ids=())  # per request: no stop
        eng.run_to_idle()
        assert eng.generated(1) == want
        assert eng.generated(2) == full
    ref.generation_config.eos_token_id = stop
    ids = torch.tensor([PROMPT])
    gen = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)[0, len(PROMPT):]
    assert gen.tolist()[: len(want)] == want


def test_kv_dtype_bf16_pools_under_an_fp32_model():
    with TorchEngine(config(l3_enabled=False), tiny_llama(seed=1), kv_dtype=torch.bfloat16) as eng:
        assert eng.device_pool.k(0).dtype == torch.bfloat16 and eng.host_pool.data.dtype == torch.bfloat16
        eng.submit(1, PROMPT, 4)
        eng.run_to_idle()
        assert len(eng.generated(1)) == 4


def test_the_model_is_given_back_after_the_engine():
    model = tiny_llama(seed=1)
    ids = torch.tensor([PROMPT])
    with TorchEngine(config(l3_enabled=False), model) as eng:
        eng.submit(1, PROMPT, 3)
        eng.run_to_idle()
    got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert got[0, len(PROMPT):].tolist() == eng.generated(1)
    with use_paged_attention(model):
        with pytest.raises(ValueError):  # paged attention needs a page table
            model(ids)
    assert model(ids).logits.shape[1] == len(PROMPT)


@pytest.mark.parametrize(
    "prompt, stops, error",
    [
        ([1.9, 2.7, 3.2, 4.5], None, TypeError),  # were truncated to 1, 2, 3, 4 and run
        (["10", "11", "12"], None, TypeError),  # were parsed as 10, 11, 12 and run
        ([True, False, True], None, TypeError),
        (np.array([1.5, 2.5]), None, TypeError),
        (torch.tensor([1.0, 2.0]), None, TypeError),
        ([1, 2, 500, 4], None, ValueError),  # past the vocabulary: IndexError mid-forward, a step stuck
        ([1, -2, 3], None, ValueError),
        (PROMPT, 5, TypeError),  # stop ids not a list: raised after the request was queued
        (PROMPT, [1.5], TypeError),
        (PROMPT, [128], ValueError),
    ],
)
def test_submit_refuses_bad_tokens_and_changes_nothing(prompt, stops, error):
    """Tokens that are not integers in the model's vocabulary, and stop ids likewise, are
    refused before the request is queued: the same id can then be submitted correctly."""
    with TorchEngine(config(l3_enabled=False), tiny_llama(seed=1)) as eng:
        with pytest.raises(error):
            eng.submit(1, prompt, 3, stop_token_ids=stops)
        assert eng.s.live_requests() == 0 and 1 not in eng.outputs
        eng.submit(1, torch.tensor(PROMPT), 3)  # an integer tensor is a prompt
        eng.run_to_idle()
        assert eng.generated(1) == greedy_reference(tiny_llama(seed=1), PROMPT, 3)


def test_a_long_run_keeps_nothing_of_the_requests_it_handed_back():
    """Requests ended by length, a stop token and aborts (queued and running): once
    ``take_ended`` handed each back (outcome, tokens, first logits), the engine keeps nothing
    of it, so a long-running engine does not grow with the requests it served (before, every
    request's prompt, tokens, stop set and first-token logits, a vocabulary-sized tensor,
    stayed for good)."""
    full = greedy_reference(tiny_llama(seed=1), PROMPT, 6)
    with TorchEngine(config(l3_enabled=False), tiny_llama(seed=1)) as eng:
        handed = {}
        for rnd in range(2):
            base = rnd * 10
            eng.submit(base + 1, PROMPT, 6)
            eng.submit(base + 2, PROMPT, 6, stop_token_ids=[full[2]])
            eng.submit(base + 3, PROMPT[:9], 20)
            eng.submit(base + 4, PROMPT[:5], 4)
            eng.abort(base + 4)  # queued
            for now in range(3):
                eng.step(now)
            eng.abort(base + 3)  # running
            eng.run_to_idle(start_ms=3)
            for r, outcome, toks, logits in eng.take_ended():
                handed[r] = (outcome, toks, logits)
        assert sorted(handed) == [1, 2, 3, 4, 11, 12, 13, 14]
        assert handed[1][1] == full and handed[2][1] == full[:3] and handed[1][2] is not None
        kept = {name: len(getattr(eng, name)) for name in ("tables", "tokens", "outputs", "stops", "first_logits",
                                                             "ended")}
        assert kept == dict.fromkeys(kept, 0)
        assert eng.executor.in_flight() == 0
