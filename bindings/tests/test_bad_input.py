"""Bad input from Python: every case raises a Python exception (or returns a code); none
crashes the interpreter. The process running these tests is the proof."""

import threading

import numpy as np
import pytest

import kvtier
from conftest import prompt, small_config


def test_wrong_types_to_the_scheduler(cfg):
    s = kvtier.Scheduler(cfg)
    with pytest.raises(TypeError):
        s.submit("one", [1, 2], 3)
    with pytest.raises(TypeError):
        s.submit(1, "abcd", 3)
    with pytest.raises(TypeError):
        s.submit(1, [1, "x"], 3)
    with pytest.raises(TypeError):
        s.submit(1, None, 3)
    with pytest.raises(TypeError):
        s.submit(1, [[1, 2]], 3)
    with pytest.raises(TypeError):
        s.on_event("ForwardDone")
    with pytest.raises(TypeError):
        s.on_event(None)
    with pytest.raises(TypeError):
        kvtier.Scheduler(42)
    with pytest.raises(TypeError):
        s.next_execution_plan("soon")
    with pytest.raises(TypeError):
        s.forward_done(1, 5, [1])


def test_negative_and_huge_numbers(cfg):
    s = kvtier.Scheduler(cfg)
    with pytest.raises(OverflowError):
        s.submit(-1, [1, 2], 3)
    with pytest.raises(OverflowError):
        s.submit(1, [1, -2], 3)
    with pytest.raises(OverflowError):
        s.submit(1, [1, 2**32], 3)
    with pytest.raises(OverflowError):
        s.submit(1, np.array([1, -2], dtype=np.int64), 3)
    with pytest.raises(OverflowError):
        s.submit(1, [1, 2], -3)
    with pytest.raises(OverflowError):
        s.submit(2**64, [1, 2], 3)
    with pytest.raises(OverflowError):
        s.next_execution_plan(-1)
    with pytest.raises(OverflowError):
        kvtier.LoadBackDone(-1)
    with pytest.raises(OverflowError):
        kvtier.L3QueryDone(1, 2**40)
    with pytest.raises(kvtier.InvalidRequestError):
        s.submit(1, [], 3)
    with pytest.raises(kvtier.InvalidRequestError):
        s.submit(1, [1], 0)
    with pytest.raises(kvtier.InvalidRequestError):
        s.submit(1, [1] * 1000, 3)  # longer than max_context_tokens
    with pytest.raises(ValueError):
        kvtier.page_hashes([1, 2], 0)


def test_absurd_pool_sizes_raise_instead_of_exhausting_memory():
    big = small_config(device_pages=2**32 - 1, host_pages=2**32 - 1, max_context_tokens=64)
    with pytest.raises(kvtier.ConfigError, match="bookkeeping"):
        kvtier.Scheduler(big)
    with pytest.raises(kvtier.ConfigError):
        big.validate()
    with pytest.raises(OverflowError):
        kvtier.Scheduler(small_config(device_pages=2**32))


def test_a_million_element_list(cfg):
    s = kvtier.Scheduler(cfg)
    big = list(range(1_000_000))
    with pytest.raises(kvtier.InvalidRequestError, match="exceeds"):
        s.submit(1, big, 1)
    with pytest.raises(ValueError, match="differ in length"):
        s.forward_done(1, big, [1])
    s.submit(1, prompt(1, 9), 1)
    plan = s.next_execution_plan(0)
    with pytest.raises(kvtier.SchedulerError):
        s.forward_done(plan.step, np.arange(1_000_000, dtype=np.uint64), np.zeros(1_000_000, dtype=np.uint32))
    s.forward_done(plan.step, [1], [1])  # the step is still in flight and completes normally
    hs = kvtier.page_hashes(np.arange(1_000_000, dtype=np.uint32), 64)
    assert hs.shape == (15625, 32)
    st = kvtier.L3Store.embedded(1 << 20)
    res = st.batch_is_exist([f"k{i}" for i in range(60_000)])
    assert res.size == 60_000 and (res == 0).all()
    with pytest.raises(kvtier.InvalidParamsError):
        st.batch_is_exist([f"k{i}" for i in range(1_000_000)])  # beyond max_batch_keys


def test_scheduler_errors_are_typed_and_change_nothing(cfg):
    s = kvtier.Scheduler(cfg)
    s.submit(1, prompt(1, 9), 2)
    with pytest.raises(kvtier.DuplicateRequestError):
        s.submit(1, prompt(1, 9), 2)
    with pytest.raises(kvtier.UnknownRequestError):
        s.abort(99)
    with pytest.raises(kvtier.UnknownOpError):
        s.on_event(kvtier.LoadBackDone(12345))
    with pytest.raises(kvtier.UnknownStepError):
        s.forward_done(77, [1], [1])
    plan = s.next_execution_plan(0)
    with pytest.raises(kvtier.NotInStepError):
        s.forward_done(plan.step, [2], [1])
    with pytest.raises(kvtier.RowCountMismatchError):
        s.forward_done(plan.step, [1, 1], [1, 1])
    s.forward_done(plan.step, [1], [1])
    with pytest.raises(kvtier.UnknownStepError):
        s.forward_done(plan.step, [1], [1])  # duplicate
    for cls in (kvtier.DuplicateRequestError, kvtier.UnknownOpError, kvtier.IllegalEventError):
        assert issubclass(cls, kvtier.SchedulerError) and issubclass(cls, kvtier.KvtierError)
    s.check()


def test_wrong_completion_kind():
    s = kvtier.Scheduler(small_config(l3_enabled=True, prefetch_threshold=1))
    s.submit(1, prompt(1, 21), 2)
    plan = s.next_execution_plan(0)
    [q] = plan.ops
    with pytest.raises(kvtier.WrongCompletionKindError):
        s.on_event(kvtier.LoadBackDone(q.id))
    with pytest.raises(kvtier.BadCompletionError):
        s.on_event(kvtier.L3QueryDone(q.id, 10_000))
    s.on_event(kvtier.L3QueryDone(q.id, 0))
    with pytest.raises(kvtier.DuplicateCompletionError):
        s.on_event(kvtier.L3QueryDone(q.id, 0))
    with pytest.raises(ValueError):
        s.ops_done([q.id], ["Teleport"], [1])


def test_buffers_too_small_read_only_or_not_buffers():
    st = kvtier.L3Store.embedded(1 << 20)
    st.put("k", b"x" * 100)
    with pytest.raises(kvtier.BufferOverflowError):
        st.get_into("k", bytearray(10))
    with pytest.raises(TypeError, match="read-only"):
        st.get_into("k", b"\0" * 200)
    with pytest.raises(TypeError, match="read-only"):
        ro = np.zeros(200, dtype=np.uint8)
        ro.flags.writeable = False
        st.get_into("k", ro)
    with pytest.raises(TypeError):
        st.put("k2", "a str is not bytes")
    with pytest.raises(TypeError):
        st.put("k2", 12345)
    with pytest.raises(TypeError):
        st.put("k2", None)
    with pytest.raises(ValueError, match="contiguous"):
        st.put("k2", np.zeros((10, 10), dtype=np.uint8)[:, ::2])
    with pytest.raises(TypeError):
        st.batch_get_into(["k"], bytearray(100))
    with pytest.raises(TypeError):
        st.batch_put_from("k", [b"1"])
    with pytest.raises(kvtier.InvalidParamsError):
        st.batch_put_from(["a", "b"], [b"1"])
    pool = np.zeros((2, 16), dtype=np.uint8)
    with pytest.raises(ValueError):
        st.batch_get_pages(["k"], pool, [0], 0)
    with pytest.raises(OverflowError):
        st.batch_get_pages(["k"], pool, [-1], 16)
    assert st.batch_get_pages(["k"], pool, [1], 16).tolist() == [-10]  # page smaller than object
    # float, 2-D and non-uint8 arrays are fine as long as they are contiguous
    f = np.zeros(50, dtype=np.float32)
    assert st.get_into("k", f) == 100


def test_concurrent_use_is_an_error_not_a_race(cfg):
    s = kvtier.Scheduler(cfg)
    errors = []

    def hammer(base):
        for i in range(200):
            try:
                s.submit(base + i, prompt(i, 8), 1)
                s.next_execution_plan(0)
            except RuntimeError as e:  # already borrowed by the other thread
                errors.append(e)
            except kvtier.KvtierError:
                pass

    ts = [threading.Thread(target=hammer, args=(k * 10_000,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    s.check()


def test_ops_done_checks_every_completion_before_applying_any():
    # A batch with one valid completion and one bad one raises and applies neither: the
    # engine can retry the valid one (before, it stayed applied and the count was lost).
    s = kvtier.Scheduler(small_config(l3_enabled=True, prefetch_threshold=1))
    s.submit(1, prompt(1, 41), 2)
    s.submit(2, prompt(2, 41), 2)
    qs = [o.id for o in s.next_execution_plan(0).ops if o.kind == "L3Query"]
    assert len(qs) == 2 and s.ops_in_flight() == 2
    with pytest.raises(kvtier.UnknownOpError):
        s.ops_done([qs[0], 999], ["L3Query", "L3Query"], [0, 0])
    assert s.ops_in_flight() == 2, "the valid completion was applied although the batch raised"
    with pytest.raises(kvtier.DuplicateCompletionError):
        s.ops_done([qs[0], qs[0]], ["L3Query", "L3Query"], [0, 0])
    with pytest.raises(kvtier.WrongCompletionKindError):
        s.ops_done([qs[0], qs[1]], ["L3Query", "BackUp"], [0, 1])
    with pytest.raises(kvtier.BadCompletionError):
        s.ops_done([qs[0], qs[1]], ["L3Query", "L3Query"], [0, 99])
    assert s.ops_in_flight() == 2
    assert s.ops_done(qs, ["L3Query", "L3Query"], [0, 0]) == 2
    assert s.ops_in_flight() == 0
    s.check()


BAD_TENANTS = ["", "a/b", "a b", "nul\0", "line\nbreak=1", "caf\u00e9", "x" * 257, "x" * 70_000]


def test_bad_tenant_names_are_refused_with_a_typed_error():
    """Issue 33: tenant names are 1..=256 bytes of ASCII letters, digits and -_.:@+ on every
    path (-600); keys are 1..=4096 bytes without NUL (-400). Nothing is stored under either."""
    from kvtier.mooncake_compat import ErrorCode, MooncakeDistributedStore

    a = kvtier.L3Store.embedded(1 << 20, tenant="ok-tenant_1.x:y@z+w", name="bad-tenants")
    for bad in BAD_TENANTS:
        with pytest.raises(kvtier.InvalidParamsError):
            a.with_tenant(bad)
        with pytest.raises(kvtier.InvalidParamsError):
            kvtier.L3Store.embedded(1 << 20, tenant=bad, name="bad-tenants")
        m = MooncakeDistributedStore()
        rc = m.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 1 << 20, "tcp", "",
                     "embedded://bad-tenants-compat", tenant_id=bad or "a/b")
        assert rc == ErrorCode.INVALID_PARAMS, (bad[:16], rc)
    for bad_key in ["", "k\0", "k" * 4097]:
        with pytest.raises(kvtier.InvalidKeyError):
            a.put(bad_key, b"x")
    a.put("k" * 4096, b"x")
    assert a.get("k" * 4096) == b"x"
