"""kvtier.torch's constructors on bad input: a layout, pools or executor arguments of the
wrong type are a typed error (PoolLayoutError / ValueError) where they are given, not an
AttributeError or TypeError from deep inside, or a layout accepted and failing later."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.torch import DevicePool, Executor, HostPool, KVLayout, Pinning, PoolLayoutError
from kvtier.torch.pools import Attention

LAYOUT = KVLayout.mha(num_layers=2, kv_heads=2, head_dim=4, page_size=2, dtype=torch.float32)

BAD_DIMS = st.one_of(st.floats(allow_nan=True), st.booleans(), st.text(max_size=3), st.none(),
                     st.integers(max_value=0))


@settings(max_examples=60, deadline=None)
@given(which=st.integers(0, 3), bad=BAD_DIMS)
def test_a_layout_with_a_dimension_that_is_not_a_positive_integer_is_refused(which, bad):
    dims = [2, 2, 4, 2]  # layers, kv_heads, head_dim, page_size
    dims[which] = bad
    with pytest.raises(PoolLayoutError):
        KVLayout.mha(*dims, dtype=torch.float32)
    if which != 1:  # an MLA layout has no KV heads
        with pytest.raises(PoolLayoutError):
            KVLayout.mla(dims[0], dims[2], dims[3], torch.float32)


@pytest.mark.parametrize("dtype", ["float16", np.float16, None, 2])
def test_a_layout_whose_dtype_is_not_a_torch_dtype_is_refused(dtype):
    with pytest.raises(PoolLayoutError, match="dtype"):
        KVLayout.mha(2, 2, 4, 2, dtype)


def test_numpy_integer_dimensions_are_dimensions():
    lay = KVLayout.mha(np.int64(2), np.int32(2), np.uint8(4), np.int16(2), torch.float32)
    assert lay == LAYOUT and lay.page_bytes == LAYOUT.page_bytes
    assert KVLayout(2, 2, (2, 16), torch.bfloat16, Attention.MLA).components == 1
    with pytest.raises(PoolLayoutError, match="attention"):
        KVLayout(2, 2, (2, 16), torch.bfloat16, "mla")


def test_executor_refuses_swapped_or_foreign_pools_and_bad_sizes():
    dev = DevicePool.allocate(LAYOUT, 4)
    host = HostPool.allocate(LAYOUT, 4, Pinning.PAGEABLE)
    with pytest.raises(PoolLayoutError, match="DevicePool"):
        Executor(host, dev)  # AttributeError before
    with pytest.raises(PoolLayoutError, match="HostPool"):
        Executor(dev, dev)
    with pytest.raises(PoolLayoutError, match="DevicePool"):
        Executor(dev.tensors, host)
    for bad in ["2", 1.5, None, True, 0]:
        with pytest.raises(ValueError, match="positive integers"):
            Executor(dev, host, l3_workers=bad)
        with pytest.raises(ValueError, match="positive integers"):
            Executor(dev, host, prefetch_chunk_pages=bad)


def test_a_plan_applied_again_after_its_ops_completed_is_refused():
    """The scheduler numbers ops from one counter and every plan's ops come after the last
    plan's, so an id not above every id already submitted is a plan applied twice: its
    LoadBack ran again into a device page the scheduler had since given to another request,
    overwriting that request's KV with no error."""
    from conftest import HandOp
    from kvtier.torch import ExecutorError

    dev = DevicePool.allocate(LAYOUT, 4)
    host = HostPool.allocate(LAYOUT, 4, Pinning.PAGEABLE)
    host.data[1] = 5.0
    with Executor(dev, host) as ex:
        plan = [HandOp(7, "LoadBack", "host", "device", [1], [2])]
        ex.submit(plan)
        ex.drain()
        dev.k(0)[2] = -1.0  # page 2 reused: another request's KV
        for again in (plan, [HandOp(3, "WriteBack", "device", "host", [0], [0])]):
            with pytest.raises(ExecutorError, match="already submitted"):
                ex.submit(again)
        assert ex.in_flight() == 0 and (dev.k(0)[2] == -1.0).all()
        ex.submit([HandOp(8, "LoadBack", "host", "device", [1], [3])])  # the next plan's ops run
        ex.drain()
        assert (dev.k(0)[3] == 5.0).all()


def test_a_host_pool_that_requires_grad_is_refused():
    """A parameter (or any tensor that requires grad) as the host pool: its L3 view
    (``byte_pages``, through numpy) raised a bare RuntimeError when the executor was built."""
    data = torch.zeros(4, 2, 2, *LAYOUT.chunk_shape, requires_grad=True)
    with pytest.raises(PoolLayoutError, match="grad"):
        HostPool.wrap(LAYOUT, data)


@pytest.mark.parametrize("bad", [["x"], [1.5], [None], [True], 5, "12", [-1], [1 << 64]])
def test_op_ids_given_to_terminate_or_poll_that_are_not_ids_are_typed_errors(bad):
    """``terminate`` and ``poll(require=)`` took ``int(i)`` of whatever they were given: a
    bare ValueError or TypeError (``"x"``, ``None``, a lone int), a float truncated to
    another op's id (1.5 → op 1), and a string of digits iterated as one id per character."""
    from conftest import HandOp
    from kvtier.torch import ExecutorError

    with Executor(DevicePool.allocate(LAYOUT, 4), HostPool.allocate(LAYOUT, 4, Pinning.PAGEABLE)) as ex:
        ex.submit([HandOp(1, "LoadBack", "host", "device", [1], [2])])
        with pytest.raises(ExecutorError, match="op id"):
            ex.terminate(bad)
        with pytest.raises(ExecutorError, match="op id"):
            ex.poll(require=bad)
        ex.terminate([np.int64(1)])  # a numpy integer is an id
        assert [e.op for e in ex.drain()] == [1]
