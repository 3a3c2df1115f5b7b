#!/usr/bin/env python3
"""Serves a multi-turn chat workload through kvtier's engine loop and prints per-tier hits.

Two engine instances (two schedulers, each with its own device and host pools) share one L3
store. Conversations share a system prompt; turn k of a conversation resends the whole
history plus a new user message, and every two turns a conversation moves to the other instance. So a turn finds
its prefix on device (same instance, still resident), on host (same instance, evicted from
device), or in L3 (written by the other instance), and only the new tail is computed. Every
forward is checked by the executor's integrity oracle.

    python examples/multi_turn.py                       # kvtier's embedded store
    python examples/multi_turn.py --backend remote      # a kvtier-l3 server (in process)
    python examples/multi_turn.py --backend compat      # kvtier.mooncake_compat
    python examples/multi_turn.py --backend mooncake --master 127.0.0.1:50051  # real Mooncake
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import kvtier
from kvtier.engine import Engine, KvtierL3Backend, MooncakeL3Backend


def make_backends(kind: str, master: str):
    if kind == "embedded":
        st = kvtier.L3Store.embedded(256 << 20)
        return [KvtierL3Backend(st), KvtierL3Backend(st)], None
    if kind == "remote":
        srv = kvtier.L3Server(256 << 20)
        return [KvtierL3Backend(kvtier.L3Store.connect(srv.addr)) for _ in range(2)], srv
    if kind == "compat":
        from kvtier.mooncake_compat import MooncakeDistributedStore

        stores = []
        for _ in range(2):
            s = MooncakeDistributedStore()
            assert s.setup("127.0.0.1", "P2PHANDSHAKE", 256 << 20, 16 << 20, "tcp", "", "embedded://multi-turn") == 0
            stores.append(s)
        return [MooncakeL3Backend(s) for s in stores], None
    if kind == "mooncake":
        from mooncake.store import MooncakeDistributedStore

        s = MooncakeDistributedStore()
        rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 256 << 20, 64 << 20, "tcp", "", master)
        if rc != 0:
            raise SystemExit(f"Mooncake setup failed: {rc}")
        b = MooncakeL3Backend(s)
        return [b, b], None
    raise SystemExit(f"unknown backend {kind}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="embedded", choices=["embedded", "remote", "compat", "mooncake"])
    ap.add_argument("--master", default="127.0.0.1:50051", help="Mooncake master (--backend mooncake)")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    ps = args.page_size
    cfg = kvtier.SchedulerConfig(
        page_size=ps,
        device_pages=80,  # small on purpose: earlier turns get evicted to host
        host_pages=384,
        max_batch_size=16,
        token_budget=1024,
        chunked_prefill_size=512,
        max_context_tokens=80 * ps,
        l3_enabled=True,
        prefetch_threshold=2,
        keep_device_after_write_back=True,
        namespace={"model": "demo-7b", "dtype": "bf16", "layout": "tp1", "tenant": "demo", "adapter": ""},
    )
    backends, server = make_backends(args.backend, args.master)
    engines = [Engine(kvtier.Scheduler(cfg), b, page_bytes=128) for b in backends]
    rng = np.random.default_rng(args.seed)
    system = rng.integers(1, 32_000, size=args.system_tokens).tolist()
    history = {c: list(system) for c in range(args.conversations)}
    now = [0, 0]
    next_id = 0
    t0 = time.perf_counter()
    print(f"{args.conversations} conversations x {args.turns} turns, backend={args.backend}, page={ps} tokens")
    print(f"{'turn':>4} {'prompt tok':>10} {'device':>8} {'host':>8} {'L3':>8} {'computed':>9}")
    prev = [dict(e.s.stats()) for e in engines]
    for turn in range(args.turns):
        ids = {}
        for c in range(args.conversations):
            history[c] += rng.integers(1, 32_000, size=args.user_tokens).tolist()
            inst = (c + turn // 2) % 2  # two turns on one instance, then the other
            engines[inst].submit(next_id, history[c], args.answer_tokens, now_ms=now[inst])
            ids[next_id] = (c, inst)
            next_id += 1
        for i, e in enumerate(engines):
            e.run_to_idle(start_ms=now[i])
            now[i] += 1000
        for rid, (c, inst) in ids.items():
            history[c] += engines[inst].generated(rid)
        cur = [dict(e.s.stats()) for e in engines]
        d = {k: sum(cur[i][k] - prev[i][k] for i in range(2))
             for k in ("device_hit_tokens", "host_hit_tokens", "l3_hit_tokens", "computed_tokens")}
        total = sum(d.values())
        print(f"{turn:>4} {total:>10} {d['device_hit_tokens']:>8} {d['host_hit_tokens']:>8} "
              f"{d['l3_hit_tokens']:>8} {d['computed_tokens']:>9}")
        prev = cur
    dt = time.perf_counter() - t0
    print()
    for i, e in enumerate(engines):
        s = e.s.stats()
        print(f"instance {i}: device {s['device_hit_tokens']}, host {s['host_hit_tokens']}, "
              f"L3 {s['l3_hit_tokens']}, computed {s['computed_tokens']} tokens; "
              f"{e.stats.l3_probes} lease-free L3 probes, {e.stats.l3_queries} lease-taking reads; "
              f"{e.stats.pages_checked} pages verified")
    tot = {k: sum(e.s.stats()[k] for e in engines)
           for k in ("device_hit_tokens", "host_hit_tokens", "l3_hit_tokens", "computed_tokens")}
    allp = sum(tot.values())
    print("per-tier hits: " + ", ".join(
        f"{name} {tot[k]} ({100 * tot[k] / allp:.1f}%)" for name, k in
        (("device", "device_hit_tokens"), ("host", "host_hit_tokens"), ("L3", "l3_hit_tokens"),
         ("computed", "computed_tokens"))))
    print(f"served {next_id} requests in {dt:.2f} s")
    for b in backends:
        if isinstance(b, MooncakeL3Backend):
            b.detach()
    if server is not None:
        server.shutdown()


if __name__ == "__main__":
    main()
