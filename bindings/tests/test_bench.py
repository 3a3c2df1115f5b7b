"""`next_execution_plan` from Python costs at most 2 × the native Rust call, for the
256-request decode step of the scheduler bench (same scenario, same build, same process)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_plan  # noqa: E402


def test_python_plan_within_2x_native():
    results = []
    for _ in range(3):  # a shared 2-core machine: take the best of three medians
        r = bench_plan.measure(256, 300)
        results.append(r)
        if r["ratio_median"] <= 2.0:
            break
    best = min(results, key=lambda r: r["ratio_median"])
    print("plan bench:", best)
    assert best["ratio_median"] <= 2.0, results
