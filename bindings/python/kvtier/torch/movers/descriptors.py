"""Copy descriptors: which bytes go where, for the pointer-based movers.

Why plain arrays of (dst, src, size): ``cudaMemcpyBatchAsync`` takes exactly that, and a copy
kernel reads exactly that; building them is pure arithmetic on pool addresses, so it is
tested on CPU (and executed there with ``memmove``) without a GPU.

Coalescing: chunk i+1 is merged into chunk i when it starts where chunk i ends on both sides.
The scheduler often hands out consecutive pages; with a layer-first host pool, or when both
sides happen to be consecutive, a run of n pages becomes one copy of n chunks, which matters
for small pages (the per-copy cost is what separates 10 GB/s from 50 GB/s with 16-token
pages). Chunks are listed layer-major, then component, then page order as given, so runs
follow the page lists.
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass
from typing import Iterable, List

import numpy as np

from ..pools import DevicePool, HostPool

__all__ = ["Direction", "Descriptors", "LayerRuns", "build", "build_by_layer", "coalesce", "memmove_all"]


class Direction(enum.Enum):
    """``LOAD``: host to device (load-back); ``STORE``: device to host (write-back)."""

    LOAD = "load"
    STORE = "store"


@dataclass
class Descriptors:
    """Parallel int64 arrays: copy i moves ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]``."""

    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray

    def __len__(self) -> int:
        return int(self.sizes.size)

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    def slice(self, start: int, stop: int) -> "Descriptors":
        """Copies ``start`` to ``stop`` (views, no copy of the arrays)."""
        return Descriptors(self.dsts[start:stop], self.srcs[start:stop], self.sizes[start:stop])


@dataclass
class LayerRuns:
    """The descriptors of several layers in one set of arrays, layer ``layers[i]``'s copies at
    ``starts[i]:starts[i + 1]``; no copy spans two layers."""

    desc: Descriptors
    layers: List[int]
    starts: np.ndarray

    def of(self, i: int) -> Descriptors:
        """The copies of ``layers[i]``."""
        return self.desc.slice(int(self.starts[i]), int(self.starts[i + 1]))


def coalesce(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> Descriptors:
    """Merges each copy into its predecessor when both its ends continue the predecessor's."""
    dsts = np.asarray(dsts, dtype=np.int64)
    srcs = np.asarray(srcs, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    if sizes.size <= 1:
        return Descriptors(dsts.copy(), srcs.copy(), sizes.copy())
    cont = (dsts[1:] == dsts[:-1] + sizes[:-1]) & (srcs[1:] == srcs[:-1] + sizes[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    run_sizes = np.add.reduceat(sizes, starts)
    return Descriptors(dsts[starts], srcs[starts], run_sizes)


def build(
    direction: Direction,
    device: DevicePool,
    host: HostPool,
    dev_pages: np.ndarray,
    host_pages: np.ndarray,
    layers: Iterable[int],
    merge: bool = True,
) -> Descriptors:
    """Descriptors moving ``host_pages[i]`` <-> ``dev_pages[i]`` for ``layers`` (every component)."""
    dev_pages = np.asarray(dev_pages, dtype=np.int64)
    host_pages = np.asarray(host_pages, dtype=np.int64)
    if dev_pages.shape != host_pages.shape:
        raise ValueError(f"{dev_pages.size} device pages but {host_pages.size} host pages")
    cb = device.layout.chunk_bytes
    d_parts, h_parts = [], []
    for layer in layers:
        for c in range(device.layout.components):
            d_parts.append(device.chunk_addrs(layer, c, dev_pages))
            h_parts.append(host.chunk_addrs(layer, c, host_pages))
    if not d_parts:
        empty = np.zeros(0, dtype=np.int64)
        return Descriptors(empty, empty.copy(), empty.copy())
    d = np.concatenate(d_parts)
    h = np.concatenate(h_parts)
    sizes = np.full(d.size, cb, dtype=np.int64)
    dsts, srcs = (d, h) if direction == Direction.LOAD else (h, d)
    return coalesce(dsts, srcs, sizes) if merge else Descriptors(dsts, srcs, sizes)


def build_by_layer(
    direction: Direction,
    device: DevicePool,
    host: HostPool,
    dev_pages: np.ndarray,
    host_pages: np.ndarray,
    layers: Iterable[int],
    merge: bool = True,
) -> LayerRuns:
    """:func:`build` for each of ``layers`` (coalesced within a layer only), in one set of
    arrays: a mover prepares every layer of a load at once and then issues layer after layer
    with no Python work between them beyond the issue itself."""
    layers = list(layers)
    parts = [build(direction, device, host, dev_pages, host_pages, [l], merge) for l in layers]
    starts = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=starts[1:])
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return LayerRuns(Descriptors(empty, empty.copy(), empty.copy()), layers, starts)
    desc = Descriptors(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("dsts", "srcs", "sizes")))
    return LayerRuns(desc, layers, starts)


def memmove_all(desc: Descriptors) -> None:
    """Executes descriptors with ``memmove`` (CPU memory only: the reference the tests use)."""
    for d, s, n in zip(desc.dsts.tolist(), desc.srcs.tolist(), desc.sizes.tolist()):
        ctypes.memmove(d, s, n)
