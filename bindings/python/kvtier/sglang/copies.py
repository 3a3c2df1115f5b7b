"""How the radix backend moves pages between SGLang's device KV pool and kvtier's host pool.

Why a choice: a page is many small chunks (``page_size`` rows of every K and V buffer of
every layer), scattered over the device pool. On CPU an index copy per buffer is as good as
anything; on a GPU, index copies stage through pinned memory and top out far below the bus
for scattered pages, so kvtier.torch's movers (``docs/torch.md``) do the GPU copies: ``dma``
(``cudaMemcpyBatchAsync`` on the copy engines) and ``kernel`` (a Triton gather/scatter over
pinned host memory on a few thread blocks).

Why not SGLang's own copy kernels (``sgl_kernel.kvcacheio``): they address a host pool by
token with one stride per layer (HiCache's ``layer_first`` layout, or ``page_first`` with K
and V in two separate pools), and kvtier's host page is one contiguous byte range holding
every buffer of the page, because one page is one L3 object (read and written in place by
the store). kvtier.torch's movers address pages through chunk descriptors, so they copy into
that layout directly.

The host page layout is the same whatever copies it: the ``page_size`` rows of each device
buffer in turn (K of every layer, then V of every layer; MLA: the latent of every layer).

- :class:`IndexCopier` (``"torch"``): index copies, widest word the rows allow; any device.
- :class:`MoverCopier` (``"dma"``, ``"kernel"``): kvtier.torch's movers, which see each
  device buffer as a one-component layer of ``[pages, page_size, row bytes]`` chunks. They
  need every buffer's row to be the same size and a request's pages to be whole device pages
  (SGLang's paged allocator hands out page-aligned runs); a copy that is not is done by index
  copies instead and counted in ``fallbacks``. Each copy ends with the device stream
  synchronized: the host bytes it wrote feed the store, and host slots it read may be
  rewritten by an L3 prefetch right after.

The ``mover`` config key chooses; ``auto`` (the default) picks ``torch`` on CPU and, on a CUDA device, ``kernel`` when Triton is installed
and the pools suit it, else ``torch``.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence

import numpy as np
import torch

from ..torch.errors import MoverUnavailableError, PoolLayoutError
from ..torch.movers import Direction, Mover, make_mover
from ..torch.pools import DevicePool, HostPool, KVLayout
from .config import RadixConfigError

logger = logging.getLogger(__name__)

MOVERS = ("auto", "torch", "dma", "kernel")


class IndexCopier:
    """Index copies (``index_select`` / ``index_copy_``) moving the widest word every row and
    offset is a multiple of (8x fewer elements than bytes for the usual fp16/bf16/fp32 rows)."""

    name = "torch"

    def __init__(self, bufs: Sequence[torch.Tensor], host: torch.Tensor, page_size: int) -> None:
        word = next(w for w in (8, 4, 2, 1) if all(b.shape[1] % w == 0 for b in bufs))
        wdt = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
        self._bufs = [b.view(wdt) for b in bufs]
        self._host_w = host.view(wdt)
        offsets = np.cumsum([0] + [b.shape[1] * page_size for b in bufs]).tolist()
        self._woffsets = [o // word for o in offsets]
        self.page_size = page_size

    def to_host(self, dev_idx: torch.Tensor, slots: List[int]) -> None:
        n, ps = len(slots), self.page_size
        idx = dev_idx.to(torch.int64)
        pages = torch.cat([b.index_select(0, idx.to(b.device)).reshape(n, ps * b.shape[1]) for b in self._bufs], 1)
        self._host_w.index_copy_(0, torch.as_tensor(slots, dtype=torch.int64), pages.to("cpu"))

    def to_device(self, slots: List[int], dev_idx: torch.Tensor) -> None:
        n, ps = len(slots), self.page_size
        pages = self._host_w.index_select(0, torch.as_tensor(slots, dtype=torch.int64))
        for b, lo, hi in zip(self._bufs, self._woffsets, self._woffsets[1:]):
            rows = pages[:, lo:hi].reshape(n * ps, b.shape[1])
            b.index_copy_(0, dev_idx.to(device=b.device, dtype=torch.int64), rows.to(b.device))


class MoverCopier:
    """kvtier.torch's ``mover`` over the device buffers as ``[pages, page_size, row]`` chunks."""

    def __init__(self, mover: Mover, bufs: Sequence[torch.Tensor], host: torch.Tensor, page_size: int) -> None:
        rows = {int(b.shape[1]) for b in bufs}
        if len(rows) != 1:
            raise PoolLayoutError(f"the {mover.name} mover needs one row size for every KV buffer, got {sorted(rows)}")
        row, ps = rows.pop(), page_size
        layout = KVLayout.mla(len(bufs), row, ps, torch.uint8)
        pages = min(int(b.shape[0]) for b in bufs) // ps
        self.device = DevicePool.wrap(layout, [b[: pages * ps].view(pages, ps, row) for b in bufs])
        self.host = HostPool.wrap(layout, host.view(host.shape[0], len(bufs), 1, ps, row))
        mover.check_pools(self.device, self.host)
        self.mover = mover
        self.name = mover.name
        self.page_size = ps
        self._layers = range(len(bufs))
        self._index = IndexCopier(bufs, host, ps)
        self.fallbacks = 0

    def _pages(self, dev_idx: torch.Tensor, n: int) -> Optional[np.ndarray]:
        """The device pages of ``dev_idx`` (``n`` pages' token slots), or None unless each page's
        slots are one whole device page in order."""
        ps = self.page_size
        idx = dev_idx.to("cpu", torch.int64).numpy().reshape(n, ps)
        first = idx[:, 0]
        if (first % ps).any() or (idx != first[:, None] + np.arange(ps)).any():
            return None
        pages = first // ps
        if (pages >= self.device.num_pages).any():
            return None
        return pages

    def _sync(self) -> None:
        if self.device.device.type == "cuda":
            torch.cuda.current_stream(self.device.device).synchronize()

    def _move(self, direction: Direction, dev_idx: torch.Tensor, slots: List[int]) -> None:
        pages = self._pages(dev_idx, len(slots))
        if pages is None:
            self.fallbacks += 1
            if direction == Direction.STORE:
                self._index.to_host(dev_idx, slots)
            else:
                self._index.to_device(slots, dev_idx)
            return
        self.mover.copy(direction, self.device, self.host, pages, np.asarray(slots, np.int64), self._layers)
        self._sync()

    def to_host(self, dev_idx: torch.Tensor, slots: List[int]) -> None:
        self._move(Direction.STORE, dev_idx, slots)

    def to_device(self, slots: List[int], dev_idx: torch.Tensor) -> None:
        self._move(Direction.LOAD, dev_idx, slots)


def make_copier(name: str, bufs: Sequence[torch.Tensor], host: torch.Tensor, page_size: int):
    """The copier ``name`` (one of :data:`MOVERS`, the ``mover`` config key) over SGLang's device ``bufs`` (``[slots,
    row bytes]`` uint8 views) and the host pool ``host`` (``[pages, page bytes]`` uint8).
    A mover named explicitly that cannot run here is a :class:`RadixConfigError`."""
    if name not in MOVERS:
        raise RadixConfigError(f"mover is one of {', '.join(MOVERS)}, got {name!r}")
    on_cuda = any(b.device.type == "cuda" for b in bufs)
    if name == "torch" or (name == "auto" and not on_cuda):
        return IndexCopier(bufs, host, page_size)
    try:
        return MoverCopier(make_mover("kernel" if name == "auto" else name), bufs, host, page_size)
    except (MoverUnavailableError, PoolLayoutError) as e:
        if name != "auto":
            raise RadixConfigError(f"mover {name!r} cannot run here: {e}") from None
        logger.info("kvtier radix backend: index copies (the kernel mover cannot run here: %s)", e)
        return IndexCopier(bufs, host, page_size)
