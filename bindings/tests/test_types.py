"""Round trips of every type between Python and Rust, and the shapes of plans."""

import dataclasses
import hashlib
import pickle

import numpy as np
import pytest

import kvtier
from kvtier import _native
from conftest import prompt, small_config


# ---- SchedulerConfig --------------------------------------------------------------------------


def test_config_defaults_are_the_rust_defaults():
    d = kvtier.SchedulerConfig().to_dict()
    assert d == _native.default_config()
    assert set(d) == {f.name for f in dataclasses.fields(kvtier.SchedulerConfig)}


@pytest.mark.parametrize(
    "over",
    [
        {},
        dict(prefetch_stop="best_effort"),
        dict(prefetch_stop="wait_complete"),
        dict(prefetch_stop="timeout", prefetch_timeout_base_ms=7, prefetch_timeout_per_1k_tokens_ms=3),
        dict(write_policy="write_through_selective", write_hit_threshold=3),
        dict(write_policy="write_back", l3_enabled=True),
        dict(retraction="fewest_generated"),
        dict(retraction="most_pages"),
        dict(namespace=dict(model="m", dtype="bf16", layout="tp8", tenant="t", adapter="a"), rank=3, tp_ranks=8),
        dict(host_enabled=False, host_pages=0),
        dict(mixed_prefill_decode=False, keep_device_after_write_back=False, record_kv_events=True),
        dict(eviction="freq-depth:100:3:7"),
        dict(eviction="lru"),
        dict(eviction="adaptive"),
        dict(host_admission="on-device-eviction:16"),
        dict(host_admission="on-finish"),
        dict(eviction="adaptive", host_admission="adaptive:16"),
        dict(eviction="shadow", host_admission="adaptive:16", shadow_sample_salt=2**64 - 1),
        dict(eviction="shadow", shadow_full_size_pages=2**64 - 1),
    ],
)
def test_config_roundtrip(over):
    c = small_config(**over)
    back = _native.config_roundtrip(c)
    expect = c.to_dict()
    if expect["prefetch_stop"] != "timeout":  # parameters only live inside the timeout policy
        for k in ("prefetch_timeout_base_ms", "prefetch_timeout_per_1k_tokens_ms"):
            back[k] = expect[k]
    if expect["write_policy"] != "write_through_selective":
        back["write_hit_threshold"] = expect["write_hit_threshold"]
    assert back == expect
    s = kvtier.Scheduler(c)
    assert s.config()["page_size"] == c.page_size


def test_config_from_dict_and_pickle():
    c = small_config(rank=2, tp_ranks=3)
    assert kvtier.Scheduler(c.to_dict()).config()["rank"] == 2
    assert pickle.loads(pickle.dumps(c)) == c
    assert c.replace(rank=5).rank == 5


def test_config_errors_name_the_field():
    with pytest.raises(kvtier.ConfigError, match="page_size"):
        kvtier.Scheduler(small_config(page_size=0))
    with pytest.raises(kvtier.ConfigError, match="shadow_full_size_pages"):
        kvtier.Scheduler(small_config(eviction="shadow", shadow_full_size_pages=0))
    with pytest.raises((OverflowError, TypeError)):
        kvtier.Scheduler(small_config(eviction="shadow", shadow_full_size_pages=-1))
    with pytest.raises(kvtier.ConfigError):
        small_config(token_budget=2).validate()
    with pytest.raises(ValueError, match="prefetch_stop"):
        kvtier.Scheduler(small_config(prefetch_stop="sometimes"))
    with pytest.raises(TypeError, match="device_pages"):
        kvtier.Scheduler(small_config(device_pages="many"))
    with pytest.raises(OverflowError, match="page_size.*out of range"):
        kvtier.Scheduler(small_config(page_size=-4))
    with pytest.raises(ValueError, match="eviction"):
        kvtier.Scheduler(small_config(eviction="lfu"))
    with pytest.raises(ValueError, match="eviction"):
        kvtier.Scheduler(small_config(eviction="freq-depth:1:99999999999:2"))
    # The short spelling names the measured setting, which comes back spelled out.
    full = kvtier.Scheduler(small_config(eviction="freq-depth")).config()["eviction"]
    assert full.startswith("freq-depth:") and full.count(":") == 3
    with pytest.raises(ValueError, match="host_admission"):
        kvtier.Scheduler(small_config(host_admission="on-device-eviction"))
    with pytest.raises(kvtier.ConfigError, match="host"):
        kvtier.Scheduler(small_config(host_admission="on-device-eviction:4", host_enabled=False, host_pages=0))
    with pytest.raises(kvtier.ConfigError, match="ahead_pages"):
        kvtier.Scheduler(small_config(host_admission="on-device-eviction:0"))
    # The learnt admission follows the adaptive eviction policy only.
    with pytest.raises(kvtier.ConfigError, match="eviction Adaptive"):
        kvtier.Scheduler(small_config(host_admission="adaptive:4", eviction="lru"))
    with pytest.raises(KeyError, match="bogus"):
        kvtier.Scheduler({"bogus": 1})
    with pytest.raises(KeyError):
        kvtier.Scheduler(small_config(namespace={"modle": "x"}))
    assert issubclass(kvtier.ConfigError, ValueError)


# ---- events -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ev",
    [
        kvtier.L3QueryDone(3, 7),
        kvtier.PrefetchDone(4, 0),
        kvtier.LoadBackDone(5),
        kvtier.LoadBackDone(5, False),
        kvtier.WriteBackDone(6, True),
        kvtier.BackUpDone(2**63, False),
        kvtier.ForwardDone(9, [1, 2, 3], np.array([10, 20, 30], dtype=np.uint32), [False, True, False]),
        kvtier.ForwardDone(1, np.array([], dtype=np.uint64), [], None),
    ],
)
def test_event_roundtrip(ev):
    back = _native.event_roundtrip(ev)
    assert type(back) is type(ev)
    assert back == ev
    assert repr(back) == repr(ev)


def test_event_fields():
    ev = kvtier.ForwardDone(9, np.array([1, 2], dtype=np.int64), [7, 8], [True, False])
    assert ev.step == 9 and len(ev) == 2
    assert ev.reqs.dtype == np.uint64 and ev.reqs.tolist() == [1, 2]
    assert ev.tokens.dtype == np.uint32 and ev.tokens.tolist() == [7, 8]
    assert ev.stops.tolist() == [True, False]
    assert kvtier.L3QueryDone(1, 2).hit_pages == 2
    assert kvtier.BackUpDone(1).success is True
    assert kvtier.LoadBackDone(1) == kvtier.LoadBackDone(1, True)
    assert kvtier.LoadBackDone(1) != kvtier.WriteBackDone(1)


# ---- plans -------------------------------------------------------------------------------------


def _ack_all(s, plan):
    for op in plan.ops:
        res = op.num_keys if op.kind == "Prefetch" else (0 if op.kind == "L3Query" else 1)
        s.ops_done([op.id], [op.kind], [res])


def test_plan_prefill_then_decode_columns(cfg):
    s = kvtier.Scheduler(cfg)
    for r in range(3):
        s.submit(r, prompt(r, 10 + r), 6)
    plan = s.next_execution_plan(1)
    assert plan.step is not None and plan.num_decode == 0
    assert [c.req for c in plan.prefill] == [0, 1, 2]
    tables = {}
    for c in plan.prefill:
        assert c.start == 0 and c.last and c.len == 10 + c.req
        assert c.tokens.dtype == np.uint32 and c.tokens.tolist() == prompt(c.req, c.len).tolist()
        assert c.table_from == 0 and c.table_pages.dtype == np.uint32
        assert len(c.table_pages) == -(-c.len // 4)  # ceil: pages the chunk writes
        tables[c.req] = c.table_pages.tolist()
    s.forward_done(plan.step, [c.req for c in plan.prefill], [1, 1, 1])
    lens = {r: 10 + r + 1 for r in range(3)}
    for step in range(5):
        plan = s.next_execution_plan(2 + step)
        _ack_all(s, plan)
        if plan.step is None:
            continue
        n = plan.num_decode
        assert plan.decode_reqs.dtype == np.uint64 and plan.decode_positions.dtype == np.uint32
        assert plan.decode_table_offsets.size == n + 1 and plan.decode_table_offsets[0] == 0
        for i in range(n):
            r = int(plan.decode_reqs[i])
            assert int(plan.decode_positions[i]) == lens[r] - 1
            f = int(plan.decode_table_from[i])
            if f >= 0:
                pages = plan.decode_table_pages[plan.decode_table_offsets[i] : plan.decode_table_offsets[i + 1]]
                tables[r] = tables[r][:f] + pages.tolist()
            # the table covers every token of the sequence
            assert len(tables[r]) * 4 >= lens[r]
        s.forward_done(plan.step, plan.decode_reqs, np.full(n, 5, dtype=np.uint32))
        for r in plan.decode_reqs.tolist():
            lens[r] += 1
    assert all(s.request_tokens(r).size == lens[r] for r in range(3) if s.request_state(r))


def test_plan_ops_fields_and_keys():
    cfg = small_config(l3_enabled=True, prefetch_threshold=1)
    s = kvtier.Scheduler(cfg)
    p = prompt(1, 21)
    s.submit(7, p, 2)
    plan = s.next_execution_plan(0)
    [q] = plan.ops
    assert q.kind == "L3Query" and q.req == 7 and not q.before_forward
    assert q.src_tier is None and q.dst_tier is None and q.src.size == 0 and q.dst.size == 0
    assert q.keys == s.l3_keys(p)[: q.num_keys] and q.num_keys == 5
    arr = q.keys_array()
    assert arr.dtype.kind == "S" and [k.decode() for k in arr] == q.keys
    hashes = kvtier.page_hashes(p, 4)
    assert [k.split(":")[1] for k in q.keys] == [h.tobytes().hex() for h in hashes]
    assert all(k.endswith(":0") for k in q.keys)
    s.on_event(kvtier.L3QueryDone(q.id, 0))  # nothing in L3: compute everything
    plan = s.next_execution_plan(1)
    assert plan.prefill and plan.prefill[0].req == 7
    assert "PlannedOp(" in repr(q) and "ExecutionPlan(" in repr(plan)


def test_page_hashes_match_sglang_formula():
    toks = list(range(1, 10))
    hs = kvtier.page_hashes(toks, 4)
    assert hs.shape == (2, 32) and hs.dtype == np.uint8
    h0 = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in [1, 2, 3, 4])).digest()
    h1 = hashlib.sha256(h0 + b"".join(t.to_bytes(4, "little") for t in [5, 6, 7, 8])).digest()
    assert hs[0].tobytes() == h0 and hs[1].tobytes() == h1


def test_stats_and_kv_events(cfg):
    s = kvtier.Scheduler(cfg.replace(record_kv_events=True))
    s.submit(1, prompt(1, 9), 1)
    while not s.is_idle() or s.live_requests():
        plan = s.next_execution_plan(0)
        _ack_all(s, plan)
        if plan.step is not None:
            s.forward_done(plan.step, [c.req for c in plan.prefill] + plan.decode_reqs.tolist(),
                           [3] * plan.num_rows)
    s.next_execution_plan(0)
    st = s.stats()
    assert st["submitted"] == 1 and st["finished"] == 1 and st["computed_tokens"] == 9
    # every counter of the Rust Stats (these three were missing)
    assert st["l3_lost_nodes"] == st["demotions"] == st["internal_errors"] == 0
    assert set(st["ops"]) == set(kvtier.OP_KINDS)
    assert set(st["device"]) == {"capacity", "free", "held", "cached", "locked"}
    evs = s.drain_kv_events()
    assert evs and {e["type"] for e in evs} <= {"stored", "removed"}
    stored = [e for e in evs if e["type"] == "stored"]
    assert stored[0]["hashes"].shape[1] == 32 and stored[0]["tier"] in ("device", "host")
    assert s.drain_kv_events() == []
    s.check()


def test_request_state_and_tokens(cfg):
    s = kvtier.Scheduler(cfg)
    s.submit(1, [5, 6, 7], 2)
    assert s.request_state(1) == "Submitted"
    assert s.request_tokens(1).tolist() == [5, 6, 7]
    assert s.request_state(2) is None and s.request_tokens(2) is None
    assert s.live_requests() == 1 and not s.is_idle()
