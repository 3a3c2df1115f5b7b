"""L3 residency is a hint: a loss the store reports (``Scheduler.l3_lost``) makes the scheduler
back the page up again; the one key parser (``kvtier.parse_l3_key``)."""

import pytest

import kvtier
from kvtier.engine import Engine, KvtierL3Backend

from conftest import prompt, small_config


def _run(report: bool) -> bool:
    store = kvtier.L3Store.embedded(1 << 22)
    s = kvtier.Scheduler(small_config(l3_enabled=True))
    e = Engine(s, KvtierL3Backend(store))
    p = prompt(5, 41)
    e.submit(1, p, 2)
    e.run_to_idle()
    keys = s.l3_keys(p)
    assert all(store.is_exist(k) for k in keys)
    store.remove(keys[3], True)  # evicted by the store
    if report:
        assert s.l3_lost([keys[3]]) >= 1
    e.submit(2, p, 2)
    e.run_to_idle()
    s.check()
    return store.is_exist(keys[3])


def test_a_reported_loss_is_backed_up_again():
    assert _run(report=True)
    assert not _run(report=False)  # the stale flag keeps it out of L3: the test can fail


def test_parse_l3_key():
    s = kvtier.Scheduler(small_config(rank=3, namespace={"model": "m", "dtype": "", "layout": "", "tenant": "", "adapter": ""}))
    p = prompt(1, 8)
    k = s.l3_keys(p)[1]
    ns, h, rank = kvtier.parse_l3_key(k)
    assert h == bytes(kvtier.page_hashes(p, 4)[1]) and rank == 3 and k.startswith(ns + ":")
    for bad in ["", "a:b:c", k + ":1", k[:-2], k.replace(":3", ":x")]:
        assert kvtier.parse_l3_key(bad) is None
    assert s.l3_lost(["garbage", k.replace(":3", ":4")]) == 0
    with pytest.raises(TypeError):
        s.l3_lost("not a list of keys")
