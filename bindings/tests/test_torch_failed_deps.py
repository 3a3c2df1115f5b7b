"""kvtier.torch's executor when a copy fails: an op that reads pages a failed copy was to fill
must fail too, never pass the stale bytes on (to L3 under the new page's key, or into a device
page) as if they were the page's KV."""

import numpy as np
import pytest
import torch

import kvtier
from kvtier import BackUpDone, LoadBackDone
from kvtier.engine import KvtierL3Backend
from kvtier.torch import DevicePool, Direction, Executor, HostPool, KVLayout, Pinning, TorchMover
from conftest import HandOp

LAYOUT = KVLayout.mha(num_layers=2, kv_heads=2, head_dim=4, page_size=2, dtype=torch.float32)
KEYS = [f"kvtier-test-fail:{i:064x}:0" for i in range(8)]


def pools():
    dev = DevicePool.allocate(LAYOUT, 8)
    for comps in dev.tensors:
        for t in comps:
            t.copy_(torch.arange(8, dtype=torch.float32).view(8, 1, 1, 1).expand_as(t) + 1)
    host = HostPool.allocate(LAYOUT, 8, Pinning.PAGEABLE)
    host.data.fill_(-7.0)  # stale bytes of an earlier page
    return dev, host


def failing(direction):
    """A mover whose copies in ``direction`` raise (a CUDA error, a bad mapping)."""

    def delay(d, layers):
        if d == direction:
            raise RuntimeError("copy failed")

    return TorchMover(delay=delay)


def failing_until_fixed(direction):
    """A mover whose copies in ``direction`` raise until ``fixed.set()``."""
    import threading

    fixed = threading.Event()

    def delay(d, layers):
        if d == direction and not fixed.is_set():
            raise RuntimeError("copy failed")

    return TorchMover(delay=delay), fixed


def by_id(events):
    return {e.op: e for e in events}


@pytest.mark.parametrize("same_batch", [True, False])
def test_a_backup_of_a_host_page_whose_write_back_failed_fails_and_stores_nothing(same_batch):
    dev, host = pools()
    store = kvtier.L3Store.embedded(1 << 22)
    with Executor(dev, host, KvtierL3Backend(store), mover=failing(Direction.STORE)) as ex:
        wb = HandOp(1, "WriteBack", "device", "host", [2], [5])
        bu = HandOp(2, "BackUp", "host", None, [5], (), KEYS[:1])
        if same_batch:
            ex.submit([wb, bu])
            evs = by_id(ex.drain())
        else:  # the write-back failed and was reported before the backup was submitted
            ex.submit([wb])
            evs = by_id(ex.drain())
            ex.submit([bu])
            evs.update(by_id(ex.drain()))
    assert evs[1] == kvtier.WriteBackDone(1, False)
    assert evs[2] == BackUpDone(2, False)
    assert not store.is_exist(KEYS[0]), "the stale host bytes were stored as page 2's KV"


def test_a_device_backup_of_a_page_whose_load_back_failed_fails_and_stores_nothing():
    dev, host = pools()
    store = kvtier.L3Store.embedded(1 << 22)
    with Executor(dev, host, KvtierL3Backend(store), mover=failing(Direction.LOAD)) as ex:
        ex.submit([HandOp(1, "LoadBack", "host", "device", [2], [3]),
                   HandOp(2, "BackUp", "device", None, [3], (), KEYS[:1])])
        evs = by_id(ex.drain())
    assert evs[1] == LoadBackDone(1, False)
    assert evs[2] == BackUpDone(2, False)
    assert not store.is_exist(KEYS[0])


def test_a_load_back_of_a_host_page_whose_write_back_failed_fails():
    dev, host = pools()
    with Executor(dev, host, mover=failing(Direction.STORE)) as ex:
        ex.submit([HandOp(1, "WriteBack", "device", "host", [2], [5]),
                   HandOp(2, "LoadBack", "host", "device", [5], [6])])
        evs = by_id(ex.drain())
    assert evs[1] == kvtier.WriteBackDone(1, False)
    assert evs[2] == LoadBackDone(2, False)


def test_a_later_write_of_the_page_clears_the_failure():
    """Only the page's last writer counts: a write-back that refilled the page after the failed
    one makes it good again."""
    dev, host = pools()
    mover, fixed = failing_until_fixed(Direction.STORE)
    store = kvtier.L3Store.embedded(1 << 22)
    with Executor(dev, host, KvtierL3Backend(store), mover=mover) as ex:
        ex.submit([HandOp(1, "WriteBack", "device", "host", [2], [5])])
        ex.drain()
        fixed.set()
        ex.submit([HandOp(2, "WriteBack", "device", "host", [3], [5]),
                   HandOp(3, "BackUp", "host", None, [5], (), KEYS[:1])])
        evs = by_id(ex.drain())
    assert evs[3] == BackUpDone(3, True)
    assert store.is_exist(KEYS[0])


def test_a_device_page_the_forward_wrote_after_a_failed_load_backs_up():
    """The forward writes its table's pages (untracked copies): a page whose load failed and
    that a later forward wrote holds that forward's KV and is backed up again."""
    dev, host = pools()
    mover, fixed = failing_until_fixed(Direction.LOAD)
    store = kvtier.L3Store.embedded(1 << 22)
    with Executor(dev, host, KvtierL3Backend(store), mover=mover) as ex:
        ex.submit([HandOp(1, "LoadBack", "host", "device", [2], [3])])
        ex.drain()
        fixed.set()

        class Plan:
            ops, prefill, decode_table_pages = [], [], np.asarray([3], dtype=np.uint32)

        ex.wait_before_forward(Plan())
        ex.submit([HandOp(2, "BackUp", "device", None, [3], (), KEYS[:1])])
        evs = by_id(ex.drain())
    assert evs[2] == BackUpDone(2, True)
    assert store.is_exist(KEYS[0])


@pytest.mark.parametrize("keys", ["abc", b"abc", [1, 2, 3], ["k:a", None, "k:c"], None])
def test_l3_ops_whose_keys_are_not_strings_are_refused_before_anything_starts(keys):
    """A string as the keys was split into characters (a BackUp of three pages stored them
    under 'a', 'b' and 'c'); keys that are not strings failed in the L3 worker (or, None, with
    a bare TypeError). ExecutorError now, nothing of the batch started."""
    from kvtier.torch import ExecutorError

    dev, host = pools()
    store = kvtier.L3Store.embedded(1 << 22)
    with Executor(dev, host, KvtierL3Backend(store)) as ex:
        good = HandOp(1, "WriteBack", "device", "host", [0], [0])
        for kind, tier in (("BackUp", "host"), ("Prefetch", None), ("L3Query", None)):
            op = HandOp(2, kind, tier, None if kind != "Prefetch" else "host", [1, 2, 3] if tier else (),
                        [1, 2, 3] if kind == "Prefetch" else ())
            op.keys = keys
            with pytest.raises(ExecutorError, match="keys"):
                ex.submit([good, op])
            assert ex.in_flight() == 0
        assert not store.is_exist("a") and (host.data[0] == -7.0).all()
