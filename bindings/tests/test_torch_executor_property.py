"""kvtier.torch's executor, property: whatever the ops, batches and delays, running them on
the executor's lanes (loads, stores, L3 workers, all concurrent) leaves the pools and L3 as
running them one after another in submission order would, as the ordering rules promise.

A prefetch may read fewer pages than its keys (a key whose BackUp has not landed yet is a
miss: backups and prefetches are ordered through pages, not keys); what it reports as read
must hold the bytes stored under those keys, and the pages it did not read are left as
undefined (the scheduler frees them)."""

import random
import time

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier import BackUpDone, PrefetchDone
from kvtier.engine import KvtierL3Backend
from kvtier.torch import DevicePool, Executor, HostPool, KVLayout, Pinning, TorchMover
from conftest import HandOp

LAYOUT = KVLayout.mha(num_layers=2, kv_heads=1, head_dim=2, page_size=1, dtype=torch.float32)
DEV, HOST = 4, 5


class Jitter(KvtierL3Backend):
    def __init__(self, store, rng):
        super().__init__(store)
        self.rng = rng

    def put(self, keys, pool, page_ids):
        time.sleep(self.rng.uniform(0, 0.002))
        return super().put(keys, pool, page_ids)

    def get_with_query(self, q, offset, pool, page_ids):
        time.sleep(self.rng.uniform(0, 0.002))
        return super().get_with_query(q, offset, pool, page_ids)


def pages(draw, n, k):
    return draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k, unique=True))


@st.composite
def programs(draw):
    ops, keys = [], []
    for i in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["LoadBack", "WriteBack", "BackUpHost", "BackUpDevice", "Prefetch"]))
        k = draw(st.integers(1, 3))
        if kind == "LoadBack":
            ops.append(HandOp(i, "LoadBack", "host", "device", draw(st.lists(st.integers(0, HOST - 1), min_size=k,
                                                                            max_size=k)), pages(draw, DEV, k)))
        elif kind == "WriteBack":
            ops.append(HandOp(i, "WriteBack", "device", "host", draw(st.lists(st.integers(0, DEV - 1), min_size=k,
                                                                             max_size=k)), pages(draw, HOST, k)))
        elif kind in ("BackUpHost", "BackUpDevice"):
            tier, n = ("host", HOST) if kind == "BackUpHost" else ("device", DEV)
            new = [f"prop:{len(keys) + j:064x}:0" for j in range(k)]
            keys += new
            ops.append(HandOp(i, "BackUp", tier, None, pages(draw, n, k), (), new))
        else:
            pool = keys + [f"prop:missing{j}:0" for j in range(2)]
            ks = draw(st.lists(st.sampled_from(pool), min_size=k, max_size=k))
            ops.append(HandOp(i, "Prefetch", None, "host", (), pages(draw, HOST, k), ks))
    cuts = sorted(set(draw(st.lists(st.integers(1, len(ops)), max_size=3))))
    return ops, cuts


def initial():
    dev = DevicePool.allocate(LAYOUT, DEV)
    for l, comps in enumerate(dev.tensors):
        for c, t in enumerate(comps):
            for p in range(DEV):
                t[p] = 100 * (p + 1) + 10 * l + c
    host = HostPool.allocate(LAYOUT, HOST, Pinning.PAGEABLE)
    for p in range(HOST):
        host.data[p] = -(p + 1)
    return dev, host


def page_of(dev, p):
    return torch.stack([torch.stack(list(comps))[:, p] for comps in dev.tensors])


@settings(max_examples=60, deadline=None)
@given(prog=programs(), seed=st.integers(0, 2**16))
def test_concurrent_ops_leave_what_running_them_in_order_leaves(prog, seed):
    ops, cuts = prog
    rng = random.Random(seed)
    dev, host = initial()
    store = kvtier.L3Store.embedded(1 << 20)
    mover = TorchMover(delay=lambda d, layers: time.sleep(rng.uniform(0, 0.002)))
    with Executor(dev, host, Jitter(store, rng), mover=mover, l3_workers=2, prefetch_chunk_pages=1) as ex:
        for lo, hi in zip([0, *cuts], [*cuts, len(ops)]):
            ex.submit(ops[lo:hi])
        events = {e.op: e for e in ex.drain()}
    # the reference: the same ops, one after another, with the prefetches' reported counts
    rdev, rhost = initial()
    l3 = {}
    undefined = set()  # host pages a prefetch did not read
    dundef = set()
    for op in ops:
        if op.kind == "LoadBack":
            for s, d in zip(op.src.tolist(), op.dst.tolist()):
                for l, comps in enumerate(rdev.tensors):
                    for c, t in enumerate(comps):
                        t[d] = rhost.data[s, l, c]
                (dundef.add if s in undefined else dundef.discard)(d)
        elif op.kind == "WriteBack":
            for s, d in zip(op.src.tolist(), op.dst.tolist()):
                rhost.data[d] = page_of(rdev, s)
                (undefined.add if s in dundef else undefined.discard)(d)
        elif op.kind == "BackUp":
            assert events[op.id] == BackUpDone(op.id, True)
            for p, k in zip(op.src.tolist(), op.keys):
                src_undef = p in (undefined if op.src_tier == "host" else dundef)
                l3[k] = None if src_undef else (rhost.data[p] if op.src_tier == "host" else page_of(rdev, p)).clone()
        else:
            ev = events[op.id]
            assert isinstance(ev, PrefetchDone)
            n = ev.completed
            for j, (p, k) in enumerate(zip(op.dst.tolist(), op.keys)):
                if j < n:
                    assert k in l3, "a prefetch read a key no backup stored before it"
                    if l3[k] is None:
                        undefined.add(p)
                    else:
                        rhost.data[p] = l3[k]
                        undefined.discard(p)
                else:
                    undefined.add(p)
    for p in range(HOST):
        if p not in undefined:
            assert torch.equal(host.data[p], rhost.data[p]), f"host page {p}"
    for p in range(DEV):
        if p not in dundef:
            assert torch.equal(page_of(dev, p), page_of(rdev, p)), f"device page {p}"
    for k, v in l3.items():
        if v is not None:
            buf = np.zeros(LAYOUT.page_bytes, dtype=np.uint8)
            assert store.get_into(k, buf) == LAYOUT.page_bytes
            assert torch.equal(torch.from_numpy(buf).view(torch.float32).view_as(v), v), k
