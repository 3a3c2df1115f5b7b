"""kvtier.torch pools and page movers on CPU: layouts, wrapping, copy descriptors (built and
executed with memmove, coalescing as a property), the torch mover, and the Triton kernel run
by Triton's CPU interpreter."""

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.torch import (
    DevicePool,
    Direction,
    Executor,
    HostOrder,
    HostPool,
    KVLayout,
    MoverUnavailableError,
    Pinning,
    PoolLayoutError,
    TorchMover,
    make_mover,
)
from kvtier.torch.movers import build, build_by_layer, coalesce, memmove_all

import kvtier
from kvtier.engine import KvtierL3Backend


def layouts():
    return [
        KVLayout.mha(num_layers=3, kv_heads=2, head_dim=4, page_size=2, dtype=torch.float32),
        KVLayout.mla(num_layers=2, latent_dim=4, page_size=3, dtype=torch.bfloat16),
    ]


def filled_pools(layout, dev_pages, host_pages, order=HostOrder.PAGE_FIRST, seed=0):
    g = torch.Generator().manual_seed(seed)
    dev = DevicePool.allocate(layout, dev_pages)
    for comps in dev.tensors:
        for t in comps:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    lc = (layout.num_layers, layout.components)
    shape = (host_pages, *lc, *layout.chunk_shape) if order == HostOrder.PAGE_FIRST else (*lc, host_pages, *layout.chunk_shape)
    host = HostPool.wrap(layout, torch.randn(shape, generator=g).to(layout.dtype), order)
    return dev, host


def one_buffer_device_pool(layout, pages, seed=0):
    """A device pool whose layers are views of one ``[layers, components, pages, ...]`` buffer
    (as engines that allocate one KV tensor have): the last chunk of one layer and the first
    of the next touch, so a copy could span two layers."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn((layout.num_layers, layout.components, pages, *layout.chunk_shape), generator=g).to(layout.dtype)
    return DevicePool(layout, [[buf[l][c] for c in range(layout.components)] for l in range(layout.num_layers)])


def layer_state(dev, host, l):
    """Everything of layer ``l``: its device chunks and its host chunks, copied."""
    comps = range(dev.layout.components)
    return [dev.tensors[l][c].clone() for c in comps] + [host.chunks(l, c).clone() for c in comps]


def expected_after(direction, dev, host, dp, hp):
    """What each pool must hold after the copy, computed chunk by chunk."""
    d = [[t.clone() for t in comps] for comps in dev.tensors]
    h = host.data.clone()
    hview = HostPool.wrap(host.layout, h, host.order)
    for l in range(dev.layout.num_layers):
        for c in range(dev.layout.components):
            for a, b in zip(dp.tolist(), hp.tolist()):
                if direction == Direction.LOAD:
                    d[l][c][a] = hview.chunks(l, c)[b]
                else:
                    hview.chunks(l, c)[b] = d[l][c][a]
    return d, h


def assert_pools(dev, host, d, h):
    for l, comps in enumerate(dev.tensors):
        for c, t in enumerate(comps):
            assert torch.equal(t, d[l][c]), (l, c)
    assert torch.equal(host.data, h)


# ---- pools ------------------------------------------------------------------------------


def test_host_page_is_one_contiguous_l3_object():
    lay = layouts()[0]
    host = HostPool.allocate(lay, 5, Pinning.PAGEABLE)
    b = host.byte_pages()
    assert b.shape == (5, lay.page_bytes) and b.dtype == np.uint8
    b[3, :] = 0xFF  # the byte view is the pool itself (zero-copy L3 reads land in the tensor)
    assert torch.isnan(host.page(3)).all() and not torch.isnan(host.page(2)).any()
    assert host.page(3).is_contiguous()


def test_wrap_uses_the_engines_tensors_and_checks_them():
    lay = layouts()[0]
    k = [torch.zeros(4, *lay.chunk_shape) for _ in range(3)]
    v = [torch.zeros(4, *lay.chunk_shape) for _ in range(3)]
    dev = DevicePool.wrap(lay, k, v)
    dev.k(1)[2].fill_(7)
    assert (k[1][2] == 7).all()  # wrapped, not copied
    with pytest.raises(PoolLayoutError, match="shape"):
        DevicePool.wrap(lay, k, [torch.zeros(5, *lay.chunk_shape) for _ in range(3)])
    with pytest.raises(PoolLayoutError, match="dtype"):
        DevicePool.wrap(lay, k, [torch.zeros(4, *lay.chunk_shape, dtype=torch.float16) for _ in range(3)])
    with pytest.raises(PoolLayoutError, match="contiguous"):
        DevicePool.wrap(lay, k, [torch.zeros(*lay.chunk_shape, 4).movedim(-1, 0) for _ in range(3)])
    with pytest.raises(PoolLayoutError, match="layers"):
        DevicePool.wrap(lay, k[:2], v[:2])
    with pytest.raises(PoolLayoutError, match="MLA"):
        DevicePool.wrap(lay, k)
    with pytest.raises(PoolLayoutError, match="positive"):
        KVLayout.mha(0, 2, 4, 2, torch.float32)
    with pytest.raises(PoolLayoutError, match="torch.Tensor"):
        HostPool.wrap(lay, np.zeros(3))


def test_pools_refuse_aliased_tensors_orders_and_sizes_they_cannot_use():
    """Found by an adversarial tester: one tensor as K and V (or two layers, or overlapping
    slices of one buffer) was wrapped and a LoadBack then wrote V over K; a string as the host
    order was taken as layer-first (``== HostOrder.PAGE_FIRST`` failed) and read the pool in
    the wrong layout; meta tensors were accepted; a negative page count raised a bare
    RuntimeError. Each is a PoolLayoutError now."""
    lay = layouts()[0]
    k = [torch.zeros(4, *lay.chunk_shape) for _ in range(3)]
    v = [torch.zeros(4, *lay.chunk_shape) for _ in range(3)]
    with pytest.raises(PoolLayoutError, match="overlap"):
        DevicePool.wrap(lay, k, k)
    with pytest.raises(PoolLayoutError, match="overlap"):
        DevicePool.wrap(lay, [k[0], k[0], k[2]], v)
    buf = torch.zeros(7, *lay.chunk_shape)
    with pytest.raises(PoolLayoutError, match="overlap"):
        DevicePool.wrap(lay, [buf[0:4], k[1], k[2]], [buf[3:7], v[1], v[2]])
    # disjoint slices of one buffer are a pool (one allocation for K and V)
    buf8 = torch.zeros(8, *lay.chunk_shape)
    DevicePool.wrap(lay, [buf8[0:4], k[1], k[2]], [buf8[4:8], v[1], v[2]])
    with pytest.raises(PoolLayoutError, match="meta"):
        DevicePool.wrap(lay, [t.to("meta") for t in k], [t.to("meta") for t in v])
    data = torch.zeros(2, lay.num_layers, lay.components, *lay.chunk_shape)
    for bad in ["page_first", "layer_first", 0, None]:
        with pytest.raises(PoolLayoutError, match="HostOrder"):
            HostPool.wrap(lay, data, bad)
    with pytest.raises(PoolLayoutError, match="CPU memory"):
        HostPool.wrap(lay, data.to("meta"))
    for n in [-1, 1.5, "4", True]:
        with pytest.raises(PoolLayoutError, match="num_pages"):
            DevicePool.allocate(lay, n)
        with pytest.raises(PoolLayoutError, match="num_pages"):
            HostPool.allocate(lay, n)


def test_layer_first_host_pool_cannot_back_l3():
    lay = layouts()[0]
    dev, host = filled_pools(lay, 4, 4, HostOrder.LAYER_FIRST)
    with pytest.raises(PoolLayoutError, match="page-first"):
        host.byte_pages()
    with pytest.raises(PoolLayoutError, match="page-first"):
        Executor(dev, host, KvtierL3Backend(kvtier.L3Store.embedded(1 << 20)))


# ---- descriptors ------------------------------------------------------------------------


def test_coalesce_merges_exactly_the_runs_contiguous_on_both_sides():
    d = coalesce([100, 110, 120, 200, 210], [0, 10, 25, 35, 45], [10, 10, 10, 10, 10])
    # 0-1 contiguous on both; 2 breaks on the source side; 3 breaks on the destination; 3-4 merge
    assert d.dsts.tolist() == [100, 120, 200] and d.srcs.tolist() == [0, 25, 35]
    assert d.sizes.tolist() == [20, 10, 20]


@settings(max_examples=60, deadline=None)
@given(
    which=st.integers(0, 1),
    order=st.sampled_from(list(HostOrder)),
    direction=st.sampled_from(list(Direction)),
    data=st.data(),
)
def test_descriptors_move_exactly_the_listed_pages(which, order, direction, data):
    lay = layouts()[which]
    n_dev, n_host = 9, 11
    n = data.draw(st.integers(0, 8))
    dp = np.asarray(data.draw(st.permutations(range(n_dev)))[:n], dtype=np.int64)
    if data.draw(st.booleans()):  # runs of consecutive pages, as the scheduler often allocates
        start = data.draw(st.integers(0, n_dev - n))
        dp = np.arange(start, start + n, dtype=np.int64)
    hp = np.asarray(data.draw(st.permutations(range(n_host)))[:n], dtype=np.int64)
    if data.draw(st.booleans()):
        start = data.draw(st.integers(0, n_host - n))
        hp = np.arange(start, start + n, dtype=np.int64)
    dev, host = filled_pools(lay, n_dev, n_host, order, seed=n)
    d, h = expected_after(direction, dev, host, dp, hp)
    merged = build(direction, dev, host, dp, hp, range(lay.num_layers))
    plain = build(direction, dev, host, dp, hp, range(lay.num_layers), merge=False)
    assert len(plain) == n * lay.num_layers * lay.components
    assert merged.total_bytes == plain.total_bytes == n * lay.num_layers * lay.components * lay.chunk_bytes
    assert len(merged) <= len(plain)
    memmove_all(merged)
    assert_pools(dev, host, d, h)


@settings(max_examples=60, deadline=None)
@given(
    which=st.integers(0, 1),
    order=st.sampled_from(list(HostOrder)),
    direction=st.sampled_from(list(Direction)),
    one_buffer=st.booleans(),
    data=st.data(),
)
def test_layer_runs_move_each_layer_alone(which, order, direction, one_buffer, data):
    """``build_by_layer``: executing layer i's copies moves exactly layer i's chunks of the
    listed pages, leaving later layers untouched (a load marks layer i done after its
    copies), also where a single copy could have spanned two layers."""
    lay = layouts()[which]
    n_pages = data.draw(st.integers(1, 6))
    n = data.draw(st.integers(0, n_pages))
    dp = np.asarray(data.draw(st.permutations(range(n_pages)))[:n], dtype=np.int64)
    hp = np.asarray(data.draw(st.permutations(range(n_pages)))[:n], dtype=np.int64)
    if data.draw(st.booleans()):  # every page in order: layers touch on both sides
        dp = hp = np.arange(n_pages, dtype=np.int64)
    dev, host = filled_pools(lay, n_pages, n_pages, order, seed=n)
    if one_buffer:
        dev = one_buffer_device_pool(lay, n_pages, seed=n + 1)
    before = [layer_state(dev, host, l) for l in range(lay.num_layers)]
    d, h = expected_after(direction, dev, host, dp, hp)
    want = [layer_state(DevicePool(lay, d), HostPool.wrap(lay, h, host.order), l) for l in range(lay.num_layers)]
    layers = data.draw(st.permutations(range(lay.num_layers)))
    runs = build_by_layer(direction, dev, host, dp, hp, layers)
    assert runs.layers == list(layers) and len(runs.starts) == lay.num_layers + 1
    assert runs.desc.total_bytes == build(direction, dev, host, dp, hp, range(lay.num_layers)).total_bytes
    done = set()
    for i, l in enumerate(layers):
        memmove_all(runs.of(i))
        done.add(l)
        for k in range(lay.num_layers):
            got = layer_state(dev, host, k)
            ref = want[k] if k in done else before[k]
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), (l, k)


def test_layer_runs_split_a_copy_that_would_span_layers():
    """Every page in order, a layer-first host and a one-buffer device pool: ``build`` makes
    one copy of everything; ``build_by_layer`` one per layer."""
    lay = layouts()[0]
    _, host = filled_pools(lay, 4, 4, HostOrder.LAYER_FIRST)
    dev = one_buffer_device_pool(lay, 4)
    pages = np.arange(4)
    assert len(build(Direction.LOAD, dev, host, pages, pages, range(lay.num_layers))) == 1
    runs = build_by_layer(Direction.LOAD, dev, host, pages, pages, range(lay.num_layers))
    assert [len(runs.of(i)) for i in range(lay.num_layers)] == [1] * lay.num_layers
    assert set(runs.desc.sizes.tolist()) == {lay.components * 4 * lay.chunk_bytes}


def test_layer_first_host_with_consecutive_pages_coalesces_to_one_copy_per_chunk_column():
    lay = layouts()[0]
    dev, host = filled_pools(lay, 16, 16, HostOrder.LAYER_FIRST)
    dp, hp = np.arange(3, 11), np.arange(5, 13)
    desc = build(Direction.LOAD, dev, host, dp, hp, range(lay.num_layers))
    assert len(desc) == lay.num_layers * lay.components  # 8 pages each: one copy per (layer, K/V)
    assert set(desc.sizes.tolist()) == {8 * lay.chunk_bytes}
    # page-first hosts interleave layers inside a page: runs of pages never merge there
    dev2, host2 = filled_pools(lay, 16, 16, HostOrder.PAGE_FIRST)
    assert len(build(Direction.LOAD, dev2, host2, dp, hp, range(lay.num_layers))) == 8 * lay.num_layers * 2


# ---- movers -----------------------------------------------------------------------------


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("direction", list(Direction))
def test_torch_mover_moves_scattered_pages(which, direction):
    lay = layouts()[which]
    dev, host = filled_pools(lay, 10, 12, seed=3)
    dp, hp = np.array([7, 0, 3, 9]), np.array([2, 11, 5, 6])
    d, h = expected_after(direction, dev, host, dp, hp)
    TorchMover().copy(direction, dev, host, dp, hp, range(lay.num_layers))
    assert_pools(dev, host, d, h)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32,
                                   torch.bfloat16, torch.float16])
@pytest.mark.parametrize("direction", list(Direction))
def test_kv_of_any_dtype_moves_as_bytes(dtype, direction):
    """An adversarial tester's case: FP8 (and uint16 / uint32) layouts, pools and an Executor
    were all accepted, and then every LoadBack ended ``LoadBackDone(success=False)`` with no
    byte moved: torch has no CPU ``index_copy_`` for these dtypes, so every host hit of an
    FP8 cache became a recompute. The torch mover copies bytes; the named pages' bytes land
    exactly, the others are untouched."""
    from types import SimpleNamespace as NS

    from kvtier.torch.executor import Executor

    lay = KVLayout.mha(num_layers=2, kv_heads=2, head_dim=4, page_size=4, dtype=dtype)
    dev, host = DevicePool.allocate(lay, 8), HostPool.allocate(lay, 8)
    g = torch.Generator().manual_seed(5)

    def noise(t):
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))

    for comps in dev.tensors:
        for t in comps:
            noise(t)
    noise(host.data)
    dp, hp = np.array([5, 0, 3]), np.array([2, 7, 4])
    chunks = [(l, c) for l in range(lay.num_layers) for c in range(lay.components)]
    dev_before = {lc: dev.chunks(*lc).view(torch.uint8).clone() for lc in chunks}
    host_before = {lc: host.chunks(*lc).view(torch.uint8).clone() for lc in chunks}
    if direction == Direction.LOAD:  # through the executor, as an engine's LoadBack runs
        ex = Executor(dev, host)
        try:
            ex.submit([NS(id=1, kind="LoadBack", src_tier="host", dst_tier="device", src=hp, dst=dp,
                          keys=[], req=1, before_forward=True)])
            evs = []
            for _ in range(500):
                evs += ex.poll()
                if evs:
                    break
                time.sleep(0.01)
            assert evs == [kvtier.LoadBackDone(1, True)], evs
        finally:
            ex.close()
    else:
        TorchMover().copy(direction, dev, host, dp, hp, range(lay.num_layers))
    for lc in chunks:
        d, h = dev.chunks(*lc).view(torch.uint8), host.chunks(*lc).view(torch.uint8)
        want_d, want_h = dev_before[lc].clone(), host_before[lc].clone()
        for a, b in zip(dp, hp):
            if direction == Direction.LOAD:
                want_d[a] = host_before[lc][b]
            else:
                want_h[b] = dev_before[lc][a]
        assert torch.equal(d, want_d) and torch.equal(h, want_h), (dtype, lc)


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("direction", list(Direction))
def test_copy_layers_reports_each_layer_once_its_bytes_moved(which, direction):
    """``Mover.copy_layers`` (the executor's load path): ``issued(l)`` comes once per layer, in
    order, after the delay hook of that layer and after its bytes landed (on CPU the copy is
    done when issued), before any later layer moved."""
    lay = layouts()[which]
    dev, host = filled_pools(lay, 10, 12, seed=4)
    dp, hp = np.array([7, 0, 3, 9]), np.array([2, 11, 5, 6])
    before = [layer_state(dev, host, l) for l in range(lay.num_layers)]
    d, h = expected_after(direction, dev, host, dp, hp)
    want = [layer_state(DevicePool(lay, d), HostPool.wrap(lay, h), l) for l in range(lay.num_layers)]
    events = []

    def issued(l):
        events.append(("issued", l))
        for k in range(lay.num_layers):
            ref = want[k] if k <= l else before[k]
            assert all(torch.equal(a, b) for a, b in zip(layer_state(dev, host, k), ref)), (l, k)

    m = TorchMover(delay=lambda direction, layers: events.append(("delay", *layers)))
    m.copy_layers(direction, dev, host, dp, hp, range(lay.num_layers), issued)
    assert events == [e for l in range(lay.num_layers) for e in (("delay", l), ("issued", l))]
    events.clear()
    m.copy_layers(direction, dev, host, np.array([], np.int64), np.array([], np.int64), range(lay.num_layers),
                  lambda l: events.append(("issued", l)))
    assert events == [("issued", l) for l in range(lay.num_layers)]  # no pages: no copy, every layer marked


def test_gpu_movers_raise_a_typed_error_where_they_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the GPU tests cover dma and kernel")
    with pytest.raises(MoverUnavailableError, match="CUDA"):
        make_mover("dma")
    with pytest.raises(MoverUnavailableError, match="CUDA"):
        make_mover("kernel")
    with pytest.raises(MoverUnavailableError, match="unknown mover"):
        make_mover("rdma")


def test_dma_batches_reach_the_cuda_runtime_through_the_real_cuda_python():
    """The dma mover's call into cuda-python (torch's own dependency, so CI has it) with real
    descriptors: every argument is accepted (a wrong type would raise TypeError before the
    call) and, with no driver here, the runtime's refusal comes back as a CopyError."""
    from kvtier.torch import CopyError
    from kvtier.torch.movers.dma import batch_attributes, issue_batch, runtime_module

    rt = runtime_module()
    lay = layouts()[0]
    dev, host = filled_pools(lay, 10, 12)
    desc = build(Direction.LOAD, dev, host, np.array([1, 2, 7]), np.array([3, 4, 0]), range(lay.num_layers))
    assert len(desc) > 0
    host_t, dev_t = rt.cudaMemLocationType.cudaMemLocationTypeHost, rt.cudaMemLocationType.cudaMemLocationTypeDevice
    load, store = batch_attributes(rt, Direction.LOAD, 0), batch_attributes(rt, Direction.STORE, 0)
    assert (load.srcLocHint.type, load.dstLocHint.type) == (host_t, dev_t)
    assert (store.srcLocHint.type, store.dstLocHint.type) == (dev_t, host_t)
    assert load.srcAccessOrder == rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    issue_batch(rt, build(Direction.LOAD, dev, host, np.array([], np.int64), np.array([], np.int64), [0]), load, 0)
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: test_torch_gpu.py runs real batches")
    before = [t.clone() for comps in dev.tensors for t in comps]
    with pytest.raises(CopyError, match="cudaError"):
        issue_batch(rt, desc, load, 0)
    assert all(torch.equal(a, b) for a, b in zip(before, (t for comps in dev.tensors for t in comps)))


KERNEL_SCRIPT = textwrap.dedent(
    """
    import numpy as np, torch
    from kvtier.torch import DevicePool, Direction, HostPool, make_mover
    from test_torch_pools_movers import layouts, filled_pools, expected_after, assert_pools
    for which in (0, 1):
        lay = layouts()[which]
        for direction in Direction:
            dev, host = filled_pools(lay, 10, 12, seed=5)
            dp, hp = np.array([7, 0, 3, 9, 4]), np.array([2, 11, 5, 6, 7])
            d, h = expected_after(direction, dev, host, dp, hp)
            m = make_mover("kernel", max_blocks=2, block_words=4)  # more chunks than blocks, several words each
            m.check_pools(dev, host)
            m.copy(direction, dev, host, dp, hp, range(lay.num_layers))
            assert_pools(dev, host, d, h)
    # two lanes launching at once (the executor's load and store lanes do): the interpreter is
    # not thread-safe, the mover serializes its launches; both copies must land
    import sys, threading
    sys.setswitchinterval(1e-6)  # switch threads often, so the launches interleave
    lay = layouts()[0]
    dev, host = filled_pools(lay, 10, 12, seed=6)
    jobs = [(Direction.LOAD, np.array([1, 2, 3]), np.array([4, 5, 6])),
            (Direction.STORE, np.array([7, 8, 9]), np.array([0, 10, 11]))]
    d, h = expected_after(jobs[0][0], dev, host, jobs[0][1], jobs[0][2])
    d, h = expected_after(jobs[1][0], DevicePool(lay, d), HostPool.wrap(lay, h), jobs[1][1], jobs[1][2])
    m = make_mover("kernel", max_blocks=2, block_words=4)
    errors = []
    def run(job):
        try:
            for _ in range(10):
                m.copy(job[0], dev, host, job[1], job[2], range(lay.num_layers))
        except BaseException as e:
            errors.append(e)
    threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    assert_pools(dev, host, d, h)
    # copy_layers: one upload, one launch per layer; after issued(l) layer l has landed (the
    # interpreter runs a launch to completion) and no later layer has, also where one copy
    # could have spanned layers (a one-buffer device pool, every page in order)
    from test_torch_pools_movers import one_buffer_device_pool, layer_state
    from kvtier.torch import HostOrder
    for which in (0, 1):
        lay = layouts()[which]
        for direction in Direction:
            _, host = filled_pools(lay, 4, 4, HostOrder.LAYER_FIRST, seed=7)
            dev = one_buffer_device_pool(lay, 4, seed=8)
            pages = np.arange(4)
            before = [layer_state(dev, host, l) for l in range(lay.num_layers)]
            d, h = expected_after(direction, dev, host, pages, pages)
            want = [layer_state(DevicePool(lay, d), HostPool.wrap(lay, h, HostOrder.LAYER_FIRST), l)
                    for l in range(lay.num_layers)]
            seen = []
            def issued(l):
                seen.append(l)
                for k in range(lay.num_layers):
                    ref = want[k] if k <= l else before[k]
                    assert all(torch.equal(a, b) for a, b in zip(layer_state(dev, host, k), ref)), (l, k)
            km = make_mover("kernel", max_blocks=2, block_words=4)
            uploads = []
            real_upload = km._upload
            km._upload = lambda desc, device: uploads.append(len(desc)) or real_upload(desc, device)
            km.copy_layers(direction, dev, host, pages, pages, range(lay.num_layers), issued)
            assert seen == list(range(lay.num_layers))
            assert uploads == [lay.num_layers], uploads  # every layer's descriptors uploaded once, up front
    from kvtier.torch import KVLayout, PoolLayoutError
    odd = KVLayout.mla(num_layers=1, latent_dim=3, page_size=3, dtype=torch.bfloat16)  # 18-byte chunks
    dev, host = filled_pools(odd, 2, 2)
    try:
        make_mover("kernel").check_pools(dev, host)
        raise SystemExit("18-byte chunks accepted")
    except PoolLayoutError:
        pass
    print("kernel ok")
    """
)


def test_triton_kernel_mover_under_the_cpu_interpreter():
    """The kernel mover's Triton kernel itself, run by Triton's interpreter on CPU tensors."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.path.dirname(__file__))
    p = subprocess.run([sys.executable, "-c", KERNEL_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and "kernel ok" in p.stdout, p.stderr[-3000:]
