#!/usr/bin/env python3
"""Two traces of issue 36's policy matrix, in Mooncake's format (one JSON object a line:
timestamp in ms, input_length, output_length, hash_ids of 512-token blocks), deterministic
(fixed seeds, no dependency beyond the standard library).

- agent_trace.jsonl: agent-style sessions. 4 agents, each a shared system + tools prefix of
  6 blocks; a session adds a unique task block, then runs 3-24 steps, each step's prompt the
  previous one plus one block of tool call and result, 2-20 s of tool latency apart. Sessions
  arrive as a Poisson process (0.2 / s). Reuse is deep and sequential within a session.
- shift_trace.jsonl: popular prefixes that change half-way. Requests (2.5 / s) read a
  document (4-24 blocks) drawn by Zipf(1.1) popularity from 400 documents, then a unique
  question block; at the half-way request the 400 documents are replaced by 400 others with
  another ranking. Reuse is shallow and frequency-driven, and what was hot stops being read.

Usage: python3 scripts/gen_policy_traces.py OUT_DIR
"""
import json
import random
import sys

BLOCK = 512


def write(path, reqs):
    reqs.sort(key=lambda r: r[0])
    with open(path, "w") as f:
        for ts, blocks, out in reqs:
            f.write(json.dumps({"timestamp": int(ts), "input_length": len(blocks) * BLOCK,
                                "output_length": out, "hash_ids": blocks}) + "\n")


class Ids:
    """Fresh block ids: each call returns the next n."""

    def __init__(self):
        self.next = 0

    def __call__(self, n):
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


def agent(path):
    rng = random.Random(36)
    fresh = Ids()

    prefixes = [fresh(6) for _ in range(4)]
    reqs, t = [], 0.0
    for _ in range(700):
        t += rng.expovariate(0.2)
        blocks = rng.choice(prefixes) + fresh(1)
        step_t = t
        for _ in range(rng.randint(3, 24)):
            blocks = blocks + fresh(1)
            reqs.append((step_t * 1000, list(blocks), rng.randint(40, 300)))
            step_t += rng.uniform(2, 20)
    write(path, reqs)


def shift(path):
    rng = random.Random(3636)
    fresh = Ids()

    def library():
        docs = [fresh(rng.randint(4, 24)) for _ in range(400)]
        weights = [1.0 / (i + 1) ** 1.1 for i in range(400)]
        return docs, weights

    n, reqs, t = 8000, [], 0.0
    docs, weights = library()
    for i in range(n):
        if i == n // 2:
            docs, weights = library()
        t += rng.expovariate(2.5)
        doc = rng.choices(docs, weights)[0]
        reqs.append((t * 1000, doc + fresh(1), rng.randint(50, 400)))
    write(path, reqs)


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "traces"
    agent(f"{out}/agent_trace.jsonl")
    shift(f"{out}/shift_trace.jsonl")
