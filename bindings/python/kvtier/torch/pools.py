"""KV pools as torch tensors: the device pool in the layout attention kernels read, the host
pool in the layout L3 stores.

Why two layouts: paged attention kernels (FlashInfer, FlashAttention's paged KV, vLLM's and
SGLang's) take one K and one V tensor per layer shaped ``[pages, page_size, kv_heads,
head_dim]`` (MLA models: one latent tensor per layer, ``[pages, page_size, latent_dim]``), so
that is the device layout. The host pool is page-first, ``[pages, layers, K/V, page_size,
...]``: all layers of a page are one contiguous byte range, so one page is one L3 object that
the store reads from and writes into in place (no staging copy, one key per page, as the
scheduler's keys are). Pinned when CUDA is available, so copies to and from the GPU run as
DMA at the bus rate.

The unit every mover moves is a *chunk*: one (page, layer, component) slab of ``page_size x
kv_heads x head_dim`` elements, contiguous on both sides. The pools expose chunk addresses
(``chunk_addrs``) for the pointer-based movers (``dma``, ``kernel``) and chunk views
(``chunks``) for the indexed one (``torch``).

Pools the engine already owns are wrapped (``DevicePool.wrap``, ``HostPool.wrap``), checked
for shape, dtype, device and contiguity; a host pool may also be layer-first (SGLang HiCache's
default), which lets the ``dma`` mover coalesce runs of consecutive pages but cannot back L3
pages (a page is not one byte range).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .errors import PoolLayoutError

__all__ = ["Attention", "HostOrder", "Pinning", "KVLayout", "DevicePool", "HostPool"]


class Attention(enum.Enum):
    """What a layer caches: K and V (``MHA``, GQA included) or one latent (``MLA``)."""

    MHA = "mha"
    MLA = "mla"


class HostOrder(enum.Enum):
    """Host pool dimension order: ``PAGE_FIRST`` ``[pages, layers, comps, ...]`` (one page is
    one byte range: L3 capable) or ``LAYER_FIRST`` ``[layers, comps, pages, ...]``."""

    PAGE_FIRST = "page_first"
    LAYER_FIRST = "layer_first"


class Pinning(enum.Enum):
    """Host memory: ``AUTO`` pins when CUDA is available; ``PINNED``; ``PAGEABLE``."""

    AUTO = "auto"
    PINNED = "pinned"
    PAGEABLE = "pageable"


@dataclass(frozen=True)
class KVLayout:
    """The shape of one model's KV: ``chunk_shape`` is one page of one layer's component."""

    num_layers: int
    page_size: int
    chunk_shape: Tuple[int, ...]
    dtype: torch.dtype
    attention: Attention = Attention.MHA

    @staticmethod
    def mha(num_layers: int, kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype) -> "KVLayout":
        """K and V per layer, ``[pages, page_size, kv_heads, head_dim]`` each."""
        return KVLayout(num_layers, page_size, (page_size, kv_heads, head_dim), dtype, Attention.MHA)

    @staticmethod
    def mla(num_layers: int, latent_dim: int, page_size: int, dtype: torch.dtype) -> "KVLayout":
        """One latent tensor per layer, ``[pages, page_size, latent_dim]``."""
        return KVLayout(num_layers, page_size, (page_size, latent_dim), dtype, Attention.MLA)

    def __post_init__(self) -> None:
        # A float, bool or string dimension (or a dtype given as a string) was accepted and
        # failed later, inside an allocation or a copy, with an untyped error.
        shape = self.chunk_shape if isinstance(self.chunk_shape, (tuple, list)) else None
        if shape is None:
            raise PoolLayoutError(f"layout chunk_shape must be a tuple of dimensions, got {self.chunk_shape!r}")
        dims = [self.num_layers, self.page_size, *shape]
        if any(isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)) or d <= 0 for d in dims):
            raise PoolLayoutError(f"layout dimensions must be positive integers: {self}")
        if not isinstance(self.dtype, torch.dtype):
            raise PoolLayoutError(f"layout dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.attention, Attention):
            raise PoolLayoutError(f"layout attention must be an Attention, got {self.attention!r}")
        object.__setattr__(self, "num_layers", int(self.num_layers))
        object.__setattr__(self, "page_size", int(self.page_size))
        object.__setattr__(self, "chunk_shape", tuple(int(d) for d in shape))
        if self.chunk_shape[0] != self.page_size:
            raise PoolLayoutError("chunk_shape[0] must be the page size")

    @property
    def components(self) -> int:
        """Tensors per layer: 2 (K, V) or 1 (the MLA latent)."""
        return 2 if self.attention == Attention.MHA else 1

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def chunk_numel(self) -> int:
        return int(np.prod(self.chunk_shape))

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one (page, layer, component) chunk."""
        return self.chunk_numel * self.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer and component (one L3 object)."""
        return self.chunk_bytes * self.components * self.num_layers


def _check(t: torch.Tensor, shape: Tuple[int, ...], layout: KVLayout, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise PoolLayoutError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise PoolLayoutError(f"{what}: shape {tuple(t.shape)}, expected {shape}")
    if t.dtype != layout.dtype:
        raise PoolLayoutError(f"{what}: dtype {t.dtype}, expected {layout.dtype}")
    if not t.is_contiguous():
        raise PoolLayoutError(f"{what}: must be contiguous")


def _num_pages(n: Any) -> int:
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or int(n) < 0:
        raise PoolLayoutError(f"num_pages must be a non-negative integer, got {n!r}")
    return int(n)


def _refuse_overlaps(tensors: Sequence[Tuple[str, torch.Tensor]]) -> None:
    """Refuses tensors whose memory overlaps (one tensor as K and V, or as two layers, or
    overlapping slices of one buffer): a copy into one would overwrite the other. Every pool
    tensor is contiguous, so its bytes are one range and the test is exact."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), what) for what, t in tensors)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise PoolLayoutError(f"{a} and {b} overlap in memory: each needs its own pages")


class DevicePool:
    """Per layer, ``components`` tensors of ``[pages, *chunk_shape]`` on one device."""

    def __init__(self, layout: KVLayout, tensors: Sequence[Sequence[torch.Tensor]]) -> None:
        if len(tensors) != layout.num_layers:
            raise PoolLayoutError(f"{len(tensors)} layers given, layout has {layout.num_layers}")
        first = tensors[0][0]
        self.num_pages = int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 0
        shape = (self.num_pages, *layout.chunk_shape)
        self.device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
        for l, comps in enumerate(tensors):
            if len(comps) != layout.components:
                raise PoolLayoutError(f"layer {l}: {len(comps)} tensors, layout needs {layout.components}")
            for c, t in enumerate(comps):
                _check(t, shape, layout, f"device layer {l} component {c}")
                if t.device != self.device:
                    raise PoolLayoutError(f"device layer {l} component {c} is on {t.device}, not {self.device}")
        if self.device.type == "meta":
            raise PoolLayoutError("device pool: meta tensors hold no memory")
        _refuse_overlaps([(f"device layer {l} component {c}", t) for l, comps in enumerate(tensors)
                          for c, t in enumerate(comps)])
        self.layout = layout
        self.tensors: List[Tuple[torch.Tensor, ...]] = [tuple(c) for c in tensors]
        self._base = np.array([[t.data_ptr() for t in comps] for comps in self.tensors], dtype=np.int64)

    @staticmethod
    def allocate(layout: KVLayout, num_pages: int, device: "torch.device | str" = "cpu") -> "DevicePool":
        """Zero-filled pools of ``num_pages`` pages per layer and component."""
        shape = (_num_pages(num_pages), *layout.chunk_shape)
        return DevicePool(
            layout,
            [[torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.components)]
             for _ in range(layout.num_layers)],
        )

    @staticmethod
    def wrap(layout: KVLayout, k: Sequence[torch.Tensor], v: Optional[Sequence[torch.Tensor]] = None) -> "DevicePool":
        """Wraps the engine's own per-layer tensors (``v`` is None for MLA)."""
        if (v is None) != (layout.attention == Attention.MLA):
            raise PoolLayoutError("pass v for MHA layouts and only k (the latent) for MLA")
        if v is not None and len(v) != len(k):
            raise PoolLayoutError(f"{len(k)} K tensors but {len(v)} V tensors")
        return DevicePool(layout, [(kt, vt) for kt, vt in zip(k, v)] if v is not None else [(kt,) for kt in k])

    def k(self, layer: int) -> torch.Tensor:
        return self.tensors[layer][0]

    def v(self, layer: int) -> torch.Tensor:
        if self.layout.attention == Attention.MLA:
            raise PoolLayoutError("an MLA pool has no V tensor")
        return self.tensors[layer][1]

    def chunks(self, layer: int, comp: int) -> torch.Tensor:
        """``[pages, *chunk_shape]`` of one layer's component."""
        return self.tensors[layer][comp]

    def chunk_addrs(self, layer: int, comp: int, pages: np.ndarray) -> np.ndarray:
        """Byte addresses of the chunks of ``pages`` (int64)."""
        return self._base[layer, comp] + pages.astype(np.int64) * self.layout.chunk_bytes


class HostPool:
    """The host tier: one tensor, page-first by default (a page is one contiguous L3 object)."""

    def __init__(self, layout: KVLayout, data: torch.Tensor, order: HostOrder = HostOrder.PAGE_FIRST) -> None:
        if not isinstance(data, torch.Tensor):
            raise PoolLayoutError(f"host pool: expected a torch.Tensor, got {type(data).__name__}")
        if data.device.type != "cpu":
            raise PoolLayoutError(f"host pool must live in CPU memory, not on {data.device}")
        if not isinstance(order, HostOrder):
            # a string compared unequal to HostOrder.PAGE_FIRST and was taken as layer-first
            raise PoolLayoutError(f"host pool order must be a HostOrder, got {order!r}")
        lc = (layout.num_layers, layout.components)
        pages = int(data.shape[0] if order == HostOrder.PAGE_FIRST else data.shape[2]) if data.dim() >= 3 else 0
        shape = (pages, *lc, *layout.chunk_shape) if order == HostOrder.PAGE_FIRST else (*lc, pages, *layout.chunk_shape)
        _check(data, shape, layout, "host pool")
        if data.requires_grad:  # its L3 view (byte_pages, numpy) raised a bare RuntimeError
            raise PoolLayoutError("host pool: requires grad (a parameter?): L3 reads and writes it in place")
        self.layout = layout
        self.data = data
        self.order = order
        self.num_pages = pages
        isz = layout.itemsize
        s = data.stride()
        if order == HostOrder.PAGE_FIRST:
            self._strides = (s[0] * isz, s[1] * isz, s[2] * isz)
        else:
            self._strides = (s[2] * isz, s[0] * isz, s[1] * isz)
        self._base = data.data_ptr()

    @staticmethod
    def allocate(layout: KVLayout, num_pages: int, pinning: Pinning = Pinning.AUTO) -> "HostPool":
        """Zero-filled, page-first; pinned per ``pinning``."""
        shape = (_num_pages(num_pages), layout.num_layers, layout.components, *layout.chunk_shape)
        pin = pinning == Pinning.PINNED or (pinning == Pinning.AUTO and torch.cuda.is_available())
        return HostPool(layout, torch.zeros(shape, dtype=layout.dtype, pin_memory=pin))

    @staticmethod
    def wrap(layout: KVLayout, data: torch.Tensor, order: HostOrder = HostOrder.PAGE_FIRST) -> "HostPool":
        """Wraps the engine's own host tensor (checked; never copied)."""
        return HostPool(layout, data, order)

    @property
    def pinned(self) -> bool:
        return bool(self.data.is_pinned()) if torch.cuda.is_available() else False

    @property
    def page_contiguous(self) -> bool:
        """True when each page is one byte range (what an L3 object needs)."""
        return self.order == HostOrder.PAGE_FIRST

    def chunks(self, layer: int, comp: int) -> torch.Tensor:
        """``[pages, *chunk_shape]`` view of one layer's component (strided when page-first)."""
        return self.data[:, layer, comp] if self.order == HostOrder.PAGE_FIRST else self.data[layer, comp]

    def page(self, page: int) -> torch.Tensor:
        """All layers of one page (page-first pools)."""
        if not self.page_contiguous:
            raise PoolLayoutError("a layer-first host pool has no contiguous page")
        return self.data[page]

    def chunk_addrs(self, layer: int, comp: int, pages: np.ndarray) -> np.ndarray:
        sp, sl, sc = self._strides
        return self._base + layer * sl + comp * sc + pages.astype(np.int64) * sp

    def byte_pages(self) -> np.ndarray:
        """The pool as a numpy ``uint8 [pages, page_bytes]`` view (zero-copy), the buffer the
        L3 store reads pages from and writes pages into."""
        if not self.page_contiguous:
            raise PoolLayoutError("L3 needs a page-first host pool (one page, one object)")
        if self.num_pages == 0:
            return np.zeros((0, self.layout.page_bytes), dtype=np.uint8)
        return self.data.view(self.num_pages, -1).view(torch.uint8).numpy()
