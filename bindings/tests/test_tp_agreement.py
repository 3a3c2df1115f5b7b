"""Tensor-parallel agreement from Python: two ranks' schedulers fed different L3 answers agree
through ``kvtier.RankAgreement`` (an in-process stand-in for ``torch.distributed.all_reduce``
with MIN), and ``plan.digest`` shows when they do not."""

import numpy as np
import pytest

import kvtier

from conftest import prompt, small_config


def _ranks(**over):
    return [kvtier.Scheduler(small_config(l3_enabled=True, prefetch_threshold=1, rank=r, **over)) for r in (0, 1)]


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


def _losses_run(agreed, overflow):
    ranks = _ranks()
    agrees = [kvtier.RankAgreement() for _ in ranks]
    digests = []
    p = prompt(1, 41)
    for s in ranks:
        s.submit(1, p, 2)
    for t in range(40):
        digests.append(_step_both(ranks, agrees, t, agreed))
    assert all(s.is_idle() for s in ranks)
    # Rank 0's store lost 3 keys of its shard (or its journal overflowed); only rank 0 hears.
    keys = ranks[0].l3_keys(p)[:3]
    if agreed:
        agrees[0].lost_all() if overflow else agrees[0].lost(ranks[0], keys)
        assert agrees[0].pending_losses() == ((0, True) if overflow else (3, False))
    else:
        ranks[0].l3_lost_all() if overflow else ranks[0].l3_lost(keys)
    for s in ranks:
        s.submit(2, prompt(1, 45), 2)
    for t in range(40, 80):
        digests.append(_step_both(ranks, agrees, t, agreed))
    return digests


@pytest.mark.parametrize("overflow", [False, True])
def test_one_sided_losses_are_agreed(overflow):
    assert any(d0 != d1 for d0, d1 in _losses_run(False, overflow)), "unagreed ranks diverge"
    assert all(d0 == d1 for d0, d1 in _losses_run(True, overflow))


def test_bad_loss_words_raise_and_change_nothing():
    (s, _) = _ranks()
    a = kvtier.RankAgreement()
    assert a.lost(s, s.l3_keys(prompt(1, 8)) + ["junk"]) == 2
    with pytest.raises(kvtier.AgreementError, match="tag"):
        a.agree_losses(s, lambda w: [np.array([1, 2, 3], dtype=np.int64)])
    with pytest.raises(kvtier.AgreementError, match="own"):
        a.agree_losses(s, lambda w: [np.array(w[:3]) * 0 + [w[0], 0, 0]])
    with pytest.raises(TypeError):
        a.agree_losses(s, lambda w: 5)
    assert a.pending_losses() == (2, False)
    padded = lambda w: [np.concatenate([w, np.zeros(4, dtype=np.int64)])]  # noqa: E731
    assert a.agree_losses(s, padded) == 0  # nothing of it was marked in L3
    assert a.pending_losses() == (0, False)
