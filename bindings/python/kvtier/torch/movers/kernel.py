"""The ``kernel`` mover: a Triton gather/scatter kernel over chunk descriptors.

Why a kernel: a GPU thread can load from and store to pinned host memory through its device
pointer (unified addressing), so one kernel launch moves every scattered chunk at close to
the bus rate with no per-copy cost (issue 11's microbenchmark: 51 to 52 GB/s with 8 thread
blocks for 16- and 64-token pages). The price is SM time taken from the forward pass, hence
``max_blocks``: the kernel runs on at most that many thread blocks, each looping over its
share of the descriptors.

Bytes in flight: a load reads pinned host memory across PCIe, where each read waits about a
microsecond and a half, so the rate is the bytes a launch keeps in flight over that latency.
The first H100 run had 8 blocks of 4 warps each moving a 4 KiB block per step (32 KiB in
flight): 18 to 20 GB/s loading, while stores (posted writes) reached 44 to 48. The CUDA anchor
kernel that loads at 51 GB/s keeps 8 blocks of 1,024 threads x 16 bytes (128 KiB) in flight;
the defaults here match that (16 warps, 2,048-word blocks: 16 KiB per block per step).

The kernel reads ``[n, 3]`` int64 descriptors ``(dst, src, bytes)`` and copies 8-byte words,
so chunk sizes and addresses must be multiples of 8 (checked). It also runs under Triton's
CPU interpreter (``TRITON_INTERPRET=1``) on CPU tensors, which is how CI tests the kernel's
logic without a GPU. The interpreter is not thread-safe (it swaps ``triton.language``'s
functions for the length of a run), so interpreted launches are serialized by a lock; on a GPU
launches from several lanes run at once.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Any, Optional

import numpy as np
import torch

from ..errors import MoverUnavailableError, PoolLayoutError
from . import DelayHook, Mover, build, build_by_layer
from .descriptors import Descriptors

__all__ = ["KernelMover", "interpreted"]


def interpreted() -> bool:
    """True when Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_INTERPRETER_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise MoverUnavailableError("kernel mover: Triton is not installed") from e

    @triton.jit
    def copy_chunks(desc_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        for i in range(pid, n, nprog):
            d = tl.load(desc_ptr + 3 * i).to(tl.pointer_type(tl.int64))
            s = tl.load(desc_ptr + 3 * i + 1).to(tl.pointer_type(tl.int64))
            words = tl.load(desc_ptr + 3 * i + 2) // 8
            for off in range(0, words, BLOCK):
                idx = off + tl.arange(0, BLOCK)
                m = idx < words
                tl.store(d + idx, tl.load(s + idx, mask=m), mask=m)

    return copy_chunks


class KernelMover(Mover):
    """Copies through a Triton kernel on at most ``max_blocks`` thread blocks."""

    name = "kernel"
    gpu_ordered = True

    def __init__(self, delay: Optional[DelayHook] = None, max_blocks: int = 8, block_words: int = 2048,
                 merge: bool = True, num_warps: int = 16) -> None:
        super().__init__(delay)
        if max_blocks <= 0 or block_words <= 0 or block_words & (block_words - 1):
            raise ValueError("max_blocks must be positive and block_words a power of two")
        if num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError("num_warps must be a power of two from 1 to 32")
        self.num_warps = num_warps
        if not interpreted() and not torch.cuda.is_available():
            raise MoverUnavailableError("kernel mover: CUDA is not available to torch")
        self.max_blocks = max_blocks
        self.block_words = block_words
        self.merge = merge
        self.kernel = _kernel()

    def check_pools(self, device, host) -> None:
        if device.layout.chunk_bytes % 8:
            raise PoolLayoutError("kernel mover: chunk bytes must be a multiple of 8")
        ptrs = [host.data.data_ptr()] + [t.data_ptr() for comps in device.tensors for t in comps]
        if any(p % 8 for p in ptrs):
            raise PoolLayoutError("kernel mover: pool tensors must be 8-byte aligned")
        if interpreted():
            return
        if device.device.type != "cuda":
            raise PoolLayoutError("kernel mover: the device pool must be on a CUDA device")
        if not host.pinned:
            raise PoolLayoutError("kernel mover: the host pool must be pinned (the kernel reads it by pointer)")

    def _copy(self, direction, device, host, dev_pages, host_pages, layers) -> None:
        desc = build(direction, device, host, dev_pages, host_pages, layers, merge=self.merge)
        if len(desc):
            self._launch(self._upload(desc, device), len(desc))

    def _copy_layers(self, direction, device, host, dev_pages, host_pages, layers, issued) -> None:
        # every layer's descriptors built and uploaded at once; then one launch per layer
        runs = build_by_layer(direction, device, host, dev_pages, host_pages, layers, merge=self.merge)
        arr = self._upload(runs.desc, device) if len(runs.desc) else None
        for i, l in enumerate(runs.layers):
            if self.delay is not None:
                self.delay(direction, [l])
            a, b = int(runs.starts[i]), int(runs.starts[i + 1])
            if b > a:
                assert arr is not None  # uploaded: there are descriptors
                self._launch(arr[a:b], b - a)
            issued(l)

    @staticmethod
    def _upload(desc: Descriptors, device) -> torch.Tensor:
        """The ``[n, 3]`` descriptor table where the kernel reads it (the device, on a GPU)."""
        arr = torch.from_numpy(np.stack([desc.dsts, desc.srcs, desc.sizes], axis=1).copy())
        if device.device.type == "cuda":
            arr = arr.pin_memory().to(device.device, non_blocking=True)
        return arr

    def _launch(self, arr: torch.Tensor, n: int) -> None:
        grid = (min(n, self.max_blocks),)
        with _INTERPRETER_LOCK if interpreted() else contextlib.nullcontext():
            self.kernel[grid](arr, n, BLOCK=self.block_words, num_warps=self.num_warps)
