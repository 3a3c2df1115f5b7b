"""Tensor-parallel agreement from Python: two ranks' schedulers fed different L3 answers agree
through ``kvtier.RankAgreement`` (an in-process stand-in for ``torch.distributed.all_reduce``
with MIN), and ``plan.digest`` shows when they do not."""

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier

from conftest import found_by_every_rank, prompt, run_ranks, small_config


def _ranks(**over):
    return [kvtier.Scheduler(small_config(l3_enabled=True, prefetch_threshold=1, rank=r, tp_ranks=2, **over))
            for r in (0, 1)]


def _all_reduce_min(arrays):
    m = np.minimum.reduce(arrays)

    def reduce(v):
        v[:] = m  # in place, as torch.distributed.all_reduce does

    return reduce


def _probe_round(ranks, hits, agreed):
    """Both ranks plan, answer their L3Query with their own hit count, and plan again."""
    plans = [s.next_execution_plan(0, digest=True) for s in ranks]
    assert plans[0].digest == plans[1].digest
    agrees = [kvtier.RankAgreement() for _ in ranks]
    for s, a, p, h in zip(ranks, agrees, plans, hits):
        (op,) = [o for o in p.ops if o.kind == "L3Query"]
        ev = kvtier.L3QueryDone(op.id, h)
        a.push(ev) if agreed else s.on_event(ev)
    if agreed:
        red = _all_reduce_min([a.values(s) for s, a in zip(ranks, agrees)])
        for s, a in zip(ranks, agrees):
            for ev in a.reduce(s, red):
                s.on_event(ev)
            assert a.pending() == 0
    return [s.next_execution_plan(1, digest=True) for s in ranks]


def test_agreed_ranks_plan_the_same_prefetch():
    ranks = _ranks()
    for s in ranks:
        s.submit(1, prompt(1, 41), 2)
    p0, p1 = _probe_round(ranks, hits=[10, 6], agreed=True)
    assert p0.digest == p1.digest
    (f0,), (f1,) = [[o for o in p.ops if o.kind == "Prefetch"] for p in (p0, p1)]
    assert len(f0.keys) == len(f1.keys) == 6  # the minimum
    assert [k.rsplit(":", 1)[0] for k in f0.keys] == [k.rsplit(":", 1)[0] for k in f1.keys]


def test_unreduced_ranks_diverge_and_the_digest_says_so():
    ranks = _ranks()
    for s in ranks:
        s.submit(1, prompt(1, 41), 2)
    p0, p1 = _probe_round(ranks, hits=[10, 6], agreed=False)
    assert p0.digest != p1.digest


def test_an_op_waits_until_every_rank_finished_it():
    ranks = _ranks()
    for s in ranks:
        s.submit(1, prompt(1, 41), 2)
    plans = [s.next_execution_plan(0) for s in ranks]
    a0, a1 = kvtier.RankAgreement(), kvtier.RankAgreement()
    a0.push(kvtier.L3QueryDone(plans[0].ops[0].id, 4))  # rank 1 not done yet
    red = _all_reduce_min([a0.values(ranks[0]), a1.values(ranks[1])])
    assert a0.reduce(ranks[0], red) == [] and a1.reduce(ranks[1], red) == []
    assert a0.pending() == 1 and ranks[0].ops_in_flight() == 1


def test_mla_leader_probes_for_everyone():
    ranks = _ranks(l3_sharing="replicated", l3_leader_rank=0)
    for s in ranks:
        s.submit(1, prompt(1, 41), 2)
    plans = [s.next_execution_plan(0) for s in ranks]
    (q0,), (q1,) = [p.ops for p in plans]
    assert q0.keys == q1.keys  # one set of keys: the leader's
    assert ranks[0].runs_here(q0) and not ranks[1].runs_here(q1)
    a0, a1 = kvtier.RankAgreement(), kvtier.RankAgreement()
    a0.push(kvtier.L3QueryDone(q0.id, 7))
    a1.skip(q1.id)
    red = _all_reduce_min([a0.values(ranks[0]), a1.values(ranks[1])])
    assert a1.reduce(ranks[1], red) == [kvtier.L3QueryDone(q1.id, 7)]  # the leader's answer
    assert a0.reduce(ranks[0], red) == [kvtier.L3QueryDone(q0.id, 7)]


def test_a_rank_cannot_skip_an_op_it_runs():
    """An adversarial tester's wrong data: a skip (another rank answers for all) of an op this
    rank runs itself was taken, and the other rank's answer became this rank's (3 prefetched
    pages it never read landed as host hits). Refused: checked at once, unchecked by the
    reduction, after the collective, with nothing agreed."""
    ranks, (q,) = _probing()
    with pytest.raises(kvtier.AgreementError, match="runs"):
        kvtier.RankAgreement().skip(q, ranks[1])
    a0, a1 = kvtier.RankAgreement(), kvtier.RankAgreement()
    a0.push(kvtier.L3QueryDone(q, 7))
    a1.skip(q)
    assert a1.values(ranks[1]).tolist() == [0], "the skipping rank enters with the op not done"
    red = _all_reduce_min([a0.values(ranks[0]), a1.values(ranks[1])])
    with pytest.raises(kvtier.AgreementError, match="runs"):
        a1.reduce(ranks[1], red)
    assert a0.reduce(ranks[0], red) == []
    # the replicated leader runs the probe; the other rank may skip it
    ranks = _ranks(l3_sharing="replicated", l3_leader_rank=0)
    for s in ranks:
        s.submit(1, prompt(1, 41), 2)
    (q0,), (q1,) = [s.next_execution_plan(0).ops for s in ranks]
    with pytest.raises(kvtier.AgreementError, match="runs"):
        kvtier.RankAgreement().skip(q0.id, ranks[0])
    kvtier.RankAgreement().skip(q1.id, ranks[1])


def test_bad_reductions_raise():
    (s, _) = _ranks()
    s.submit(1, prompt(1, 41), 2)
    s.next_execution_plan(0)
    a = kvtier.RankAgreement()
    with pytest.raises(ValueError):
        a.reduce(s, lambda v: np.zeros(3, dtype=np.int64))  # wrong length
    with pytest.raises(ValueError):
        a.reduce(s, lambda v: np.full(1, -1, dtype=np.int64))
    with pytest.raises(TypeError):
        a.reduce(s, lambda v: "nope")
    with pytest.raises(ValueError):
        a.push(kvtier.ForwardDone(1, [1], [2]))
    with pytest.raises(ValueError):
        kvtier.Scheduler(small_config(l3_sharing="sometimes"))
    assert s.ops_in_flight() == 1  # nothing applied


def test_a_reduced_value_above_this_ranks_own_is_refused():
    # A SUM or MAX all-reduce configured by mistake hands back values no MIN can produce: a
    # larger hit count than this rank found, or a completion of an op this rank has not
    # finished. Refused with a typed error; nothing recorded is consumed or applied.
    (s, _) = _ranks()
    s.submit(1, prompt(1, 41), 2)
    s.submit(2, prompt(2, 41), 2)
    q0, q1 = [o.id for o in s.next_execution_plan(0).ops]
    a = kvtier.RankAgreement()
    a.push(kvtier.L3QueryDone(q0, 3))  # this rank found 3 pages, and has not finished q1
    for bad in ([4 + 1, 0], [3 + 1, 5 + 1], [0, 2 + 1]):
        with pytest.raises(kvtier.AgreementError, match="not the minimum"):
            a.reduce(s, lambda v, bad=bad: np.array(bad, dtype=np.int64))
        assert a.pending() == 1 and s.ops_in_flight() == 2
    assert isinstance(kvtier.AgreementError("x"), ValueError)  # as before: a ValueError
    assert a.reduce(s, lambda v: np.array([2 + 1, 0], dtype=np.int64)) == [kvtier.L3QueryDone(q0, 2)]
    assert a.pending() == 0


def _step_both(ranks, agrees, t, agreed):
    """One step on both ranks: plan, every op answered the same (no L3 hits, successes),
    completions reduced, losses agreed (when `agreed`), the forward run. Returns the digests."""
    plans = [s.next_execution_plan(t, digest=True) for s in ranks]
    for s, a, p in zip(ranks, agrees, plans):
        for op in p.ops:
            res = 0 if op.kind == "L3Query" else (op.num_keys if op.kind == "Prefetch" else 1)
            if agreed:
                a.push(_EVENTS[op.kind](op.id, res if op.kind in ("L3Query", "Prefetch") else True))
            else:
                s.ops_done([op.id], [op.kind], [res])
    if agreed:
        red = _all_reduce_min([a.values(s) for s, a in zip(ranks, agrees)])
        for s, a in zip(ranks, agrees):
            for ev in a.reduce(s, red):
                s.on_event(ev)
        words = [a.loss_words() for a in agrees]
        for s, a in zip(ranks, agrees):
            a.agree_losses(s, lambda w: words)  # an in-process all_gather
    for s, p in zip(ranks, plans):
        if p.step is not None:
            reqs = [c.req for c in p.prefill] + p.decode_reqs.tolist()
            s.forward_done(p.step, reqs, [5] * len(reqs))
    return [p.digest for p in plans]


_EVENTS = {
    "L3Query": kvtier.L3QueryDone,
    "Prefetch": kvtier.PrefetchDone,
    "LoadBack": kvtier.LoadBackDone,
    "WriteBack": kvtier.WriteBackDone,
    "BackUp": kvtier.BackUpDone,
}


def _losses_run(mode, overflow):
    """Two ranks serve a prompt, rank 0's store loses 3 keys of its shard (or its journal
    overflows) and only rank 0 hears; then both serve a longer prompt. ``mode``: "agreed"
    (recorded on rank 0's agreement, agreed by both), "one-sided" (rank 0 applies it alone,
    the other rank skips the collective), "direct" (rank 0 calls ``Scheduler.l3_lost`` as a
    single-rank engine does: refused), "silent" (never reported). Returns the digests."""
    ranks = _ranks()
    agrees = [kvtier.RankAgreement() for _ in ranks]
    digests = []
    p = prompt(1, 41)
    for s in ranks:
        s.submit(1, p, 2)
    for t in range(40):
        digests.append(_step_both(ranks, agrees, t, mode != "one-sided"))
    assert all(s.is_idle() for s in ranks)
    keys = ranks[0].l3_keys(p)[:3]
    if mode == "agreed":
        agrees[0].lost_all() if overflow else agrees[0].lost(ranks[0], keys)
        assert agrees[0].pending_losses() == ((0, True) if overflow else (3, False))
    elif mode == "one-sided":
        alone = kvtier.RankAgreement()
        alone.lost_all() if overflow else alone.lost(ranks[0], keys)
        alone.agree_losses(ranks[0], lambda w: [w, kvtier.RankAgreement().loss_words()])
    elif mode == "direct":
        with pytest.raises(kvtier.LossNeedsAgreementError, match=r"RankAgreement\W+lost.*agree_losses"):
            ranks[0].l3_lost_all() if overflow else ranks[0].l3_lost(keys)
    for s in ranks:
        s.submit(2, prompt(1, 45), 2)
    for t in range(40, 80):
        digests.append(_step_both(ranks, agrees, t, mode != "one-sided"))
    return digests


@pytest.mark.parametrize("overflow", [False, True])
def test_one_sided_losses_are_agreed(overflow):
    assert any(d0 != d1 for d0, d1 in _losses_run("one-sided", overflow)), "unagreed ranks diverge"
    assert all(d0 == d1 for d0, d1 in _losses_run("agreed", overflow))


@pytest.mark.parametrize("overflow", [False, True])
def test_a_tp_ranks_direct_loss_report_is_refused_and_changes_nothing(overflow):
    """Issue 33 (5a): a scheduler that is one rank of several refuses ``l3_lost`` /
    ``l3_lost_all`` with ``LossNeedsAgreementError`` (a ``SchedulerError``) naming the
    agreement; nothing changes, so the run is step for step the one in which the loss was never
    reported, and the ranks do not diverge."""
    direct = _losses_run("direct", overflow)
    assert direct == _losses_run("silent", overflow)
    assert all(d0 == d1 for d0, d1 in direct)
    assert issubclass(kvtier.LossNeedsAgreementError, kvtier.SchedulerError)
    single = kvtier.Scheduler(small_config(l3_enabled=True))  # one rank: the direct path stays
    assert single.l3_lost(single.l3_keys(prompt(1, 8))) == 0 and single.l3_lost_all() >= 0


def test_an_agreement_over_another_number_of_ranks_is_refused():
    """The agreement checks that the scheduler knows its group (``tp_ranks``): a rank 0 left at
    the default ``tp_ranks=1`` is caught at its first agreement; a rank >= tp_ranks at
    construction. Nothing changes."""
    s = kvtier.Scheduler(small_config(l3_enabled=True))
    a = kvtier.RankAgreement()
    assert a.lost(s, s.l3_keys(prompt(1, 8))) == 2
    with pytest.raises(kvtier.AgreementError, match="tp_ranks"):
        a.agree_losses(s, lambda w: [w, kvtier.RankAgreement().loss_words()])
    assert a.pending_losses() == (2, False)
    with pytest.raises(kvtier.ConfigError, match="tp_ranks"):
        kvtier.Scheduler(small_config(rank=1))
    with pytest.raises(kvtier.ConfigError, match="tp_ranks"):
        kvtier.Scheduler(small_config(tp_ranks=0))
    with pytest.raises(kvtier.ConfigError, match="leader"):
        kvtier.Scheduler(small_config(tp_ranks=2, l3_sharing="replicated", l3_leader_rank=2))


def test_single_rank_engines_refuse_a_tp_ranks_scheduler():
    """kvtier.engine.Engine answers ops and losses on one rank: a scheduler of a TP group is
    refused at construction (``ConfigError`` naming ``tp_ranks``), not at its first loss."""
    from kvtier.engine import Engine

    with pytest.raises(kvtier.ConfigError, match="tp_ranks"):
        Engine(kvtier.Scheduler(small_config(rank=1, tp_ranks=2)))
    Engine(kvtier.Scheduler(small_config())).s.is_idle()


def test_bad_loss_words_raise_and_change_nothing():
    (s, _) = _ranks()
    a = kvtier.RankAgreement()
    none = kvtier.RankAgreement().loss_words()
    assert a.lost(s, s.l3_keys(prompt(1, 8)) + ["junk"]) == 2
    with pytest.raises(kvtier.AgreementError, match="tag"):
        a.agree_losses(s, lambda w: [w, np.array([1, 2, 3], dtype=np.int64)])
    with pytest.raises(kvtier.AgreementError, match="own"):
        a.agree_losses(s, lambda w: [none, none])
    with pytest.raises(kvtier.AgreementError, match="tp_ranks"):
        a.agree_losses(s, lambda w: [w])
    with pytest.raises(TypeError):
        a.agree_losses(s, lambda w: 5)
    assert a.pending_losses() == (2, False)
    padded = lambda w: [np.concatenate([w, np.zeros(4, dtype=np.int64)]), none]  # noqa: E731
    assert a.agree_losses(s, padded) == 0  # nothing of it was marked in L3
    assert a.pending_losses() == (0, False)


# ---- what an agreement accepts from its rank ----------------------------------------------------
#
# An agreed event is exactly one every rank reported (or skipped), of the op's kind, within the
# op's bounds, for an op in flight; anything else never becomes an event: a completion of another
# kind or a count above the op's is a typed error before the collective that changes nothing, a
# record of an op not in flight is dropped at the next reduction (``dropped()``).


class _Wait(Exception):
    """Raised by a collective that has not heard from every rank yet."""


def _collective(ranks, agrees):
    """Every rank's ``reduce`` through a blocking MIN all-reduce, simulated in one process: in a
    first round each rank enters the collective (its values recorded; it then waits, raising
    ``_Wait``, which leaves it unchanged), and every rank must enter (one that refused before
    it would leave the others waiting for ever); a second round hands each the minimum.
    Returns ``(events per rank, refusals)``; a refused rank's events are ``None``."""
    entered = []
    for s, a in zip(ranks, agrees):

        def enter(v):
            entered.append(np.array(v))
            raise _Wait

        with pytest.raises(_Wait):
            a.reduce(s, enter)
    assert len(entered) == len(ranks), "every rank enters the collective"
    m = np.minimum.reduce(entered)
    events, refusals = [], []
    for s, a in zip(ranks, agrees):
        try:
            events.append(a.reduce(s, lambda v: m))
        except kvtier.AgreementError as e:
            events.append(None)
            refusals.append(e)
    return events, refusals


def _probing(n=1):
    ranks = _ranks()
    for s in ranks:
        for i in range(n):
            s.submit(i + 1, prompt(i + 1, 41), 2)  # 10 keys probed each
    ops = [[o.id for o in s.next_execution_plan(0).ops] for s in ranks]
    assert ops[0] == ops[1] and len(ops[0]) == n
    return ranks, ops[0]


def test_a_completion_of_another_kind_is_refused_and_never_agreed():
    """The tester's case: ``on_event(LoadBackDone(op))`` for an L3 probe raises
    ``WrongCompletionKindError``; pushed through the agreement (LoadBackDone on rank 0,
    BackUpDone on rank 1) it came out as ``L3QueryDone(op, hit_pages=1)``."""
    ranks, (q,) = _probing()
    agrees = [kvtier.RankAgreement(), kvtier.RankAgreement()]
    agrees[0].push(kvtier.LoadBackDone(q, True))
    agrees[1].push(kvtier.BackUpDone(q, True))
    events, refusals = _collective(ranks, agrees)
    assert events == [None, None] and len(refusals) == 2
    assert "L3Query" in str(refusals[0]) and "LoadBack" in str(refusals[0])
    assert [a.pending() for a in agrees] == [1, 1]
    assert [s.ops_in_flight() for s in ranks] == [1, 1]
    # The values never complete the op, so a rank that answered right gets nothing either.
    assert [a.values(s).tolist() for s, a in zip(ranks, agrees)] == [[0], [0]]
    ranks, (q,) = _probing()
    agrees = [kvtier.RankAgreement(), kvtier.RankAgreement()]
    agrees[0].push(kvtier.WriteBackDone(q, True))
    agrees[1].push(kvtier.L3QueryDone(q, 4))
    m = np.minimum(agrees[0].values(ranks[0]), agrees[1].values(ranks[1]))
    assert agrees[1].reduce(ranks[1], lambda v: m) == []
    with pytest.raises(kvtier.AgreementError, match="WriteBack"):
        agrees[0].reduce(ranks[0], lambda v: m)
    assert [a.pending() for a in agrees] == [1, 1]


def test_a_count_above_the_ops_is_refused_before_anything_is_consumed():
    """``hit_pages=999`` on every rank (10 keys probed) passed the reduction and was refused by
    ``on_event`` after the record was consumed; now refused first, the record kept."""
    ranks, (q,) = _probing()
    agrees = [kvtier.RankAgreement(), kvtier.RankAgreement()]
    for a in agrees:
        a.push(kvtier.L3QueryDone(q, 999))
    events, refusals = _collective(ranks, agrees)
    assert events == [None, None] and len(refusals) == 2 and "999" in str(refusals[0])
    assert [a.pending() for a in agrees] == [1, 1] and ranks[0].ops_in_flight() == 1


def test_records_of_ops_not_in_flight_never_complete_a_later_op():
    """A push for an op id not issued yet was kept, and completed that op (ids are sequential)
    once it was issued, with the value this rank never produced; a duplicate of an agreed op
    was kept for ever. Both are dropped at the next reduction and counted."""
    ranks, (q,) = _probing()
    agrees = [kvtier.RankAgreement(), kvtier.RankAgreement()]
    agrees[0].push(kvtier.L3QueryDone(q + 1, 5))  # the next op's id
    events, _ = _collective(ranks, agrees)
    assert events == [[], []] and agrees[0].pending() == 0
    for s in ranks:
        s.submit(9, prompt(9, 41), 2)
    assert [[o.id for o in s.next_execution_plan(1).ops] for s in ranks] == [[q + 1], [q + 1]]
    agrees[1].push(kvtier.L3QueryDone(q + 1, 5))
    events, _ = _collective(ranks, agrees)
    assert events == [[], []], "rank 0 never ran it"
    for a in agrees:
        a.push(kvtier.L3QueryDone(q, 2))
    agrees[0].push(kvtier.L3QueryDone(q + 1, 3))
    events, _ = _collective(ranks, agrees)
    assert events == [[kvtier.L3QueryDone(q, 2), kvtier.L3QueryDone(q + 1, 3)]] * 2
    for s, evs in zip(ranks, events):
        for ev in evs:
            s.on_event(ev)
    agrees[0].push(kvtier.L3QueryDone(q, 2))  # again, after it was agreed
    assert _collective(ranks, agrees)[0] == [[], []] and agrees[0].pending() == 0
    assert [a.dropped() for a in agrees] == [2, 0]


def test_a_push_checked_against_the_scheduler_is_refused_at_once():
    """``push(event, scheduler)`` / ``skip(op, scheduler)``: refused (``AgreementError``,
    nothing recorded) unless the op is in flight there and the completion of its kind, within
    its count; this also closes the window between a push and the op's issue."""
    ranks, (q,) = _probing()
    s = ranks[0]
    a = kvtier.RankAgreement()
    for ev, why in (
        (kvtier.L3QueryDone(q + 1, 1), "not in flight"),
        (kvtier.LoadBackDone(q, True), "LoadBack"),
        (kvtier.L3QueryDone(q, 11), "11"),
    ):
        with pytest.raises(kvtier.AgreementError, match=why):
            a.push(ev, s)
    with pytest.raises(kvtier.AgreementError, match="not in flight"):
        a.skip(q + 1, s)
    with pytest.raises(kvtier.AgreementError):
        a.push(kvtier.ForwardDone(1, [1], [2]), s)
    assert a.pending() == 0
    a.push(kvtier.L3QueryDone(q, 10), s)
    with pytest.raises(kvtier.AgreementError, match="already recorded"):
        a.push(kvtier.L3QueryDone(q, 10), s)
    m, _, job = _backing_up()
    with pytest.raises(kvtier.AgreementError, match="BackUp"):
        a.push(kvtier.PrefetchDone(job, 1), m)
    a.push(kvtier.BackUpDone(job, True), m)
    assert a.pending() == 2


def _backing_up():
    """A write-through manager of two ranks with one backup job in flight (pages ``c``)."""
    m = kvtier.OffloadManager(4, "lru", "write-through", tp_ranks=2)
    c = [hashlib.sha256(b"%d" % i).digest() for i in range(2)]
    j, *_ = m.prepare_store(c, 2)
    m.complete_store(j, "done")
    [(job, _, _)] = m.plan_backups()
    return m, c, job


def test_an_offload_managers_backup_is_not_completed_by_another_kind():
    """PrefetchDone / L3QueryDone pushed for a backup job became ``BackUpDone(success=True)``:
    the pages were marked in L3 though no backup ran. Refused as a whole (also when one rank
    answered right), nothing consumed on any rank."""
    for right in (False, True):
        m, c, job = _backing_up()
        r0, r1 = kvtier.RankAgreement(), kvtier.RankAgreement()
        r0.push(kvtier.BackUpDone(job, True) if right else kvtier.PrefetchDone(job, 1))
        r1.push(kvtier.L3QueryDone(job, 7))
        with pytest.raises(kvtier.AgreementError, match="BackUp"):
            m.agree([r0, r1])
        assert (r0.pending(), r1.pending()) == (1, 1)
        assert [m.lookup(c, i) for i in range(2)] == ["hit", "hit"] and m.usage()["backups"] == 1
        m.check()


def test_the_same_ranks_agreement_twice_is_refused():
    """``agree([r, r])`` raised PyO3's bare ``RuntimeError("Already borrowed")``; now the
    module's ``AgreementError`` saying so, and nothing changes."""
    m = kvtier.OffloadManager(8, "lru", "write-through", tp_ranks=2)
    a = [hashlib.sha256(b"x%d" % i).digest() for i in range(3)]
    found_by_every_rank(m, a)
    job, _, _, _ = m.prepare_prefetch(a, 1)
    r, other = kvtier.RankAgreement(), kvtier.RankAgreement()
    r.push(kvtier.PrefetchDone(job, 3))
    for ranks in ([r, r], [other, other]):
        with pytest.raises(kvtier.AgreementError, match="twice"):
            m.agree(ranks)
    assert r.pending() == 1 and [m.lookup(a, i) for i in range(3)] == ["pending"] * 3
    other.push(kvtier.PrefetchDone(job, 2))
    assert m.agree([r, other]) == 1
    assert [m.lookup(a, i) for i in range(3)] == ["hit", "hit", "miss"]
    m.check()


def test_a_collective_may_read_the_agreements_it_reduces():
    """The Scheduler's side of the same problem: ``reduce`` and ``agree_losses`` held their
    agreement borrowed while calling the engine's collective, so an in-process collective that
    reads it (``values``, ``loss_words``) raised ``RuntimeError("Already mutably borrowed")``.
    Reducing over a manager does not change it (its generation stays)."""
    ranks, (q,) = _probing()
    agrees = [kvtier.RankAgreement(), kvtier.RankAgreement()]
    for a in agrees:
        a.push(kvtier.L3QueryDone(q, 3))
    seen = []

    def both(v):  # the first rank to get here reads every rank's values: the minimum for all
        seen.append(np.minimum(agrees[0].values(ranks[0]), agrees[1].values(ranks[1])))
        return seen[0]

    assert [a.reduce(s, both) for s, a in zip(ranks, agrees)] == [[kvtier.L3QueryDone(q, 3)]] * 2
    agrees[0].lost(ranks[0], ranks[0].l3_keys(prompt(1, 8)))
    gathered = lambda w: [a.loss_words() for a in agrees]  # noqa: E731
    for s, a in zip(ranks, agrees):
        a.agree_losses(s, gathered)
    assert [a.pending_losses() for a in agrees] == [(0, False), (0, False)]
    m, _, _ = _backing_up()
    g = m.generation
    r = kvtier.RankAgreement()
    r.values(m)
    assert r.reduce(m, lambda v: v) == [] and m.generation == g


_KINDS = ("L3Query", "Prefetch", "LoadBack", "WriteBack", "BackUp")


def _event(kind, op, n):
    return _EVENTS[kind](op, n) if kind in ("L3Query", "Prefetch") else _EVENTS[kind](op, n % 2 == 0)


# Per op and rank: nothing, a skip, or a completion (its kind, its count; 10 keys are probed).
_record = st.one_of(
    st.none(), st.just("skip"), st.tuples(st.sampled_from(_KINDS), st.integers(0, 12))
)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 3),
    records=st.lists(st.tuples(_record, _record), min_size=5, max_size=5),
)
def test_an_agreed_event_is_exactly_one_every_rank_reported(n, records):
    """Property: over ops in flight and ops not (``records[n:]``: ids after them), whatever
    each rank recorded, either some rank refuses before the collective (it recorded a
    completion of another kind than an op in flight, or above its 10 keys) and nothing changes
    on any rank, or every rank gets the same events: one per op in flight that every rank
    answered (or skipped, not all), of its kind, with the minimum count; the scheduler takes
    them all, and nothing about ops not in flight is kept."""
    ranks, ops = _probing(n)
    ids = ops + [ops[-1] + k for k in range(1, 6 - n)]
    agrees = [kvtier.RankAgreement(), kvtier.RankAgreement()]
    for op, pair in zip(ids, records):
        for a, rec in zip(agrees, pair):
            if rec == "skip":
                a.skip(op)
            elif rec is not None:
                a.push(_event(rec[0], op, rec[1]))
    live = dict(zip(ops, records))
    # per-rank keys: each rank runs its own probes, so a skip of one is refused too
    bad = [any((isinstance(p[r], tuple) and (p[r][0] != "L3Query" or p[r][1] > 10)) or p[r] == "skip"
               for p in live.values())
           for r in (0, 1)]
    before = [(a.pending(), a.values(s).tolist(), s.ops_in_flight()) for s, a in zip(ranks, agrees)]
    events, refusals = _collective(ranks, agrees)
    if any(bad):
        # The refused ranks raise; the others agree nothing (a refused rank enters with every
        # op "not done"), so the ranks do not part ways.
        assert len(refusals) == sum(bad)
        assert [e is None for e in events] == bad and all(e == [] for e in events if e is not None)
        after = [(a.pending(), a.values(s).tolist(), s.ops_in_flight()) for s, a in zip(ranks, agrees)]
        for r in (0, 1):
            if bad[r]:
                assert after[r] == before[r]  # nothing of a refused rank changes
            else:  # nothing agreed: its ops' records kept (records of ops not in flight dropped)
                assert after[r][1:] == before[r][1:]
        return
    assert refusals == [] and events[0] == events[1]
    want = []
    for op, pair in live.items():
        if all(p is not None for p in pair) and pair != ("skip", "skip"):
            want.append(kvtier.L3QueryDone(op, min(p[1] for p in pair if p != "skip")))
    assert events[0] == want
    for s, evs in zip(ranks, events):
        for ev in evs:
            s.on_event(ev)
        s.check()
    agreed = {e.op for e in want}
    for r, a in enumerate(agrees):
        assert a.pending() == sum(1 for op, p in live.items() if p[r] is not None and op not in agreed)
        assert a.dropped() == sum(1 for p in records[n:] if p[r] is not None)


def _gloo_rank(rank, port, out):
    """One rank of a real gloo group: rank 0 answers the probe with a completion of another
    kind (refused), rank 1 with the right one; both reduce through ``dist.all_reduce`` (MIN),
    then meet in one more collective, as the next engine step would."""
    import datetime
    import traceback

    try:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=15))
        s = kvtier.Scheduler(small_config(l3_enabled=True, prefetch_threshold=1, rank=rank, tp_ranks=2))
        s.submit(1, prompt(1, 41), 2)
        (q,) = [o.id for o in s.next_execution_plan(0).ops]
        a = kvtier.RankAgreement()
        a.push(kvtier.LoadBackDone(q, True) if rank == 0 else kvtier.L3QueryDone(q, 4))

        def all_min(v):
            t = torch.from_numpy(v)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)

        try:
            got = ("events", len(a.reduce(s, all_min)))
        except kvtier.AgreementError as e:
            got = ("refused", str(e))
        except RuntimeError as e:  # the collective itself failed (a peer never entered it)
            got = ("collective failed", str(e)[:200])
        nxt = torch.tensor([rank + 1])
        dist.all_reduce(nxt)  # the next step's collective: the group is still in step
        out.put((rank, (got, int(nxt), a.pending(), s.ops_in_flight())))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 (reported to the test)
        out.put((rank, (traceback.format_exc(), None, None, None)))


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_rank_that_refuses_its_record_still_enters_the_collective():
    """A rank whose record is refused raised before the all-reduce, and the other ranks waited
    in it for ever (here: until gloo's 15 s timeout). The refusing rank now enters with its
    refused records as "not done" (the others agree nothing for that op) and raises after it;
    the group stays in step."""
    res = run_ranks(_gloo_rank, ())
    (got0, n0, pend0, fl0), (got1, n1, pend1, fl1) = res[0], res[1]
    assert got0[0] == "refused" and "LoadBack" in got0[1], got0
    assert got1 == ("events", 0), got1  # rank 1 waited for ever before: "collective failed"
    assert n0 == n1 == 3  # both met in the next collective
    assert (pend0, fl0) == (pend1, fl1) == (1, 1)  # nothing agreed, nothing consumed


def test_a_loss_recorded_while_the_words_are_gathered_waits_for_the_next_round():
    """``agree_losses`` lets go of its agreement while ``all_gather`` runs (above), so another
    thread may record a loss then. The agreement checked the union against every loss
    recorded so far: this rank raised ``AgreementError`` (its own losses missing) while the
    other ranks applied the union, and the ranks' L3 marks diverged. Now the words sent are
    what is checked and consumed; the late loss is agreed at the next round."""
    m = kvtier.OffloadManager(8, "lru", "write-through", tp_ranks=2)
    a = [hashlib.sha256(b"y%d" % i).digest() for i in range(3)]
    found_by_every_rank(m, a)
    r0, r1 = kvtier.RankAgreement(), kvtier.RankAgreement()
    r0.lost_pages(a[2:])

    def gather(w):  # another thread's loss report lands while the words are gathered
        r0.lost_pages(a[1:2])
        return [w, r1.loss_words()]

    assert r0.agree_losses(m, gather) >= 1
    assert [m.lookup(a, i) for i in range(3)] == ["in-l3", "in-l3", "miss"]
    assert r0.pending_losses() == (1, False)
    r0.agree_losses(m, lambda w: [w, r1.loss_words()])
    assert [m.lookup(a, i) for i in range(3)] == ["in-l3", "miss", "miss"]
    assert r0.pending_losses() == (0, False)
    m.check()
