"""examples/torch_engine.py (the loop engine authors copy) when a load-back fails: the
scheduler discards the token of the chunk that read its pages and recomputes the request, so
the loop must drop that token too, or the request's output holds it twice."""

import argparse
import importlib.util
from pathlib import Path

import numpy as np

import kvtier
from test_torch_engine_failed_load import fail_loads

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torch_engine.py"


def test_the_example_loop_drops_the_token_of_a_chunk_whose_load_back_failed(monkeypatch):
    spec = importlib.util.spec_from_file_location("torch_engine_example_failed", EXAMPLE)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    failing, left = fail_loads(2)
    real = ex.Executor
    monkeypatch.setattr(ex, "Executor", lambda dev, host, backend, mover: real(dev, host, backend, mover=failing))
    args = argparse.Namespace(device="cpu", mover="torch", max_new=4)
    rng = np.random.default_rng(0)
    system = rng.integers(1, 128, size=20).tolist()
    turn1 = {r: system + rng.integers(1, 128, size=6).tolist() for r in range(3)}
    store = kvtier.L3Store.embedded(16 << 20)
    out = ex.serve(turn1, store, args)
    turn2 = {r + 10: turn1[r] + out[r] + rng.integers(1, 128, size=4).tolist() for r in range(3)}
    out.update(ex.serve(turn2, store, args))  # a second engine, empty: prefixes from L3, loaded back
    assert left[0] == 0  # the loads did fail
    ref = ex.tiny_llama("cpu")
    for r, p in {**turn1, **turn2}.items():
        assert out[r] == ex.reference(ref, p, args.max_new), r
