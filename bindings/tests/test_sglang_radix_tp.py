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



# Attention DP over two DP ranks: DP rank 0 serves DP_PROMPTS[0], DP rank 1 DP_PROMPTS[1]:
# other prompts, and another count of them (so another count of matches, probes and steps).
DP_PROMPTS = [PROMPTS, [np.random.default_rng(60 + i).integers(1, 50_000, 24).tolist() for i in range(2)]]


def _dp_built(e, rank, attn_tp, whole, attn_group, conf):
    """SGLang's ``create_tree_cache`` for ``--radix-cache-backend kvtier`` on global ``rank`` of
    TP ``2 * attn_tp`` with ``--attn-dp-size 2``, as SGLang's scheduler builds it: the build
    context names the whole TP group, ``params.tp_cache_group`` is ``get_dp_tp_group()``'s CPU
    group (the DP rank's attention-TP group)."""
    import types

    from sglang.srt.mem_cache import registry
    from sglang.srt.runtime_context import get_parallel

    from kvtier.sglang import plugin
    from sglang_engine import publish_server_args

    plugin.register()
    os.environ[kr.ENV_CONFIG] = conf
    e.tp_cache_group = attn_group
    tp = 2 * attn_tp
    args = publish_server_args(["--model-path", "dp-model", "--device", "cpu", "--radix-cache-backend", "kvtier",
                                "--tp", str(tp), "--attn-dp-size", "2"])
    try:
        with get_parallel().override(tp_rank=rank, attn_tp_rank=rank % attn_tp, attn_dp_rank=rank // attn_tp,
                                     attn_cp_rank=0):
            ctx = registry.TreeCacheBuildContext(
                server_args=args, params=e, is_hybrid_swa=False, is_hybrid_ssm=False,
                enable_hierarchical_cache=False, tp_worker=None,
                model_config=types.SimpleNamespace(model_path="dp-model"), tp_size=tp, tp_rank=rank,
                tp_group=types.SimpleNamespace(cpu_group=whole), disable_radix_cache=False)
            return registry.create_tree_cache(ctx)
    finally:
        publish_server_args()


def _dp_rank(rank, port, addr, attn_tp, out):
    try:
        from datetime import timedelta

        import torch.distributed as dist

        # A collective paired across DP ranks waits for a partner that never comes: gloo gives
        # up after `wait` (an error each rank reports), not the default 30 minutes.
        wait = timedelta(seconds=20)
        world = 2 * attn_tp
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=wait)
        whole = dist.new_group(list(range(world)), backend="gloo", timeout=wait)
        groups = [dist.new_group(list(range(d * attn_tp, (d + 1) * attn_tp)), backend="gloo", timeout=wait)
                  for d in range(2)]
        dp, attn = divmod(rank, attn_tp)
        conf = '{"host_pages": 64, "l3": "server", "server": "%s", "io_threads": 0, "prefetch_wait_ms": 0}' % addr
        model = f"dp-model.head-shard{attn}"  # the heads of attention-TP rank `attn`, on either DP rank
        prompts = DP_PROMPTS[dp]

        def cache(params):
            return _dp_built(params, rank, attn_tp, whole, groups[dp], conf)

        one = Engine(cache, model=model)
        one.run([one.request(p) for p in prompts])
        one.cache.flush_pending_backups()
        backed = one.cache.stats()["backed_up_pages"]
        dist.barrier(whole)  # every DP rank's pages are in L3
        two = Engine(cache, model=model)
        c, store = two.cache, two.cache.store
        if dp == 0:  # DP rank 0: L3 losses (one-sided under attention-TP 2, as above)
            if attn == attn_tp - 1:  # a loss only this rank's store knows of, before any probe
                store.remove(c.l3_keys(c._chain(prompts[0], None, None))[3], True)
            dist.barrier(groups[dp])
            req = two.request(prompts[1])
            req.init_next_round_input(c)  # the probe and prefetch of prompt 1's five pages
            if attn == 0:  # ... and rank 0 loses page 2 of it before the read
                store.remove(c.l3_keys(c._chain(prompts[1], None, None))[2], True)
            req0 = two.request(prompts[0])
            req0.init_next_round_input(c)  # the probe: page 3 lost (on one rank), pages 0-2 found
            dist.barrier(groups[dp])
            c.flush_pending_backups()  # the per-step hook: the reads, then the agreement
            two.run([req, req0, two.request(prompts[2])])
        else:  # DP rank 1, meanwhile: its own requests, no loss of its own
            reqs = [two.request(p) for p in prompts]
            for r in reqs:
                r.init_next_round_input(c)  # each a probe and a prefetch of its five pages
            c.flush_pending_backups()
            two.run(reqs)
            two.run([two.request(prompts[0] + list(range(5, 13)))])  # six pages on device, a probe past them
        two.check_pools()
        c.flush_pending_backups()  # idle: the last step's L3 jobs end and are agreed
        c.wait_io()
        books = {k: v for k, v in c.books().items() if v}
        s = c.stats()
        res = dict(hits=two.prefix_hits, usage=c.manager.usage(), rows=two.checked_rows, backed=backed,
                   lost=s["prefetch_lost_pages"], agreements=c.agreements, books=books,
                   key=c.l3_keys([bytes(32)])[0].rsplit(":", 1)[1], place=(c.tp_size, c.tp_rank))
        dist.barrier(whole)
        out.put((rank, res))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 (reported to the test)
        out.put((rank, traceback.format_exc()))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("attn_tp", [2, 1])
def test_attention_dp_ranks_agree_within_their_attention_tp_group_only(attn_tp):
    """TP ``2 * attn_tp`` with attention DP 2 (``--attn-dp-size 2``: DeepSeek's usual
    deployment), built by SGLang's ``create_tree_cache`` as its scheduler does: ``2 * attn_tp``
    processes on one L3 server. Each DP rank serves its own requests (3 prompts on DP rank 0; 2
    and a longer one on DP rank 1: other counts of matches, probes and steps), its KV split over
    its ``attn_tp`` ranks. DP rank 0's ranks agree on its L3 losses (one-sided under
    attention-TP 2); DP rank 1, probing and prefetching meanwhile, takes every page of its
    prompts from L3, unchanged by DP rank 0's probes and losses. Every reused row is the
    oracle's, the books are empty at idle on every rank, nothing hangs. With the whole TP group
    agreeing (the backend before 2026-12-07) the first probe's collective waits for a partner
    serving the other DP rank's requests: gloo's timeout on both layouts (this test failed)."""
    srv = kvtier.L3Server(1 << 24)
    try:
        res = run_ranks(_dp_rank, (srv.addr, attn_tp), timeout=60, ranks=2 * attn_tp)
    finally:
        srv.shutdown()
    for r, v in res.items():
        assert isinstance(v, dict), f"rank {r} failed:\n{v}"
    dps = [[res[d * attn_tp + a] for a in range(attn_tp)] for d in range(2)]
    for pair in dps:  # each DP rank's attention-TP ranks agree, each on its own shard
        a = pair[0]
        assert all(b["hits"] == a["hits"] and b["usage"] == a["usage"] and b["lost"] == a["lost"] and
                   b["agreements"] == a["agreements"] for b in pair)
        assert [b["place"] for b in pair] == [(attn_tp, i) for i in range(attn_tp)]
        assert [b["key"] for b in pair] == [str(i) for i in range(attn_tp)]  # its shard's L3 keys
        assert (a["agreements"] > 0) == (attn_tp > 1)  # one rank alone agrees with no one
    assert [r["backed"] for r in dps[0]] == [18] * attn_tp and [r["backed"] for r in dps[1]] == [12] * attn_tp
    # DP rank 0: pages 0-1 of prompt 1 (page 2 lost mid-prefetch) and pages 0-2 of prompt 0
    # (page 3 lost before the probe), then all of prompt 2.
    assert dps[0][0]["hits"] == [8, 12, 20] and dps[0][0]["lost"] == 3
    # DP rank 1: every page of its prompts from L3, then the longer prompt's six on device.
    assert dps[1][0]["hits"] == [20, 20, 24] and dps[1][0]["lost"] == 0
    for r in res.values():
        assert r["books"] == {}
        assert r["rows"] == sum(r["hits"])
