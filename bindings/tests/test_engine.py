"""The reference executor (kvtier.engine) against kvtier's L3 store, embedded and remote,
and against kvtier's Mooncake-compatible class."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier.engine import Engine, IntegrityError, KvtierL3Backend, MooncakeL3Backend
from kvtier.mooncake_compat import MooncakeDistributedStore
from conftest import small_config


def l3_config(**over):
    return small_config(**{"l3_enabled": True, "prefetch_threshold": 2, **over})


def prompts(n=5, length=40, base=0):
    return [list(range((base + i) * 1000, (base + i) * 1000 + length)) for i in range(n)]


def serve(engine, ps, first_id=0, max_new=5):
    for i, p in enumerate(ps):
        engine.submit(first_id + i, p, max_new)
    engine.run_to_idle()
    for i in range(len(ps)):
        assert len(engine.generated(first_id + i)) == max_new
    assert engine.s.live_requests() == 0
    engine.s.check()
    st = engine.s.stats()
    assert st["device"]["held"] == 0 and st["host"]["held"] == 0
    assert st["device"]["locked"] == 0 and st["host"]["locked"] == 0
    return st


@pytest.fixture(params=["embedded", "remote", "compat"])
def backends(request):
    """Two backends on one shared store (two engine instances)."""
    if request.param == "embedded":
        st = kvtier.L3Store.embedded(1 << 24)
        yield KvtierL3Backend(st), KvtierL3Backend(st)
    elif request.param == "remote":
        srv = kvtier.L3Server(1 << 24)
        yield KvtierL3Backend(kvtier.L3Store.connect(srv.addr)), KvtierL3Backend(kvtier.L3Store.connect(srv.addr))
        srv.shutdown()
    else:
        name = f"embedded://engine-{id(request)}"
        a, b = MooncakeDistributedStore(), MooncakeDistributedStore()
        assert a.setup("h", "m", 1 << 24, 0, "tcp", "", name) == 0
        assert b.setup({"local_hostname": "h", "metadata_server": "m", "master_server_addr": name}) == 0
        yield MooncakeL3Backend(a), MooncakeL3Backend(b)


def test_cross_instance_l3_hits(backends):
    ba, bb = backends
    a = Engine(kvtier.Scheduler(l3_config()), ba)
    sa = serve(a, prompts())
    # 45 tokens (prompt + 4 decoded with KV) make 11 full pages per request
    assert sa["computed_tokens"] == 5 * 40 and a.stats.l3_pages_written == 5 * 11
    b = Engine(kvtier.Scheduler(l3_config()), bb)
    sb = serve(b, prompts(), first_id=100)
    # 9 of each prompt's 10 pages come from L3 (the last page holds the token to compute)
    assert sb["l3_hit_tokens"] == 5 * 36 and sb["computed_tokens"] == 5 * 4
    assert b.stats.l3_probes == 5  # one lease-free probe per request
    assert b.stats.l3_queries == 5  # one lease-taking query per prefetch, none repeated
    assert b.stats.pages_checked > 0
    st = sb["ops"]
    assert st["Prefetch"]["succeeded"] == 5 and st["L3Query"]["succeeded"] == 5


def test_device_and_host_hits_in_one_instance():
    st = kvtier.L3Store.embedded(1 << 24)
    e = Engine(kvtier.Scheduler(l3_config(keep_device_after_write_back=False)), KvtierL3Backend(st))
    serve(e, prompts(3))
    s2 = serve(e, prompts(3), first_id=10)  # same prompts again: host → device load-backs
    assert s2["host_hit_tokens"] > 0
    e2 = Engine(kvtier.Scheduler(l3_config()), None)
    serve(e2, prompts(2))
    s3 = serve(e2, prompts(2), first_id=10)
    assert s3["device_hit_tokens"] == 2 * 36


def test_a_probe_takes_no_lease():
    # Seed review (probe starves eviction): a probe not followed by a read must leave every
    # key removable (and evictable) at once.
    st = kvtier.L3Store.embedded(1 << 24, lease_ttl_ms=60_000)
    serve(Engine(kvtier.Scheduler(l3_config()), KvtierL3Backend(st)), prompts(1))
    keys = kvtier.Scheduler(l3_config()).l3_keys(prompts(1)[0])
    # A request probes L3 and does not prefetch: its prefix hits fewer pages than the threshold.
    b = Engine(kvtier.Scheduler(l3_config(prefetch_threshold=20)), KvtierL3Backend(st))
    b.submit(7, prompts(1)[0] + list(range(90_000, 90_060)), 3)
    b.run_to_idle()
    assert b.stats.l3_probes == 1 and b.stats.l3_queries == 0
    st.remove(keys[0], False)  # no lease: not ObjectHasLeaseError
    assert not st.is_exist(keys[0])


def test_a_lease_refused_by_the_store_triggers_a_requery():
    st = kvtier.L3Store.embedded(1 << 24, lease_ttl_ms=1000)
    serve(Engine(kvtier.Scheduler(l3_config()), KvtierL3Backend(st)), prompts(1))

    class SlowRead(KvtierL3Backend):
        """The leases of the first read's query expire before the read reaches the store."""

        slowed = False

        def get_with_query(self, q, offset, pool, page_ids):
            if not self.slowed:
                self.slowed = True
                st.advance_clock_ms(5000)
            return super().get_with_query(q, offset, pool, page_ids)

    b = Engine(kvtier.Scheduler(l3_config()), SlowRead(st))
    b.submit(7, prompts(1)[0], 3)
    b.run_to_idle()
    assert b.stats.lease_expired_on_read == 9  # refused with -707, never read blindly
    assert b.stats.l3_queries == 2 and b.stats.l3_pages_read == 9
    assert b.s.stats()["l3_hit_tokens"] == 36


def test_oracle_catches_stale_l3_data():
    st = kvtier.L3Store.embedded(1 << 24)
    cfg = l3_config()
    s = kvtier.Scheduler(cfg)
    p = prompts(1)[0]
    keys = s.l3_keys(p)
    # Poison L3: right keys, wrong bytes.
    st.batch_put_from(keys, [np.full(64, 7, dtype=np.uint8) for _ in keys])
    e = Engine(s, KvtierL3Backend(st))
    e.submit(1, p, 2)
    with pytest.raises(IntegrityError, match="prefetch"):
        e.run_to_idle()


def test_oracle_catches_a_corrupted_host_page():
    e = Engine(kvtier.Scheduler(small_config(keep_device_after_write_back=False)))
    serve(e, prompts(1))
    e.host[:] = 0  # lose every host copy behind the scheduler's back
    e.submit(5, prompts(1)[0], 2)
    with pytest.raises(IntegrityError):
        e.run_to_idle()


def test_abort_and_retraction_paths_stay_consistent():
    e = Engine(kvtier.Scheduler(small_config(device_pages=24, max_context_tokens=96)))
    for i, p in enumerate(prompts(6, length=30)):
        e.submit(i, p, 40)
    e.step(0)
    e.s.abort(2)
    e.run_to_idle(start_ms=1)
    ended = dict(e.ended)
    assert ended[2] == "aborted" and sum(1 for o in ended.values() if o == "finished") == 5
    assert e.s.stats()["retracted"] >= 0
    e.s.check()


def test_the_engine_refuses_the_prompts_the_scheduler_refuses_and_keeps_the_others():
    """``Engine.submit`` takes a prompt as ``Scheduler.submit`` does: a str or non-integer
    tokens are a TypeError (it converted each element with ``int()``: "1234" became tokens
    1, 2, 3, 4 and 1.9 became 1), nothing is submitted, and a numpy prompt keeps its tokens."""
    e = Engine(kvtier.Scheduler(small_config()))
    for bad in ("1234", [1.9, 2.5, 3.0], [1, "2"], [[1, 2]]):
        with pytest.raises(TypeError):
            e.submit(1, bad, 1)
        assert e.s.live_requests() == 0 and 1 not in e.tokens
    e.submit(1, np.arange(5, 45, dtype=np.int64), 2)
    e.submit(2, range(100, 140), 2)
    assert e.tokens[1] == list(range(5, 45)) and e.tokens[2] == list(range(100, 140))
    e.run_to_idle()
    assert len(e.generated(1)) == len(e.generated(2)) == 2


@pytest.mark.parametrize("short", [40, 16])
def test_a_short_l3_object_is_a_miss_not_a_page(short):
    """An L3 object shorter than a page (another writer's, a truncated one) was counted as a
    page read: the store answers each key with the bytes it read, and every code >= 0 was
    taken as a good read, so the rest of the page stayed what the pool held before. With
    its first 32 bytes right (the oracle's stamp) the stale tail was served silently. Only a
    read of exactly ``page_bytes`` counts; the request computes the rest."""
    st = kvtier.L3Store.embedded(1 << 24)
    a = Engine(kvtier.Scheduler(l3_config()), KvtierL3Backend(st))
    serve(a, prompts(1))
    keys = a.s.l3_keys(prompts(1)[0])
    assert len(keys) == 10
    for k in keys:
        whole = st.get(k)
        assert len(whole) == a.page_bytes
        st.remove(k, force=True)
        st.put(k, whole[:short])
    b = Engine(kvtier.Scheduler(l3_config()), KvtierL3Backend(st))
    sb = serve(b, prompts(1), first_id=100)
    assert b.stats.l3_pages_read == 0
    assert sb["l3_hit_tokens"] == 0 and sb["computed_tokens"] == 40
    assert b.stats.pages_checked > 0  # the oracle read every page the forwards used


def test_engines_one_after_another_on_one_mooncake_backend():
    """An engine registered its pools with a Mooncake-API store and never unregistered them:
    the store kept registrations of freed memory, and the next engine's pools, allocated where
    the last one's had been, were refused (register_buffer -600: the second engine could not
    be built). Closed (``close`` / ``with``) or collected, an engine gives its own back."""
    import gc

    st = MooncakeDistributedStore()
    assert st.setup("h", "m", 1 << 24, 0, "tcp", "", "embedded://engine-lifetime") == 0
    backend = MooncakeL3Backend(st)
    cfg = l3_config(page_size=4, device_pages=16, host_pages=16, max_context_tokens=64)
    outs = []
    for i in range(6):
        if i % 2:
            with Engine(kvtier.Scheduler(cfg), backend) as e:
                serve(e, prompts(2, 12), max_new=3)
                outs.append([e.generated(r) for r in (0, 1)])
        else:
            e = Engine(kvtier.Scheduler(cfg), backend)
            serve(e, prompts(2, 12), max_new=3)
            outs.append([e.generated(r) for r in (0, 1)])
            del e
            gc.collect()
        assert backend._registered == [], f"engine {i} left its pools registered"
    assert all(o == outs[0] for o in outs)
    other = Engine(kvtier.Scheduler(cfg), backend)
    with Engine(kvtier.Scheduler(cfg), backend) as e:
        serve(e, prompts(1, 12), max_new=2)
    assert len(backend._registered) == 2, "closing one engine leaves another's registrations"
    other.close()
    other.close()  # closing twice is harmless
    assert backend._registered == []


def test_a_failed_attach_leaves_no_pool_registered():
    """``attach_pools`` registered the pools one by one and stopped at the first refusal,
    leaving the earlier ones registered with nobody to give them back (the engine being built
    raised): the store refused them to every later owner of that memory."""
    st = MooncakeDistributedStore()
    assert st.setup("h", "m", 1 << 24, 0, "tcp", "", "embedded://attach-partial") == 0
    backend = MooncakeL3Backend(st)
    a = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(RuntimeError, match="register_buffer"):
        backend.attach_pools([a, a[1024:]])  # the second overlaps the first: refused
    assert backend._registered == []
    assert st.register_buffer(a.ctypes.data, a.nbytes) == 0, "the first pool was left registered"
    assert st.unregister_buffer(a.ctypes.data) == 0


def test_a_long_run_keeps_nothing_of_the_requests_it_handed_back():
    """An engine serving request after request, some aborted while queued, running or
    retracted: once ``take_ended`` handed each ended request back (outcome and tokens), the
    engine keeps nothing of it (its page table, tokens, page hashes, scope, outputs, stop
    limit), so memory does not grow with the requests served."""
    e = Engine(kvtier.Scheduler(small_config(device_pages=24, max_context_tokens=96)))
    handed = {}
    for rnd in range(3):
        ids = [rnd * 10 + i for i in range(6)]
        for r, p in zip(ids, prompts(6, length=30, base=rnd * 6)):
            e.submit(r, p, 40, cache_salt=f"s{rnd}")
        e.stop_after[ids[1]] = 3
        e.s.abort(ids[0])  # queued
        for now in range(4):
            e.step(now)
        e.s.abort(ids[2])  # running (or retracted)
        e.run_to_idle(start_ms=4)
        for r, outcome, toks in e.take_ended():
            handed[r] = (outcome, toks)
    assert sorted(handed) == sorted(rnd * 10 + i for rnd in range(3) for i in range(6))
    assert all(len(handed[r * 10 + 1][1]) == 3 for r in range(3))
    assert all(handed[r * 10][0] == "aborted" for r in range(3))
    kept = {name: len(getattr(e, name)) for name in ("tables", "tokens", "_hashes", "_scopes", "outputs",
                                                       "stop_after", "ended")}
    assert kept == dict.fromkeys(kept, 0)
    e.s.check()


@settings(max_examples=40, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12), st.none() | st.integers(0, 12),
                               st.none() | st.integers(1, 6)), min_size=1, max_size=10),
       device_pages=st.integers(18, 40), take_every=st.integers(1, 5))
def test_property_every_ended_request_is_handed_back_once_and_nothing_stays(reqs, device_pages, take_every):
    """Random requests (prompt length, tokens, an abort after some steps or none, a stop
    limit or none) on a device pool that may force retractions, ended ones taken every few
    steps: each request is handed back exactly once, and at idle the engine keeps nothing of
    any (page tables, tokens, hashes, scopes, outputs, stop limits, ended)."""
    e = Engine(kvtier.Scheduler(small_config(device_pages=device_pages, max_context_tokens=72)))
    handed = []
    for i, (n, new, _, stop) in enumerate(reqs):
        e.submit(i, list(range(i * 100, i * 100 + n)), new)
        if stop is not None:
            e.stop_after[i] = stop
    for now in range(2000):
        for i, (_, _, abort_at, _) in enumerate(reqs):
            if abort_at == now and i in e.tokens:
                try:
                    e.s.abort(i)
                except kvtier.UnknownRequestError:
                    pass  # it ended at the last completion; the next plan reports it
        idle = e.s.is_idle()
        e.step(now)
        if now % take_every == 0 or idle:
            handed += [r for r, _, _ in e.take_ended()]
        if idle:
            break
    assert sorted(handed) == list(range(len(reqs)))
    kept = {name: len(getattr(e, name)) for name in ("tables", "tokens", "_hashes", "_scopes", "outputs",
                                                       "stop_after", "ended")}
    assert kept == dict.fromkeys(kept, 0)
    e.s.check()
