"""kvtier.OffloadManager from Python: the offloading-manager mode's calls, and bad input as
typed errors that change nothing (the logic itself: scheduler/tests/offload_manager.rs)."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvtier
from conftest import found_by_every_rank


def chain(tag: str, n: int):
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def test_store_load_evict_and_events():
    m = kvtier.OffloadManager(4, "freq-depth")
    a = chain("a", 3)
    job, first, slots, evicted = m.prepare_store(a, 3)
    assert (first, len(set(slots)), evicted) == (0, 3, [])
    assert m.usage()["storing"] == 3 and m.usage()["stores"] == 1
    m.complete_store(job, "done")
    assert m.drain_events() == [(False, a)]
    assert [m.lookup(a, i) for i in range(3)] == ["hit"] * 3 and m.host_prefix(a) == 3
    load, read = m.prepare_load(a, 1, 3)
    assert read == slots[1:]
    m.complete_load(load)
    m.touch(a)
    b = chain("b", 2)
    job, _, _, evicted = m.prepare_store(b, 2)
    assert evicted == a
    m.complete_store(job, "failed")
    assert m.take_dropped() == b and m.lookup(b, 0) == "miss"
    assert m.drain_events() == [(True, a)]
    m.check()


def test_absurd_host_slots_raise_instead_of_exhausting_memory():
    # The host pool is allocated whole (about 5 bytes a slot): OffloadManager(2**32 - 1) took
    # 21 GB and 27 s on a 23 GB machine, and aborts the interpreter (a failed allocation)
    # wherever there is less; the Scheduler's pools were already checked.
    with pytest.raises(kvtier.ConfigError, match="bookkeeping"):
        kvtier.OffloadManager(2**32 - 1)
    assert kvtier.OffloadManager(1 << 16).usage()["capacity"] == 1 << 16


def test_bad_input_is_a_typed_error_and_changes_nothing():
    with pytest.raises(kvtier.OffloadManagerError):
        kvtier.OffloadManager(0)
    with pytest.raises(kvtier.ConfigError):
        kvtier.OffloadManager(4, "mru")
    m = kvtier.OffloadManager(4)
    a = chain("a", 2)
    job, *_ = m.prepare_store(a, 2)
    before = m.usage()
    with pytest.raises(ValueError):
        m.prepare_store([b"short"], 1)
    with pytest.raises(ValueError):
        m.complete_store(job, "maybe")
    with pytest.raises(kvtier.OffloadManagerError):
        m.complete_store(job + 1, "done")
    with pytest.raises(kvtier.OffloadManagerError):
        m.prepare_store(a, 3)
    with pytest.raises(kvtier.OffloadManagerError):
        m.prepare_load(a, 0, 2)  # not on host yet
    with pytest.raises(kvtier.OffloadManagerError):
        m.complete_load(1)
    with pytest.raises(TypeError):
        m.lookup(None, 0)
    assert m.usage() == before
    m.check()
    m.complete_store(job, "done")
    with pytest.raises(kvtier.OffloadManagerError):
        m.complete_store(job, "done")  # reported once
    m.check()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5), st.booleans()), max_size=30),
       st.integers(1, 8))
def test_hits_are_exactly_what_landed_and_still_fits(ops, slots):
    """Stores completed at once: every chain's hits are a prefix, host pages never exceed the
    slots, and the consistency check holds after every call."""
    m = kvtier.OffloadManager(slots)
    for tag, n, ok in ops:
        c = chain(str(tag), n)
        plan = m.prepare_store(c, n)
        if plan is not None:
            m.complete_store(plan[0], "done" if ok else "failed")
        m.check()
        hits = [m.lookup(c, i) == "hit" for i in range(n)]
        assert hits == sorted(hits, reverse=True)  # a prefix
        assert m.usage()["cached"] <= slots


def test_tensor_parallel_ranks_agree_prefetches_and_losses():
    """Two ranks' agreements over one manager: a prefetch lands with the pages both read;
    a loss one rank reports is forgotten for both (scheduler/tests/offload_agreement.rs)."""
    m = kvtier.OffloadManager(8, "lru", "write-through", tp_ranks=2)
    a = chain("tp", 3)
    found_by_every_rank(m, a)
    job, first, slots, _ = m.prepare_prefetch(a, 1)  # the whole run known in L3
    assert (first, len(slots)) == (0, 3) and m.lookup(a, 2) == "pending"
    ranks = [kvtier.RankAgreement(), kvtier.RankAgreement()]
    ranks[0].push(kvtier.PrefetchDone(job, 3))
    assert m.agree(ranks) == 0 and m.lookup(a, 0) == "pending", "rank 1 has not reported"
    ranks[1].push(kvtier.PrefetchDone(job, 2))
    assert m.agree(ranks) == 1
    assert [m.lookup(a, i) for i in range(3)] == ["hit", "hit", "miss"]
    m.check()
    b = chain("tp-b", 2)
    found_by_every_rank(m, b)
    assert ranks[1].lost_pages(b[1:]) == 1
    gathered = [r.loss_words() for r in ranks]
    for r in ranks:
        r.agree_losses(m, lambda _w: gathered)
    assert [m.lookup(b, i) for i in range(2)] == ["in-l3", "miss"]
    m.check()


def test_a_held_prefetch_survives_a_store_until_released_and_bad_releases_are_typed():
    """``prepare_prefetch_held``: the landed pages stay on host through a store that would
    evict them, until ``release_hold``; releasing twice, or a job that is no held prefetch,
    is an ``OffloadManagerError`` that changes nothing (scheduler/tests/prefetch_hold.rs)."""
    m = kvtier.OffloadManager(3, "lru", "write-through")
    a = chain("held", 3)
    m.l3_found(a)
    job, first, slots, _ = m.prepare_prefetch_held(a, 1)
    assert (first, len(slots), m.holds()) == (0, 3, (1, 0, 0))
    m.complete_prefetch(job, 3)
    assert m.holds() == (0, 1, 0) and m.usage()["locked"] == 3
    b = chain("other", 3)
    m.l3_found(b)  # a store of pages L3 holds displaces no hold
    assert m.prepare_store(b, 3) is None, "every slot is held"
    assert m.host_prefix(a) == 3 and m.holding(job) and m.holds_displaced == 0
    m.check()
    before = m.usage()
    for bad in (job + 1, 10_000):
        with pytest.raises(kvtier.OffloadManagerError):
            m.release_hold(bad)
    assert m.usage() == before and m.holds() == (0, 1, 0)
    m.release_hold(job)
    with pytest.raises(kvtier.OffloadManagerError):
        m.release_hold(job)
    sjob, _, _, evicted = m.prepare_store(b, 3)
    assert evicted == a
    m.complete_store(sjob, "done")
    m.check()


def test_a_store_of_pages_l3_lacks_displaces_a_landed_hold():
    """A store short of slots for pages L3 lacks (a running request's new chunks) displaces
    the newest landed hold: its pages are evicted as the store needs (their node whole), the
    hold holds nothing and is released once, as one that ended (scheduler/tests/prefetch_hold.rs)."""
    m = kvtier.OffloadManager(3, "lru", "write-through")
    a = chain("held", 3)
    m.l3_found(a)
    job, _, _, _ = m.prepare_prefetch_held(a, 1)
    assert not m.holding(job), "still landing"
    m.complete_prefetch(job, 3)
    assert m.holding(job)
    sjob, first, slots, evicted = m.prepare_store(chain("new", 2), 2)
    assert (first, len(slots), evicted) == (0, 2, a)
    assert not m.holding(job) and m.holds_displaced == 1 and m.holds() == (0, 0, 1)
    assert m.lookup(a, 0) == "in-l3", "its requester prefetches it again"
    m.check()
    m.release_hold(job)
    with pytest.raises(kvtier.OffloadManagerError):
        m.release_hold(job)
    m.complete_store(sjob, "done")
    assert m.holds() == (0, 0, 0) and m.usage()["locked"] == 0
    m.check()


def test_a_manager_of_several_ranks_refuses_direct_losses():
    """Issue 33 (5a): a manager planning for several ranks refuses ``l3_lost`` / ``l3_lost_all``
    (``LossNeedsAgreementError``, naming the agreement) and an agreement of another number of
    ranks (``AgreementError``); nothing changes. One rank keeps the direct calls."""
    m = kvtier.OffloadManager(8, "lru", "write-through", tp_ranks=2)
    a = chain("tp-lost", 2)
    found_by_every_rank(m, a)
    with pytest.raises(kvtier.LossNeedsAgreementError, match="lost_pages.*agree_losses"):
        m.l3_lost(a[1:])
    with pytest.raises(kvtier.LossNeedsAgreementError):
        m.l3_lost_all()
    assert [m.lookup(a, i) for i in range(2)] == ["in-l3", "in-l3"]
    r = kvtier.RankAgreement()
    r.lost_pages(a[1:])
    with pytest.raises(kvtier.AgreementError, match="tp_ranks"):
        r.agree_losses(m, lambda w: [w])
    with pytest.raises(kvtier.AgreementError, match="tp_ranks"):
        m.agree([r])
    assert m.lookup(a, 1) == "in-l3" and r.pending_losses() == (1, False)
    r.agree_losses(m, lambda w: [w, kvtier.RankAgreement().loss_words()])
    assert m.lookup(a, 1) == "miss"
    m.check()
    with pytest.raises(kvtier.ConfigError, match="tp_ranks"):
        kvtier.OffloadManager(8, tp_ranks=0)
    one = kvtier.OffloadManager(8)
    one.l3_found(a)
    one.l3_lost(a[1:])
    assert one.lookup(a, 1) == "miss"


def test_one_ranks_find_alone_is_refused_and_the_ranks_agree_the_shortest_run():
    """One manager per TP rank (SGLang's layout): a find one rank's probe made, told to that
    rank alone, made its lookups differ from the other rank's (['in-l3'] * 3 against
    ['miss'] * 3: different prefetches, different prefix lengths). Now refused
    (``FoundNeedsAgreementError``, nothing changed); the ranks agree their finds with
    ``RankAgreement.found_pages`` / ``agree_found`` and mark only what every rank found."""
    ms = [kvtier.OffloadManager(8, "lru", "write-through", tp_ranks=2) for _ in range(2)]
    a = chain("tp-found", 3)
    with pytest.raises(kvtier.FoundNeedsAgreementError, match="found_pages.*agree_found"):
        ms[0].l3_found(a)
    assert issubclass(kvtier.FoundNeedsAgreementError, kvtier.SchedulerError)
    assert [ms[0].lookup(a, i) for i in range(3)] == [ms[1].lookup(a, i) for i in range(3)] == ["miss"] * 3
    ranks = [kvtier.RankAgreement(), kvtier.RankAgreement()]
    assert ranks[0].found_pages(a) == 3 and ranks[1].found_pages(a[:1]) == 1
    gathered = [r.found_words() for r in ranks]
    for m, r in zip(ms, ranks):
        assert r.agree_found(m, lambda _w: gathered) == 1
        assert r.pending_found() == 0
        m.check()
    for m in ms:
        assert [m.lookup(a, i) for i in range(3)] == ["in-l3", "miss", "miss"]
    with pytest.raises(kvtier.AgreementError, match="tp_ranks"):
        ranks[0].agree_found(ms[0], lambda w: [w])
    with pytest.raises(kvtier.AgreementError, match="own words"):
        ranks[0].found_pages(a)
        ranks[0].agree_found(ms[0], lambda _w: [kvtier.RankAgreement().found_words()] * 2)
    with pytest.raises(ValueError):
        ranks[0].found_pages([b"short"])
    assert ranks[0].pending_found() == 3 and ms[0].lookup(a, 1) == "miss"
    with pytest.raises(kvtier.AgreementError, match="twice"):
        ms[0].agree_found([ranks[0], ranks[0]])
    ranks[1].found_pages(a[:2])
    assert ms[0].agree_found(ranks) == 1  # one manager over both ranks (vLLM's layout)
    assert [ms[0].lookup(a, i) for i in range(3)] == ["in-l3", "in-l3", "miss"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=1, max_size=4))
def test_after_the_find_agreement_every_rank_answers_alike(finds):
    """Whatever each rank's probe finds (its leading run of the chain), after the agreement
    every rank's manager answers every lookup alike: the shortest run is in L3."""
    n = len(finds)
    a = chain("tp-any", 4)
    ms = [kvtier.OffloadManager(8, "lru", "write-through", tp_ranks=n) for _ in range(n)]
    ranks = [kvtier.RankAgreement() for _ in range(n)]
    runs = [next((i for i, x in enumerate(f) if not x), len(f)) for f in finds]
    for r, run in zip(ranks, runs):
        r.found_pages(a[:run])
    gathered = [r.found_words() for r in ranks]
    for m, r in zip(ms, ranks):
        r.agree_found(m, lambda _w: gathered)
    answers = {tuple(m.lookup(a, i) for i in range(4)) for m in ms}
    assert answers == {tuple(["in-l3"] * min(runs) + ["miss"] * (4 - min(runs)))}


def test_agreement_bad_input_is_a_typed_error_that_changes_nothing():
    m = kvtier.OffloadManager(4)
    a = chain("bad", 2)
    m.l3_found(a)
    job, _, _, _ = m.prepare_prefetch(a, 2)
    with pytest.raises(kvtier.OffloadManagerError):
        m.complete_prefetch(job + 7, 1)
    with pytest.raises(kvtier.OffloadManagerError):
        m.apply_agreed(kvtier.LoadBackDone(job, True))
    with pytest.raises(TypeError):
        kvtier.RankAgreement().values(object())
    with pytest.raises(ValueError):
        kvtier.RankAgreement().lost_pages([b"short"])
    assert m.lookup(a, 0) == "pending"
    m.apply_agreed(kvtier.PrefetchDone(job, 2))
    assert m.lookup(a, 1) == "hit"
    m.check()


# Every call of OffloadManager's API with arguments drawn from small pools: (name, changes
# the manager?). A call that raises is fine (typed error, nothing changed).
def _calls(m, chains, jobs, slot):
    c = chains[slot % len(chains)]
    j = jobs[slot % len(jobs)] if jobs else 0
    return [
        ("prepare_store", True, lambda: m.prepare_store(c, len(c))),
        ("prepare_store_part", True, lambda: m.prepare_store(c, 1 + slot % len(c))),
        ("complete_store", True, lambda: m.complete_store(j, "done" if slot % 3 else "failed")),
        ("prepare_load", True, lambda: m.prepare_load(c, 0, 1 + slot % len(c))),
        ("complete_load", True, lambda: m.complete_load(j)),
        ("touch", True, lambda: m.touch(c)),
        ("drain_events", False, lambda: m.drain_events()),
        ("take_dropped", False, lambda: m.take_dropped()),
        ("l3_found", True, lambda: m.l3_found(c)),
        ("l3_lost", True, lambda: m.l3_lost(c[:1])),
        ("prepare_prefetch", True, lambda: m.prepare_prefetch(c, len(c))),
        ("prepare_prefetch_held", True, lambda: m.prepare_prefetch_held(c, len(c))),
        ("complete_prefetch", True, lambda: m.complete_prefetch(j, slot % 3)),
        ("release_hold", True, lambda: m.release_hold(j)),
        ("plan_backups", True, lambda: m.plan_backups()),
        ("lookup", False, lambda: m.lookup(c, slot % len(c))),
        ("host_prefix", False, lambda: m.host_prefix(c)),
        ("usage", False, lambda: m.usage()),
        ("occupancy", False, lambda: m.occupancy()),
        ("holds", False, lambda: m.holds()),
        ("check", False, lambda: m.check()),
    ]


def _run(call, jobs: list) -> None:
    """One call of ``_calls``: a typed error is fine (nothing changed); the jobs it starts are
    added to ``jobs`` for later calls to complete."""
    try:
        out = call()
    except (kvtier.OffloadManagerError, ValueError):
        return
    if isinstance(out, tuple) and out and isinstance(out[0], int):
        jobs.append(out[0])
    elif isinstance(out, list) and out and isinstance(out[0], tuple) and isinstance(out[0][0], int):
        jobs.extend(b[0] for b in out)  # plan_backups


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 50)), max_size=60), st.integers(2, 6))
# found by hypothesis in CI-like runs: backups queued, every one skipped (its pages left the
# host), so plan_backups returns [] having taken the queue: a change, the generation renewed
@example([(0, 2), (2, 1), (0, 0), (14, 0)], 2)
def test_an_unchanged_generation_means_every_answer_is_unchanged(ops, slots):
    """``generation`` (what kvtier.vllm keeps a chain's host prefix by) is renewed by every
    call that may change the manager (``plan_backups`` only when backups were queued) and by
    no read (taking the recorded events or dropped pages out is a read: vLLM takes them every
    step, and a kept host prefix must survive that); while it is unchanged, every chain's
    ``host_prefix`` and ``lookup`` answers and the occupancy are too; ``occupancy()`` is
    ``usage()``'s figures."""
    m = kvtier.OffloadManager(slots, "lru", "write-through")
    chains = [chain("a", 3), chain("a", 3)[:2] + chain("x", 1), chain("b", 4), chain("c", 1)]
    jobs: list = []

    def answers():
        return ([m.host_prefix(c) for c in chains], [[m.lookup(c, i) for i in range(len(c))] for c in chains],
                m.occupancy())

    for which, slot in ops:
        name, changes, call = _calls(m, chains, jobs, slot)[which]
        gen, before = m.generation, answers()
        queued = m.usage()["backups_queued"]
        _run(call, jobs)
        if changes and not (name == "plan_backups" and queued == 0):  # nothing queued: unchanged
            assert m.generation != gen, f"{name} left the generation as it was"
        else:
            assert m.generation == gen, f"{name} (a read) renewed the generation"
        if m.generation == gen:
            assert answers() == before, f"{name} changed an answer without a new generation"
        u = m.usage()
        assert m.occupancy() == (u["cached"], u["free"], u["locked"], u["held"], u["capacity"])
    m.check()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 50)), max_size=60), st.integers(2, 6))
@example([(0, 0), (2, 1), (0, 2), (0, 0), (2, 2)], 3)  # stores done, an eviction, a failed store
def test_events_and_dropped_pages_come_only_with_a_new_generation(ops, slots):
    """kvtier.vllm's manager takes the recorded events and dropped pages out only when the
    generation moved since it last did (most engine steps change nothing). That is right only
    if no call records an event or drops a page without renewing the generation: after every
    call of the API, events or dropped pages to take imply a new generation."""
    m = kvtier.OffloadManager(slots, "lru", "write-through")
    chains = [chain("a", 3), chain("a", 3)[:2] + chain("x", 1), chain("b", 4), chain("c", 1)]
    jobs: list = []
    drained = m.generation
    for which, slot in ops:
        name, _, call = _calls(m, chains, jobs, slot)[which]
        if name in ("drain_events", "take_dropped"):
            continue  # the takers themselves: taken after every call below
        _run(call, jobs)
        events, dropped = m.drain_events(), m.take_dropped()
        if m.generation == drained:
            assert events == [] and dropped == [], f"{name} recorded {events} / dropped {dropped} unannounced"
        drained = m.generation
    m.check()


def test_no_two_managers_show_one_generation():
    """A manager replaced by a new one (vLLM's reset_cache) never shows a generation the old
    one showed, so an answer kept from the old one is never taken for the new one's."""
    seen = set()
    for _ in range(5):
        m = kvtier.OffloadManager(4)
        assert m.generation not in seen
        seen.add(m.generation)
        m.prepare_store(chain("a", 2), 2)
        assert m.generation not in seen
        seen.add(m.generation)


def test_a_list_that_is_not_a_chain_is_refused_and_never_loads_other_pages():
    """A page hash names one prefix (scheduler/src/offload_chain.rs): a repeated hash, or one
    that followed another page before, is an OffloadManagerError and changes nothing. Before,
    the store was accepted, ``check()`` failed right after, and a load of ``c, c, b, c``
    over a stored ``c, c, a, c`` handed out the slot of ``a`` for ``b``."""
    a, b, c = chain("x", 3)
    m = kvtier.OffloadManager(8)
    before = m.usage()
    with pytest.raises(kvtier.OffloadManagerError, match="not a chain"):
        m.prepare_store([a, b, a], 3)
    with pytest.raises(kvtier.OffloadManagerError, match="not a chain"):
        m.prepare_store([c, c, a, c], 4)
    assert m.usage() == before
    m.check()
    # stored as a chain, a list agreeing with it at its ends only is no hit past the agreement
    d, e = chain("y", 2)
    job, _, slots, _ = m.prepare_store([c, d, a, e], 4)
    m.complete_store(job, "done")
    assert m.host_prefix([c, d, b, e]) == 2
    with pytest.raises(kvtier.OffloadManagerError, match="not a chain"):
        m.prepare_load([c, d, b, e], 0, 4)
    load, read = m.prepare_load([c, d, b, e], 0, 2)
    assert read == slots[:2]
    m.complete_load(load)
    m.check()


def test_a_prefetch_is_completed_with_at_most_its_pages_and_only_as_a_prefetch():
    """The tester's cases: ``complete_prefetch(job, pages + 5)`` was taken as "every page landed"
    (clamped), ``complete_store`` on a prefetch job was accepted ("failed" left its pages
    marked in L3), and a TP agreement took ``PrefetchDone(job, 1000)`` for a 3-page prefetch.
    Each is an error now, and nothing changes."""
    a = chain("p", 3)
    m = kvtier.OffloadManager(8, "lru", "write-through")
    m.l3_found(a)
    job, _, slots, _ = m.prepare_prefetch(a, 3)
    before = m.usage()
    with pytest.raises(kvtier.OffloadManagerError, match="reads 3 pages, 8 reported"):
        m.complete_prefetch(job, len(slots) + 5)
    for outcome in ("done", "failed"):
        with pytest.raises(kvtier.OffloadManagerError, match="is a Prefetch job"):
            m.complete_store(job, outcome)
    assert m.usage() == before
    m.check()
    m.complete_prefetch(job, 3)
    assert m.host_prefix(a) == 3
    m2 = kvtier.OffloadManager(8, "lru", "write-through", tp_ranks=2)
    found_by_every_rank(m2, a)
    j2, *_ = m2.prepare_prefetch(a, 3)
    with pytest.raises(kvtier.AgreementError, match="at most 3"):
        kvtier.RankAgreement().push(kvtier.PrefetchDone(j2, 1000), m2)
    ranks = [kvtier.RankAgreement(), kvtier.RankAgreement()]
    for r in ranks:
        r.push(kvtier.PrefetchDone(j2, 1000))
    with pytest.raises(kvtier.AgreementError, match="at most 3"):
        m2.agree(ranks)
    m2.check()


def test_failed_backups_are_probed_by_an_engine_serving_only_hits():
    """After an outage an engine that stores nothing and reads nothing still backs its failed
    pages up: one ``plan_backups`` in ``probe_every`` (64) plans one waiting run as the probe
    (before: never, as L3 made no other answer); ``usage()['backups_probed']`` counts them."""
    m = kvtier.OffloadManager(8, "lru", "write-through")
    a = chain("probe", 3)
    job, _, _, _ = m.prepare_store(a, 3)
    m.complete_store(job, "done")
    [(b, pages, _)] = m.plan_backups()
    m.complete_backup(b, "failed")
    tried = []
    for _ in range(64):
        for b, pages, _ in m.plan_backups():
            tried.append(pages)
            m.complete_backup(b, "done")
    assert tried == [a] and m.usage()["backups_probed"] == 1
    assert m.plan_backups() == [] and m.usage()["backups_retrying"] == 0  # the probed run, in L3, dropped
