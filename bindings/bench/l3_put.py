#!/usr/bin/env python3
"""Embedded L3 put path from Python: `L3Store.batch_put_pages` of 64 × 8 MiB (512 MiB) from a
numpy page pool, as a ratio to a numpy copy of the same bytes into warm buffers measured in
the same run.

Cases (medians over --reps):
- fresh store: a new embedded store each repetition (objects land in never-touched memory);
- overwrite: the same keys again after remove_all (memory the removes freed);
- evicting: new keys into a full store (memory eviction freed).

Usage: l3_put.py [--reps 5] [--n 64] [--mib 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import kvtier


def timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    page = a.mib << 20
    n = a.n
    pool = np.random.default_rng(0).integers(0, 255, size=n * page, dtype=np.uint8)
    ids = np.arange(n, dtype=np.uint32)
    warm = np.ones_like(pool)
    cap = 2 * n * page

    def keys(g: int) -> list[str]:
        return [f"put-{g}-{i}" for i in range(n)]

    def put(store, g: int) -> None:
        codes = store.batch_put_pages(keys(g), pool, ids, page)
        if (np.asarray(codes) != 0).any():
            raise SystemExit(f"put failed: {codes}")

    reused = kvtier.L3Store.embedded(cap, max_object_bytes=page)
    put(reused, 0)
    full = kvtier.L3Store.embedded(cap + cap // 4, max_object_bytes=page)
    for g in range(3):
        put(full, 1000 + g)
    res: dict[str, list[float]] = {"numpy copy": [], "fresh store": [], "overwrite": [], "evicting": []}
    for rep in range(a.reps):
        res["numpy copy"].append(timed(lambda: np.copyto(warm, pool)))
        s = kvtier.L3Store.embedded(cap, max_object_bytes=page)
        res["fresh store"].append(timed(lambda: put(s, 0)))
        del s
        reused.remove_all(force=True)
        res["overwrite"].append(timed(lambda: put(reused, 0)))
        res["evicting"].append(timed(lambda: put(full, 2000 + rep)))
    ref = statistics.median(res["numpy copy"])
    out = {k: {"ms": statistics.median(v), "x_copy": statistics.median(v) / ref} for k, v in res.items()}
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"batch_put_pages {n} x {a.mib} MiB, medians of {a.reps}")
    for k, v in out.items():
        print(f"  {k:<12} {v['ms']:8.1f} ms  {v['x_copy']:5.2f}x numpy copy")


if __name__ == "__main__":
    main()
