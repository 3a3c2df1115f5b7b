#!/usr/bin/env python3
"""How much the shadow selector's figures at sampled capacities depend on the sample itself.

Above `full_size_pages` (65,536 pages of device + host) the selector's shadows replay 1
request prefix in R; `--shadow-sample-salt` picks which. This runs the selector at every
sampled point of issue 36's matrix (the conversation trace at 81,920 / 163,840 / 327,680 and
102,400 / 204,800 pages, FAST'25 at 81,920 / 163,840 / 327,680, agent sessions and the
half-way shift at 102,400; device:host 1:4, no L3, queue protection off as in the matrix)
under each salt, and prints per point the selector's total hit rate minus the best fixed
option's (from the round-8 sweeps docs/sim/sweep-shadow8-NAME, which ran every fixed option),
then per salt the points more than 0.5 below and the mean. Figures in docs/sim/shadow.md
(round 9).

Usage: python3 scripts/shadow_salts.py [--salts 0,1,2,3] [--jobs 2] [--kvtier target/release/kvtier]
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# (matrix workload, trace, device pages): the matrix points whose shadows are sampled.
POINTS = ([("trace", "traces/conversation_trace.jsonl", d) for d in (16384, 32768, 65536)]
          + [("trace-dense", "traces/conversation_trace.jsonl", d) for d in (20480, 40960)]
          + [("synthetic", "traces/synthetic_trace.jsonl", d) for d in (16384, 32768, 65536)]
          + [("agent", "traces/agent_trace.jsonl", 20480), ("shift", "traces/shift_trace.jsonl", 20480)])


def best_fixed(name, capacity):
    with open(os.path.join(ROOT, "docs/sim", f"sweep-shadow8-{name}", "sweep.json")) as f:
        for q in json.load(f):
            if q["capacity_pages"] == capacity:
                return max(c["hit_rate"] for c in q["compared"])
    raise SystemExit(f"no point {capacity} in sweep-shadow8-{name}")


def run(kvtier, salt, point):
    name, trace, dev = point
    out = subprocess.run(
        [kvtier, "sim", "--trace", trace, "--no-l3", "--device-pages", str(dev), "--host-pages",
         str(4 * dev), "--eviction", "shadow", "--host-admission", "adaptive:256",
         "--queue-protection", "off", "--shadow-sample-salt", str(salt), "--json"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout
    r = json.loads(out)
    return (r["hits"]["total"] - best_fixed(name, 5 * dev)) * 100


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--salts", default="0,1,2,3")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--kvtier", default=os.path.join(ROOT, "target/release/kvtier"))
    a = ap.parse_args()
    salts = [int(s) for s in a.salts.split(",")]
    jobs = list(itertools.product(salts, POINTS))
    with ThreadPoolExecutor(a.jobs) as ex:
        res = dict(zip(jobs, ex.map(lambda j: run(a.kvtier, *j), jobs)))
    print("| point (device + host pages) | " + " | ".join(f"salt {s}" for s in salts) + " | spread |")
    print("| --- " * (len(salts) + 2) + "|")
    for p in POINTS:
        v = [res[(s, p)] for s in salts]
        print(f"| {p[0]}, {5 * p[2]:,} | " + " | ".join(f"{x:+.2f}" for x in v)
              + f" | {max(v) - min(v):.2f} |")
    below = [sum(res[(s, p)] < -0.5 for p in POINTS) for s in salts]
    means = [statistics.mean(res[(s, p)] for p in POINTS) for s in salts]
    print("| points more than 0.5 below | " + " | ".join(str(b) for b in below) + " | |")
    print("| mean | " + " | ".join(f"{m:+.2f}" for m in means) + " | |")


if __name__ == "__main__":
    main()
