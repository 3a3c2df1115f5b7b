"""The engine driver's own logic, without an engine: the hand-stepped round with aborts
(``_generate_with_aborts``) against a scripted engine whose requests each take a fixed number
of steps. (The driver's runs of real vLLM engines are test_vllm_engine.py.)"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_driver import _generate_with_aborts  # noqa: E402


class ScriptedEngine:
    """``LLMEngine``'s add_request / step / abort_request / has_unfinished_requests: request
    ``i`` finishes at its ``steps[i]``-th step, outputs carry an internal id suffix as vLLM's."""

    def __init__(self, steps):
        self.steps, self.live, self.n = steps, {}, 0

    def add_request(self, rid, prompt, params):
        self.live[rid] = self.steps[len(self.live) + self.n]

    def abort_request(self, rids):
        for r in rids:
            self.live.pop(r, None)

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        self.n += 1
        if self.n > 10_000:
            raise AssertionError("stepped past every request's end")
        out = []
        for rid, left in list(self.live.items()):
            self.live[rid] = left - 1
            if left - 1 == 0:
                del self.live[rid]
                out.append(SimpleNamespace(request_id=f"{rid}-abcd1234", finished=True))
        return out


def run(steps, aborts):
    llm = SimpleNamespace(llm_engine=ScriptedEngine(steps))
    box = {}
    t = threading.Thread(target=lambda: box.update(res=_generate_with_aborts(llm, "r", [[1]] * len(steps),
                                                                             [None] * len(steps), aborts)),
                         daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the round did not end"
    return box["res"]


def test_requests_are_aborted_at_their_step_and_the_others_answer():
    res, aborted = run([3, 5, 8], [[0, 0], [2, 4]])
    assert aborted == ["r-0", "r-2"]
    assert [r is not None for r in res] == [False, True, False]


def test_an_abort_due_after_every_request_ended_ends_the_round():
    """Before: the loop kept waiting for the abort's step with nothing left to step, for ever."""
    res, aborted = run([2, 3], [[1, 50]])
    assert aborted == [] and all(r is not None for r in res)


def test_a_request_that_ended_before_its_abort_keeps_its_answer():
    res, aborted = run([2, 9], [[0, 4], [1, 4]])
    assert aborted == ["r-1"] and res[0] is not None and res[1] is None
