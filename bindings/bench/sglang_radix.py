"""SGLang's own RadixCache (device only) versus SGLang + kvtier's radix-cache backend (device,
host and L3), the same workload through SGLang's real scheduler pieces on CPU, in one run.

Why: issue 34 claims kvtier's tiers under SGLang's device tree turn recomputation into hits
when the device pool cannot hold the working set; this counts where each request's cached
prefix came from (device / host / L3 tokens, SGLang's own admission counters), the prefill
tokens left to compute, and the time per scheduler step of the cache side.

What: ``DOCS`` shared documents of ``DOC`` tokens, ``REQS`` requests each one document plus
a distinct ``Q``-token question, documents drawn Zipf-like (a few hot, a long tail), admitted
one step at a time through ``bindings/tests/sglang_engine.Engine`` (SGLang's PrefillAdder,
paged allocator, MHATokenToKVPool, ReqToTokenPool, prepare_for_extend, release_kv_cache; the
model replaced by a KV oracle that checks every reused row). The device pool holds about two
documents; kvtier's host pool about ``HOST_DOCS``; L3 is a ``kvtier-l3`` server in this process
on 127.0.0.1. A second "engine" (a fresh process's cache: empty device and host) then serves the
same requests from the same server: its hits are L3's. Time per step has no model in it (the
oracle "forward" is not counted): it is SGLang's admission, allocation and release plus the
cache's own work (kvtier: hashing, host copies, L3 I/O), on CPU.

    .venv/bin/python bindings/bench/sglang_radix.py
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from sglang_engine import Engine, sglang_radix  # noqa: E402

import kvtier  # noqa: E402
from kvtier.sglang import radix as kr  # noqa: E402


def workload(docs, doc, reqs, q, seed=0):
    g = np.random.default_rng(seed)
    bodies = [g.integers(1, 50_000, doc).tolist() for _ in range(docs)]
    w = 1.0 / np.arange(1, docs + 1)
    pick = g.choice(docs, size=reqs, p=w / w.sum())
    return [bodies[i] + g.integers(1, 50_000, q).tolist() for i in pick]


def run(name, cache, prompts, args):
    e = Engine(cache, page_size=args.page_size, device_tokens=args.device_tokens, max_context=args.doc + args.q + 8,
               max_reqs=args.batch + 1, shape=(args.layers, args.heads, args.dim), model="bench-model")
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.batch):
        e.run([e.request(p) for p in prompts[i:i + args.batch]])
    wall = time.perf_counter() - t0
    e.check_pools()
    c = getattr(e.cache, "stats", None)
    s = c() if c else {}
    return dict(name=name, device=e.adder_hits["device"], host=e.adder_hits["host"], l3=e.adder_hits["storage"],
                computed=e.computed_tokens, steps=e.steps, step_ms=1e3 * statistics.mean(e.step_seconds),
                step_p50_ms=1e3 * statistics.median(e.step_seconds), wall_s=wall, rows=e.checked_rows, stats=s,
                engine=e)


def main():
    torch.set_num_threads(1)  # 2 shared vCPUs: intra-op threads only contend
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--doc", type=int, default=256)
    ap.add_argument("--q", type=int, default=32)
    ap.add_argument("--reqs", type=int, default=192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--host-docs", type=int, default=8)
    ap.add_argument("--io-threads", type=int, default=1, help="kvtier's io_threads (0: L3 I/O inline)")
    ap.add_argument("--prefetch-wait-ms", type=int, default=20, help="kvtier's prefetch_wait_ms")
    ap.add_argument("--write-policy", default="write_through", help="kvtier's write_policy")
    args = ap.parse_args()
    args.device_tokens = 2 * args.doc + args.batch * (args.doc + args.q + 2 * args.page_size)
    prompts = workload(args.docs, args.doc, args.reqs, args.q)
    page_bytes = args.page_size * args.layers * 2 * args.heads * args.dim * 4
    host_pages = args.host_docs * args.doc // args.page_size
    srv = kvtier.L3Server(1 << 30)
    try:
        conf = kr.RadixBackendConfig.from_dict(dict(host_pages=host_pages, l3="server", server=srv.addr,
                                                    io_threads=args.io_threads,
                                                    prefetch_wait_ms=args.prefetch_wait_ms,
                                                    write_policy=args.write_policy))
        rows = [run("SGLang RadixCache (device)", sglang_radix, prompts, args)]
        rows.append(run("SGLang + kvtier (device+host+L3)",
                        lambda p: kr.KvtierRadixCache(p, conf, model="bench-model"), prompts, args))
        rows[-1]["engine"].cache.wait_io()
        rows[-1]["engine"].cache.flush_pending_backups()
        rows[-1]["engine"].cache.wait_io()
        rows.append(run("SGLang + kvtier, second engine (same L3)",
                        lambda p: kr.KvtierRadixCache(p, conf, model="bench-model"), prompts, args))
        for r in rows[1:]:
            r["engine"].cache.shutdown()
    finally:
        srv.shutdown()
    total = sum(len(p) for p in prompts)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}, torch CPU; "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"workload: {args.reqs} requests, {args.docs} docs x {args.doc} tokens + {args.q}-token questions "
          f"({total} prompt tokens), page {args.page_size} tokens = {page_bytes >> 10} KiB, device pool "
          f"{args.device_tokens} tokens, kvtier host {host_pages} pages, batch {args.batch}, "
          f"io_threads {args.io_threads}, prefetch_wait_ms {args.prefetch_wait_ms}, {args.write_policy}")
    base = rows[0]
    print("| engine | device hit | host hit | L3 hit | computed | computed / SGLang | steps | ms/step (mean, p50) | ms/step / SGLang |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['name']} | {r['device']} | {r['host']} | {r['l3']} | {r['computed']} | "
              f"{r['computed'] / base['computed']:.2f} | {r['steps']} | {r['step_ms']:.1f}, {r['step_p50_ms']:.1f} | "
              f"{r['step_ms'] / base['step_ms']:.2f} |")
    for r in rows[1:]:
        s = r["stats"]
        print(f"{r['name']}: kvtier counters host {s['host_hit_tokens']} l3 {s['l3_hit_tokens']} "
              f"stored {s['stored_pages']} backed up {s['backed_up_pages']} prefetched {s['prefetched_pages']} "
              f"fallbacks {s['load_back_fallbacks']}; rows checked {r['rows']}")


if __name__ == "__main__":
    main()
