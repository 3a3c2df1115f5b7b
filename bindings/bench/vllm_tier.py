"""kvtier's vLLM secondary tier: store and load throughput between vLLM's host chunk slots
and the L3, against vLLM's built-in ``fs`` tier and a plain memcpy, in one run.

Why: the tier claims zero-copy moves between vLLM's /dev/shm chunk slots and kvtier's store
(docs/vllm.md); this measures what a cascade store (host -> L3) and a promotion load (L3 ->
host) of one batch cost, next to the tier vLLM ships for the same job and to the floor (one
memcpy of the same bytes), and prints ratios against memcpy.

What: a real vLLM engine on CPU (bindings/tests/vllm_suite/harness.py: real Scheduler,
OffloadingConnector, TieringOffloadingSpec with its /dev/shm host region) per tier, with
Llama-3-8B-shaped KV: 32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks x 4 blocks
per chunk = 8 MiB a chunk. The host slots 0..N-1 are filled with random bytes; each round
submits one store job of N chunks (fresh keys) through the tier's ``submit_store`` and one
load job of those N chunks into slots N..2N-1 through ``submit_load`` (bytes checked), and
waits for ``get_finished_jobs``; median of ``--repeat`` rounds after a warm-up (kvtier's store
is emptied between rounds). Tiers: kvtier
embedded, kvtier with a ``kvtier-l3`` server process on 127.0.0.1 (token on), vLLM's ``fs``
(files under a temporary directory: page cache, no fsync). memcpy: ``np.copyto`` of the same
N chunks out of and back into the slots.

    .venv-vllm/bin/python bindings/bench/vllm_tier.py [--chunks 32] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "vllm_suite"))

import numpy as np  # noqa: E402
from harness import Engine  # noqa: E402
from l3proc import L3Process  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

GIB = float(1 << 30)


def wait(tier, job_id: int, timeout: float = 300.0):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        for r in tier.get_finished_jobs():
            if r.job_id == job_id:
                return r
        time.sleep(0.0002)
    raise TimeoutError(f"job {job_id} did not finish")


def run_tier(engine: Engine, n: int, repeat: int):
    tier = engine.tier
    host = np.asarray(engine.manager.primary_tier.get_kv_memoryview()).view(np.uint8)
    rng = np.random.default_rng(0)
    host[:n] = rng.integers(0, 256, host[:n].shape, dtype=np.uint8)
    stores, loads = [], []
    for r in range(repeat + 1):
        keys = [make_offload_key(uuid.uuid4().bytes * 2, 0) for _ in range(n)]
        ctx = ReqContext(req_id=f"bench-{r}")
        t0 = time.perf_counter()
        tier.submit_store(TransferJob(2 * r, keys, np.arange(n), False, ctx))
        ok = wait(tier, 2 * r).success
        t1 = time.perf_counter()
        host[n:2 * n] = 0
        t2 = time.perf_counter()
        tier.submit_load(TransferJob(2 * r + 1, keys, np.arange(n, 2 * n), True, ctx))
        ok = ok and wait(tier, 2 * r + 1).success
        t3 = time.perf_counter()
        if not ok or not np.array_equal(host[n:2 * n], host[:n]):
            raise AssertionError(f"{tier.tier_type}: a job failed or the bytes differ")
        if r:  # round 0 warms up
            stores.append(t1 - t0)
            loads.append(t3 - t2)
        if hasattr(tier, "store"):
            tier.store.remove_all(True)  # each round starts from an empty store
    del host
    return statistics.median(stores), statistics.median(loads)


def run_memcpy(n: int, chunk: int, repeat: int):
    src = np.random.default_rng(0).integers(0, 256, (n, chunk), dtype=np.uint8)
    dst = np.empty_like(src)
    outs, ins = [], []
    for r in range(repeat + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        t1 = time.perf_counter()
        np.copyto(src, dst)
        t2 = time.perf_counter()
        if r:
            outs.append(t1 - t0)
            ins.append(t2 - t1)
    return statistics.median(outs), statistics.median(ins)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n = args.chunks
    shape = dict(layers=32, heads=8, head_dim=128, dtype="bfloat16", bpc=4, content=False,
                 num_gpu_blocks=64, cpu_bytes=(2 * n + 2) * 8 * (1 << 20))
    root = tempfile.mkdtemp(prefix="kvtier-vllm-bench-")
    srv = L3Process(token="bench", segment_bytes=(2 * n + 8) * 8 << 20)
    tiers = [
        ("kvtier embedded", {"type": "KvtierSecondaryTier", "module_path": "kvtier.vllm",
                             "segment_bytes": (2 * n + 8) * 8 << 20}),
        ("kvtier, kvtier-l3 server on loopback", {"type": "KvtierSecondaryTier", "module_path": "kvtier.vllm",
                                                  "server": srv.addr, "token": "bench"}),
        ("vLLM fs tier (page cache)", {"type": "fs", "root_dir": os.path.join(root, "fs")}),
    ]
    rows = []
    try:
        for name, cfg in tiers:
            e = Engine(root, [cfg], **shape)
            try:
                chunk = e.tier.block_size_bytes
                s, ld = run_tier(e, n, args.repeat)
            finally:
                e.close()
            rows.append((name, s, ld))
    finally:
        srv.kill()
    m_out, m_in = run_memcpy(n, chunk, args.repeat)
    size = n * chunk
    print(f"{n} chunks of {chunk / (1 << 20):.1f} MiB ({size / GIB:.2f} GiB a batch), median of {args.repeat}")
    print("| path | store (host -> L3) | load (L3 -> host) | store / memcpy | load / memcpy |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| memcpy (np.copyto) | {m_out * 1e3:.1f} ms ({size / GIB / m_out:.2f} GiB/s) | "
          f"{m_in * 1e3:.1f} ms ({size / GIB / m_in:.2f} GiB/s) | 1.00 | 1.00 |")
    for name, s, ld in rows:
        print(f"| {name} | {s * 1e3:.1f} ms ({size / GIB / s:.2f} GiB/s) | {ld * 1e3:.1f} ms "
              f"({size / GIB / ld:.2f} GiB/s) | {m_out / s:.2f} | {m_in / ld:.2f} |")


if __name__ == "__main__":
    main()
