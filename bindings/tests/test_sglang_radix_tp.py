"""kvtier's radix-cache backend under tensor parallelism: two ranks (two processes, forked
after SGLang is imported) on a gloo group, each an SGLang engine of SGLang's own pieces holding
its KV shard (the oracle differs per rank), on one ``kvtier-l3`` server. L3 losses one rank
sees and the other does not (a rank's object removed before the probe, another during a
prefetch) must lead both ranks to the same decisions: the same host hits and prefix lengths
for every request, the same host tree (``usage``), and bytes that are each rank's own. Without
the agreement the ranks diverge (the test runs that too and sees it): SGLang's TP ranks would
then compute different batches."""

from __future__ import annotations

import os
import traceback

import numpy as np
import pytest

import kvtier
from conftest import run_ranks
from sglang_engine import Engine

from kvtier.sglang import radix as kr

PROMPTS = [np.random.default_rng(40 + i).integers(1, 50_000, 24).tolist() for i in range(3)]


def _rank(rank, port, addr, agree, out):
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        group = dist.new_group([0, 1], backend="gloo")
        conf = kr.RadixBackendConfig.from_dict(dict(host_pages=64, l3="server", server=addr, io_threads=0,
                                                    prefetch_wait_ms=0))
        model = f"tp-model.rank{rank}"  # each rank's shard: its own KV content

        class Unagreed(kr.KvtierRadixCache):
            def _all_min(self, v):  # each rank keeps its own outcome: no agreement
                pass

            def _agree_found(self, pages):  # each rank marks what its own probe found
                self._agreement.found_pages(pages)
                self._agreement.agree_found(self.manager, lambda w: [w, w])

        def cache(params, cls=kr.KvtierRadixCache):
            return cls(params, conf, model="tp-model", tp_rank=rank, tp_size=2, tp_group=group)

        one = Engine(cache, model=model)
        one.run([one.request(p) for p in PROMPTS])
        one.cache.flush_pending_backups()
        assert one.cache.stats()["backed_up_pages"] == 18
        dist.barrier(group)
        two = Engine(cache if agree else (lambda p: cache(p, Unagreed)), model=model)
        store = two.cache.store
        if rank == 1:  # a loss only rank 1's store knows of, before any probe
            store.remove(two.cache.l3_keys(two.cache._chain(PROMPTS[0], None, None))[3], True)
        dist.barrier(group)
        req = two.request(PROMPTS[1])
        req.init_next_round_input(two.cache)  # SGLang's match: starts the prefetch of prompt 1's five pages
        if rank == 0:  # ... and rank 0 loses page 2 of it before the read
            store.remove(two.cache.l3_keys(two.cache._chain(PROMPTS[1], None, None))[2], True)
        req0 = two.request(PROMPTS[0])
        req0.init_next_round_input(two.cache)  # the probe: rank 1 finds 3 pages, rank 0 all 5
        dist.barrier(group)
        two.cache.flush_pending_backups()  # the per-step hook: the reads, then the agreement
        two.run([req, req0, two.request(PROMPTS[2])])
        two.check_pools()
        two.cache.flush_pending_backups()  # idle: the last step's L3 jobs end and are agreed
        two.cache.wait_io()
        books = {k: v for k, v in two.cache.books().items() if v}
        s = two.cache.stats()
        out.put((rank, dict(hits=two.prefix_hits, usage=two.cache.manager.usage(), rows=two.checked_rows,
                            lost=s["prefetch_lost_pages"], agreements=two.cache.agreements, books=books)))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 (reported to the test)
        out.put((rank, traceback.format_exc()))


def _run(agree):
    srv = kvtier.L3Server(1 << 24)
    try:
        res = run_ranks(_rank, (srv.addr, agree), timeout=240)
    finally:
        srv.shutdown()
    for r, v in res.items():
        assert isinstance(v, dict), f"rank {r} failed:\n{v}"
    return res[0], res[1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_two_ranks_agree_on_one_sided_l3_losses():
    r0, r1 = _run(agree=True)
    # Prompt 1: rank 0 lost page 2 mid-prefetch -> both take pages 0-1 from L3 (8 tokens).
    # Prompt 0: rank 1 lost page 3 before the probe -> both take pages 0-2 (12 tokens).
    assert r0["hits"] == r1["hits"] and r0["hits"][:2] == [8, 12]
    assert r0["usage"] == r1["usage"]
    assert r0["agreements"] == r1["agreements"] > 0
    # Idle, nothing is kept per request or per job on either rank (outcomes waiting for the
    # agreement included): docs/sglang.md, "What kvtier keeps per request".
    assert r0["books"] == r1["books"] == {}
    assert r0["rows"] == r1["rows"] == sum(r0["hits"])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_without_agreement_the_ranks_diverge():
    r0, r1 = _run(agree=False)
    assert r0["hits"] != r1["hits"]
