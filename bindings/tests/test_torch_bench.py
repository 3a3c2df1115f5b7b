"""The kvtier.torch benchmark script (bindings/bench/torch_movers.py) on CPU with tiny shapes.

Why: its figures are taken on a GPU machine that a session gets for minutes; a script that
breaks there wastes them. CI runs the same code paths here: every mover that can run on CPU
(``torch``, and ``kernel`` under Triton's interpreter), the byte checks after each direction,
the executor's LoadBack, duplex and GEMM beside a copy, and the TTFT turn whose first-token
logits must equal the recompute's. Speeds measured here mean nothing and are not asserted.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

BENCH_DIR = os.path.join(os.path.dirname(__file__), "..", "bench")
sys.path.insert(0, BENCH_DIR)
import torch_movers  # noqa: E402

from kvtier.torch import TorchMover  # noqa: E402


def test_bench_runs_every_cpu_mover_and_checks_its_bytes(tmp_path):
    out = tmp_path / "r.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, os.path.join(BENCH_DIR, "torch_movers.py"), "--device", "cpu", "--smoke",
           "--pages", "8", "--iters", "2", "--ttft", "--profile", str(tmp_path), "--json-out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Exception in thread" not in p.stderr, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["smoke"]
    assert [run["page_size"] for run in r["runs"]] == [16, 64]
    for run in r["runs"]:
        assert "CUDA" in run["movers"]["dma"]["unavailable"]
        for name in ("torch", "kernel"):
            m = run["movers"][name]
            figures = [m["load"]["GBps"], m["store"]["GBps"], m["executor_load"]["GBps"], m["duplex_GBps"],
                       m["gemm_slowdown"], m["load"]["ratio_to_contiguous"]]
            assert all(math.isfinite(x) and x > 0 for x in figures), (name, m)
    ttft = {t["mover"]: t for t in r["ttft"] if "unavailable" not in t}
    assert "CUDA" in next(t for t in r["ttft"] if t["mover"] == "dma")["unavailable"]
    assert set(ttft) == {"torch", "kernel"}
    for t in ttft.values():
        # the turn that loaded its prefix from host pages computes what a full recompute does
        assert t["first_token_logits_max_abs_diff"] < 1e-4 and t["first_token_argmax_equal"], t
        assert min(t["load_s"], t["compute_s"], t["ttft_s"], t["recompute_s"], t["compute_host_s"]) > 0
        for phase in ("compute", "overlapped"):
            prof = t[f"profile_{phase}"]
            assert prof["wall_s"] > 0 and prof["host_ops_s"] > 0, prof
            table = (tmp_path / f"ttft-16-{t['mover']}-{phase}.txt").read_text()
            assert table.startswith("wall ") and "aten::" in table, table[:500]


def test_ttft_graph_says_why_it_is_unavailable_on_cpu(tmp_path):
    # --ttft-graph captures the compute as a CUDA graph on a GPU; on CPU each mover's TTFT says
    # why there is none and keeps its other figures (the GPU session's command must not fail
    # on a machine without one).
    out = tmp_path / "r.json"
    cmd = [sys.executable, os.path.join(BENCH_DIR, "torch_movers.py"), "--device", "cpu", "--smoke",
           "--page-sizes", "", "--iters", "1", "--movers", "torch", "--ttft", "--ttft-graph", "--json-out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    (t,) = json.loads(out.read_text())["ttft"]
    assert "CUDA" in t["graph_unavailable"] and "graph_compute_s" not in t, t
    assert t["ttft_s"] > 0 and t["first_token_argmax_equal"], t
    assert "as a CUDA graph: unavailable" in p.stdout, p.stdout


class DropsLastPage(TorchMover):
    """A mover that is fast because it is wrong: it skips the last page of every copy."""

    def _copy(self, direction, device, host, dev_pages, host_pages, layers):
        super()._copy(direction, device, host, dev_pages[:-1], host_pages[:-1], layers)


def test_bench_fails_a_mover_that_loses_a_page(monkeypatch):
    monkeypatch.setattr(torch_movers, "make_mover", lambda name: DropsLastPage())
    clock = torch_movers.Clock(torch_movers.torch.device("cpu"))
    with pytest.raises(AssertionError, match="differs after the copy"):
        torch_movers.movers_bench(clock, torch_movers.SMOKE, 16, 8, ["torch"], 1)


def test_disjoint_page_sets_share_no_page():
    a, b = torch_movers._disjoint_pages(np.random.default_rng(1), 32, 8)
    assert len(a) == len(b) == 8 and not set(a.tolist()) & set(b.tolist())
