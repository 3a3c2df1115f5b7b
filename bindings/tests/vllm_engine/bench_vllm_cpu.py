"""Benchmark (not a test): one real vLLM engine workload with each offloading mode, on CPU.

Why: whether kvtier's modes serve the reused prefixes at least as fast as vLLM's own CPU
offloading, and reuse at least as many tokens, at several host-cache sizes.

How: the workload of the end-to-end tests (workload.py: long prefixes the engine's KV cannot
hold, round 1 computes them, round 2 reuses them with new suffixes), one request at a time
(TTFT per request), each mode in its own engine process (engine_driver.py). Modes: ``none``
(no offloading), ``vllm`` (vLLM's own ``CPUOffloadingSpec``, through kvtier's CPU copy path:
``KvtierCpuOffloadingSpec``), ``tiering`` (vLLM's tiering + ``KvtierSecondaryTier``
embedded), ``spec`` (``KvtierOffloadingSpec``), ``spec_l3`` (with an embedded ``kvtier_l3``).
With ``--repeats N`` every (host size, mode) runs N times, interleaved (repeat 1 of every
mode, then repeat 2...), so that a change of the machine's load over the run falls on every
mode alike; the table gives the median over the repeats of each figure. ``--rounds N`` (default
2) runs N rounds in each engine: round 1 computes the prefixes, rounds 2..N reuse them with new
suffixes (N - 1 times as many TTFT samples per engine start, which is most of a run's time).
Printed: TTFT p50/p99 over the reuse rounds, throughput (prompt tokens / s of those rounds)
and tokens reused per round, with ratios against ``none`` and ``vllm``, and the machine's
1-minute load average around each run.

``--profile DIR`` runs each engine's rounds under cProfile (engine_driver.py; every figure
then includes cProfile's own overhead, so use it to attribute time, not for the table) and
prints, per run, the seconds round 2 spent in each part of the offloading path: entries
into kvtier's manager (``KvtierOffloadingManager``, its L3 half, chains, tier and policies),
vLLM's own CPU manager, vLLM's offloading connector (scheduler and worker sides, what calls
either manager) and the copy path (cpu_copy.py, both modes' worker), vLLM's model runner (the
forward passes), the whole engine step, and the number of engine steps.

``--time-manager`` times every call vLLM's connector makes into the mode's offloading manager
(``perf_counter`` around each call, no profiler: engine_driver.py) and prints the reuse
rounds' manager time per request and its largest calls: the scheduler-side cost each manager adds
to TTFT, measured in the same run as the TTFTs.

``--prefixes``, ``--prefix-tokens`` and ``--kv-blocks`` (the engine's KV budget in blocks of
32 tokens; by default one prompt fits and two do not) set the workload's shape, e.g. issue
32's: ``--prefixes 8 --prefix-tokens 1024``; ``--model KEY=VALUE...`` changes the random-weight
model's config (workload.MODEL) and ``--dtype`` the engine's (float32 by default), e.g. the
issue's model: ``--model hidden_size=768 num_hidden_layers=6 num_attention_heads=12
num_key_value_heads=12 --dtype bfloat16``.

    .venv-vllm-cpu/bin/python bindings/tests/vllm_engine/bench_vllm_cpu.py --host-mib 16 64 256 --repeats 3
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
from workload import (  # noqa: E402
    BLOCK,
    KV_BLOCKS,
    PREFIX_TOKENS,
    PREFIXES,
    SUFFIX_TOKENS,
    model_dir,
    offloading,
    prompts,
    run_engine,
)

MODES = ["none", "vllm", "tiering", "spec", "spec_l3"]


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


def kv_blocks_for(prefix_tokens: int) -> int:
    """One prompt (prefix, suffix, generated tokens) and a block to spare, not two prompts."""
    one = -(-(prefix_tokens + SUFFIX_TOKENS + 8) // BLOCK) + 1
    return max(KV_BLOCKS, one)


# (part, path fragments of its source files): the time of a part is that of the calls into its
# files from files outside it (cProfile's per-caller cumulative times), so nested calls inside
# a part count once.
PARTS = [
    ("kvtier manager", ("kvtier/vllm/manager", "kvtier/vllm/chunks", "kvtier/vllm/tier", "kvtier/vllm/policy",
                        "kvtier/vllm/keys", "kvtier/vllm/spec_config")),
    ("vLLM manager", ("vllm/v1/kv_offload/cpu/manager", "vllm/v1/kv_offload/cpu/policies",
                      "vllm/v1/kv_offload/tiering/")),
    ("connector scheduler", ("kv_connector/v1/offloading/scheduler", "kv_connector/v1/offloading_connector")),
    ("connector worker", ("kv_connector/v1/offloading/worker",)),
    ("copy", ("kvtier/vllm/cpu_copy",)),
    ("model runner", ("vllm/v1/executor/",)),
    ("engine step", ("vllm/v1/engine/core.py",)),
]


def attribute(path: str) -> dict:
    """Seconds spent in each of ``PARTS`` (calls entering it from outside it; a part's time
    includes the other parts it calls) and ``steps``, the engine steps."""
    import pstats

    stats = pstats.Stats(path).stats  # {func: (cc, nc, tt, ct, {caller: (cc, nc, tt, ct)})}

    def part_of(func):
        f = func[0].replace(os.sep, "/")
        return next((name for name, frags in PARTS if any(x in f for x in frags)), None)

    out = {name: 0.0 for name, _ in PARTS}
    out["steps"] = sum(v[1] for k, v in stats.items() if k[2] == "step" and k[0].endswith("vllm/v1/engine/core.py"))
    for func, (_, _, _, _, callers) in stats.items():
        part = part_of(func)
        if part is None:
            continue
        for caller, (_, _, _, ct) in callers.items():
            if part_of(caller) != part:
                out[part] += ct
    return out


def summary(runs):
    """The median over repeats of each figure of one (host size, mode)."""
    med = {k: statistics.median(r[k] for r in runs) for k in ("ttft_p50", "ttft_p99", "tok_s", "reused")}
    return {**runs[0], **med, "repeats": len(runs), "ttft_p50_min": min(r["ttft_p50"] for r in runs), "reused_min": min(r["reused"] for r in runs),
            "reused_max": max(r["reused"] for r in runs),
            "load": [min(r["load_before"] for r in runs), max(r["load_after"] for r in runs)]}


def table(res: dict) -> None:
    """Prints the medians of ``res`` (what ``--json`` wrote), and the lowest TTFT p50 of the
    repeats (``min``: the run the machine's load slowed least). ``p50 / vllm`` is the median
    over repeats of each repeat's ratio against vLLM's run of the same repeat and host size
    (runs next to each other, under about the same load)."""
    runs = res["runs"]
    order = list(dict.fromkeys((r["host_mib"], r["mode"]) for r in runs))
    rows = [summary([r for r in runs if (r["host_mib"], r["mode"]) == key]) for key in order]
    base = next((r for r in rows if r["mode"] == "none"), None)

    def paired(r):
        ratios = []
        for x in runs:
            if (x["host_mib"], x["mode"]) != (r["host_mib"], r["mode"]):
                continue
            v = [y for y in runs if (y["host_mib"], y["mode"], y["repeat"]) == (r["host_mib"], "vllm", x["repeat"])]
            if v:
                ratios.append(x["ttft_p50"] / v[0]["ttft_p50"])
        return f"{statistics.median(ratios):.2f}" if ratios else "-"

    print(f"\n{res['prefixes']} prefixes of {res['prefix_tokens']} tokens, KV {res['kv_blocks']} blocks of {BLOCK}, "
          f"model {res.get('model') or 'workload.MODEL'} {res.get('dtype', 'float32')}; "
          f"{res.get('rounds', 2) - 1} reuse round(s) per engine; "
          f"medians of {res.get('repeats') or 1 + max(r['repeat'] for r in runs)} run(s)")
    print(f"{'host MiB':>8} {'mode':>8} {'TTFT p50':>9} {'min':>6} {'p99':>7} {'tok/s':>7} {'reused':>12} "
          f"{'p50 / none':>10} {'p50 / vllm':>10} {'reuse / vllm':>12} {'load':>9}")
    for r in rows:
        v = next((x for x in rows if x["mode"] == "vllm" and x["host_mib"] == r["host_mib"]), None)
        vs_none = f"{r['ttft_p50'] / base['ttft_p50']:.2f}" if base else "-"
        reuse_v = "-" if not v else f"{r['reused'] / v['reused']:.2f}" if v["reused"] else \
            "1.00" if not r["reused"] else "inf"
        reused = f"{r['reused']:.0f}" if r["reused_min"] == r["reused_max"] else \
            f"{r['reused_min']:.0f}-{r['reused_max']:.0f}"
        print(f"{r['host_mib']:>8} {r['mode']:>8} {r['ttft_p50']:>9.3f} {r['ttft_p50_min']:>6.3f} {r['ttft_p99']:>7.3f} {r['tok_s']:>7.0f} "
              f"{reused:>5}/{r['of']:<6} {vs_none:>10} {paired(r):>10} {reuse_v:>12} "
              f"{r['load'][0]:>4.1f}-{r['load'][1]:<4.1f}")
    if any("manager_us" in r for r in runs):
        print("\nreuse rounds: offloading manager time per request, µs (median over repeats; perf_counter "
              "around each call)")
        for key in order:
            got = [r["manager_us"] for r in runs if (r["host_mib"], r["mode"]) == key and "manager_us" in r]
            if not got:
                continue
            names = sorted({k for g in got for k in g}, key=lambda k: -statistics.median(g.get(k, 0) for g in got))
            total = statistics.median(sum(g.values()) for g in got)
            parts = ", ".join(f"{k} {statistics.median(g.get(k, 0) for g in got):.1f}" for k in names[:6])
            print(f"{key[0]:>8} {key[1]:>8} {total:>8.1f}  ({parts})")
    if any("profile_r2_s" in r for r in runs):
        print("\nround 2 under cProfile, seconds in each part (median over repeats):")
        names = [name for name, _ in PARTS] + ["round", "steps"]
        print(f"{'host MiB':>8} {'mode':>8} " + " ".join(f"{x:>{max(8, len(x))}}" for x in names))
        for key in order:
            got = [r["profile_r2_s"] for r in runs if (r["host_mib"], r["mode"]) == key and "profile_r2_s" in r]
            if got:
                print(f"{key[0]:>8} {key[1]:>8} "
                      + " ".join(f"{statistics.median(g.get(x, 0) for g in got):>{max(8, len(x))}.3f}"
                                 for x in names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host-mib", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--prefixes", type=int, default=PREFIXES)
    ap.add_argument("--prefix-tokens", type=int, default=PREFIX_TOKENS)
    ap.add_argument("--kv-blocks", type=int, help="the engine's KV budget in blocks (default: one prompt fits)")
    ap.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE",
                    help="changes to the model's config (integers), e.g. hidden_size=768")
    ap.add_argument("--dtype", default="float32", help="the engine's dtype")
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each (host size, mode), interleaved")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds per engine: the first computes the prefixes, every later one reuses them "
                         "(TTFT, throughput and reuse over all of those)")
    ap.add_argument("--json", help="write every run and the medians here")
    ap.add_argument("--profile", help="a directory: each run's rounds under cProfile, round 2's time attributed")
    ap.add_argument("--time-manager", action="store_true",
                    help="time each call into the offloading manager (round 2: µs per request)")
    ap.add_argument("--table", metavar="JSON", help="print the table of a --json file (runs nothing)")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds is at least 2: one computes the prefixes, the others reuse them")
    if args.table:
        with open(args.table) as f:
            table(json.load(f))
        return
    over = {}
    for kv_ in args.model:
        k, _, v = kv_.partition("=")
        if not v.isdigit():
            ap.error(f"--model takes KEY=INTEGER, got {kv_!r}")
        over[k] = int(v)
    md = model_dir(os.path.join(tempfile.gettempdir(), "kvtier-bench-model"), **over)
    n, plen = args.prefixes, args.prefix_tokens
    kv = args.kv_blocks or kv_blocks_for(plen)
    phases = [{"name": f"r{r}", "prompts": prompts(7, n=n, prefix=plen, round_=r), "max_tokens": 8, "serial": True}
              for r in range(1, args.rounds + 1)]
    order = [(mib, name) for mib in args.host_mib for name in MODES
             if name in args.modes and not (name == "none" and mib != args.host_mib[0])]
    runs = []
    for rep in range(args.repeats):
        for mib, name in order:
            cfg = modes(mib << 20)[name]
            t = time.time()
            load0 = os.getloadavg()[0]
            job = {"model": md, "phases": phases, "kv_transfer_config": cfg, "kv_blocks": kv,
                   "max_model_len": kv * BLOCK - BLOCK, "dtype": args.dtype}
            if args.profile:
                os.makedirs(args.profile, exist_ok=True)
                job["profile"] = os.path.join(os.path.abspath(args.profile), f"{name}-{mib}-{rep}")
            if args.time_manager:
                job["time_manager"] = True
            out = run_engine(job)
            reuse = out["phases"][1:]  # every round after the first reuses the prefixes
            r2 = reuse[0]
            ttft = [t for ph in reuse for t in ph["ttft"]]
            wall = sum(ph["wall_s"] for ph in reuse)
            runs.append({"host_mib": mib if cfg else 0, "mode": name, "repeat": rep,
                         "ttft_p50": statistics.median(ttft), "ttft_p99": pct(ttft, 0.99),
                         "tok_s": len(reuse) * n * (plen + SUFFIX_TOKENS) / wall,
                         "reused": sum(sum(ph["cached"]) for ph in reuse) / len(reuse),
                         "of": n * plen, "cached": r2["cached"], "run_s": time.time() - t,
                         "load_before": load0, "load_after": os.getloadavg()[0],
                         "threads_cpu_s": r2.get("threads_cpu_s", {})})
            if "manager_s" in r2:
                calls: dict = {}
                for ph in reuse:
                    for k, (c, sec) in ph["manager_s"].items():
                        calls.setdefault(k, [0, 0.0])
                        calls[k][0] += c
                        calls[k][1] += sec
                served = n * len(reuse)
                runs[-1]["manager_us"] = {k: 1e6 * sec / served for k, (_, sec) in calls.items()}
                runs[-1]["manager_calls"] = {k: c / served for k, (c, _) in calls.items()}
            if args.profile:
                runs[-1]["profile_r2_s"] = attribute(job["profile"] + ".r2")
                runs[-1]["profile_r2_s"]["round"] = r2["wall_s"]
            print(json.dumps(runs[-1]), flush=True)
    res = {"runs": runs, "kv_blocks": kv, "prefixes": n, "prefix_tokens": plen, "model": over,
           "dtype": args.dtype, "repeats": args.repeats, "rounds": args.rounds}
    table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
