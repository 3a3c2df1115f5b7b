"""Page movers: how a list of (host page, device page) pairs becomes copies.

Why several: the obvious way (index a tensor, copy it) tops out far below the bus for
scattered pages, because each page is many small chunks (one per layer and K/V). The
engines people run solve it with batched copies or a copy kernel; which is best depends on
the GPU, the CUDA version and how much SM time the forward pass can spare, so the executor
takes any of them behind one interface:

- ``torch``: indexed copies (``index_select`` / ``index_copy_``, through a pinned staging
  tensor on GPU). Runs everywhere, CPU included (the CI path).
- ``dma``: ``cudaMemcpyBatchAsync`` (CUDA >= 12.8, through NVIDIA's cuda-python), one batch
  per call, contiguous runs coalesced (``descriptors``). Uses copy engines, no SMs.
- ``kernel``: a Triton gather/scatter kernel that reads and writes pinned host memory through
  its device pointer, on at most ``max_blocks`` thread blocks, so it leaves the forward pass
  most of the GPU.

``make_mover(name)`` builds one; ``dma`` and ``kernel`` import their GPU dependencies lazily
and raise :class:`MoverUnavailableError` when they cannot run. Every mover takes a ``delay``
hook called before each copy it issues (tests use it to make copies slow on purpose: a sleep
on CPU, ``torch.cuda._sleep`` on the copy stream on GPU).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ..errors import MoverUnavailableError
from ..pools import DevicePool, HostPool
from .descriptors import Descriptors, Direction, LayerRuns, build, build_by_layer, coalesce, memmove_all

__all__ = [
    "DelayHook",
    "Descriptors",
    "Direction",
    "LayerIssued",
    "LayerRuns",
    "Mover",
    "TorchMover",
    "build",
    "build_by_layer",
    "coalesce",
    "make_mover",
    "memmove_all",
    "MOVERS",
]

DelayHook = Callable[[Direction, Sequence[int]], None]
"""Called as ``delay(direction, layers)`` right before a mover issues the copies of ``layers``."""

LayerIssued = Callable[[int], None]
"""Called as ``issued(layer)`` once the copies of ``layer`` are issued (on the current stream)."""


class Mover:
    """Copies pages between a host pool and a device pool on the current stream."""

    name = "base"
    gpu_ordered = True
    """True when every copy is enqueued on the current CUDA stream (GPU dependencies can then be
    stream-waited); False when the mover waits on the host between stages."""

    def __init__(self, delay: Optional[DelayHook] = None) -> None:
        self.delay = delay

    def check_pools(self, device: DevicePool, host: HostPool) -> None:
        """Raises ``PoolLayoutError`` when the mover cannot work on these pools."""

    def copy(
        self,
        direction: Direction,
        device: DevicePool,
        host: HostPool,
        dev_pages: np.ndarray,
        host_pages: np.ndarray,
        layers: Sequence[int],
    ) -> None:
        """Moves every component of ``layers`` for each page pair (``LOAD``: host to device)."""
        if len(dev_pages) == 0:
            return
        if self.delay is not None:
            self.delay(direction, layers)
        self._copy(direction, device, host, np.asarray(dev_pages, dtype=np.int64),
                   np.asarray(host_pages, dtype=np.int64), layers)

    def copy_layers(
        self,
        direction: Direction,
        device: DevicePool,
        host: HostPool,
        dev_pages: np.ndarray,
        host_pages: np.ndarray,
        layers: Sequence[int],
        issued: LayerIssued,
    ) -> None:
        """Moves ``layers`` one after another, calling ``issued(l)`` as soon as layer ``l``'s
        copies are issued (what a layer-by-layer load marks, so attention of layer ``l`` can
        start while later layers still cross the bus); ``issued`` is called for every layer,
        also when there are no pages.

        Why not one ``copy`` per layer: the issuing runs on a lane thread beside the forward
        pass, and every Python step it takes between two layers competes with the forward
        pass for the GIL (the H200 run: a turn overlapping an 8K-token load with its compute
        took as long as both one after the other). Movers whose copies need preparation
        (descriptors, an upload) prepare every layer first and then only issue."""
        layers = list(layers)
        if len(dev_pages) == 0:
            for l in layers:
                issued(l)
            return
        self._copy_layers(direction, device, host, np.asarray(dev_pages, dtype=np.int64),
                          np.asarray(host_pages, dtype=np.int64), layers, issued)

    def _copy(self, direction, device, host, dev_pages, host_pages, layers) -> None:  # pragma: no cover
        raise NotImplementedError

    def _copy_layers(self, direction, device, host, dev_pages, host_pages, layers, issued) -> None:
        for l in layers:
            if self.delay is not None:
                self.delay(direction, [l])
            self._copy(direction, device, host, dev_pages, host_pages, [l])
            issued(l)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as bytes (the last dimension times the element size). A page copy moves
    bit patterns, and torch lacks ``index_copy_`` / ``index_select`` for some KV dtypes
    (float8_e4m3fn, float8_e5m2, uint16, uint32 on CPU in torch 2.14): copied in the KV's own
    dtype, every load of an FP8 cache failed and each host hit became a recompute."""
    if t.dtype == torch.uint8 or t.dim() == 0:
        return t
    try:
        return t.view(torch.uint8)
    except RuntimeError:  # a last dimension that is not contiguous: copy in the dtype itself
        return t


class TorchMover(Mover):
    """Indexed copies. On CPU a gather and a scatter per (layer, component); on GPU a CPU gather
    into pinned staging, one upload and a GPU scatter (load), or a GPU gather, one download and
    a CPU scatter after the stream is synchronized (store)."""

    name = "torch"
    gpu_ordered = False

    def _copy(self, direction, device, host, dev_pages, host_pages, layers) -> None:
        h_idx = torch.from_numpy(host_pages)
        dev = device.device
        d_idx = torch.from_numpy(dev_pages).to(dev, non_blocking=False)
        if dev.type != "cuda":
            for l in layers:
                for c in range(device.layout.components):
                    hv, dv = _as_bytes(host.chunks(l, c)), _as_bytes(device.chunks(l, c))
                    if direction == Direction.LOAD:
                        dv.index_copy_(0, d_idx, hv.index_select(0, h_idx))
                    else:
                        hv.index_copy_(0, h_idx, dv.index_select(0, d_idx))
            return
        stream = torch.cuda.current_stream(dev)
        for l in layers:
            for c in range(device.layout.components):
                hv, dv = _as_bytes(host.chunks(l, c)), _as_bytes(device.chunks(l, c))
                if direction == Direction.LOAD:
                    staged = hv.index_select(0, h_idx).pin_memory()
                    dv.index_copy_(0, d_idx, staged.to(dev, non_blocking=True))
                else:
                    g = dv.index_select(0, d_idx)
                    staged = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                    staged.copy_(g, non_blocking=True)
                    stream.synchronize()
                    hv.index_copy_(0, h_idx, staged)


MOVERS = ("torch", "dma", "kernel")


def make_mover(name: str, *, delay: Optional[DelayHook] = None, **kw) -> Mover:
    """``torch``, ``dma`` (``merge=True``) or ``kernel`` (``max_blocks=8``)."""
    if name == "torch":
        return TorchMover(delay=delay, **kw)
    if name == "dma":
        from .dma import DmaMover

        return DmaMover(delay=delay, **kw)
    if name == "kernel":
        from .kernel import KernelMover

        return KernelMover(delay=delay, **kw)
    raise MoverUnavailableError(f"unknown mover {name!r}; one of {', '.join(MOVERS)}")
