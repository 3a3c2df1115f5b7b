"""TorchEngine when a load-back fails: the forward that read its pages computed garbage, and
the scheduler discards that chunk's token and recomputes the request (docs/scheduler.md), so
the engine must not keep that token either: the request's output is still exactly what the
model generates without kvtier. Also what the engine records per request when an id is used
again."""

import threading

import numpy as np
import pytest

from kvtier.torch import Direction, LoadWait, TorchEngine, TorchMover
from conftest import greedy_reference, small_config, tiny_deepseek_v3, tiny_llama

MAX_NEW = 4


def fail_loads(n):
    """A mover whose first ``n`` loads fail (a CUDA error, a bad mapping)."""
    left = [n]
    lock = threading.Lock()

    def delay(d, layers):
        if d == Direction.LOAD:
            with lock:
                if left[0] > 0:
                    left[0] -= 1
                    raise RuntimeError("load failed")

    return TorchMover(delay=delay), left


@pytest.mark.parametrize("make", [tiny_llama, tiny_deepseek_v3], ids=["mha", "mla"])
@pytest.mark.parametrize("loads", list(LoadWait))
@pytest.mark.parametrize("failures", [1, 3])
def test_a_failed_load_back_leaves_no_garbage_token_in_the_output(make, loads, failures):
    import copy

    model = make(0)
    ref = copy.deepcopy(model)
    cfg = small_config(page_size=4, device_pages=16, host_pages=32, max_context_tokens=64,
                       keep_device_after_write_back=False)  # the second turn loads the prefix back
    rng = np.random.default_rng(1)
    first = rng.integers(1, 128, size=13).tolist()
    second = first + rng.integers(1, 128, size=5).tolist()
    mover, left = fail_loads(failures)
    with TorchEngine(cfg, model, None, mover=mover, loads=loads, stop_token_ids=()) as eng:
        eng.submit(1, first, MAX_NEW)
        eng.run_to_idle()
        eng.submit(2, second, MAX_NEW)
        eng.run_to_idle()
        assert left[0] == 0 and eng.executor.stats.failed_ops >= 1  # the loads did fail
        eng.s.check()
        assert eng.generated(1) == greedy_reference(ref, first, MAX_NEW)
        assert eng.generated(2) == greedy_reference(ref, second, MAX_NEW)


def test_a_request_id_used_again_reports_the_new_requests_first_logits():
    """first_logits were set only for an id that had none, so an id submitted again after its
    request ended kept the old request's logits (a check against the new prompt compared the
    wrong request's)."""
    import copy

    import torch

    from conftest import full_last_logits

    model = tiny_llama(0)
    ref = copy.deepcopy(model)
    cfg = small_config(page_size=4, device_pages=16, host_pages=32, max_context_tokens=64)
    with TorchEngine(cfg, model, None, stop_token_ids=()) as eng:
        for prompt in ([5, 6, 7, 8, 9], [40, 41, 42]):
            eng.submit(7, prompt, 2)
            eng.run_to_idle()
            assert torch.allclose(eng.first_logits[7], full_last_logits(ref, prompt), atol=1e-4), prompt
