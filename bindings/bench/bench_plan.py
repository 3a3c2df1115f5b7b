#!/usr/bin/env python3
"""Python vs native cost of `next_execution_plan` for the 256-request decode step.

Scenario (the scheduler bench's, scheduler/benches/scenario/mod.rs): 256 distinct 4,096-token
prompts, page 64, token budget 8,192, host = 2 × device, every op acknowledged at once, one
token per decode row. Once every request decodes, each step's `next_execution_plan` is timed
(the ForwardDone that follows is not). The native figure runs the same scenario code in Rust,
in this process (`kvtier._native.bench_native_decode_step`).

Usage: bench_plan.py [--n 256] [--iters 400] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import kvtier
from kvtier import _native


def decoding_scheduler(n: int, max_new: int = 2048) -> tuple:
    s = kvtier.Scheduler(_native.bench_config(n, max_new))
    for i in range(n):
        s.submit(i, _native.bench_prompt(i % 1_000_000), max_new)
    now = 0
    while True:
        now += 1
        plan = s.next_execution_plan(now)
        if plan.ops:
            s.ops_done([o.id for o in plan.ops], [o.kind for o in plan.ops],
                       [o.num_keys if o.kind == "Prefetch" else 1 for o in plan.ops])
        report(s, plan)
        if not plan.prefill and plan.num_decode == n:
            return s, now


def report(s: kvtier.Scheduler, plan: kvtier.ExecutionPlan) -> None:
    if plan.step is None:
        return
    reqs = [c.req for c in plan.prefill]
    d = plan.decode_reqs
    all_reqs = np.concatenate([d, np.asarray(reqs, dtype=np.uint64)])
    toks = np.concatenate([
        (7 + plan.decode_positions % 1000).astype(np.uint32),
        np.full(len(reqs), 11, dtype=np.uint32),
    ])
    s.forward_done(plan.step, all_reqs, toks)


def python_decode_step(n: int, iters: int) -> list:
    s, now = decoding_scheduler(n)
    out = []
    for _ in range(iters):
        now += 1
        t0 = time.perf_counter_ns()
        plan = s.next_execution_plan(now)
        t1 = time.perf_counter_ns()
        assert plan.num_decode == n and not plan.prefill and not plan.ops
        out.append(t1 - t0)
        report(s, plan)
    return out


def measure(n: int = 256, iters: int = 400) -> dict:
    py = python_decode_step(n, iters)
    native = _native.bench_native_decode_step(n, iters)
    py_med = statistics.median(py)
    na_med = statistics.median(native)
    return {
        "n": n,
        "iters": iters,
        "python_median_us": round(py_med / 1e3, 2),
        "python_p90_us": round(sorted(py)[int(0.9 * len(py))] / 1e3, 2),
        "native_median_us": round(na_med / 1e3, 2),
        "native_p90_us": round(sorted(native)[int(0.9 * len(native))] / 1e3, 2),
        "ratio_median": round(py_med / na_med, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    r = measure(a.n, a.iters)
    if a.json:
        print(json.dumps(r))
    else:
        for k, v in r.items():
            print(f"{k:>20}: {v}")


if __name__ == "__main__":
    main()
