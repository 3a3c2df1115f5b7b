"""Tensor-parallel agreement from Python: two ranks' schedulers fed different L3 answers agree
through ``kvtier.RankAgreement`` (an in-process stand-in for ``torch.distributed.all_reduce``
with MIN), and ``plan.digest`` shows when they do not."""

import numpy as np
import pytest

import kvtier

from conftest import prompt, small_config


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
