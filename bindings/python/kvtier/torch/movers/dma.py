"""The ``dma`` mover: ``cudaMemcpyBatchAsync`` over coalesced chunk descriptors.

Why: one ``cudaMemcpyAsync`` per chunk pays a launch per 32 KB (16-token Llama-3-8B pages)
and reaches a fifth of the bus; a batch hands the driver every chunk at once and the copy
engines stream them (issue 11's microbenchmark: 30 to 48 GB/s against 55 contiguous). No SM
is used, so the forward pass is not slowed by the copy itself.

Requirements, checked at construction (``MoverUnavailableError`` otherwise): CUDA available to
torch, NVIDIA's cuda-python (``cuda.bindings.runtime``, or the older ``cuda.cudart``) exposing
``cudaMemcpyBatchAsync``, runtime and driver >= 12.8. The call's return differs by binding
version (12.x: ``(err, failIdx)``, 13.x: ``(err,)``); only the error is used.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import CopyError, MoverUnavailableError, PoolLayoutError
from . import DelayHook, Direction, Mover, build
from .descriptors import Descriptors

__all__ = ["DmaMover", "batch_attributes", "issue_batch", "load_runtime", "runtime_module"]

MIN_CUDA = 12080


def runtime_module() -> Any:
    """cuda-python's runtime module, if it has ``cudaMemcpyBatchAsync`` (no GPU needed)."""
    try:
        from cuda.bindings import runtime as rt  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart as rt  # type: ignore[no-redef]  # older cuda-python
        except ImportError as e:
            raise MoverUnavailableError("dma mover: cuda-python is not installed (pip install cuda-python)") from e
    if not hasattr(rt, "cudaMemcpyBatchAsync"):
        raise MoverUnavailableError("dma mover: this cuda-python has no cudaMemcpyBatchAsync (needs >= 12.8)")
    return rt


def load_runtime() -> Any:
    """cuda-python's runtime module, if it can batch copies here (CUDA >= 12.8 on a GPU)."""
    if not torch.cuda.is_available():
        raise MoverUnavailableError("dma mover: CUDA is not available to torch")
    rt = runtime_module()
    err, rtv = rt.cudaRuntimeGetVersion()
    err2, drv = rt.cudaDriverGetVersion()
    if int(err) != 0 or int(err2) != 0 or rtv < MIN_CUDA or drv < MIN_CUDA:
        raise MoverUnavailableError(f"dma mover: CUDA runtime {rtv} / driver {drv}, needs >= {MIN_CUDA}")
    return rt


def batch_attributes(rt: Any, direction: Direction, device_index: int) -> Any:
    """The one ``cudaMemcpyAttributes`` of a batch: stream-ordered source access (the source
    may be written by earlier work on the stream), locality hints for the direction, and the
    hint to overlap with compute."""
    a = rt.cudaMemcpyAttributes()
    a.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    a.flags = rt.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
    host_loc, dev_loc = rt.cudaMemLocation(), rt.cudaMemLocation()
    host_loc.type = rt.cudaMemLocationType.cudaMemLocationTypeHost
    dev_loc.type = rt.cudaMemLocationType.cudaMemLocationTypeDevice
    dev_loc.id = device_index
    a.srcLocHint, a.dstLocHint = (host_loc, dev_loc) if direction == Direction.LOAD else (dev_loc, host_loc)
    return a


def issue_batch(rt: Any, desc: Descriptors, attrs: Any, stream_handle: int) -> None:
    """Enqueues every descriptor as one ``cudaMemcpyBatchAsync`` on the stream; raises
    :class:`CopyError` with the runtime's code when it refuses."""
    if len(desc) == 0:
        return
    res = rt.cudaMemcpyBatchAsync(
        desc.dsts.tolist(), desc.srcs.tolist(), desc.sizes.tolist(), len(desc),
        [attrs], [0], 1, rt.cudaStream_t(stream_handle),
    )
    err = res[0] if isinstance(res, tuple) else res
    if int(err) != 0:
        raise CopyError(f"cudaMemcpyBatchAsync of {len(desc)} copies failed: {err!r}")


class DmaMover(Mover):
    """Batched copies on the current stream. ``merge``: coalesce contiguous runs."""

    name = "dma"
    gpu_ordered = True

    def __init__(self, delay: Optional[DelayHook] = None, merge: bool = True) -> None:
        super().__init__(delay)
        self.rt = load_runtime()
        self.merge = merge
        dev = torch.cuda.current_device()
        self._attrs = {d: batch_attributes(self.rt, d, dev) for d in Direction}

    def check_pools(self, device, host) -> None:
        if device.device.type != "cuda":
            raise PoolLayoutError("dma mover: the device pool must be on a CUDA device")

    def _copy(self, direction, device, host, dev_pages, host_pages, layers) -> None:
        desc = build(direction, device, host, dev_pages, host_pages, layers, merge=self.merge)
        stream = torch.cuda.current_stream(device.device)
        issue_batch(self.rt, desc, self._attrs[direction], stream.cuda_stream)
