"""The dma mover's raw ``cuMemcpyBatchAsync`` call, on CPU: what crosses the ctypes boundary.

The driver itself only runs on a GPU (test_torch_gpu.py); here the function behind the pointer
is a ctypes callback with the same prototype, which reads every argument back through the raw
pointers it is given, so the marshalling (array buffers, count, attributes, attribute index,
the failIdx slot of the pre-13.0 ABI, the stream) is checked without CUDA."""

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.torch.errors import CopyError
from kvtier.torch.movers import Descriptors, Direction
from kvtier.torch.movers.dma import RawBatch, batch_prototype


class Attr:
    """Stands for cuda-python's attributes object: only its pointer crosses the boundary."""

    def __init__(self, ptr):
        self.ptr = ptr

    def getPtr(self):
        return self.ptr


ATTRS = {Direction.LOAD: Attr(0x1000), Direction.STORE: Attr(0x2000)}


def driver_standin(with_fail_idx, seen, result=0):
    """A callback with the driver's prototype recording what it was given, read through the
    raw pointers (as the driver reads them)."""

    def fn(*args):
        dsts, srcs, sizes, count, attrs, idxs, num_attrs = args[:7]
        read = lambda p: list((ctypes.c_int64 * count).from_address(p))  # noqa: E731
        seen.append({
            "dsts": read(dsts), "srcs": read(srcs), "sizes": read(sizes), "count": count,
            "attrs": attrs, "idx0": ctypes.c_uint64.from_address(idxs).value, "num_attrs": num_attrs,
            "fail_idx": args[7] if with_fail_idx else None, "stream": args[-1] or 0,
        })
        return result

    cb = batch_prototype(with_fail_idx)(fn)
    return cb, ctypes.cast(cb, ctypes.c_void_p).value


addrs = st.integers(min_value=1, max_value=(1 << 62))


@settings(max_examples=60, deadline=None)
@given(
    copies=st.lists(st.tuples(addrs, addrs, st.integers(min_value=1, max_value=1 << 30)), min_size=1, max_size=300),
    with_fail_idx=st.booleans(),
    direction=st.sampled_from(list(Direction)),
    stream=st.integers(min_value=1, max_value=(1 << 62)),
    strided=st.booleans(),
)
def test_raw_call_hands_the_driver_every_descriptor(copies, with_fail_idx, direction, stream, strided):
    seen = []
    cb, addr = driver_standin(with_fail_idx, seen)
    raw = RawBatch(addr, with_fail_idx, ATTRS)
    d, s, n = (np.array(x, dtype=np.int64) for x in zip(*copies))
    if strided:  # views that are not contiguous: the call must still pass what they hold
        d, s, n = (np.repeat(x, 2)[::2] for x in (d, s, n))
    raw(Descriptors(d, s, n), direction, stream)
    assert len(seen) == 1
    got = seen[0]
    assert got["count"] == len(copies)
    assert (got["dsts"], got["srcs"], got["sizes"]) == tuple(list(x) for x in zip(*copies))
    assert got["attrs"] == ATTRS[direction].ptr and got["idx0"] == 0 and got["num_attrs"] == 1
    assert got["stream"] == stream
    assert (got["fail_idx"] is not None) == with_fail_idx


def test_raw_call_reports_the_drivers_error_and_skips_empty_batches():
    seen = []
    cb, addr = driver_standin(False, seen, result=1)  # CUDA_ERROR_INVALID_VALUE
    raw = RawBatch(addr, False, ATTRS)
    empty = np.zeros(0, dtype=np.int64)
    raw(Descriptors(empty, empty, empty), Direction.LOAD, 7)
    assert seen == []
    with pytest.raises(CopyError, match="CUresult 1"):
        raw(Descriptors(np.array([8]), np.array([16]), np.array([4])), Direction.LOAD, 7)
    assert len(seen) == 1
