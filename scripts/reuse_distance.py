#!/usr/bin/env python3
"""Why no online policy reaches the issue-36 Belady targets on the conversation trace: where
its reuse comes from and how far apart the reads are (docs/sim/shadow.md, "Goal on the
conversation trace").

Why a script: the claim ("they need a better policy than any of the four") rests on the
trace's structure, not on a policy's run; these tables are that structure, reproducible from
the trace alone (a test checks that the page shows what this prints).

How: the trace's prompts are chains of 512-token block hashes (Mooncake's format). A request
*reuses* the longest prefix of its blocks that earlier requests brought (past block 0, which
every prompt shares). The reuse is a *continuation* when that prefix covers the earlier
request's prompt but at most its last block (the next turn of the same conversation; the
last block differs because it was partial), else *shared* (a document or prompt part of an
earlier request). Its *distance* is the prompt traffic, in 64-token pages, between the
request that last read the prefix's last block and this one: an LRU cache of C pages keeps a
page at least until C pages of other prompts went through it, so the share of reused pages
read again within C pages of traffic is about what recency can catch at C (the pages of the
requests in between may repeat, so LRU can catch somewhat more).

    python3 scripts/reuse_distance.py [TRACE]
"""

from __future__ import annotations

import json
import sys
from collections import Counter

PAGE_TOKENS = 64
PAGES_PER_BLOCK = 512 // PAGE_TOKENS
CAPACITIES = (10_240, 20_480, 40_960, 81_920, 163_840, 327_680)


def main(path: str) -> None:
    with open(path) as f:
        reqs = [json.loads(line) for line in f if line.strip()]
    traffic = [0]  # prompt pages of requests 0..i-1
    for r in reqs:
        traffic.append(traffic[-1] + -(-int(r["input_length"]) // PAGE_TOKENS))
    first: dict = {}  # block -> the request that brought it
    last: dict = {}  # block -> the request that read it last
    turn = [0] * len(reqs)
    continued = [False] * len(reqs)
    kinds: Counter = Counter()
    kind_pages: Counter = Counter()
    reuses = []  # (pages reused, traffic since the last read)
    for i, r in enumerate(reqs):
        h = r["hash_ids"]
        m = 0
        while m < len(h) and h[m] in first:
            m += 1
        if m > 1:
            src = first[h[m - 1]]
            kind = "continuation" if m >= len(reqs[src]["hash_ids"]) - 1 else "shared"
            if kind == "continuation":
                turn[i] = turn[src] + 1
                continued[src] = True
            kinds[kind] += 1
            kind_pages[kind] += (m - 1) * PAGES_PER_BLOCK
            reuses.append(((m - 1) * PAGES_PER_BLOCK, traffic[i] - traffic[last[h[m - 1]] + 1]))
        for b in h:
            first.setdefault(b, i)
            last[b] = i

    total = sum(p for p, _ in reuses)
    print("| reuse | requests | pages reused | share of reused pages |")
    print("| --- | --- | --- | --- |")
    for k in ("continuation", "shared"):
        print(f"| {k} | {kinds[k]:,} | {kind_pages[k]:,} | {kind_pages[k] / total:.2f} |")
    print()
    print("| capacity (pages) | reused pages read again within that much traffic |")
    print("| --- | --- |")
    for c in CAPACITIES:
        share = sum(p for p, d in reuses if d < c) / total
        print(f"| {c:,} | {share:.2f} |")
    print()
    print("| turn of the request | requests | share continued later |")
    print("| --- | --- | --- |")
    n: Counter = Counter()
    hit: Counter = Counter()
    for t, c in zip(turn, continued):
        n[min(t, 4)] += 1
        hit[min(t, 4)] += c
    for t in sorted(n):
        label = f"{t}+" if t == 4 else str(t)
        print(f"| {label} | {n[t]:,} | {hit[t] / n[t]:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "traces/conversation_trace.jsonl")
