"""kvtier.torch's executor on CPU: completion semantics (poll, per-layer waits) and the three
ordering rules, each proven with copies delayed on purpose. Every rule's test also runs with
``Ordering.UNCHECKED`` and must then see the corruption the rule prevents (so the test can
fail)."""

import threading
import time

import numpy as np
import pytest
import torch

import kvtier
from kvtier import LoadBackDone, PrefetchDone
from kvtier.engine import KvtierL3Backend
from kvtier.torch import (
    DevicePool,
    Direction,
    Executor,
    ExecutorError,
    HostPool,
    KVLayout,
    LoadWait,
    Ordering,
    Pinning,
    TorchMover,
)
from conftest import HandOp

LAYERS = 3
LAYOUT = KVLayout.mha(num_layers=LAYERS, kv_heads=2, head_dim=4, page_size=2, dtype=torch.float32)
KEYS = [f"kvtier-test:{i:064x}:0" for i in range(16)]


def pools():
    dev = DevicePool.allocate(LAYOUT, 8)
    for l, comps in enumerate(dev.tensors):
        for c, t in enumerate(comps):
            for p in range(8):
                t[p] = 1000 * (p + 1) + 10 * l + c
    host = HostPool.allocate(LAYOUT, 8, Pinning.PAGEABLE)
    return dev, host


def dev_page_as_host(dev, p):
    """Device page ``p`` in the host (page-first) layout, the bytes an L3 object holds."""
    return torch.stack([torch.stack([dev.k(l)[p], dev.v(l)[p]]) for l in range(LAYERS)])


def dev_page_is(dev, p, value):
    """Every layer's K and V of device page ``p`` hold ``value`` (a copy landed whole)."""
    return all(bool((dev.k(l)[p] == value).all() and (dev.v(l)[p] == value).all())
               for l in range(LAYERS))


def slow(direction_delays):
    """A delay hook: sleeps ``direction_delays[direction]`` seconds before each copy."""
    return lambda d, layers: time.sleep(direction_delays.get(d, 0.0))


# What an ordering rule holds back must stay held however slow the machine is, and what
# ``Ordering.UNCHECKED`` lets through must be seen however slow: a copy is held until the
# racing operation's effect is visible, or for HOLD_S when the rule keeps it from happening.
HOLD_S = 1.5


def until(cond, timeout=HOLD_S):
    """Waits until ``cond()`` holds or ``timeout`` seconds pass; returns whether it held."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def held(direction, cond):
    """A delay hook: copies in ``direction`` wait until ``cond()`` holds (at most HOLD_S)."""
    return lambda d, layers: until(cond) if d == direction else None


class SlowBackend(KvtierL3Backend):
    """kvtier's embedded store, with puts and reads that take ``delay`` seconds (the bytes land
    at the end of the call, as a DMA would)."""

    def __init__(self, store, delay=0.0, put_when=None, read_gate=None):
        super().__init__(store)
        self.delay = delay
        self.put_when = put_when  # a put waits for it (at most HOLD_S), if given
        self.read_gate = read_gate  # a read waits for it to be set (at most 10 s), if given
        self.reading = threading.Event()  # set when a read starts
        self.landed = []

    def put(self, keys, pool, page_ids):
        time.sleep(self.delay)
        if self.put_when is not None:
            until(self.put_when)
        return super().put(keys, pool, page_ids)

    def get_with_query(self, q, offset, pool, page_ids):
        self.reading.set()
        time.sleep(self.delay)
        if self.read_gate is not None:
            self.read_gate.wait(10)
        r = super().get_with_query(q, offset, pool, page_ids)
        self.landed.append(time.monotonic())
        return r


def get_l3(store, key):
    buf = np.zeros(LAYOUT.page_bytes, dtype=np.uint8)
    store.get_into(key, buf)
    return torch.from_numpy(buf).view(torch.float32).view(LAYERS, 2, *LAYOUT.chunk_shape)


class Plan:
    """What ``wait_before_forward`` reads from an ``ExecutionPlan``."""

    def __init__(self, ops, written=()):
        self.ops = ops
        self.prefill = []
        self.decode_table_pages = np.asarray(written, dtype=np.uint32)


# ---- completions --------------------------------------------------------------------------


def test_poll_reports_a_copy_once_and_only_after_it_landed():
    dev, host = pools()
    with Executor(dev, host, mover=TorchMover(delay=slow({Direction.STORE: 0.3}))) as ex:
        ex.submit([HandOp(1, "WriteBack", "device", "host", [2, 4], [0, 1])])
        assert ex.poll() == [] and ex.in_flight() == 1
        assert torch.count_nonzero(host.data) == 0  # nothing landed yet
        evs = ex.poll(require=[1])
        assert [type(e).__name__ for e in evs] == ["WriteBackDone"] and evs[0].success
        assert torch.equal(host.page(0), dev_page_as_host(dev, 2))
        assert torch.equal(host.page(1), dev_page_as_host(dev, 4))
        assert ex.poll() == [] and ex.in_flight() == 0


def test_per_layer_waits_let_layer_0_start_while_later_layers_load():
    dev, host = pools()
    host.data.fill_(-1.0)
    # layers past 0 are held until the test lets them go (10 s at most: a wait for layer 0
    # that waited for them too would then see the last layer landed, and fail)
    later_layers = threading.Event()
    layer_delay = lambda d, layers: later_layers.wait(10) if layers[0] > 0 else None
    with Executor(dev, host, mover=TorchMover(delay=layer_delay)) as ex:
        op = HandOp(1, "LoadBack", "host", "device", [3], [5], before_forward=True)
        ex.submit([op])
        ex.wait_before_forward(Plan([op]), LoadWait.PER_LAYER)
        ex.wait_for_layer(0)
        assert (dev.k(0)[5] == -1).all()  # layer 0 landed
        assert not (dev.k(LAYERS - 1)[5] == -1).any()  # the last layer has not
        later_layers.set()
        for l in range(LAYERS):
            ex.wait_for_layer(l)
        assert (dev.k(LAYERS - 1)[5] == -1).all() and (dev.v(LAYERS - 1)[5] == -1).all()
        assert [type(e) for e in ex.poll(require=[1])] == [LoadBackDone]
        # LoadWait.ALL: the forward waits for the whole load up front
        op2 = HandOp(2, "LoadBack", "host", "device", [4], [6], before_forward=True)
        ex.submit([op2])
        ex.wait_before_forward(Plan([op2]), LoadWait.ALL)
        assert (dev.v(LAYERS - 1)[6] == -1).all()
        ex.poll(require=[2])


def raw(op, **pages):
    """``op`` with page ids exactly as given (``HandOp`` converts them to uint32)."""
    for k, v in pages.items():
        setattr(op, k, v)
    return op


def test_bad_ops_raise_executor_error_and_start_nothing():
    dev, host = pools()
    with Executor(dev, host) as ex:
        good = HandOp(1, "WriteBack", "device", "host", [0], [0])
        bad = [
            HandOp(2, "LoadBack", "host", "device", [0], [8]),  # device page out of range
            HandOp(2, "LoadBack", "device", "host", [0], [0]),  # wrong direction
            HandOp(2, "LoadBack", "host", "device", [0, 1], [0]),  # length mismatch
            HandOp(2, "Prefetch", None, "device", (), [0], KEYS[:1]),  # into device
            HandOp(2, "BackUp", "host", None, [0, 1], (), KEYS[:1]),  # keys vs pages
            HandOp(2, "Teleport"),
            HandOp(1, "L3Query"),  # duplicate id within the batch
            # page ids that are not a flat list of integers (they failed in the start phase,
            # a bare TypeError after `good` was started; floats were truncated)
            raw(HandOp(2, "LoadBack", "host", "device"), src=np.array([[1]]), dst=np.array([[1]])),
            raw(HandOp(2, "LoadBack", "host", "device"), src=[1.7], dst=[1]),
            raw(HandOp(2, "WriteBack", "device", "host"), src=[1], dst=["1"]),
            raw(HandOp(2, "BackUp", "host", None, keys=KEYS[:1]), src=[[0]]),
            # two pages copied onto one page: which one lands is undefined
            HandOp(2, "LoadBack", "host", "device", [1, 2], [3, 3]),
            HandOp(2, "Prefetch", None, "host", (), [4, 4], KEYS[:2]),
            # op ids that are not the scheduler's (unsigned 64-bit integers): accepted, they
            # made every later poll raise, and 2**64 lost the good op's completion for good
            *(HandOp(i, "WriteBack", "device", "host", [1], [1]) for i in ("a", -5, 2**64, 1.5, None, True)),
        ]
        for b in bad:
            with pytest.raises(ExecutorError):
                ex.submit([good, b])
            assert ex.in_flight() == 0 and torch.count_nonzero(host.data) == 0
        ex.submit([good, HandOp(np.uint64(2**64 - 1), "L3Query")])
        assert sorted(e.op for e in ex.drain()) == [1, 2**64 - 1]
    with Executor(dev, host) as ex:  # ids only grow (test_a_plan_applied_again_...): a new executor
        ex.submit([good])
        with pytest.raises(ExecutorError, match="in flight"):
            ex.submit([HandOp(1, "L3Query")])
        assert len(ex.drain()) == 1


# ---- the ordering rules -----------------------------------------------------------------


@pytest.mark.parametrize("ordering", list(Ordering))
def test_backup_never_reads_a_host_page_before_the_write_back_filling_it(ordering):
    dev, host = pools()
    store = kvtier.L3Store.embedded(1 << 22)
    # the write-back waits until the backup stored its key (UNCHECKED), or HOLD_S
    mover = TorchMover(delay=held(Direction.STORE, lambda: store.is_exist(KEYS[0])))
    with Executor(dev, host, KvtierL3Backend(store), mover=mover, ordering=ordering) as ex:
        ex.submit([HandOp(1, "WriteBack", "device", "host", [2], [5])])
        ex.submit([HandOp(2, "BackUp", "host", None, [5], (), KEYS[:1])])
        evs = ex.drain()
        assert all(getattr(e, "success", True) for e in evs)
    stored = get_l3(store, KEYS[0])
    if ordering == Ordering.ENFORCED:
        assert torch.equal(stored, dev_page_as_host(dev, 2))
    else:  # the backup read the page before the write-back filled it
        assert torch.count_nonzero(stored) == 0


@pytest.mark.parametrize("ordering", list(Ordering))
def test_a_device_page_is_not_overwritten_while_a_write_back_still_reads_it(ordering):
    dev, host = pools()
    host.data[6] = -7.0
    before = dev_page_as_host(dev, 3)
    # the write-back waits until the load-back overwrote its page (UNCHECKED), or HOLD_S
    mover = TorchMover(delay=held(Direction.STORE, lambda: dev_page_is(dev, 3, -7.0)))
    with Executor(dev, host, mover=mover, ordering=ordering) as ex:
        # the scheduler released device page 3 (the write-back is its last reader) and reuses it
        ex.submit([HandOp(1, "WriteBack", "device", "host", [3], [1])])
        ex.submit([HandOp(2, "LoadBack", "host", "device", [6], [3])])
        ex.drain()
    assert (dev.k(0)[3] == -7).all()  # the load landed either way
    if ordering == Ordering.ENFORCED:
        assert torch.equal(host.page(1), before)
    else:  # the write-back saved the new page's KV, not the one it was asked to save
        assert (host.page(1) == -7).all()


@pytest.mark.parametrize("ordering", list(Ordering))
def test_a_host_page_is_not_overwritten_while_a_backup_still_reads_it(ordering):
    dev, host = pools()
    host.data[4] = 42.0
    store = kvtier.L3Store.embedded(1 << 22)
    # the backup's put waits until the write-back overwrote the whole page (UNCHECKED; it
    # copies layer by layer, and a put in between reads a torn page), or HOLD_S
    backend = SlowBackend(store, put_when=lambda: torch.equal(host.page(4), dev_page_as_host(dev, 0)))
    with Executor(dev, host, backend, ordering=ordering) as ex:
        ex.submit([HandOp(1, "BackUp", "host", None, [4], (), KEYS[1:2])])
        ex.submit([HandOp(2, "WriteBack", "device", "host", [0], [4])])
        ex.drain()
    stored = get_l3(store, KEYS[1])
    if ordering == Ordering.ENFORCED:
        assert (stored == 42).all()
    else:
        assert torch.equal(stored, dev_page_as_host(dev, 0))


@pytest.mark.parametrize("ordering", list(Ordering))
def test_a_terminated_prefetch_is_reported_after_its_in_flight_reads_landed(ordering):
    dev, host = pools()
    store = kvtier.L3Store.embedded(1 << 22)
    src = np.arange(8 * LAYOUT.page_bytes // 4, dtype=np.float32).view(np.uint8).reshape(8, -1)
    assert (store.batch_put_from(KEYS[:8], [src[i] for i in range(8)]) == 0).all()
    reads = threading.Event()  # the reads are held until the test lets them go
    backend = SlowBackend(store, read_gate=reads)
    with Executor(dev, host, backend, ordering=ordering, prefetch_chunk_pages=2) as ex:
        ex.submit([HandOp(1, "Prefetch", None, "host", (), list(range(8)), KEYS[:8])])
        assert backend.reading.wait(10)  # the first read (pages 0-1) is in flight
        ex.terminate([1])
        # UNCHECKED reports at once; ENFORCED must not while the read is held (HOLD_S)
        evs = []
        until(lambda: bool(evs.extend(ex.poll()) or evs))
        reported = time.monotonic() if evs else None
        reads.set()
        while not evs:
            evs = ex.poll()
            time.sleep(0.001)
        reported = reported or time.monotonic()
        assert len(evs) == 1 and isinstance(evs[0], PrefetchDone)
        completed = evs[0].completed
        ex.drain()
        assert until(lambda: len(backend.landed) > 0, timeout=10)  # the held read landed
        landed = list(backend.landed)
    if ordering == Ordering.ENFORCED:
        assert landed and max(landed) <= reported  # nothing was written after the report
        assert completed == 2 * len(landed) and completed < 8
        got = host.byte_pages()[:completed]
        assert np.array_equal(got, src[:completed])
        assert not host.byte_pages()[completed:].any()  # pages past `completed` untouched
    else:  # reported while the read was still writing into pages the scheduler frees
        assert completed == 0 and max(landed) > reported


def test_probe_runs_on_its_own_lane_next_to_a_slow_prefetch():
    dev, host = pools()
    store = kvtier.L3Store.embedded(1 << 22)
    store.put(KEYS[0], np.zeros(LAYOUT.page_bytes, dtype=np.uint8))
    reads = threading.Event()  # the prefetch's read is held until the probe answered
    backend = SlowBackend(store, read_gate=reads)
    with Executor(dev, host, backend, l3_workers=1) as ex:
        ex.submit([HandOp(1, "Prefetch", None, "host", (), [0], KEYS[:1])])
        ex.submit([HandOp(2, "L3Query", keys=KEYS[:2])])
        evs = ex.poll(require=[2])
        assert backend.landed == [], "the probe waited for the prefetch's read"
        reads.set()
        probe = [e for e in evs if type(e).__name__ == "L3QueryDone"]
        assert probe and probe[0].hit_pages == 1
        assert ex.stats.l3_probes == 1
        ex.drain()


@pytest.mark.parametrize("short", [LAYOUT.page_bytes // 2, 16])
def test_a_prefetch_counts_only_whole_pages_read(short):
    """A key whose object is shorter than a page was reported read: the store answers the
    bytes it read (a size, >= 0) and any code >= 0 counted, so the host page kept stale bytes
    past the object's end and the scheduler mapped it as loaded. Only ``page_bytes`` counts:
    the prefetch stops at the short key (here the second of three)."""
    dev, host = pools()
    store = kvtier.L3Store.embedded(1 << 22)
    page = np.arange(LAYOUT.page_bytes, dtype=np.uint8)
    store.put(KEYS[0], page)
    store.put(KEYS[1], page[:short])
    store.put(KEYS[2], page)
    with Executor(dev, host, KvtierL3Backend(store)) as ex:
        ex.submit([HandOp(1, "Prefetch", None, "host", (), [0, 1, 2], KEYS[:3])])
        evs = ex.drain()
        assert [(type(e).__name__, e.completed) for e in evs] == [("PrefetchDone", 1)]
        assert ex.stats.l3_pages_read == 1
    assert torch.equal(host.data[0].view(-1).view(torch.uint8), torch.from_numpy(page))


def test_a_host_pool_over_the_device_pools_memory_is_refused():
    """An adversarial tester's case (CPU only: there both pools are host memory): device K/V
    views of a buffer the host pool also wraps were accepted, and a LoadBack from host page 5
    into device page 1 rewrote host pages 0 and 1, which no op named."""
    from kvtier.torch import DevicePool, HostPool, KVLayout, PoolLayoutError

    lay = KVLayout.mha(num_layers=1, kv_heads=1, head_dim=4, page_size=2, dtype=torch.float32)
    buf = torch.zeros(8 * 2 * 2 * 4)
    host = HostPool.wrap(lay, buf.view(8, 1, 2, 2, 1, 4))
    k, v = buf[:32].view(4, 2, 1, 4), buf[32:64].view(4, 2, 1, 4)
    dev = DevicePool.wrap(lay, [k], [v])
    with pytest.raises(PoolLayoutError, match="overlap"):
        Executor(dev, host)
    # pools of their own are accepted
    Executor(DevicePool.wrap(lay, [k.clone()], [v.clone()]), host).close()
