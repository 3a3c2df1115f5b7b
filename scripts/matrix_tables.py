#!/usr/bin/env python3
"""Issue 36's matrix tables (docs/sim/shadow.md) from the sweeps' sweep.json files.

For each workload: the shadow selector's sweep (docs/sim/sweep-shadow-NAME; with --round1,
the first round's docs/sim/sweep-shadow1-NAME) and, where that sweep ran with --no-compare,
the fixed options of the same points from the sweep that ran them (docs/sim/sweep-matrix-NAME
of issue 25, or the first round's full sweeps of the new workloads: the fixed options' code
is the same). Prints one
markdown table per workload: every fixed option and the selector with TTFT p50 / p99, the
selector against the best fixed option (bold when more than 0.5 point below), Belady, and
the selector's share of Belady; then the worst point per workload.

With --protect: queue-aware protection (LRU with --queue-protection waiting, the sweeps
docs/sim/sweep-protect-NAME) against LRU at the same points (docs/sim/sweep-protect-off-NAME).

With --round3: the third round (measured corrections), docs/sim/sweep-shadow3-NAME
(scripts/shadow_sweeps).

With --round PREFIX: the sweeps docs/sim/sweep-PREFIX-NAME (scripts/shadow_sweeps PREFIX).
With --fixed-from PREFIX as well: a selector-only round (run with --no-compare) beside the fixed
options of the round PREFIX that ran them (FULL=1), for a change to the selector alone.

Usage: python3 scripts/matrix_tables.py [--round1 | --round3 | --round PREFIX [--fixed-from PREFIX] | --protect] [DOCS_SIM_DIR]
"""
import json
import os
import sys

FIXED = ["lru", "lru + on-device-eviction:256", "freq-depth:56000:4:60",
         "freq-depth:56000:4:60 + on-device-eviction:256"]
SHORT = {FIXED[0]: "LRU (default)", FIXED[1]: "LRU + demote", FIXED[2]: "freq-depth",
         FIXED[3]: "freq-depth + demote"}
WORKLOADS = [
    ("trace", "Conversation trace, device:host 1:4, no L3", "matrix-trace"),
    ("trace-dense", "Conversation trace, denser small capacities (device 1,280 ... 40,960), no L3", "shadow1-trace-dense"),
    ("synthetic", "FAST'25 synthetic trace, no L3", "matrix-synthetic"),
    ("chat", "Built-in chat (400 clients x 8 rounds), no L3", "matrix-chat"),
    ("chat-long", "Long chats (100 x 32), no L3", "matrix-chat-long"),
    ("chat-short", "Short chats (1,600 x 2), no L3", "matrix-chat-short"),
    ("chat-2inst", "Two instances sharing one L3 (chat)", "matrix-chat-2inst"),
    ("agent", "Agent sessions (new: traces/agent_trace.jsonl), no L3", "shadow1-agent"),
    ("shift", "Popular prefixes change half-way (new: traces/shift_trace.jsonl), no L3", "shadow1-shift"),
]


def ms(v):
    return f"{v:.0f} ms" if v < 1000 else f"{v / 1000:.2f} s"


def cell(rate, t):
    return f"{rate * 100:.2f} % ({ms(t['p50'])} / {ms(t['p99'])})"


def main(d, prefix, fixed_from=None):
    worst_all = []
    for name, title, fixed_dir in WORKLOADS:
        if fixed_from:
            fixed_dir = f"{fixed_from}-{name}"
        p = os.path.join(d, f"sweep-{prefix}-{name}", "sweep.json")
        if not os.path.exists(p):
            print(f"**{title}**: not run\n")
            continue
        pts = json.load(open(p))
        fixed = {}
        fixed_path = os.path.join(d, f"sweep-{fixed_dir}", "sweep.json")
        if fixed_dir and not all(q["compared"] for q in pts):
            for q in json.load(open(fixed_path)):
                fixed[q["capacity_pages"]] = q["compared"]
        print(f"**{title}** (hit rate, TTFT p50 / p99):\n")
        cols = [SHORT[f] for f in FIXED]
        print("| device + host pages | " + " | ".join(cols) +
              " | **shadow** | vs best fixed | Belady | shadow / Belady |")
        print("| --- " * (len(cols) + 5) + "|")
        worst, below, n = None, 0, 0
        for q in pts:
            # a sweep run with FULL=1 has the fixed options itself (named with their
            # "+ protect:off", like the selector's runs)
            comp = {c["policy"].replace(" + protect:off", ""): c
                    for c in (q["compared"] or fixed.get(q["capacity_pages"], []))}
            row = [f"{q['capacity_pages']:,}"]
            best = max((comp[f]["hit_rate"] for f in FIXED if f in comp), default=None)
            for f in FIXED:
                row.append(cell(comp[f]["hit_rate"], comp[f]["ttft_ms"]) if f in comp else "-")
            row.append(cell(q["hit_rate"], q["ttft_ms"]))
            if best is None:
                row.append("-")
            else:
                delta = (q["hit_rate"] - best) * 100
                worst = delta if worst is None else min(worst, delta)
                n += 1
                below += delta < -0.5
                row.append(f"**{delta:+.2f}**" if delta < -0.5 else f"{delta:+.2f}")
            row.append(f"{q['belady'] * 100:.2f} %")
            row.append(f"{q['hit_rate'] / q['belady']:.2f}" if q["belady"] > 0 else "-")
            print("| " + " | ".join(row) + " |")
        print()
        worst_all.append((title, worst, below, n))
    print("| workload | worst point: shadow vs best fixed | points more than 0.5 below |")
    print("| --- | --- | --- |")
    for t, w, b, n in worst_all:
        print(f"| {t} | {'-' if w is None else f'{w:+.2f}'} | {b} of {n} |")
    tb, tn = sum(x[2] for x in worst_all), sum(x[3] for x in worst_all)
    print(f"| all | {min(x[1] for x in worst_all if x[1] is not None):+.2f} | {tb} of {tn} |")


def protect(d):
    """Queue-aware protection beside the default: docs/sim/sweep-protect-NAME (LRU with
    --queue-protection waiting) against docs/sim/sweep-protect-off-NAME (LRU, the same
    points, the same binary)."""
    worst_all = []
    for name, title, fixed_dir in WORKLOADS:
        p = os.path.join(d, f"sweep-protect-{name}", "sweep.json")
        if not os.path.exists(p):
            print(f"**{title}**: not run\n")
            continue
        lru = {q["capacity_pages"]: q
               for q in json.load(open(os.path.join(d, f"sweep-protect-off-{name}", "sweep.json")))}
        print(f"**{title}** (hit rate, TTFT p50 / p99):\n")
        print("| device + host pages | LRU (default) | LRU + queue protection | difference | Belady |")
        print("| --- | --- | --- | --- | --- |")
        worst, below, n = None, 0, 0
        for q in json.load(open(p)):
            base = lru[q["capacity_pages"]]
            delta = (q["hit_rate"] - base["hit_rate"]) * 100
            worst = delta if worst is None else min(worst, delta)
            n += 1
            below += delta < -0.05
            print(f"| {q['capacity_pages']:,} | {cell(base['hit_rate'], base['ttft_ms'])} | "
                  f"{cell(q['hit_rate'], q['ttft_ms'])} | {delta:+.2f} | {q['belady'] * 100:.2f} % |")
        print()
        worst_all.append((title, worst, below, n))
    print("| workload | worst point: protection vs LRU | points below LRU |")
    print("| --- | --- | --- |")
    for t, w, b, n in worst_all:
        print(f"| {t} | {'-' if w is None else f'{w:+.2f}'} | {b} of {n} |")


if __name__ == "__main__":
    rnd = "shadow1" if "--round1" in sys.argv else "shadow3" if "--round3" in sys.argv else "shadow"
    args = [a for a in sys.argv[1:] if a not in ("--round1", "--round3", "--protect")]
    if "--round" in args:  # --round PREFIX: the sweeps docs/sim/sweep-PREFIX-NAME
        i = args.index("--round")
        rnd = args[i + 1]
        del args[i:i + 2]
    fixed_from = None
    if "--fixed-from" in args:  # the fixed options from docs/sim/sweep-PREFIX-NAME
        i = args.index("--fixed-from")
        fixed_from = args[i + 1]
        del args[i:i + 2]
    if "--protect" in sys.argv:
        protect(args[0] if args else "docs/sim")
    else:
        main(args[0] if args else "docs/sim", rnd, fixed_from)
