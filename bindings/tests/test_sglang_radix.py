"""kvtier as SGLang's radix-cache backend (``--radix-cache-backend kvtier``) against the real
sglang 0.5.23 on CPU: SGLang's own admission (``PrefillAdder``), allocator, KV and
request-to-token pools, ``prepare_for_extend`` and ``release_kv_cache`` drive it
(``sglang_engine.Engine``), and every reused prefix row is checked against the KV its tokens
were computed with, so a page loaded from the wrong slot or another model's bytes fails."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from sglang_engine import PS, Engine, Mismatch, kvtier_cache, oracle, prompts, sglang_radix
from conftest import L3Process, sigstop


def test_prefixes_come_back_from_host_when_the_device_pool_is_too_small():
    """Four 24-token prompts through a 40-token device pool, twice: SGLang's RadixCache has
    evicted the first round by the second (no hits); with kvtier the second round's prefixes
    come back from host, and each loaded row holds the KV it was computed with."""
    ps = prompts(1, 4, 24)
    runs = {}
    for name, cache in (("sglang", sglang_radix), ("kvtier", kvtier_cache(host_pages=64))):
        e = Engine(cache, device_tokens=40)
        e.run([e.request(p) for p in ps])
        first = list(e.prefix_hits)
        e.run([e.request(p) for p in ps])
        e.check_pools()
        runs[name] = (first, e.prefix_hits[len(first):], e)
    assert runs["sglang"][0] == [0] * 4 and runs["kvtier"][0] == [0] * 4
    assert sum(runs["sglang"][1]) < 24 * 4 / 2, "SGLang alone lost most of round one"
    # SGLang computes a prompt's last token: 20 of 24 tokens (whole pages) is the most a hit gives.
    assert runs["kvtier"][1] == [20] * 4, "every prompt's pages came back (device or host)"
    e = runs["kvtier"][2]
    st_ = e.cache.stats()
    assert st_["host_hit_tokens"] == 80 and st_["load_backs"] == 4 and e.checked_rows == 80
    # SGLang's own per-tier admission metrics see the host hits kvtier reported.
    assert e.adder_hits["host"] == st_["host_hit_tokens"]
    e.cache.manager.check()


def test_an_mla_model_comes_back_from_host_and_l3():
    """SGLang's MLA pool (one latent buffer per layer): pages come back from host, and a second
    engine reads them from L3, bytes as stored."""
    ps = prompts(22, 3, 24)
    store = kvtier.L3Store.embedded(1 << 24)
    e = Engine(kvtier_cache(host_pages=64, store=store), device_tokens=40, mla=True)
    e.run([e.request(p) for p in ps])
    e.run([e.request(p) for p in ps])
    assert e.prefix_hits[3:] == [20] * 3 and e.cache.stats()["host_hit_tokens"] > 0
    e.cache.flush_pending_backups()
    e.cache.wait_io()
    two = Engine(kvtier_cache(host_pages=64, store=store), mla=True)
    two.run([two.request(p) for p in ps])
    assert two.prefix_hits == [20] * 3 and two.cache.stats()["l3_hit_tokens"] == 60
    e.check_pools()
    two.check_pools()


def test_a_corrupted_host_page_is_caught_by_the_oracle():
    """The check can fail: flip one host byte and the reload is a Mismatch."""
    p = prompts(2, 1, 16)[0]
    e = Engine(kvtier_cache(host_pages=16), device_tokens=32)
    e.run([e.request(p)])
    e.run([e.request(q) for q in prompts(3, 1, 20)])  # pushes p off the device
    e.cache.host.view(-1)[3] ^= 0x40
    with pytest.raises(Mismatch):
        e.run([e.request(p)])


def test_two_requests_of_one_step_sharing_a_host_prefix():
    """SGLang re-matches each request right before admitting it, so of two requests sharing
    host pages the second sees the first's load as a device hit. A match older than the
    other's load (both matched, then both admitted) must not insert a second copy of the
    pages under the same node: the load uses the pages already on device."""
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    base = prompts(4, 1, 16)[0]
    e = Engine(kvtier_cache(host_pages=32), device_tokens=48)
    e.run([e.request(base)])
    e.run([e.request(q) for q in prompts(5, 2, 20)])  # base off the device
    a, b = e.request(base + [1, 2, 3, 4]), e.request(base + [5, 6, 7, 8])
    admitted = e.step([a, b])
    assert len(admitted) == 2 and [a.prefix_len, b.prefix_len] == [16, 16]
    assert e.cache.hit_log[-1].device == 16 and e.cache.hit_log[-2].host == 16
    e = Engine(kvtier_cache(host_pages=32), device_tokens=80)
    e.run([e.request(base)])
    e.run([e.request(q) for q in prompts(13, 4, 20)])  # base off the device
    c, d = e.request(base + [1, 1, 1, 1]), e.request(base + [2, 2, 2, 2])
    c.init_next_round_input(e.cache)
    d.init_next_round_input(e.cache)
    assert c.host_hit_length == d.host_hit_length == 16
    adder = PrefillAdder(PS, e.cache, e.alloc, None, 1.0, 1 << 20, None)
    for r in (c, d):
        assert adder.add_one_req(r, has_chunked_req=False, truncation_align_size=None) == AddReqResult.CONTINUE
    assert c.last_node is d.last_node, "one copy of the shared pages"
    assert e.cache.total_size() == e.alloc.size - e.alloc.available_size()
    for r in (c, d):
        r.output_ids.append(7)
        r.kv.kv_committed_len = 0
    e.cache.manager.check()


def test_eviction_under_pressure_never_evicts_a_locked_page():
    """A request keeps its prefix locked while SGLang admits others that need the space: the
    locked pages stay on device (same slots, same bytes) whatever is evicted for them."""
    e = Engine(kvtier_cache(host_pages=64), device_tokens=48)
    p = prompts(6, 1, 16)[0]
    e.run([e.request(p)])
    holder = e.request(p + [9, 9, 9, 9])
    holder.init_next_round_input(e.cache)
    lock = e.cache.lock(holder.last_node)
    slots = e.cache.path_device_indices(holder.last_node).clone()
    e.run([e.request(q) for q in prompts(7, 6, 24)])
    assert torch.equal(e.cache.path_device_indices(holder.last_node), slots)
    row = slots.to(torch.int64)
    got = e.kv.k_buffer[0][row].reshape(len(row), 8)[:, 0]
    assert torch.equal(got, oracle("model-a", None, p))
    e.cache.unlock(lock)
    e.check_pools()


def test_a_second_engine_on_the_same_server_hits_the_firsts_prefixes(server):
    """Engine one backs its host pages up to a kvtier-l3 server; engine two (its own device
    and host tiers, empty) finds them in L3, prefetches and loads them: bytes as stored."""
    ps = prompts(8, 3, 24)
    one = Engine(kvtier_cache(host_pages=64, l3="server", server=server.addr))
    one.run([one.request(p) for p in ps])
    one.cache.wait_io()
    one.cache.flush_pending_backups()
    one.cache.wait_io()
    assert one.cache.stats()["backed_up_pages"] == 18
    two = Engine(kvtier_cache(host_pages=64, l3="server", server=server.addr))
    two.run([two.request(p) for p in ps])
    assert two.prefix_hits == [20] * 3
    s = two.cache.stats()
    assert s["l3_hit_tokens"] == 60 and s["prefetched_pages"] == 15 and s["probes"] == 3
    assert two.adder_hits["storage"] == 60
    # Per request: where its cached prefix came from.
    assert [(h.device, h.host, h.l3) for h in two.cache.hit_log] == [(0, 0, 20)] * 3
    two.check_pools()
    # Another model (or salt) on the same server: no page is shared.
    other = Engine(kvtier_cache(host_pages=64, l3="server", server=server.addr, model="model-b"),
                   model="model-b")
    other.run([other.request(p) for p in ps])
    salted = Engine(kvtier_cache(host_pages=64, l3="server", server=server.addr))
    salted.run([salted.request(p, salt="alice") for p in ps])
    assert other.prefix_hits == [0] * 3 and salted.prefix_hits == [0] * 3
    assert other.cache.stats()["prefetched_pages"] == 0 and salted.cache.stats()["prefetched_pages"] == 0


def test_pipeline_stages_on_one_server_never_share_pages(server):
    """Found by an adversarial tester: two pipeline-parallel stages of one model (same path,
    TP rank and size, row sizes and page size, but other layers, so other KV) on one kvtier-l3
    server had the same namespace, and stage 1 loaded stage 0's pages (a Mismatch: wrong KV).
    The stage (SGLang's ``pp_rank`` of ``pp_size``, and the KV pool's first layer) is part of
    the namespace; the same stage of a second engine still hits."""

    def stage(pp_rank, oracle_model):
        make = kvtier_cache(host_pages=64, l3="server", server=server.addr, model="meta-llama/X")

        def build(params):
            params.pp_rank, params.pp_size = pp_rank, 2
            return make(params)

        return Engine(build, model=oracle_model)

    ps = prompts(21, 2, 24)
    s0 = stage(0, "pp0")
    s0.run([s0.request(p) for p in ps])
    s0.cache.flush_pending_backups()
    s0.cache.wait_io()
    s1 = stage(1, "pp1")
    assert s1.cache.namespace != s0.cache.namespace
    s1.run([s1.request(p) for p in ps])  # a Mismatch before: stage 0's KV served
    assert s1.prefix_hits == [0, 0]
    again = stage(0, "pp0")
    again.run([again.request(p) for p in ps])
    assert again.prefix_hits == [20, 20]


def test_an_l3_loss_mid_prefetch_falls_back_to_recompute(server):
    """Pages L3 loses between the prefetch's start and its read are reported lost and
    recomputed; the request is served from the pages that were read, nothing garbled (a
    24-token prompt matches 5 pages: the last token is always computed)."""
    p = prompts(9, 1, 24)[0]
    one = Engine(kvtier_cache(host_pages=64, l3="server", server=server.addr))
    one.run([one.request(p)])
    one.cache.flush_pending_backups()
    one.cache.wait_io()
    two = Engine(kvtier_cache(host_pages=64, l3="server", server=server.addr, prefetch_wait_ms=0))
    req = two.request(p)
    req.init_next_round_input(two.cache)  # SGLang's match: starts the prefetch, reports no hit
    assert req.host_hit_length == 0
    keys = two.cache.l3_keys(two.cache._chain(p, None, None))
    two.cache.store.remove(keys[3], True)  # L3 loses page 3 before the read
    two.cache.flush_pending_backups()  # the per-step hook reads: pages 0-2 land, 3-5 are lost
    s = two.cache.stats()
    assert s["prefetched_pages"] == 3 and s["prefetch_lost_pages"] == 2
    two.run([req])
    assert two.prefix_hits == [12]
    two.check_pools()
    two.cache.manager.check()


def test_two_salts_never_share_on_host():
    p = prompts(10, 1, 16)[0]
    e = Engine(kvtier_cache(host_pages=64), device_tokens=32)
    e.run([e.request(p, salt="alice")])
    e.run([e.request(q) for q in prompts(11, 1, 20)])
    e.run([e.request(p, salt="bob"), e.request(p)])
    assert e.prefix_hits[-2:] == [0, 0]
    e.run([e.request(p, salt="alice")])
    assert e.prefix_hits[-1] == 12


def test_an_empty_extra_key_is_not_no_extra_key():
    """SGLang's radix tree keeps extra_key "" and None apart (no hit between them on device);
    kvtier's host and L3 tiers merged them (``adapter=extra_key or None``), so a request
    with one hit pages cached under the other (adversarial tester)."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    class WithExtraKey(Engine):
        def request(self, tokens, *, extra=None, max_new=1):
            self.n += 1
            return Req(f"{self.model}-r{self.n}", "", array("q", tokens), SamplingParams(max_new_tokens=max_new),
                       extra_key=extra)

    p = prompts(12, 1, 16)[0]
    e = WithExtraKey(kvtier_cache(host_pages=64), device_tokens=32)
    e.run([e.request(p, extra="")])
    e.run([e.request(q) for q in prompts(13, 1, 20)])  # off the device, kept on host
    e.run([e.request(p)])
    assert e.prefix_hits[-1] == 0
    e.run([e.request(p, extra="")])
    assert e.prefix_hits[-1] == 12
    e.check_pools()


@settings(max_examples=16, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6), st.booleans()), min_size=1, max_size=14),
       st.integers(3, 12), st.sampled_from(["write_through", "write_back"]))
def test_property_any_workload_reads_only_what_was_computed(ops, host_pages, write_policy):
    """Random prompts built from shared stems, random host sizes, either write policy, a small
    device pool: every reused row equals the oracle, no slot leaks, kvtier's tree stays
    consistent, nothing is kept per request after each."""
    stems = prompts(12, 6, 12)
    e = Engine(kvtier_cache(host_pages=host_pages, policy="freq-depth", write_policy=write_policy),
               device_tokens=40)
    for stem, tail, salted in ops:
        e.run([e.request(stems[stem] + list(range(100, 100 + tail)), salt="s" if salted else None)])
        e.check_pools()
        e.cache.manager.check()
        assert e.cache.manager.usage()["cached"] <= host_pages
        assert {k: v for k, v in e.cache.books().items() if v} == {}  # nothing kept per request


def test_tokens_kvtier_cannot_key_stay_device_only_and_nothing_changes():
    """Token ids outside u32 (kvtier hashes u32 pages) are served by SGLang's device tree alone:
    no host page, no error, the host tier untouched."""
    e = Engine(kvtier_cache(host_pages=16), device_tokens=48)
    big = [(1 << 33) + i for i in range(16)]
    e.run([e.request(big)])
    before = e.cache.manager.usage()
    e.run([e.request(big)])
    assert e.prefix_hits == [0, 12] and e.cache.manager.usage() == before and before["cached"] == 0
    e.check_pools()


def test_a_capped_tenant_evicts_its_own_pages_first():
    """kvtier's tenant caps on the host tier: a salted tenant capped at 4 pages keeps at most 4,
    and evicting for it never drops the shared tenant's pages."""
    e = Engine(kvtier_cache(host_pages=12, tenant_caps={"salt-alice": 4}), device_tokens=40)
    shared = prompts(14, 1, 16)[0]
    e.run([e.request(shared)])
    e.run([e.request(p, salt="alice") for p in prompts(15, 3, 16)])
    assert e.cache.manager.tenant_charge("salt-alice") <= 4
    chain = e.cache._chain(shared, None, None)
    assert e.cache.manager.host_prefix(chain) == 4, "the shared prompt's pages stayed on host"
    e.cache.manager.check()


@pytest.mark.parametrize("io_threads", [0, 1], ids=["io-inline", "io-thread"])
@pytest.mark.parametrize("journal", [True, False], ids=["loss-journal", "no-journal"])
def test_l3_losses_the_store_reports_are_not_prefetched(journal, io_threads):
    """A page L3 evicts or loses after its backup: with the store's loss journal, the per-step
    hook tells kvtier (reading the journal inline, or on the I/O thread), which then prefetches
    only the pages before it (nothing lost at read time); without a journal the read finds it
    gone and recomputes. Same hits either way."""
    store = kvtier.L3Store.embedded(1 << 24, loss_journal_keys=1024 if journal else 0)
    e = Engine(kvtier_cache(host_pages=8, store=store, io_threads=io_threads, prefetch_wait_ms=10_000),
               device_tokens=40)
    p = prompts(16, 1, 16)[0]
    e.run([e.request(p)])
    e.run([e.request(q) for q in prompts(17, 3, 20)])  # p leaves device and host (in L3)
    e.cache.wait_io()
    e.cache.flush_pending_backups()
    e.cache.wait_io()
    chain = e.cache._chain(p, None, None)
    assert [e.cache.manager.lookup(chain, i) for i in range(3)] == ["in-l3"] * 3
    store.remove(e.cache.l3_keys(chain)[1], True)
    e.cache.flush_pending_backups()
    e.cache.wait_io()
    s = e.cache.stats()
    assert e.cache.manager.lookup(chain, 1) == ("miss" if journal else "in-l3")
    assert s["l3_lost_pages"] == (1 if journal else 0)
    e.run([e.request(p)])
    assert e.prefix_hits[-1] == 4
    assert e.cache.stats()["prefetch_lost_pages"] == (0 if journal else 2)
    e.check_pools()
    e.cache.manager.check()


@pytest.mark.parametrize("l3", [False, True], ids=["host-only", "with-l3"])
def test_kvtiers_host_events_do_not_pile_up(l3):
    """kvtier keeps host events until they are read; the per-step hook reads them every step,
    so a long-running engine does not grow them (nor the pages it remembers came from L3)."""
    extra = dict(l3="embedded", segment_bytes="16MB") if l3 else {}
    e = Engine(kvtier_cache(host_pages=6, **extra), device_tokens=40)
    e.run([e.request(p) for p in prompts(18, 6, 20)])
    assert e.cache.manager.drain_events() == [] and e.cache.manager.take_dropped() == []


def test_no_prefetch_of_pages_the_device_already_holds():
    """A prompt still on device but evicted from host: L3 holds its pages, and reading them
    back to host would be wasted I/O (the device serves the hit; a checkpoint rewrites host)."""
    e = Engine(kvtier_cache(host_pages=4, l3="embedded", segment_bytes="16MB"), device_tokens=200)
    p = prompts(19, 1, 16)[0]
    e.run([e.request(p)])
    e.run([e.request(q) for q in prompts(20, 2, 16)])  # p leaves host (4 pages), stays on device
    e.cache.wait_io()
    e.cache.flush_pending_backups()
    e.cache.wait_io()
    chain = e.cache._chain(p, None, None)
    assert e.cache.manager.lookup(chain, 0) == "in-l3"
    before = e.cache.stats()["prefetches"]
    e.run([e.request(p)])
    assert e.prefix_hits[-1] == 12 and e.cache.hit_log[-1].device == 12
    assert e.cache.stats()["prefetches"] == before


def test_a_host_pool_full_of_backed_up_pages_takes_the_next_requests_pages():
    """Backups pin their host pages until they end; ended in the per-step hook, the next
    step's request finds them evictable (it stored nothing before: every slot was pinned)."""
    e = Engine(kvtier_cache(host_pages=4, l3="embedded", segment_bytes="16MB"), device_tokens=200)
    for p in prompts(21, 3, 16):
        e.run([e.request(p)])
        assert e.cache.manager.usage()["locked"] == 0
    assert e.cache.stats()["stored_pages"] == 12 and e.cache.stats()["backed_up_pages"] == 12


def test_the_benchmark_runs_and_kvtier_computes_less(monkeypatch, capsys):
    """bench/sglang_radix.py on a small workload (so the documented command does not rot): the
    three engines' table, kvtier computing fewer prefill tokens than SGLang's RadixCache."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import sglang_radix as bench

    monkeypatch.setattr(sys, "argv", ["sglang_radix.py", "--docs", "16", "--doc", "64", "--reqs", "48",
                                      "--layers", "2", "--dim", "16", "--host-docs", "2", "--io-threads", "0"])
    bench.main()
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| SGLang")]
    assert len(rows) == 3
    ratio = [float(r[6]) for r in rows]
    assert ratio[0] == 1.0 and ratio[1] < 1.0 and ratio[2] < ratio[1]


@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 6), st.integers(0, 7)), min_size=1, max_size=12),
       st.integers(4, 10), st.booleans(), st.sampled_from([0, 1]))
def test_property_l3_losses_never_load_garbage(ops, host_pages, journal, io_threads):
    """Random prompts over shared stems through device, a small host and L3, with random L3
    objects removed between steps (with and without a loss journal): every reused row equals
    the oracle, no slot or lock leaks, kvtier's tree stays consistent, and once idle nothing is
    kept per request or per job."""
    stems = prompts(23, 5, 12)
    store = kvtier.L3Store.embedded(1 << 24, loss_journal_keys=1024 if journal else 0)
    e = Engine(kvtier_cache(host_pages=host_pages, store=store, io_threads=io_threads), device_tokens=40)
    for stem, tail, drop in ops:
        e.run([e.request(stems[stem] + list(range(200, 200 + tail)))])
        e.cache.wait_io()
        chain = e.cache._chain(stems[(stem + drop) % 5], None, None)
        if drop % 2:
            try:
                store.remove(e.cache.l3_keys(chain)[drop % len(chain)], True)
            except kvtier.ObjectNotFoundError:
                pass  # never backed up (or already gone)
        e.check_pools()
        e.cache.manager.check()
    e.cache.flush_pending_backups()
    e.cache.wait_io()
    assert {k: v for k, v in e.cache.books().items() if v} == {}  # idle: nothing per request or job


def test_write_back_makes_a_host_pool_near_the_devices_size_useful():
    """Three 24-token prompts in turn, a device pool of 10 pages and a host pool of 14: with
    write-through the host holds copies of what the device holds too and the prompt asked next
    is gone from both (no hit, ever); with write-back the host holds only what the device
    evicted, and prompts come back from it, bytes as computed."""
    ps = prompts(30, 3, 24)
    out = {}
    for policy in ("write_through", "write_back"):
        e = Engine(kvtier_cache(host_pages=14, write_policy=policy), device_tokens=40)
        for _ in range(3):
            e.run([e.request(p) for p in ps])
        e.check_pools()
        e.cache.manager.check()
        out[policy] = (sum(e.prefix_hits), e.cache.stats())
    assert out["write_through"][0] == 0
    assert out["write_back"][0] >= 60 and out["write_back"][1]["host_hit_tokens"] >= 60
    assert out["write_back"][1]["written_back_pages"] == out["write_back"][1]["stored_pages"]
    assert out["write_back"][1]["stored_pages"] < out["write_through"][1]["stored_pages"]


def test_a_stalled_l3_never_holds_back_admission():
    """The L3 server stops answering (a real kvtier-l3 process, SIGSTOPped) while a fresh
    engine serves prompts whose pages it holds. With kvtier's I/O thread (the default) nothing
    in SGLang's scheduler thread waits for the store past a request's ``prefetch_wait_ms``:
    the probe for other engines' pages and the loss journal's read run on the I/O thread like
    reads and writes, so every request is admitted and computed at once (before: each match's
    probe and each step's journal read blocked for the store's whole RPC timeout). Once the
    server answers again the late answers are applied and the cache is consistent."""
    import os
    import signal
    import time

    from test_shm import Proc

    srv = Proc()
    try:
        ps = prompts(51, 3, 24)
        one = Engine(kvtier_cache(host_pages=64, l3="server", server=srv.addr))
        one.run([one.request(p) for p in ps])
        one.cache.flush_pending_backups()
        one.cache.wait_io()
        two = Engine(kvtier_cache(host_pages=64, l3="server", server=srv.addr, io_threads=1,
                                  rpc_timeout_ms=30_000))
        sigstop(srv.p.pid)
        try:
            t0 = time.monotonic()
            two.run([two.request(p) for p in ps])
            stalled = time.monotonic() - t0
        finally:
            os.kill(srv.p.pid, signal.SIGCONT)
        assert stalled < 10, f"admission waited {stalled:.1f} s for a store that does not answer"
        assert two.prefix_hits == [0] * 3, "the store never answered: everything was computed"
        two.check_pools()
        two.cache.wait_io()  # the answers come now
        s = two.cache.stats()
        assert s["probes"] >= 1 and s["store_errors"] == 0
        two.cache.manager.check()
        # A store that answers: on the I/O thread, a match's probe and then the prefetch of what
        # it found end within the request's budget (ample here), so the pages serve this match.
        again = Engine(kvtier_cache(host_pages=64, l3="server", server=srv.addr, io_threads=1,
                                    prefetch_wait_ms=10_000))
        again.run([again.request(p) for p in ps])
        assert again.prefix_hits == [20] * 3 and again.cache.stats()["l3_hit_tokens"] == 60
        again.check_pools()
    finally:
        srv.close()


@pytest.mark.parametrize("how", ["reset", "shutdown"])
def test_a_flush_behind_a_stalled_store_waits_one_timeout_not_one_per_queued_job(how):
    """An adversarial tester's hang: with the L3 server SIGSTOPped, six requests queued 13 L3
    jobs on the I/O thread, and SGLang's ``flush_cache`` (``reset``) then drained them one
    after another, each waiting its whole RPC timeout: 73.5 s at ``rpc_timeout_ms`` 3,000
    (tens of minutes at the default). Once a job finds the store not answering, the jobs not
    yet begun are dropped as failed (``dropped_jobs``); the one running is waited for (it
    reads into host pages reset hands out again). The cache is consistent afterwards and
    serves again once the store answers."""
    import signal
    import time

    from test_shm import Proc

    srv = Proc()
    try:
        timeout_s = 2
        e = Engine(kvtier_cache(host_pages=32, l3="server", server=srv.addr, io_threads=1,
                                rpc_timeout_ms=timeout_s * 1000), device_tokens=60)
        sigstop(srv.p.pid)
        try:
            for p in prompts(9, 6, 24):
                e.run([e.request(p)])
            queued = len(e.cache._jobs)
            assert queued >= 4, f"only {queued} L3 jobs queued: no evidence"
            t0 = time.monotonic()
            getattr(e.cache, how)()
            took = time.monotonic() - t0
        finally:
            os.kill(srv.p.pid, signal.SIGCONT)
        s = e.cache.stats()
        # the job running and at most the next one wait out their timeouts
        assert took < 3 * timeout_s + 2, f"{how} waited {took:.1f} s behind {queued} jobs"
        assert s["dropped_jobs"] >= queued - 2 and s["store_errors"] >= 1, s
        assert not e.cache._jobs
        if how == "reset":
            # the rest of SGLang's flush_cache: its pools are cleared after the tree
            e.alloc.clear()
            e.r2t.clear()
            e.cache.manager.check()
            e.check_pools()
            # the store answers again: the cache serves and backs up as before
            e.run([e.request(p) for p in prompts(10, 2, 24)])
            e.cache.flush_pending_backups()
            e.cache.wait_io()
            assert e.cache.stats()["backed_up_pages"] > 0
    finally:
        srv.close()


@settings(max_examples=12, deadline=None)
@given(st.sampled_from([1, 3, 16]), st.lists(st.tuples(st.integers(0, 3), st.integers(0, 36)), min_size=1, max_size=8),
       st.sampled_from(["write_through", "write_back"]))
def test_property_page_sizes_and_ragged_prompts_read_only_what_was_computed(page_size, ops, write_policy):
    """The other tests run 4-token pages. SGLang's default page size 1, an odd one (3) and 16,
    prompts cut to any length (a multiple of none of them), a small host pool, L3 behind it:
    every reused row equals the oracle, nothing leaks; then a fresh engine on the same store
    (empty device and host) gets each prompt's whole pages back from L3, bytes as computed."""
    stems = prompts(41, 4, 37)
    store = kvtier.L3Store.embedded(1 << 24)
    dev = -(-96 // page_size) * page_size
    e = Engine(kvtier_cache(host_pages=max(4, 48 // page_size), store=store, write_policy=write_policy),
               page_size=page_size, device_tokens=dev)
    seen = []
    for stem, cut in ops:
        p = stems[stem][: 37 - cut]
        seen.append(p)
        e.run([e.request(p)])
        e.check_pools()
        e.cache.manager.check()
    e.cache.flush_pending_backups()
    e.cache.wait_io()
    two = Engine(kvtier_cache(host_pages=64, store=store), page_size=page_size, device_tokens=dev)
    last = seen[-1]
    two.run([two.request(last)])
    # SGLang computes a prompt's last token: its whole pages before that are the most a hit gives
    want = (len(last) - 1) // page_size * page_size
    if write_policy == "write_through":  # written back only once evicted from the device
        assert two.prefix_hits == [want], (len(last), two.cache.stats())
    two.check_pools()


def _run_chunked(e, reqs, chunk, max_steps=200):
    """SGLang's scheduler loop with chunked prefill (``--chunked-prefill-size chunk``): the
    request cut by ``PrefillAdder`` continues next step (``add_chunked_req``) after its chunk
    is checkpointed (the scheduler's ``stash_chunked_request``); the others finish."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, ScheduleBatch
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    waiting, chunked = list(reqs), None
    for _ in range(max_steps):
        if not waiting and chunked is None:
            return
        if chunked is not None and chunked.extend_end > chunked.prefix_len:
            checkpoint_kv_cache(chunked, e.cache)
        adder = PrefillAdder(e.ps, e.cache, e.alloc, None, 1.0, 1 << 20, chunk)
        if chunked is not None:
            chunked.init_next_round_input()
            chunked = adder.add_chunked_req(chunked)
        for req in list(waiting):
            req.init_next_round_input(e.cache)
            if adder.add_one_req(req, has_chunked_req=chunked is not None,
                                 truncation_align_size=None) != AddReqResult.CONTINUE:
                break
        e.adder_hits["host"] += adder.log_host_hit_tokens
        e.adder_hits["storage"] += adder.log_storage_hit_tokens
        if adder.new_chunked_req is not None:
            chunked = adder.new_chunked_req
        admitted = list(adder.can_run_list)
        if admitted:
            batch = ScheduleBatch.init_new(admitted, e.r2t, e.alloc, e.cache, e.mc, False,
                                           SpeculativeAlgorithm.NONE, chunked_req=chunked)
            batch.prepare_for_extend()
            e._forward(batch)
            for r in admitted:
                if r in waiting:
                    waiting.remove(r)
                if r is chunked:
                    continue
                e.prefix_hits.append(r.prefix_len)
                r.output_ids.append(7)
                r.finished_reason = FINISH_LENGTH(length=1)
                release_kv_cache(r, e.cache, checkpoint=True)
        e.cache.flush_pending_backups()
    raise AssertionError("requests never finished")


@pytest.mark.parametrize("l3", [False, True], ids=["host", "l3"])
def test_chunked_prefill_stores_and_reuses_every_chunk(l3):
    """SGLang's chunked prefill (the tests' engine prefills a prompt in one step): a 30-token
    prompt in 8-token chunks is checkpointed after each chunk; the next prompts with that
    prefix (a smaller device pool: the first is evicted) get its pages back from host, or
    from L3 in a fresh engine, a host hit itself chunked, every reused row as computed."""
    store = kvtier.L3Store.embedded(1 << 24) if l3 else None
    stem = prompts(43, 1, 30)[0]
    e = Engine(kvtier_cache(host_pages=64, store=store), device_tokens=48)
    _run_chunked(e, [e.request(stem)], chunk=8)
    e.check_pools()
    if l3:
        e.cache.wait_io()
        e.cache.flush_pending_backups()
        e.cache.wait_io()
        assert e.cache.stats()["backed_up_pages"] == 7
        e = Engine(kvtier_cache(host_pages=64, store=store), device_tokens=48)
    else:
        _run_chunked(e, [e.request(q) for q in prompts(44, 2, 20)], chunk=8)  # evicts the stem
    _run_chunked(e, [e.request(stem + [5, 6, 7, 8, 9, 10])], chunk=8)
    rec = e.cache.hit_log[-1]  # 7 whole pages of the stem: 28 tokens
    assert rec.device + rec.host + rec.l3 == 28, (rec, e.cache.stats())
    assert rec.l3 == 28 if l3 else rec.host > 0
    e.check_pools()
    e.cache.manager.check()


@pytest.mark.parametrize("page_size", [1, 2])
def test_write_back_pages_are_not_evicted_by_a_later_match_before_their_backup(page_size):
    """With ``write_back`` and an L3, a device eviction puts a path on host, its only copy, and
    its backup was started only at the step's end; SGLang matches the step's other waiting
    requests meanwhile, and their L3 prefetches evicted those host pages first (page sizes 1 and
    2: the fourth prompt of round two was computed again, by this engine and by a fresh one on
    the same L3; write-through reused it: this test failed). Now the backup starts, pinning the
    pages, when they are written back: every prompt reused, bytes checked by the oracle."""
    store = kvtier.L3Store.embedded(1 << 26)
    ps = prompts(1, 4, 24)
    e = Engine(kvtier_cache(host_pages=64 // page_size, store=store, write_policy="write_back"),
               page_size=page_size, device_tokens=40)
    e.run([e.request(p) for p in ps])
    e.run([e.request(p) for p in ps])
    assert e.prefix_hits[4:] == [24 - page_size] * 4
    e.check_pools()
    e.cache.manager.check()
    assert e.cache.stats()["backed_up_pages"] == 4 * (24 // page_size)


def test_an_l3_server_stopped_and_restarted_mid_run_costs_reuse_never_bytes():
    """The L3 server (in the process) shuts down mid-run and comes back empty on its address. While it
    is down the engine serves on (store errors counted, nothing raised); the pages it held
    before are gone, and a request for them (host evicted its copy) recomputes them, checked
    by the oracle; the client reconnects and pages stored after the restart are backed up, so a
    fresh engine on the server gets them from L3. What the engine computed while the server was
    down had left the 12 host pages by the time a backup succeeded again, so it is not in L3
    either (a failed backup is tried again only while its pages are on host:
    test_pages_whose_backup_failed_while_the_l3_server_was_down_are_backed_up_once_it_is_back)."""
    srv = kvtier.L3Server(64 << 20)
    addr = srv.addr
    before, down, after = prompts(71, 3, 24), prompts(72, 3, 24), prompts(73, 6, 24)
    one = Engine(kvtier_cache(host_pages=12, l3="server", server=addr, rpc_timeout_ms=3000), device_tokens=40)
    try:
        one.run([one.request(p) for p in before])
        one.cache.flush_pending_backups()
        srv.shutdown()
        one.run([one.request(p) for p in down])
        assert one.cache.stats()["store_errors"] > 0 and one.cache.stats()["backup_failures"] > 0
        srv = kvtier.L3Server(64 << 20, addr=addr)
        backed = one.cache.stats()["backed_up_pages"]
        one.run([one.request(p) for p in after])
        one.cache.flush_pending_backups()
        s = one.cache.stats()
        assert s["backed_up_pages"] == backed + 6 * 6, "backups resume after the restart"
        assert s["host_backups_retrying"] == 0 and s["host_backups_given_up"] == 0, "the failed ones left host"
        one.run([one.request(p) for p in before])  # off host, lost from L3: computed again
        assert one.prefix_hits[-3:] == [0] * 3
        one.check_pools()
        one.cache.manager.check()
        two = Engine(kvtier_cache(host_pages=64, l3="server", server=addr), device_tokens=200)
        for group in (after, down):
            two.run([two.request(p) for p in group])
        assert two.prefix_hits == [20] * 6 + [0] * 3 and two.cache.stats()["l3_hit_tokens"] == 120
        two.check_pools()
    finally:
        srv.shutdown()


def test_pages_whose_backup_failed_while_the_l3_server_was_down_are_backed_up_once_it_is_back():
    """A ``kvtier-l3`` server process is killed mid-run and restarted empty on its address.
    The prefixes computed while it was down stay on host, their backups failed; while it is
    down idle steps try nothing again (no RPC per step for them). Once a backup succeeds
    after the restart, the next steps back them up (kvtier's retry of failed backups), so a
    second engine gets them from L3. Before, a failed backup was never tried again: the
    second engine computed them ([0, 0, 0])."""
    srv = L3Process()
    before, down, after = prompts(81, 2, 24), prompts(82, 3, 24), prompts(83, 1, 24)
    one = Engine(kvtier_cache(host_pages=64, l3="server", server=srv.addr, rpc_timeout_ms=2000), device_tokens=200)
    try:
        one.run([one.request(p) for p in before])
        one.cache.flush_pending_backups()
        backed = one.cache.stats()["backed_up_pages"]
        assert backed == 2 * 6
        srv.kill()
        one.run([one.request(p) for p in down])
        one.cache.flush_pending_backups()
        s = one.cache.stats()
        assert s["backup_failures"] > 0 and s["backed_up_pages"] == backed
        assert s["host_backups_retrying"] > 0, "the failed backups wait to be tried again"
        started = s["backups"]
        for _ in range(3):
            one.cache.flush_pending_backups()
        assert one.cache.stats()["backups"] == started, "a backup tried again before the store answered"
        srv = srv.restart()
        one.run([one.request(p) for p in after])
        for _ in range(3):  # engine steps: the retries go out once a backup has succeeded
            one.cache.flush_pending_backups()
        s = one.cache.stats()
        assert s["backed_up_pages"] == backed + 6 * (1 + 3), s
        assert s["host_backups_retrying"] == 0 and s["host_backups_given_up"] == 0
        one.check_pools()
        one.cache.manager.check()
        two = Engine(kvtier_cache(host_pages=64, l3="server", server=srv.addr), device_tokens=200)
        two.run([two.request(p) for p in down + after])
        assert two.prefix_hits == [20] * 4 and two.cache.stats()["l3_hit_tokens"] == 80
        two.check_pools()
    finally:
        srv.kill()


@pytest.mark.parametrize("io_threads", [0, 1], ids=["io-inline", "io-thread"])
def test_aborted_requests_and_failed_prefetches_leave_no_books(io_threads):
    """A long-running scheduler: requests aborted before any match, after their probe or
    prefetch started, after their prefetch landed (a host hit promised, never loaded), a
    prefetch whose L3 read fails (the store lost the pages; no journal told kvtier), and
    requests served whole. Once idle, every per-request and per-job book of the cache
    (``books()``: by SGLang's request handle and rid, the L3 jobs) is empty and the native
    manager holds, locks and moves nothing, after one workload and after a second."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome

    store = kvtier.L3Store.embedded(1 << 24, loss_journal_keys=0)
    one = Engine(kvtier_cache(host_pages=64, store=store))
    two = Engine(kvtier_cache(host_pages=8, store=store, io_threads=io_threads, prefetch_wait_ms=0),
                 device_tokens=40)
    c = two.cache

    def abort(req):  # SGLang's abort of a request that is not running
        c.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)

    def hook():
        c.flush_pending_backups()
        c.wait_io()

    def workload(seed):
        ps = prompts(seed, 3, 16)
        one.run([one.request(p) for p in ps])  # in L3, unknown to two: two probes
        one.cache.flush_pending_backups()
        one.cache.wait_io()
        own = prompts(seed + 1, 1, 16)[0]
        two.run([two.request(own)])
        hook()  # backed up
        two.run([two.request(q) for q in prompts(seed + 2, 3, 20)])  # own leaves device and host
        hook()
        chain = c._chain(own, None, None)
        assert c.manager.lookup(chain, 0) == "in-l3"
        abort(two.request(ps[0]))  # before SGLang matched it
        probed = two.request(ps[1])
        probed.init_next_round_input(c)  # its probe (inline: and its prefetch) started
        abort(probed)
        for k in c.l3_keys(chain):
            store.remove(k, True)
        failing = two.request(own)
        failing.init_next_round_input(c)  # a prefetch of pages L3 no longer has
        hook()  # the read fails: the pages are lost, the request computes them
        landed = two.request(ps[2])
        for _ in range(3):  # probe, prefetch, then a host hit promised
            landed.init_next_round_input(c)
            hook()
        assert landed.host_hit_length > 0
        abort(landed)  # never loaded
        two.run([failing])
        hook()
        two.check_pools()
        c.manager.check()
        return {k: v for k, v in c.books().items() if v}

    assert workload(50) == {}
    assert workload(60) == {}
    s = c.stats()
    assert s["probes"] > 0 and s["prefetched_pages"] > 0 and s["prefetch_lost_pages"] > 0, s


def test_a_failed_copy_to_device_hands_its_device_slots_back():
    """A load-back whose host → device copy raises (a CUDA error, a bad pool) passes the error
    on, and the device slots it took for the copy go back to SGLang's allocator: the pool
    holds as many free slots as before it, and the manager's load job is closed."""
    p = prompts(2, 1, 16)[0]
    e = Engine(kvtier_cache(host_pages=16), device_tokens=32)
    e.run([e.request(p)])
    e.run([e.request(q) for q in prompts(3, 1, 20)])  # pushes p off the device
    e.check_pools()

    def broken(slots, dev):
        raise RuntimeError("copy failed")

    e.cache._copy_to_device = broken
    with pytest.raises(RuntimeError, match="copy failed"):
        e.run([e.request(p)])
    assert e.cache.counters.load_backs == 0, "a failed load is not counted as one"
    e.check_pools()
    e.cache.manager.check()
