"""kvtier.sglang (the SGLang HiCache backend) reaches a ``kvtier-l3`` server on the same host
over shared memory (issue 23) with the config its users write (``server``), on the real SGLang
0.5.23 host pools, against a real ``kvtier-l3`` process on 127.0.0.1: the server maps the
backends' staging segments, and the pages stored and loaded agree byte for byte with backends
on the same server over TCP (``KVTIER_L3_SHM=off``, the operator's off switch), in both
directions."""

import pytest

from sglang_pools import fill, mha_pool, page_bytes, page_indices
from test_sglang import PS, backend
from test_shm import Proc


@pytest.fixture
def proc():
    p = Proc()
    yield p
    p.close()


def write(b, keys, pages):
    assert b.batch_set_v1(keys, page_indices(pages, PS)) == [True] * len(keys)


def read(b, pool, keys):
    """The keys' pages read into slots 0.. of ``pool`` (a fresh one), as bytes."""
    assert b.batch_exists(keys) == len(keys)
    assert b.batch_get_v1(keys, page_indices(list(range(len(keys))), PS)) == [True] * len(keys)
    return [page_bytes(pool, i) for i in range(len(keys))]


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_the_sglang_backend_uses_shared_memory_and_agrees_with_tcp(proc, monkeypatch, layout):
    src = mha_pool(layout)
    fill(src, 7)
    want = [page_bytes(src, p) for p in (3, 1, 4, 2)]
    shm_w, shm_r = backend(src, server=proc.addr), backend(mha_pool(layout), server=proc.addr)
    assert shm_w.store.uses_shm and shm_r.store.uses_shm
    assert len(proc.memfd_maps("kvtier-shm-staging")) >= 2, "the server maps both backends' segments"

    monkeypatch.setenv("KVTIER_L3_SHM", "off")  # the same config, TCP
    tcp_w, tcp_r = backend(src, server=proc.addr), backend(mha_pool(layout), server=proc.addr)
    assert not tcp_w.store.uses_shm and not tcp_r.store.uses_shm

    a, b = [f"a{i}" for i in range(4)], [f"b{i}" for i in range(4)]
    write(shm_w, a, [3, 1, 4, 2])
    write(tcp_w, b, [3, 1, 4, 2])
    # Stored over shared memory, loaded over TCP, and the other way round: the same bytes.
    for reader, keys in ((tcp_r, a), (shm_r, b), (shm_r, a), (tcp_r, b)):
        reader.register_mem_pool_host(pool := mha_pool(layout))
        assert read(reader, pool, keys) == want
    # The objects themselves are the same bytes, whichever path wrote them.
    objs = lambda bk, keys: [bytes(bk.store.get(k)) for k in bk.object_keys(keys)]  # noqa: E731
    assert objs(shm_r, a) == objs(tcp_r, b) and all(objs(shm_r, a))
