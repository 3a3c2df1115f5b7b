"""BackUp of device pages (issue 21 item 4): the scheduler's demotion with L3 backs device
pages up directly; the executor stages them through host pages (one staging pool per L3
lane, ``prefetch_chunk_pages`` pages, so a long BackUp goes chunk by chunk) and follows the
ordering rules for the device pages it reads, proven with copies delayed on purpose (and
shown broken with ``Ordering.UNCHECKED``)."""

import pytest
import torch

import kvtier
from kvtier.engine import KvtierL3Backend
from kvtier.torch import Direction, Executor, ExecutorError, Ordering, TorchMover
from conftest import HandOp
from test_torch_executor import KEYS, dev_page_as_host, dev_page_is, get_l3, held, pools


def test_backup_of_device_pages_stores_their_bytes_chunk_by_chunk():
    dev, host = pools()
    store = kvtier.L3Store.embedded(1 << 22)
    pages = [6, 1, 4, 0, 7]  # more than one staging chunk of 2 pages
    with Executor(dev, host, KvtierL3Backend(store), prefetch_chunk_pages=2) as ex:
        ex.submit([HandOp(1, "BackUp", "device", None, pages, (), KEYS[:5])])
        (ev,) = ex.drain()
        assert ev.success and ex.stats.device_backups == 1 and ex.stats.l3_pages_written == 5
    for key, p in zip(KEYS, pages):
        assert torch.equal(get_l3(store, key), dev_page_as_host(dev, p))
    assert torch.count_nonzero(host.data) == 0  # the host pool was not used as staging


def test_a_bad_device_backup_is_refused_before_anything_starts():
    dev, host = pools()
    with Executor(dev, host, KvtierL3Backend(kvtier.L3Store.embedded(1 << 22))) as ex:
        with pytest.raises(ExecutorError):
            ex.submit([HandOp(1, "BackUp", "device", None, [8], (), KEYS[:1])])  # outside the pool
        with pytest.raises(ExecutorError):
            ex.submit([HandOp(2, "BackUp", "device", None, [1, 2], (), KEYS[:1])])  # keys != pages
        assert ex.in_flight() == 0


@pytest.mark.parametrize("ordering", list(Ordering))
def test_device_backup_waits_for_the_load_back_filling_its_page(ordering):
    dev, host = pools()
    host.data[2] = -5.0
    store = kvtier.L3Store.embedded(1 << 22)
    # the load-back waits until the backup stored its key (UNCHECKED), or HOLD_S
    mover = TorchMover(delay=held(Direction.LOAD, lambda: store.is_exist(KEYS[0])))
    with Executor(dev, host, KvtierL3Backend(store), mover=mover, ordering=ordering) as ex:
        ex.submit([HandOp(1, "LoadBack", "host", "device", [2], [3])])
        ex.submit([HandOp(2, "BackUp", "device", None, [3], (), KEYS[:1])])
        ex.drain()
    stored = get_l3(store, KEYS[0])
    if ordering == Ordering.ENFORCED:
        assert (stored == -5).all()
    else:  # the backup read the device page before the load-back filled it
        assert not (stored == -5).any()


@pytest.mark.parametrize("ordering", list(Ordering))
def test_a_device_page_is_not_overwritten_while_a_backup_still_reads_it(ordering):
    dev, host = pools()
    before = dev_page_as_host(dev, 4)
    host.data[6] = -9.0
    store = kvtier.L3Store.embedded(1 << 22)
    # the backup's staging copy waits until the load-back overwrote its page (UNCHECKED)
    mover = TorchMover(delay=held(Direction.STORE, lambda: dev_page_is(dev, 4, -9.0)))
    with Executor(dev, host, KvtierL3Backend(store), mover=mover, ordering=ordering) as ex:
        ex.submit([HandOp(1, "BackUp", "device", None, [4], (), KEYS[:1])])
        ex.submit([HandOp(2, "LoadBack", "host", "device", [6], [4])])  # the page, released and reused
        ex.drain()
    assert (dev.k(0)[4] == -9).all()
    stored = get_l3(store, KEYS[0])
    if ordering == Ordering.ENFORCED:
        assert torch.equal(stored, before)
    else:
        assert not torch.equal(stored, before)
