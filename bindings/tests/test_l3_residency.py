"""L3 residency is a hint: a loss the store reports (``Scheduler.l3_lost``) makes the scheduler
back the page up again; an embedded store's loss journal (``L3Store.drain_losses``) reports
what it evicted or removed, and the reference engine passes it on; the one key parser
(``kvtier.parse_l3_key``)."""

import pytest

import kvtier
from kvtier.engine import Engine, KvtierL3Backend

from conftest import L3Process, prompt, small_config


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


def _run_journaled(journal: int, store=None) -> bool:
    store = store or kvtier.L3Store.embedded(1 << 22, loss_journal_keys=journal)
    s = kvtier.Scheduler(small_config(l3_enabled=True))
    e = Engine(s, KvtierL3Backend(store))
    p = prompt(5, 41)
    e.submit(1, p, 2)
    e.run_to_idle()
    keys = s.l3_keys(p)
    store.remove(keys[3], True)  # the store drops it; nobody calls l3_lost by hand
    e.submit(2, p, 2)
    e.run_to_idle()
    s.check()
    return store.is_exist(keys[3])


def test_the_engine_passes_the_stores_losses_on():
    assert _run_journaled(1024)
    assert not _run_journaled(0)  # no journal, no report: the stale mark stays
    with kvtier.L3Server(1 << 22) as srv:  # over the wire
        assert _run_journaled(0, kvtier.L3Store.connect(srv.addr))
    with kvtier.L3Server(1 << 22, loss_journal_keys=0) as srv:
        assert not _run_journaled(0, kvtier.L3Store.connect(srv.addr))


def _evict_and_check(a):
    """Puts eight objects into a store of four: what the handle reports lost is exactly what
    is gone."""
    obj = 1024
    keys = [f"k{i}" for i in range(8)]
    for k in keys:
        a.put(k, b"x" * obj)
    lost, overflowed = a.drain_losses()
    assert not overflowed and lost
    assert sorted(lost) == sorted(k for k in keys if not a.is_exist(k))
    return lost


def test_drain_losses_reports_evictions_per_handle_and_tenant():
    obj = 1024
    a = kvtier.L3Store.embedded(4 * obj, loss_journal_keys=64, tenant="a", name="losses-shared")
    a2 = kvtier.L3Store.embedded(tenant="a", name="losses-shared")  # another engine, same tenant
    b = a.with_tenant("b")
    assert a.drain_losses() == ([], False)
    lost = _evict_and_check(a)
    assert sorted(a2.drain_losses()[0]) == sorted(lost), "a's reads took nothing from a2"
    b.put("kb", b"y" * obj)
    b.remove("kb", True)
    lost, _ = a.drain_losses()  # b's put may evict one of a's keys: a hears of it
    assert "kb" not in lost and all(not a.is_exist(k) for k in lost), "b's loss is b's"
    assert b.drain_losses() == (["kb"], False)


def test_drain_losses_over_the_wire_and_without_a_journal():
    with kvtier.L3Server(4 * 1024) as srv:  # servers keep a journal (65,536 keys by default)
        _evict_and_check(kvtier.L3Store.connect(srv.addr))
    off = kvtier.L3Store.embedded(4 * 1024)
    with pytest.raises(kvtier.UnavailableInModeError) as e:
        off.drain_losses()
    assert e.value.code == -1011 and isinstance(e.value, kvtier.UnavailableError)
    assert kvtier.UnavailableError.code == -1010
    assert KvtierL3Backend(off).losses() == ([], False)  # the engine then runs without reports


def test_parse_l3_key():
    s = kvtier.Scheduler(small_config(rank=3, tp_ranks=4,
                                      namespace={"model": "m", "dtype": "", "layout": "", "tenant": "", "adapter": ""}))
    p = prompt(1, 8)
    k = s.l3_keys(p)[1]
    ns, h, rank = kvtier.parse_l3_key(k)
    assert h == bytes(kvtier.page_hashes(p, 4)[1]) and rank == 3 and k.startswith(ns + ":")
    for bad in ["", "a:b:c", k + ":1", k[:-2], k.replace(":3", ":x")]:
        assert kvtier.parse_l3_key(bad) is None
    assert kvtier.RankAgreement().lost(s, ["garbage", k.replace(":3", ":4")]) == 0  # rank 3 of 4: agreed
    with pytest.raises(TypeError):
        s.l3_lost("not a list of keys")


def _engine_served_one_prompt(srv):
    """A store client of ``srv``, a scheduler with L3 and an ``Engine`` over them that has
    served one prompt (its pages backed up)."""
    store = kvtier.L3Store.connect(srv.addr, rpc_timeout_ms=2000)
    s = kvtier.Scheduler(small_config(l3_enabled=True))
    e = Engine(s, KvtierL3Backend(store))
    e.submit(1, prompt(1, 41), 2)
    e.run_to_idle()
    return store, s, e


def test_pages_whose_backup_failed_while_the_l3_server_was_down_are_backed_up_once_it_is_back():
    """A ``kvtier-l3`` server process is killed while the scheduler computes two prompts, and
    restarted empty on its address. Their backups failed; their pages stay on host. While it
    is down idle steps try nothing again; once a backup succeeds after the restart, the next
    steps back them up (the scheduler's retry of failed backups), so a second engine gets
    them from L3. Before, a failed backup was never tried again: they never reached L3."""
    srv = L3Process()
    try:
        store, s, e = _engine_served_one_prompt(srv)
        srv.kill()
        down = [prompt(2, 41), prompt(3, 41)]
        for i, p in enumerate(down):
            e.submit(10 + i, p, 2)
        e.run_to_idle()
        st = s.stats()
        assert st["ops"]["BackUp"]["failed"] == 2 and st["host"]["cached"] == 30
        assert st["backups_retrying"] == 2, "the failed backups wait to be tried again"
        issued = st["ops"]["BackUp"]["issued"]
        for t in range(3):
            e.step(1000 + t)
        assert s.stats()["ops"]["BackUp"]["issued"] == issued, "tried again before the store answered"
        srv = srv.restart()
        e.submit(20, prompt(4, 41), 2)
        e.run_to_idle()
        missing = [k for p in down for k in s.l3_keys(p) if not store.is_exist(k)]
        assert missing == [], f"{len(missing)} pages computed while the server was down never reached it"
        st = s.stats()
        assert st["backups_retrying"] == 0 and st["backups_given_up"] == 0
        s.check()
        s2 = kvtier.Scheduler(small_config(l3_enabled=True))
        e2 = Engine(s2, KvtierL3Backend(kvtier.L3Store.connect(srv.addr)))
        for i, p in enumerate(down):
            e2.submit(30 + i, p, 2)
        e2.run_to_idle()
        assert s2.stats()["l3_hit_pages"] == 20
    finally:
        srv.kill()


def test_an_engine_serves_on_while_its_l3_server_is_down():
    """``kvtier.engine.Engine`` over a real ``kvtier-l3`` process that is killed mid-run: its
    L3 ops fail (the probe finds nothing, reads and backups fail, the loss journal is
    unknown) and every request is still served, each page it reads checked; once the server
    is back (empty), backups succeed again. Before, the probe's ``RpcFailError`` ended the
    engine's step: an engine died with its L3 server."""
    srv = L3Process()
    try:
        store, s, e = _engine_served_one_prompt(srv)
        assert e.stats.l3_errors == 0
        srv.kill()
        for i in range(3):
            e.submit(10 + i, prompt(1 if i == 0 else 10 + i, 41), 2)
        e.run_to_idle()
        assert [len(e.generated(10 + i)) for i in range(3)] == [2, 2, 2]
        assert e.stats.l3_errors > 0
        st = s.stats()
        assert st["ops"]["BackUp"]["failed"] >= 2
        s.check()
        srv = srv.restart()
        e.submit(20, prompt(20, 41), 2)
        e.run_to_idle()
        assert len(e.generated(20)) == 2
        assert all(store.is_exist(k) for k in s.l3_keys(prompt(20, 41)))
        s.check()
    finally:
        srv.kill()
