#!/usr/bin/env python3
"""kvtier.torch page movers, as ratios to a contiguous copy of the same bytes in the same run.

KV shaped like Llama-3-8B (32 layers, 8 KV heads, head dim 128, bf16), pages of 16 and 64
tokens, ``--pages`` pages (256 by default; the GPU check runs 1,024) scattered over pools twice
that size. For each mover (torch, dma, kernel):

- load (host to device) and store (device to host): GB/s and the ratio to one contiguous
  pinned ``copy_`` of the same bytes, median of ``--iters``; the bytes are checked after
  each direction (a mover that is fast but wrong fails the run);
- the executor's LoadBack (layer by layer, with per-layer completions) for the same pages;
- duplex: a load and a store of other pages at once (total GB/s);
- the slowdown of a GEMM loop while the mover loads beside it;

and end to end (``--ttft``): the time to first token of a turn whose 8K-token prefix is on
host against recomputing the prefix, for a Llama-3-8B-shaped model with random bf16 weights,
split into load and compute, and both overlapped through per-layer waits. The host pages hold
the prefix's real KV (computed once through the paged model and written back), so the
overlapped turn's first-token logits are compared with the recompute's.

On a GPU (the figures of docs/torch.md) copies run on CUDA streams and are timed with CUDA
events. ``--device cpu`` runs the same code on CPU (the "device" pool in DRAM, timing with
``perf_counter``, the side work of duplex and GEMM on a thread); ``--smoke`` shrinks every
shape so the whole script runs in seconds (CI runs it that way, with the ``kernel`` mover
under Triton's interpreter, so a GPU session does not find a broken script).

Usage: python bindings/bench/torch_movers.py [--device cuda|cpu] [--smoke] [--iters 10]
       [--movers torch,dma,kernel] [--page-sizes 16,64] [--pages 256] [--ttft] [--json] [--json-out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

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
    PoolLayoutError,
    make_mover,
)


@dataclass(frozen=True)
class Shape:
    """What the run moves and computes."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    gemm: int  # side of the square GEMM of the slowdown loop
    llama: Dict[str, Any]  # LlamaConfig keyword arguments of the TTFT model
    prefix: int
    new_tokens: int


LLAMA_3_8B = Shape(
    32, 8, 128, torch.bfloat16, 8192,
    dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=16384, rope_theta=500000.0),
    8192, 128,
)
SMOKE = Shape(
    2, 2, 16, torch.float32, 64,
    dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
    64, 8,
)


class Clock:
    """Streams and timing on one device: CUDA streams and events on a GPU; on CPU, work runs
    synchronously on the calling thread and side work on a thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.side: Optional["torch.cuda.Stream"] = self.stream()  # where side work runs on GPU

    def stream(self) -> Optional["torch.cuda.Stream"]:
        return torch.cuda.Stream(device=self.device) if self.cuda else None

    @contextlib.contextmanager
    def on(self, stream: Optional["torch.cuda.Stream"]) -> Iterator[None]:
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _once(self, fn: Callable[[], Any], stream: Optional["torch.cuda.Stream"]) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with self.on(stream):
            a.record()
            fn()
            b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1000.0

    def time(self, fn: Callable[[], Any], iters: int, stream: Optional["torch.cuda.Stream"] = None,
             warmup: bool = True) -> float:
        """Median seconds of ``fn`` (enqueued on ``stream``) over ``iters`` runs."""
        if warmup:
            with self.on(stream):
                fn()
            self.sync()
        return statistics.median(self._once(fn, stream) for _ in range(iters))

    def _start_side(self, side: Callable[[], None]) -> Callable[[], None]:
        """Starts ``side`` on a thread (on its own stream on GPU: a mover that waits on the
        host between stages must not hold the main work back) and returns once it began; the
        returned ``join`` re-raises what the side work raised."""
        began = threading.Event()
        errors: List[BaseException] = []
        s2 = self.side

        def run() -> None:
            with self.on(s2):
                began.set()
                try:
                    side()
                except BaseException as e:  # noqa: BLE001 - re-raised by join
                    errors.append(e)

        t = threading.Thread(target=run)
        t.start()
        began.wait()

        def join() -> None:
            t.join()
            if errors:
                raise errors[0]

        return join

    def beside(self, main: Callable[[], None], side: Callable[[], None]) -> None:
        """Runs ``side`` beside ``main``; returns when both are done (on GPU: when the current
        stream has been made to wait for the side stream)."""
        if self.cuda:
            self.side.wait_stream(torch.cuda.current_stream(self.device))
        join = self._start_side(side)
        main()
        join()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.side)

    def time_beside(self, main: Callable[[], None], side: Callable[[], None], iters: int,
                    stream: Optional["torch.cuda.Stream"] = None) -> float:
        """Median seconds of ``main`` alone while ``side`` runs beside it (``side`` should be
        the longer, so that all of ``main`` overlaps it)."""
        times = []
        for _ in range(iters):
            self.sync()
            join = self._start_side(side)
            times.append(self._once(main, stream))
            join()
            self.sync()
        return statistics.median(times)


def _disjoint_pages(rng: np.random.Generator, pool_pages: int, n: int) -> List[np.ndarray]:
    perm = rng.permutation(pool_pages)
    return [perm[:n], perm[n:2 * n]]


def _check_moved(dev: DevicePool, host: HostPool, dp: np.ndarray, hp: np.ndarray, what: str) -> None:
    """Raises unless every chunk of device pages ``dp`` equals host pages ``hp``."""
    d_idx = torch.as_tensor(dp, device=dev.device)
    h_idx = torch.as_tensor(hp)
    for l in range(dev.layout.num_layers):
        for c in range(dev.layout.components):
            got = dev.chunks(l, c).index_select(0, d_idx).cpu()
            want = host.chunks(l, c).index_select(0, h_idx)
            if not torch.equal(got, want):
                raise AssertionError(f"{what}: layer {l} component {c} differs after the copy")


def _random_pages(n: int, layout: KVLayout, device: torch.device) -> torch.Tensor:
    """``n`` pages of random bytes that are never NaN or Inf (every byte < 64), as
    ``[n, layers, comps, *chunk_shape]`` of the layout's dtype."""
    b = torch.randint(0, 64, (n, layout.page_bytes), dtype=torch.uint8, device=device)
    return b.view(layout.dtype).view(n, layout.num_layers, layout.components, *layout.chunk_shape)


def _fill(dev: DevicePool, host: HostPool, dp: np.ndarray, hp: np.ndarray) -> None:
    """New random bytes in device pages ``dp`` and host pages ``hp`` (only those: the pools are
    gigabytes), different on the two sides (drawn on the device: fast on a GPU)."""
    layout = dev.layout
    host.data.index_copy_(0, torch.as_tensor(hp), _random_pages(len(hp), layout, dev.device).cpu())
    d_idx = torch.as_tensor(dp, device=dev.device)
    r = _random_pages(len(dp), layout, dev.device)
    for l in range(layout.num_layers):
        for c in range(layout.components):
            dev.chunks(l, c).index_copy_(0, d_idx, r[:, l, c])


def mover_from_spec(spec: str) -> Any:
    """A mover from ``--movers`` names: ``torch``, ``dma``, ``kernel``, or a variant to compare in
    the same run: ``dma:bindings`` (cuda-python's wrapper instead of the raw driver call),
    ``kernel:WARPSxWORDS`` or ``kernel:WARPSxWORDSxBLOCKS`` (e.g. ``kernel:4x512``, the first
    H100 run's shape)."""
    name, _, opt = spec.partition(":")
    if not opt:
        return make_mover(name)
    if name == "dma" and opt in ("raw", "bindings"):
        from kvtier.torch.movers.dma import Issue

        return make_mover("dma", issue=Issue(opt))
    if name == "kernel":
        parts = opt.split("x")
        if len(parts) in (2, 3) and all(p.isdigit() for p in parts):
            kw = {"num_warps": int(parts[0]), "block_words": int(parts[1])}
            if len(parts) == 3:
                kw["max_blocks"] = int(parts[2])
            return make_mover("kernel", **kw)
    raise MoverUnavailableError(f"unknown mover variant {spec!r}")


class _Op(SimpleNamespace):
    """A LoadBack op as the executor reads it."""

    def __init__(self, i: int, dp: np.ndarray, hp: np.ndarray) -> None:
        super().__init__(id=i, kind="LoadBack", before_forward=True, src_tier="host", dst_tier="device",
                         src=hp, dst=dp, keys=[])


def movers_bench(clock: Clock, shape: Shape, page_size: int, n_pages: int, movers: List[str], iters: int) -> Dict:
    layout = KVLayout.mha(shape.layers, shape.kv_heads, shape.head_dim, page_size, shape.dtype)
    pool_pages = max(2 * n_pages, 1024)  # scattered over a pool twice the size (or 1,024 pages)
    dev = DevicePool.allocate(layout, pool_pages, clock.device)
    host = HostPool.allocate(layout, pool_pages, Pinning.PINNED if clock.cuda else Pinning.PAGEABLE)
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    dp, dp2 = _disjoint_pages(rng, pool_pages, n_pages)
    hp, hp2 = _disjoint_pages(rng, pool_pages, n_pages)
    nbytes = n_pages * layout.page_bytes
    s1 = clock.stream()
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=clock.cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=clock.device)
    ref = {
        "load": clock.time(lambda: dst.copy_(src, non_blocking=True), iters, s1),
        "store": clock.time(lambda: src.copy_(dst, non_blocking=True), iters, s1),
    }
    out: Dict = {"page_size": page_size, "pages": n_pages, "bytes": nbytes,
                 "contiguous_GBps": {k: nbytes / v / 1e9 for k, v in ref.items()}, "movers": {}}
    a = torch.randn(shape.gemm, shape.gemm, dtype=shape.dtype, device=clock.device)
    gemm_stream = clock.stream()

    def gemms() -> None:
        for _ in range(4):
            a @ a

    gemm_alone = clock.time(gemms, iters, gemm_stream)
    for name in movers:
        try:
            m = mover_from_spec(name)
            m.check_pools(dev, host)
        except (MoverUnavailableError, PoolLayoutError) as e:
            out["movers"][name] = {"unavailable": str(e)}
            continue
        r: Dict = {}
        for d, key in ((Direction.LOAD, "load"), (Direction.STORE, "store")):
            _fill(dev, host, dp, hp)
            t = clock.time(lambda: m.copy(d, dev, host, dp, hp, range(layout.num_layers)), iters, s1)
            clock.sync()
            _check_moved(dev, host, dp, hp, f"{name} {key}")
            r[key] = {"GBps": nbytes / t / 1e9, "ratio_to_contiguous": ref[key] / t}
        # the executor's LoadBack: per-layer copies and completions, seen by poll()
        with Executor(dev, host, mover=m) as ex:
            counter = iter(range(1 << 30))

            def load_back() -> None:
                i = next(counter)
                ex.submit([_Op(i, dp, hp)])
                ex.poll(require=[i])

            t = clock.time(load_back, iters)
            r["executor_load"] = {"GBps": nbytes / t / 1e9, "ratio_to_contiguous": ref["load"] / t}
        # duplex: a load and a store of other pages at once
        t = clock.time(lambda: clock.beside(
            lambda: m.copy(Direction.LOAD, dev, host, dp, hp, range(layout.num_layers)),
            lambda: m.copy(Direction.STORE, dev, host, dp2, hp2, range(layout.num_layers))), iters, s1)
        r["duplex_GBps"] = 2 * nbytes / t / 1e9
        # GEMM slowdown: the GEMM loop's own time while a load runs beside it (the load is
        # the longer, so every GEMM runs next to copies), against the loop alone
        t = clock.time_beside(gemms, lambda: m.copy(Direction.LOAD, dev, host, dp, hp, range(layout.num_layers)),
                              iters, gemm_stream)
        r["gemm_beside_load_s"], r["gemm_alone_s"] = t, gemm_alone
        r["gemm_slowdown"] = t / gemm_alone
        out["movers"][name] = r
    return out


def _host_s(clock: Clock, fn: Callable[[], Any], iters: int = 3) -> float:
    """Median seconds the calling thread spends issuing ``fn`` (no sync at the end): beside
    the GPU time of :meth:`Clock.time`, it says whether a phase is bound by the host."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        clock.sync()
    return statistics.median(times)


def _profile(clock: Clock, fn: Callable[[], Any], path: str) -> Dict[str, float]:
    """Runs ``fn`` once under torch.profiler; writes the op tables (by device and by host
    time) to ``path`` and returns the totals: device kernel time, host op time, wall."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if clock.cuda else [])
    clock.sync()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        clock.sync()
    wall = time.perf_counter() - t0
    avg = prof.key_averages()
    dev_us = sum(e.self_device_time_total for e in avg)
    cpu_us = sum(e.self_cpu_time_total for e in avg)
    with open(path, "w") as f:
        f.write(f"wall {wall * 1e3:.2f} ms, device kernels {dev_us / 1e3:.2f} ms, host ops {cpu_us / 1e3:.2f} ms\n\n")
        if clock.cuda:
            f.write(avg.table(sort_by="self_device_time_total", row_limit=25))
            f.write("\n")
        f.write(avg.table(sort_by="self_cpu_time_total", row_limit=25))
    return {"wall_s": wall, "device_kernels_s": dev_us / 1e6, "host_ops_s": cpu_us / 1e6}


def _graphed_forward(clock: Clock, model: Any, row: Any, ids_new: torch.Tensor, start: int) -> Tuple[Any, torch.Tensor]:
    """The turn's forward captured once as a CUDA graph (warmed up on a side stream, as torch
    asks): a replay issues the whole forward at once, so its time is the GPU's, not the host's
    op by op (the fourth H200 run: 21.8 ms of kernels issued in ~60 ms). The graph reads the
    device pages at replay time; returns the graph and its logits tensor (refreshed by each
    replay)."""
    pos = torch.arange(start, start + ids_new.shape[1], device=clock.device)[None]
    kw = dict(input_ids=ids_new, position_ids=pos, use_cache=False, logits_to_keep=1, kvtier_row=row)
    side = torch.cuda.Stream(device=clock.device)
    side.wait_stream(torch.cuda.current_stream(clock.device))
    with torch.inference_mode(), torch.cuda.stream(side):
        for _ in range(2):
            model(**kw)
    torch.cuda.current_stream(clock.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        out = model(**kw)
    return graph, out.logits


def ttft_bench(clock: Clock, shape: Shape, movers: List[str], page_size: int = 16,
               profile_dir: Optional[str] = None, graph: bool = False) -> List[Dict]:
    """Per mover, the TTFT of a turn whose ``shape.prefix`` tokens are on host against
    recomputing them (random weights in ``shape.dtype``); one model and one prefix for all.
    With ``profile_dir``, the compute alone and the overlapped turn also run once under
    torch.profiler (tables in that folder, totals in the results). With ``graph``, the compute
    also runs as one CUDA graph (``graph_compute_s``), and the turn as the mover's load then a
    replay (``graph_serial_ttft_s``, no overlap: a graph cannot wait per layer on the
    executor's copies); on CPU, or if the capture fails, ``graph_unavailable`` says why."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvtier.torch.model import PagedRow, layout_of, run_row, use_paged_attention

    cfg = LlamaConfig(**shape.llama, dtype=shape.dtype)
    torch.manual_seed(0)
    with torch.device(clock.device):
        model = LlamaForCausalLM._from_config(cfg, dtype=shape.dtype).eval()
    prefix, new = shape.prefix, shape.new_tokens
    ids = torch.randint(0, cfg.vocab_size, (1, prefix + new), device=clock.device)
    with torch.inference_mode():
        recompute = clock.time(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), 3)
        want = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
    layout = layout_of(model.config, page_size)
    n_pages = (prefix + new + page_size - 1) // page_size
    pre = prefix // page_size
    dev = DevicePool.allocate(layout, n_pages, clock.device)
    host = HostPool.allocate(layout, n_pages, Pinning.PINNED if clock.cuda else Pinning.PAGEABLE)
    use_paged_attention(model)
    pages = torch.arange(n_pages, device=clock.device)
    prefix_pages = np.arange(pre)
    # the prefix's real KV on host: computed once through the pages and copied chunk by chunk
    # (no mover under test involved), then the device pages are wiped before each mover, so
    # only that mover's load can bring it back
    run_row(model, PagedRow(dev, pages, 0), ids[0, :prefix].tolist())
    for l in range(layout.num_layers):
        for c in range(layout.components):
            host.chunks(l, c)[:pre].copy_(dev.chunks(l, c)[:pre])

    def wipe() -> None:
        for comps in dev.tensors:
            for t in comps:
                t.zero_()

    graphed: Optional[Tuple[Any, torch.Tensor]] = None
    graph_why = "" if clock.cuda else "a CUDA graph needs CUDA"
    if graph and clock.cuda:
        try:
            graphed = _graphed_forward(clock, model, PagedRow(dev, pages, prefix), ids[:, prefix:], prefix)
        except Exception as e:  # noqa: BLE001 - reported in the results, the run goes on
            graph_why = f"capture failed: {e!r}"[:500]
            clock.sync()
    out: List[Dict] = []
    for name in movers:
        try:
            m = mover_from_spec(name)
            m.check_pools(dev, host)
        except (MoverUnavailableError, PoolLayoutError) as e:
            out.append({"mover": name, "unavailable": str(e)})
            continue
        wipe()
        res: Dict = {"mover": name, "prefix": prefix, "new_tokens": new, "recompute_s": recompute}
        with Executor(dev, host, mover=m) as ex:
            counter = iter(range(1 << 30))
            logits: List[torch.Tensor] = []

            def load_only() -> None:
                i = next(counter)
                ex.submit([_Op(i, prefix_pages, prefix_pages)])
                ex.poll(require=[i])

            def compute_only() -> None:
                run_row(model, PagedRow(dev, pages, prefix), ids[0, prefix:].tolist())

            def overlapped() -> None:
                op = _Op(next(counter), prefix_pages, prefix_pages)
                ex.submit([op])
                plan = SimpleNamespace(ops=[op], prefill=[], decode_table_pages=np.zeros(0, np.uint32))
                ex.wait_before_forward(plan, LoadWait.PER_LAYER)
                logits.append(run_row(model, PagedRow(dev, pages, prefix, ex.wait_for_layer),
                                      ids[0, prefix:].tolist()))
                ex.poll(require=[op.id])

            res["load_s"] = clock.time(load_only, 3)
            res["compute_s"] = clock.time(compute_only, 3)
            res["compute_host_s"] = _host_s(clock, compute_only)
            wipe()  # the timed overlapped turns must load the prefix themselves
            res["ttft_s"] = clock.time(overlapped, 3, warmup=False)
            if graph and graphed is None:
                res["graph_unavailable"] = graph_why
            elif graphed is not None:
                g, g_logits = graphed
                res["graph_compute_s"] = clock.time(g.replay, 3)

                def serial_graph() -> None:
                    load_only()
                    g.replay()

                wipe()  # each timed turn loads the prefix itself
                res["graph_serial_ttft_s"] = clock.time(serial_graph, 3, warmup=False)
                res["graph_first_token_logits_max_abs_diff"] = float((g_logits[0, -1].float() - want).abs().max())
                res["graph_first_token_argmax_equal"] = bool(int(g_logits[0, -1].argmax()) == int(want.argmax()))
            if profile_dir is not None:
                tag = name.replace(":", "_")
                res["profile_compute"] = _profile(clock, compute_only, f"{profile_dir}/ttft-{page_size}-{tag}-compute.txt")
                wipe()
                res["profile_overlapped"] = _profile(clock, overlapped,
                                                     f"{profile_dir}/ttft-{page_size}-{tag}-overlapped.txt")
        got = logits[0]
        res["first_token_logits_max_abs_diff"] = float((got - want).abs().max())
        res["first_token_argmax_equal"] = bool(int(got.argmax()) == int(want.argmax()))
        res["speedup_vs_recompute"] = recompute / res["ttft_s"]
        out.append(res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (the figures) or cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script, measures nothing")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--movers", default="torch,dma,kernel")
    ap.add_argument("--page-sizes", default="16,64")
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--ttft", action="store_true", help="also the 8K-prefix TTFT (needs ~20 GB of GPU memory)")
    ap.add_argument("--ttft-page-size", type=int, default=16, help="the TTFT run's page size in tokens")
    ap.add_argument("--profile", metavar="DIR", help="with --ttft: op tables of the compute and the overlapped turn")
    ap.add_argument("--ttft-graph", action="store_true",
                    help="with --ttft: also the compute as one CUDA graph, and the turn as load then replay")
    ap.add_argument("--json", action="store_true", help="print the results as JSON at the end")
    ap.add_argument("--json-out", metavar="PATH", help="write the results as JSON to PATH")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("torch_movers.py: no CUDA GPU here (use --device cpu for a CPU run)")
    clock = Clock(device)
    shape = SMOKE if args.smoke else LLAMA_3_8B
    movers = args.movers.split(",")
    name = torch.cuda.get_device_name(device) if clock.cuda else "cpu"
    results: Dict[str, Any] = {"device": name, "torch": torch.__version__, "smoke": args.smoke, "runs": []}
    for ps in (int(x) for x in args.page_sizes.split(",") if x):
        r = movers_bench(clock, shape, ps, args.pages, movers, args.iters)
        results["runs"].append(r)
        c = r["contiguous_GBps"]
        print(f"page {ps} tokens, {args.pages} pages ({r['bytes'] / 2**20:.1f} MiB): contiguous "
              f"load {c['load']:.1f} GB/s, store {c['store']:.1f} GB/s")
        for mname, m in r["movers"].items():
            if "unavailable" in m:
                print(f"  {mname:>6}: unavailable ({m['unavailable']})")
                continue
            print(f"  {mname:>6}: load {m['load']['GBps']:.1f} GB/s ({m['load']['ratio_to_contiguous']:.2f}x), "
                  f"store {m['store']['GBps']:.1f} GB/s ({m['store']['ratio_to_contiguous']:.2f}x), "
                  f"executor LoadBack {m['executor_load']['GBps']:.1f} GB/s, duplex {m['duplex_GBps']:.1f} GB/s, "
                  f"GEMM slowdown {m['gemm_slowdown']:.2f}x")
    if args.ttft:
        results["ttft"] = ttft_bench(clock, shape, movers, args.ttft_page_size, args.profile, args.ttft_graph)
        for t in results["ttft"]:
            mname = t["mover"]
            if "unavailable" in t:
                print(f"  TTFT {mname}: unavailable ({t['unavailable']})")
                continue
            print(f"TTFT {t['prefix']}-token prefix on host, {mname}: load {t['load_s'] * 1e3:.1f} ms, compute "
                  f"{t['compute_s'] * 1e3:.1f} ms (host issue {t['compute_host_s'] * 1e3:.1f} ms), overlapped {t['ttft_s'] * 1e3:.1f} ms; recompute "
                  f"{t['recompute_s'] * 1e3:.1f} ms ({t['speedup_vs_recompute']:.2f}x); first-token logits "
                  f"max diff {t['first_token_logits_max_abs_diff']:.2e}")
            if "graph_compute_s" in t:
                print(f"  as a CUDA graph: compute {t['graph_compute_s'] * 1e3:.1f} ms, load then replay "
                      f"{t['graph_serial_ttft_s'] * 1e3:.1f} ms; first-token logits max diff "
                      f"{t['graph_first_token_logits_max_abs_diff']:.2e}")
            elif "graph_unavailable" in t:
                print(f"  as a CUDA graph: unavailable ({t['graph_unavailable']})")
    if args.json:
        print(json.dumps(results, indent=1))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
