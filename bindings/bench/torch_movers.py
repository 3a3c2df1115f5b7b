#!/usr/bin/env python3
"""kvtier.torch page movers on a GPU, as ratios to a contiguous pinned copy in the same run.

KV shaped like Llama-3-8B (32 layers, 8 KV heads, head dim 128, bf16), pages of 16 and 64
tokens, 256 pages scattered over the pools. For each mover (torch, dma, kernel):

- load (host to device) and store (device to host): GB/s and the ratio to one contiguous
  pinned ``copy_`` of the same bytes, timed with CUDA events, median of ``--iters``;
- the executor's LoadBack (layer by layer, with per-layer events) for the same pages;
- duplex: a load and a store at once on two streams (total GB/s);
- the slowdown of a bf16 GEMM loop while the mover copies in a loop beside it;

and end to end (``--ttft``): the time to first token of a turn with an 8K-token prefix on
host against recomputing the prefix, for a Llama-3-8B-shaped model with random bf16 weights,
split into load and compute (and both overlapped through per-layer waits).

Usage: python bindings/bench/torch_movers.py [--iters 10] [--movers torch,dma,kernel]
       [--page-sizes 16,64] [--pages 256] [--ttft] [--json]
GPU only (exits with a message otherwise). Figures go to docs/torch.md with this command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Callable, Dict, List

import numpy as np
import torch

from kvtier.torch import (
    DevicePool,
    Direction,
    Executor,
    HostPool,
    KVLayout,
    LoadWait,
    MoverUnavailableError,
    Pinning,
    make_mover,
)

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128


def cuda_time(fn: Callable[[], None], iters: int, stream: torch.cuda.Stream) -> float:
    """Median seconds of ``fn`` (enqueued on ``stream``) over ``iters`` runs after a warm-up."""
    with torch.cuda.stream(stream):
        fn()
    stream.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record(stream)
            fn()
            b.record(stream)
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000.0)
    return statistics.median(times)


def movers_bench(page_size: int, n_pages: int, movers: List[str], iters: int) -> Dict:
    layout = KVLayout.mha(LAYERS, KV_HEADS, HEAD_DIM, page_size, torch.bfloat16)
    pool_pages = 4 * n_pages
    dev = DevicePool.allocate(layout, pool_pages, "cuda")
    host = HostPool.allocate(layout, pool_pages, Pinning.PINNED)
    rng = np.random.default_rng(0)
    dp = rng.permutation(pool_pages)[:n_pages]
    hp = rng.permutation(pool_pages)[:n_pages]
    nbytes = n_pages * layout.page_bytes
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ref = {
        "load": cuda_time(lambda: on_dev.copy_(pinned, non_blocking=True), iters, s1),
        "store": cuda_time(lambda: pinned.copy_(on_dev, non_blocking=True), iters, s1),
    }
    out: Dict = {"page_size": page_size, "pages": n_pages, "bytes": nbytes,
                 "contiguous_GBps": {k: nbytes / v / 1e9 for k, v in ref.items()}, "movers": {}}
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    gemm_stream = torch.cuda.Stream()
    gemm_alone = cuda_time(lambda: [a @ a for _ in range(4)], iters, gemm_stream)
    for name in movers:
        try:
            m = make_mover(name)
            m.check_pools(dev, host)
        except MoverUnavailableError as e:
            out["movers"][name] = {"unavailable": str(e)}
            continue
        r: Dict = {}
        for d, key in ((Direction.LOAD, "load"), (Direction.STORE, "store")):
            t = cuda_time(lambda: m.copy(d, dev, host, dp, hp, range(LAYERS)), iters, s1)
            r[key] = {"GBps": nbytes / t / 1e9, "ratio_to_contiguous": ref[key] / t}
        # the executor's LoadBack: per-layer copies and events, completion seen by poll()
        with Executor(dev, host, mover=m) as ex:
            times = []
            for i in range(iters + 1):
                torch.cuda.synchronize()
                t0 = torch.cuda.Event(enable_timing=True)
                t0.record()
                ex.submit([_Op(i, dp, hp)])
                ex.poll(require=[i])
                t1 = torch.cuda.Event(enable_timing=True)
                t1.record()
                t1.synchronize()
                if i:
                    times.append(t0.elapsed_time(t1) / 1000.0)
            r["executor_load"] = {"GBps": nbytes / statistics.median(times) / 1e9,
                                  "ratio_to_contiguous": ref["load"] / statistics.median(times)}
        # duplex: a load and a store of the same size at once
        dp2, hp2 = dp[::-1].copy(), (hp + 1) % pool_pages

        def duplex() -> None:
            cur = torch.cuda.current_stream()
            s2.wait_stream(cur)
            m.copy(Direction.LOAD, dev, host, dp, hp, range(LAYERS))
            with torch.cuda.stream(s2):
                m.copy(Direction.STORE, dev, host, dp2, hp2, range(LAYERS))
            cur.wait_stream(s2)

        t = cuda_time(duplex, iters, s1)
        r["duplex_GBps"] = 2 * nbytes / t / 1e9
        # GEMM slowdown: the same GEMM loop, each run started together with a load beside it
        # (the load takes longer than the GEMMs, so every GEMM runs next to copies)
        ts = []
        for _ in range(iters):
            torch.cuda.synchronize()
            with torch.cuda.stream(s2):
                m.copy(Direction.LOAD, dev, host, dp, hp, range(LAYERS))
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(gemm_stream):
                e0.record(gemm_stream)
                for _ in range(4):
                    a @ a
                e1.record(gemm_stream)
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) / 1000.0)
        torch.cuda.synchronize()
        r["gemm_slowdown"] = statistics.median(ts) / gemm_alone
        out["movers"][name] = r
    return out


class _Op:
    """A LoadBack op as the executor reads it."""

    def __init__(self, i: int, dp: np.ndarray, hp: np.ndarray) -> None:
        self.id, self.kind, self.before_forward = i, "LoadBack", True
        self.src_tier, self.dst_tier = "host", "device"
        self.src, self.dst, self.keys = hp, dp, []


def ttft_bench(mover: str, prefix: int = 8192, new: int = 128, page_size: int = 16) -> Dict:
    """TTFT of a turn whose ``prefix`` tokens are on host vs recomputing them (Llama-3-8B
    shape, random bf16 weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvtier.torch.model import PagedRow, layout_of, run_row, use_paged_attention

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=16384,
                      rope_theta=500000.0, dtype=torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, prefix + new), device="cuda")

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1000.0)
        return statistics.median(ts)

    with torch.inference_mode():
        recompute = timed(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1))
    layout = layout_of(model.config, page_size)
    n_pages = (prefix + new + page_size - 1) // page_size
    dev = DevicePool.allocate(layout, n_pages, "cuda")
    host = HostPool.allocate(layout, n_pages, Pinning.PINNED)
    host.data.normal_()
    use_paged_attention(model)
    pre = prefix // page_size
    pages = torch.arange(n_pages, device="cuda")
    m = make_mover(mover)
    res: Dict = {"mover": mover, "prefix": prefix, "new_tokens": new, "recompute_s": recompute}
    with Executor(dev, host, mover=m) as ex:
        counter = [10_000]

        def load_only() -> None:
            counter[0] += 1
            ex.submit([_Op(counter[0], np.arange(pre), np.arange(pre))])
            ex.poll(require=[counter[0]])

        def compute_only() -> None:
            run_row(model, PagedRow(dev, pages, prefix), ids[0, prefix:].tolist())

        def overlapped() -> None:
            counter[0] += 1
            op = _Op(counter[0], np.arange(pre), np.arange(pre))
            ex.submit([op])
            plan = type("P", (), {"ops": [op], "prefill": [], "decode_table_pages": np.zeros(0, np.uint32)})()
            ex.wait_before_forward(plan, LoadWait.PER_LAYER)
            run_row(model, PagedRow(dev, pages, prefix, ex.wait_for_layer), ids[0, prefix:].tolist())
            ex.poll(require=[op.id])

        res["load_s"] = timed(load_only)
        res["compute_s"] = timed(compute_only)
        res["ttft_s"] = timed(overlapped)
    res["speedup_vs_recompute"] = recompute / res["ttft_s"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--movers", default="torch,dma,kernel")
    ap.add_argument("--page-sizes", default="16,64")
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--ttft", action="store_true", help="also the 8K-prefix TTFT (needs ~20 GB of GPU memory)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_movers.py needs a CUDA GPU")
    movers = args.movers.split(",")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
    for ps in (int(x) for x in args.page_sizes.split(",")):
        r = movers_bench(ps, args.pages, movers, args.iters)
        results["runs"].append(r)
        c = r["contiguous_GBps"]
        print(f"page {ps} tokens, {args.pages} pages ({r['bytes'] / 2**20:.0f} MiB): contiguous pinned "
              f"load {c['load']:.1f} GB/s, store {c['store']:.1f} GB/s")
        for name, m in r["movers"].items():
            if "unavailable" in m:
                print(f"  {name:>6}: unavailable ({m['unavailable']})")
                continue
            print(f"  {name:>6}: load {m['load']['GBps']:.1f} GB/s ({m['load']['ratio_to_contiguous']:.2f}x), "
                  f"store {m['store']['GBps']:.1f} GB/s ({m['store']['ratio_to_contiguous']:.2f}x), "
                  f"executor LoadBack {m['executor_load']['GBps']:.1f} GB/s, duplex {m['duplex_GBps']:.1f} GB/s, "
                  f"GEMM slowdown {m['gemm_slowdown']:.2f}x")
    if args.ttft:
        results["ttft"] = []
        for name in movers:
            try:
                t = ttft_bench(name)
            except MoverUnavailableError as e:
                print(f"  TTFT {name}: unavailable ({e})")
                continue
            results["ttft"].append(t)
            print(f"TTFT 8K prefix on host, {name}: load {t['load_s'] * 1e3:.1f} ms, compute "
                  f"{t['compute_s'] * 1e3:.1f} ms, overlapped {t['ttft_s'] * 1e3:.1f} ms; recompute "
                  f"{t['recompute_s'] * 1e3:.1f} ms ({t['speedup_vs_recompute']:.2f}x)")
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
