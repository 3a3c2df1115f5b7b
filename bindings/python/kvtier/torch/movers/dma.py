"""The ``dma`` mover: ``cudaMemcpyBatchAsync`` over coalesced chunk descriptors.

Why: one ``cudaMemcpyAsync`` per chunk pays a launch per 32 KB (16-token Llama-3-8B pages)
and reaches a fifth of the bus; a batch hands the driver every chunk at once and the copy
engines stream them (issue 11's microbenchmark: 30 to 48 GB/s against 55 contiguous). No SM
is used, so the forward pass is not slowed by the copy itself.

Requirements, checked at construction (``MoverUnavailableError`` otherwise): CUDA available to
torch, NVIDIA's cuda-python (``cuda.bindings.runtime``, or the older ``cuda.cudart``) exposing
``cudaMemcpyBatchAsync``, runtime and driver >= 12.8. The call's return differs by binding
version (12.x: ``(err, failIdx)``, 13.x: ``(err,)``); only the error is used.

Two ways to issue a batch (``DmaMover(issue=...)``):

- ``Issue.RAW`` (the default where it works): the driver's ``cuMemcpyBatchAsync``, looked up with
  ``cuGetProcAddress`` for the driver's ABI and called through ctypes with the descriptor arrays'
  own buffers. cuda-python's wrapper converts every address from a Python list (about 0.6 us a
  descriptor: 38 ms for the 65,536 chunks of 1,024 16-token Llama-3-8B pages, while the bytes
  take 40 ms to cross PCIe), which left the first H100 run CPU-bound at 17 GB/s. The mover
  checks the raw call once at construction (a small copy whose bytes it verifies) and falls
  back to the wrapper if the check fails.
- ``Issue.BINDINGS``: cuda-python's ``cudaMemcpyBatchAsync`` wrapper.

Streams: ``cuMemcpyBatchAsync`` refuses the legacy default stream (``cudaErrorInvalidValue``;
found on the H100: a BackUp of device pages runs on an L3 lane thread, where the current
stream is the default one). The mover then issues on its own side stream, ordered after the
current stream's work and before its later work by events, so the stream-order contract holds.
"""

from __future__ import annotations

import ctypes
import enum
import threading
from typing import Any, Callable, Dict, Optional

import numpy as np
import torch

from ..errors import CopyError, MoverUnavailableError, PoolLayoutError
from . import DelayHook, Direction, Mover, build, build_by_layer
from .descriptors import Descriptors

__all__ = ["DmaMover", "Issue", "RawBatch", "batch_prototype", "batch_attributes", "issue_batch", "load_runtime", "runtime_module"]

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


class Issue(enum.Enum):
    """How the dma mover hands a batch to CUDA (see the module doc)."""

    RAW = "raw"
    BINDINGS = "bindings"


class _PrimaryContext:
    """The driver API needs a current context in the calling thread (the runtime API makes one
    lazily; a lane thread may not have made a runtime call yet): the device's primary context,
    made current once per thread."""

    def __init__(self, drv: Any, device_index: int) -> None:
        self._drv, self._device_index = drv, device_index
        self._thread = threading.local()

    def __call__(self) -> None:
        if getattr(self._thread, "ready", False):
            return
        drv = self._drv
        err, ctx = drv.cuCtxGetCurrent()
        if int(err) != 0 or not int(ctx):
            err, pctx = drv.cuDevicePrimaryCtxRetain(self._device_index)
            if int(err) != 0 or int(drv.cuCtxSetCurrent(pctx)[0]) != 0:
                raise CopyError(f"dma mover: no CUDA context for device {self._device_index} in this thread")
        self._thread.ready = True


def batch_prototype(with_fail_idx: bool) -> Any:
    """The ctypes type of ``cuMemcpyBatchAsync``: ``(dsts, srcs, sizes, count, attrs,
    attrsIdxs, numAttrs, [failIdx,] stream) -> CUresult`` (``failIdx`` before CUDA 13.0)."""
    p = ctypes.c_void_p
    args = [p, p, p, ctypes.c_size_t, p, p, ctypes.c_size_t] + ([p] if with_fail_idx else []) + [p]
    return ctypes.CFUNCTYPE(ctypes.c_int, *args)


class RawBatch:
    """``cuMemcpyBatchAsync`` through ctypes: no per-descriptor Python work.

    The function pointer is requested for the driver's own CUDA version (capped at 13.0), and
    the prototype follows that ABI: 12.8 and 12.9 take a ``failIdx`` pointer before the stream,
    13.x does not. ``attrs`` are the runtime's ``cudaMemcpyAttributes`` objects of
    :func:`batch_attributes` (the runtime struct is the driver's, field for field), passed by
    their bindings' own pointers, so their layout is the bindings' (13.x added a field to the
    memory location)."""

    def __init__(self, fn_addr: int, with_fail_idx: bool, attrs: Dict[Direction, Any],
                 ensure_context: Optional[Callable[[], None]] = None) -> None:
        """``fn_addr``: the address of a function with :func:`batch_prototype`'s signature
        (the driver's, from :meth:`from_driver`; a test's ctypes callback on CPU)."""
        self.with_fail_idx = with_fail_idx
        self._fn: Callable[..., int] = batch_prototype(with_fail_idx)(fn_addr)
        self._attrs = attrs
        self._idx = np.zeros(1, dtype=np.uint64)
        self._fail = np.zeros(1, dtype=np.uint64)
        self._ensure_context = ensure_context or (lambda: None)

    @classmethod
    def from_driver(cls, device_index: int, attrs: Dict[Direction, Any]) -> "RawBatch":
        try:
            from cuda.bindings import driver as drv
        except ImportError as e:
            raise MoverUnavailableError("dma mover: raw issue needs cuda.bindings.driver") from e
        err, version = drv.cuDriverGetVersion()
        if int(err) != 0 or version < MIN_CUDA:
            raise MoverUnavailableError(f"dma mover: driver {version} has no cuMemcpyBatchAsync")
        want = min(version, 13000)
        res = drv.cuGetProcAddress(b"cuMemcpyBatchAsync", want,
                                   drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT)
        if int(res[0]) != 0 or not int(res[1]):
            raise MoverUnavailableError(f"dma mover: cuGetProcAddress(cuMemcpyBatchAsync, {want}): {res!r}")
        return cls(int(res[1]), want < 13000, attrs, _PrimaryContext(drv, device_index))

    def __call__(self, desc: Descriptors, direction: Direction, stream_handle: int) -> None:
        n = len(desc)
        if n == 0:
            return
        self._ensure_context()
        dsts = np.ascontiguousarray(desc.dsts, dtype=np.int64)
        srcs = np.ascontiguousarray(desc.srcs, dtype=np.int64)
        sizes = np.ascontiguousarray(desc.sizes, dtype=np.int64)
        args = [dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, n, self._attrs[direction].getPtr(),
                self._idx.ctypes.data, 1] + ([self._fail.ctypes.data] if self.with_fail_idx else []) + [stream_handle]
        err = self._fn(*args)
        if err != 0:
            raise CopyError(f"cuMemcpyBatchAsync of {n} copies failed: CUresult {err}")


class DmaMover(Mover):
    """Batched copies on the current stream (a side stream when that is the legacy default
    stream). ``merge``: coalesce contiguous runs; ``issue``: see :class:`Issue` (``None``:
    ``RAW`` when its self-check passes, else ``BINDINGS``)."""

    name = "dma"
    gpu_ordered = True

    def __init__(self, delay: Optional[DelayHook] = None, merge: bool = True, issue: Optional[Issue] = None) -> None:
        super().__init__(delay)
        self.rt = load_runtime()
        self.merge = merge
        dev = torch.cuda.current_device()
        self._attrs = {d: batch_attributes(self.rt, d, dev) for d in Direction}
        self._side: Dict[int, torch.cuda.Stream] = {}
        self._side_lock = threading.Lock()
        self._raw: Optional[RawBatch] = None
        self.issue = Issue.BINDINGS
        self.raw_unavailable: Optional[str] = None
        if issue in (None, Issue.RAW):
            try:
                raw = RawBatch.from_driver(dev, self._attrs)
                _self_check(raw, dev)
                self._raw, self.issue = raw, Issue.RAW
            except (MoverUnavailableError, CopyError) as e:
                if issue == Issue.RAW:
                    raise MoverUnavailableError(f"dma mover: raw issue unavailable: {e}") from e
                self.raw_unavailable = str(e)

    def check_pools(self, device, host) -> None:
        if device.device.type != "cuda":
            raise PoolLayoutError("dma mover: the device pool must be on a CUDA device")

    def _copy(self, direction, device, host, dev_pages, host_pages, layers) -> None:
        desc = build(direction, device, host, dev_pages, host_pages, layers, merge=self.merge)
        self._issue_on_current(desc, direction, device)

    def _copy_layers(self, direction, device, host, dev_pages, host_pages, layers, issued) -> None:
        # every layer's descriptors built at once; then one batch per layer
        runs = build_by_layer(direction, device, host, dev_pages, host_pages, layers, merge=self.merge)
        for i, l in enumerate(runs.layers):
            if self.delay is not None:
                self.delay(direction, [l])
            self._issue_on_current(runs.of(i), direction, device)
            issued(l)

    def _issue_on_current(self, desc: Descriptors, direction: Direction, device) -> None:
        stream = torch.cuda.current_stream(device.device)
        if stream.cuda_stream != 0:
            self._issue(desc, direction, stream.cuda_stream)
            return
        # the legacy default stream: cuMemcpyBatchAsync refuses it, so a side stream ordered
        # after the default stream's work and before its later work
        side = self._side_stream(device.device)
        side.wait_stream(stream)
        self._issue(desc, direction, side.cuda_stream)
        stream.wait_stream(side)

    def _issue(self, desc: Descriptors, direction: Direction, handle: int) -> None:
        if self._raw is not None:
            self._raw(desc, direction, handle)
        else:
            issue_batch(self.rt, desc, self._attrs[direction], handle)

    def _side_stream(self, dev: torch.device) -> "torch.cuda.Stream":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        with self._side_lock:
            if idx not in self._side:
                self._side[idx] = torch.cuda.Stream(idx)
            return self._side[idx]


def _self_check(raw: RawBatch, device_index: int) -> None:
    """One raw batch of two scattered 4 KiB copies to the device and back, bytes compared:
    raises :class:`CopyError` if the raw call is refused or moves the wrong bytes."""
    dev = torch.device("cuda", device_index)
    host = torch.arange(4 * 1024, dtype=torch.int32).pin_memory()  # 16 KiB, 4 blocks of 4 KiB
    gpu = torch.zeros(4 * 1024, dtype=torch.int32, device=dev)
    back = torch.zeros(4 * 1024, dtype=torch.int32).pin_memory()
    blk = 4096
    h, g, b = host.data_ptr(), gpu.data_ptr(), back.data_ptr()
    stream = torch.cuda.Stream(dev)
    with torch.cuda.stream(stream):
        raw(Descriptors(np.array([g, g + 2 * blk]), np.array([h + 3 * blk, h + blk]), np.array([blk, blk])),
            Direction.LOAD, stream.cuda_stream)
        raw(Descriptors(np.array([b, b + blk]), np.array([g, g + 2 * blk]), np.array([blk, blk])),
            Direction.STORE, stream.cuda_stream)
    stream.synchronize()
    want = torch.cat([host[3 * 1024:], host[1024:2 * 1024]])
    if not torch.equal(back[:2 * 1024], want):
        raise CopyError("dma mover: the raw cuMemcpyBatchAsync self-check moved the wrong bytes")
