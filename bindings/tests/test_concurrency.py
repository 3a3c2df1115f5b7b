"""The Python bindings under threads, fork and object lifetimes (adversarial round).

Every scenario runs in a child interpreter with a timeout: the failures these tests catch
are hangs, panics and aborts, and a test must fail, not take pytest down with it.
"""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest


HERE = os.path.dirname(os.path.abspath(__file__))


def child_env() -> dict:
    """A child interpreter's environment: it imports this directory's helpers (test_shm's
    Proc), on its path whether or not pytest's caller put it on PYTHONPATH (scripts/test-all
    does not)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p))


def run_child(code: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def assert_ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    assert r.stdout.strip().endswith("ok"), (r.stdout[-2000:], r.stderr[-4000:])
    assert "panicked" not in r.stderr and "PanicException" not in r.stderr, r.stderr[-4000:]


# Forks a child `FORKS` times while two threads keep the parent's store busy; each child runs
# `child()` (its exit code is the verdict) and exits through the interpreter's normal
# finalization (which drops every inherited object). A child that has not exited after 30 s
# is counted as hung and killed; forking stops at the first child that failed.
FORK_HARNESS = """
import os, sys, threading, time
FORKS = 12
stop = threading.Event()
def fork_children(busy, child):
    ts = [threading.Thread(target=busy, args=(stop,)) for _ in range(2)]
    [t.start() for t in ts]
    codes = []
    try:
        for n in range(FORKS):
            pid = os.fork()
            if pid == 0:
                code = 99
                try:
                    code = child()
                finally:
                    sys.stdout.flush()
                sys.exit(code)   # normal finalization: inherited objects are dropped
            deadline = time.monotonic() + 30
            while True:
                r, st = os.waitpid(pid, os.WNOHANG)
                if r:
                    codes.append(os.waitstatus_to_exitcode(st))
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    codes.append("hung")
                    break
                time.sleep(0.01)
            if codes[-1] != 0:
                break
    finally:
        stop.set()
        [t.join() for t in ts]
    assert codes == [0] * FORKS, codes  # the child's code, or 'hung'
"""


def test_an_embedded_store_in_a_forked_child_is_refused_not_hung():
    # A child forked while another thread of the parent was inside a call on an embedded
    # store inherited the store's locks held by a thread it does not have: its first call
    # waited for ever (6 children of 40 hung). And a child that simply exited dropped the
    # store, whose drop joined the store's sweeper thread, absent in the child: a Rust panic
    # at exit ("threads should not terminate unexpectedly"). The child's calls through the
    # inherited handle are refused (UnavailableInModeError, -1011), dropping it touches
    # nothing, and a store the child opens itself works; the parent's store is untouched.
    r = run_child(
        FORK_HARNESS
        + """
import kvtier
s = kvtier.L3Store.embedded(1 << 26, loss_journal_keys=1024, name="fork-named")
s.put("p", b"parent" * 100)
t2 = s.with_tenant("other")
def busy(stop):
    i = 0
    while not stop.is_set():
        for k in (f"k{i}", f"k{i - 40}"):
            try:
                s.put(k, b"y" * 4096) if k == f"k{i}" else s.remove(k, force=True)
            except kvtier.L3Error:
                pass
        i += 1
def child():
    for call in (lambda: s.get("p"), lambda: s.put("c", b"c"), lambda: s.stats(),
                 lambda: s.with_tenant("x"), lambda: t2.is_exist("p"), lambda: s.drain_losses(),
                 lambda: s.batch_is_exist(["p"]), lambda: s.flush()):
        try:
            call()
            return 2
        except kvtier.UnavailableInModeError:
            pass
    own = kvtier.L3Store.embedded(1 << 20)
    own.put("c", b"child")
    if own.get("c") != b"child":
        return 3
    # The name the parent's store has opens a store of the child's own (the parent's copy
    # here is the inherited one: its locks may be held, its threads absent).
    named = kvtier.L3Store.embedded(1 << 20, name="fork-named")
    named.put("c", b"child")
    return 0 if named.get("c") == b"child" and not named.is_exist("p") else 4
fork_children(busy, child)
assert s.get("p") == b"parent" * 100 and not s.is_exist("c")
print("ok")
"""
    )
    assert_ok(r)


def test_a_child_forked_while_a_named_store_is_opened_opens_its_own():
    # A child forked while another thread of the parent was opening a named embedded store
    # inherited the registry of named stores locked (by a thread absent in the child): its
    # own L3Store.embedded(name=...) waited for ever (2 children of 30 hung). The child
    # starts a registry of its own.
    r = run_child(
        FORK_HARNESS
        + """
import kvtier
FORKS = 40
def busy(stop):
    i = 0
    while not stop.is_set():
        kvtier.L3Store.embedded(1 << 26, name=f"churn{i % 3}")
        i += 1
def child():
    own = kvtier.L3Store.embedded(1 << 20, name="churn0")
    own.put("c", b"child")
    return 0 if own.get("c") == b"child" else 3
fork_children(busy, child)
print("ok")
"""
    )
    assert_ok(r)


def test_a_server_in_process_survives_a_forked_childs_exit():
    # A child forked after kvtier.L3Server() exited through normal finalization: the drop of
    # the inherited server joined accept threads the child does not have (a panic at exit).
    # The child's copy is dropped touching nothing; shutdown() in the child stops nothing of
    # the parent's, which keeps serving.
    r = run_child(
        FORK_HARNESS
        + """
import kvtier
srv = kvtier.L3Server(1 << 24)
c = kvtier.L3Store.connect(srv.addr, rpc_timeout_ms=20000)
c.put("p", b"parent")
def busy(stop):
    while not stop.is_set():
        c.get("p")
def child():
    srv.shutdown()
    own = kvtier.L3Store.connect(srv.addr, rpc_timeout_ms=20000)
    return 0 if own.get("p") == b"parent" else 3
fork_children(busy, child)
assert c.get("p") == b"parent" and srv.running
srv.shutdown()
print("ok")
"""
    )
    assert_ok(r)


def test_a_mooncake_client_on_an_embedded_store_in_a_forked_child():
    # The Mooncake-compatible client set up on an embedded store, in a child forked after:
    # its calls could hang on locks the parent's threads held at the fork, and close() raised
    # a PanicException (the store's drop joined a thread absent in the child). The child's
    # calls answer -1011 (reads: empty), close() answers 0 touching nothing, and the parent's
    # client is untouched.
    r = run_child(
        FORK_HARNESS
        + """
import numpy as np
from kvtier.mooncake_compat import MooncakeDistributedStore
m = MooncakeDistributedStore()
assert m.setup("h", "", 1 << 26, 1 << 20, "tcp", "", "embedded://fork-mc") == 0
assert m.put("p", b"parent") == 0
buf = np.zeros(1 << 16, np.uint8)
assert m.register_buffer(buf.ctypes.data, buf.nbytes) == 0
def busy(stop):
    i = 0
    while not stop.is_set():
        m.put(f"k{i}", b"y" * 4096)
        m.get_into("p", buf.ctypes.data, buf.nbytes)
        m.remove(f"k{i - 40}")
        i += 1
def child():
    if m.is_exist("p") != -1011 or m.put("c", b"c") != -1011 or m.get("p") != b"":
        return 2
    if m.get_into("p", buf.ctypes.data, buf.nbytes) != -1011:
        return 3
    if m.close() != 0:
        return 4
    own = MooncakeDistributedStore()
    if own.setup("h", "", 1 << 24, 1 << 20, "tcp", "", "embedded://child-own") != 0:
        return 5
    return 0 if own.put("c", b"child") == 0 and own.get("c") == b"child" else 6
fork_children(busy, child)
assert m.get("p") == b"parent" and m.is_exist("c") == 0
assert m.close() == 0
print("ok")
"""
    )
    assert_ok(r)


def test_ops_that_change_while_the_collective_runs_keep_their_own_values():
    # RankAgreement.reduce reads this rank's values, calls the engine's all_reduce_min with
    # no borrow held (a collective that blocks lets the engine's other threads run, and an
    # in-process one may read the agreements), then applied the reduced vector to the ops in
    # flight *then*, index by index. Ops that changed meanwhile (one completed, another
    # issued: the same count) took other ops' agreed values: here the reduction was over
    # [Q1, Q2], and Q2 was agreed with Q1's 0 hits and Q3, which no other rank ever reduced,
    # with Q2's 9 (ranks then plan different prefetches: another rank's KV read as missing).
    # Each value now goes to its op: Q2 gets its own, Q3 waits for a reduction of its own.
    import kvtier
    from conftest import prompt, small_config

    s = kvtier.Scheduler(small_config(l3_enabled=True, prefetch_threshold=1, tp_ranks=2))
    for req in (1, 2):
        s.submit(req, prompt(req, 41), 2)
    q1, q2 = [o.id for o in s.next_execution_plan(0).ops if o.kind == "L3Query"]
    a = kvtier.RankAgreement()
    a.push(kvtier.L3QueryDone(q1, 0))
    a.push(kvtier.L3QueryDone(q2, 9))
    q3 = []

    def collective(v):  # meanwhile: q1 completes, a third request's probe is issued and done
        s.on_event(kvtier.L3QueryDone(q1, 0))  # no hit: no prefetch follows
        s.submit(3, prompt(3, 41), 2)
        q3.extend(o.id for o in s.next_execution_plan(1).ops if o.kind == "L3Query")
        a.push(kvtier.L3QueryDone(q3[0], 9))
        # the other rank's values equal this rank's: the minimum is v itself

    assert a.reduce(s, collective) == [kvtier.L3QueryDone(q2, 9)]
    assert a.pending() == 1  # q3's record, for the next reduction (q1's dropped: not in flight)
    assert a.reduce(s, lambda v: v) == [kvtier.L3QueryDone(q3[0], 9)]
    with pytest.raises(kvtier.AgreementError, match="values"):  # a vector of another length
        a.reduce(s, lambda v: np.zeros(len(v) + 1, np.int64))


def test_a_forked_child_gets_no_memory_of_its_parents_shared_pool():
    # A dummy client's pool on a server of this host is shared memory (the server maps it):
    # a child forked after setup_dummy shares it with the parent instead of getting a copy,
    # and alloc_from_mem_pool there handed out the address the parent hands out next (the
    # same allocator state). The child's bytes written there became the parent's: the
    # parent's put_from stored "C" where it had written "P". In the child the pool hands
    # out nothing (0, as when exhausted); the child sets up its own client.
    r = run_child(
        """
        import ctypes, os, sys
        import kvtier
        from kvtier.mooncake_compat import MooncakeDistributedStore
        srv = kvtier.L3Server(1 << 26)
        m = MooncakeDistributedStore()
        assert m.setup_dummy(16 << 20, 1 << 20, srv.addr) == 0
        N = 1 << 16
        first = m.alloc_from_mem_pool(N)
        assert first
        to_child_r, to_child_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.read(to_child_r, 1)          # the parent filled its next allocation
            addr = m.alloc_from_mem_pool(N)
            if addr:
                ctypes.memset(addr, ord("C"), N)
            own = MooncakeDistributedStore()
            ok = own.setup_dummy(1 << 20, 1 << 20, srv.addr) == 0 and own.alloc_from_mem_pool(N) != 0
            os._exit(0 if addr == 0 and ok else 1)
        mine = m.alloc_from_mem_pool(N)
        ctypes.memset(mine, ord("P"), N)
        os.write(to_child_w, b"x")
        _, st = os.waitpid(pid, 0)
        assert m.put_from("k", mine, N) == 0
        got = m.get("k")
        assert got == b"P" * N, got[:8]
        assert os.waitstatus_to_exitcode(st) == 0, os.waitstatus_to_exitcode(st)
        print("ok")
        """,
        timeout=60,
    )
    assert_ok(r)


def test_puts_from_threads_never_raise_from_the_closing_bookkeeping():
    # A compat client of a server that mounted a segment remembers the keys it wrote, to
    # remove them on close (_owned.py). Its bookkeeping was unlocked Python: two threads
    # trimming it past its cap took the same oldest key (one del raised KeyError) or
    # iterated it while the other inserted (RuntimeError: dictionary changed size), raised
    # out of put() calls that had succeeded. The bookkeeping runs on the real core of an
    # embedded client here, with tracking forced on and a small cap (the race is the same
    # on a server client; a thread switch every microsecond makes it show in seconds).
    r = run_child(
        """
        import collections, sys, threading
        sys.setswitchinterval(1e-6)
        from kvtier.mooncake_compat import MooncakeDistributedStore
        m = MooncakeDistributedStore()
        assert m.setup("h", "", 1 << 26, 1 << 20, "tcp", "", "embedded://owned-race") == 0
        m._core.tracking, m._core._max = True, 4
        errs = collections.Counter()
        def writer(t):
            for i in range(60_000):
                try:
                    rc = m.put(f"k{t}-{i}", b"v") if i % 5 else m.remove(f"k{t}-{i - 3}")
                    if rc not in (0, -704):
                        errs[rc] += 1
                except Exception as e:  # noqa: BLE001 (counted)
                    errs[type(e).__name__] += 1
        ts = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert not errs, dict(errs)
        assert len(m._core._keys) <= 4
        print("ok")
        """,
        timeout=300,
    )
    assert_ok(r)


@pytest.mark.parametrize("call", ["setup_pool", "setup_again", "collected"])
def test_a_compat_client_waiting_on_a_stopped_server_lets_other_threads_run(call):
    # Three compat paths waited on the server holding the GIL: setup_pool (setup_dummy's
    # pool asks the server for a shared-memory region), a setup over a live one and the
    # collection of a client never closed (the previous client's segment is unmounted
    # there). With the server stopped (SIGSTOP: a paused or overloaded host) every Python
    # thread of the process froze until the RPC timed out (122 s, then a heap pool). Now
    # they wait with the GIL released: the main thread resumes the server and the call
    # completes (a shared pool, the new setup, the client gone).
    code = textwrap.dedent(
        f"""
        import os, signal, threading
        from kvtier._native import MooncakeCore
        from test_shm import Proc
        stopped, other = Proc(), Proc()
        print("servers", stopped.p.pid, other.p.pid, flush=True)
        c = MooncakeCore()
        assert c.setup_remote(stopped.addr, "default", None, 1 << 20, "h:1") == 0
        assert c.has_segment()
        from conftest import sigstop
        sigstop(stopped.p.pid)
        began, res, box = threading.Event(), [], [c]
        if {call!r} == "collected":
            del c
        def call():
            began.set()
            if {call!r} == "setup_pool":
                res.append(box[0].setup_pool(16 << 20))
            elif {call!r} == "setup_again":
                res.append(box[0].setup_remote(other.addr, "default"))
            else:
                box.clear()   # the last reference: collected here
                res.append(0)
        t = threading.Thread(target=call)
        t.start()
        began.wait()
        while t.is_alive() and not t.join(0.2):   # the main thread runs while it waits
            os.kill(stopped.p.pid, signal.SIGCONT)
        assert res == [0], res
        if {call!r} != "collected":
            assert box[0].pool_is_shared() if {call!r} == "setup_pool" else not box[0].has_segment()
        stopped.close(); other.close()
        print("ok")
        """
    )
    p = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", code],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        for line in out.splitlines():  # the servers it started, the stopped one included
            if line.startswith("servers "):
                for pid in line.split()[1:]:
                    os.kill(int(pid), signal.SIGKILL)
        raise
    assert_ok(subprocess.CompletedProcess(p.args, p.returncode, out, err))


def _content(key: str, n: int):
    """The bytes every writer stores under ``key``: whoever reads it knows what it must hold."""
    import hashlib

    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _killed_writer(addr: str, tag: str, mode: str, q) -> None:
    """A spawned child putting batches of 4 objects until it is killed; reports each batch."""
    import ctypes

    import kvtier
    from kvtier.mooncake_compat import MooncakeDistributedStore

    if mode == "client":
        c = kvtier.L3Store.connect(addr, rpc_timeout_ms=60_000)
        assert c.uses_shm
    else:  # a dummy client: the pool is a memfd the server maps, written in place
        m = MooncakeDistributedStore()
        assert m.setup_dummy(16 << 20, 1 << 20, addr) == 0
        ptrs = [m.alloc_from_mem_pool(1 << 20) for _ in range(4)]
    i = 0
    while True:
        keys = [f"{tag}-{i}-{j}" for j in range(4)]
        vals = [_content(k, (256 << 10) + 4096 * j) for j, k in enumerate(keys)]
        if mode == "client":
            c.batch_put_from(keys, vals)
        else:
            for p, v in zip(ptrs, vals):
                ctypes.memmove(p, v.ctypes.data, v.nbytes)
            m.batch_put_from(keys, ptrs, [v.nbytes for v in vals])
        q.put(i)
        i += 1


@pytest.mark.parametrize("mode", ["client", "dummy"])
def test_writers_killed_mid_put_leave_the_server_and_its_data_exact(mode):
    # Spawned processes put over shared memory to a real kvtier-l3 process and are SIGKILLed
    # while they put (each after some batches, wherever it then is). The server serves on,
    # another client's calls meanwhile are exact, and every key any writer may have written
    # reads as exactly its bytes or as missing, never as another key's or a torn write.
    # (Held when written: no bug found.)
    import multiprocessing as mp

    import kvtier
    from test_shm import Proc

    srv = Proc(segment_bytes=128 << 20)
    ctx = mp.get_context("spawn")
    try:
        c = kvtier.L3Store.connect(srv.addr, rpc_timeout_ms=60_000)
        last = {}
        for w in range(3):
            q = ctx.Queue()
            p = ctx.Process(target=_killed_writer, args=(srv.addr, f"w{w}", mode, q), daemon=True)
            p.start()
            for _ in range(4 + 3 * w):
                last[w] = q.get(timeout=120)
            os.kill(p.pid, signal.SIGKILL)
            p.join(60)
            mine = _content(f"alive-{w}", 300_000)
            c.put(f"alive-{w}", mine)
            assert c.get(f"alive-{w}") == mine.tobytes()
        assert srv.p.poll() is None
        fresh = kvtier.L3Store.connect(srv.addr, rpc_timeout_ms=60_000)
        buf = np.zeros(1 << 20, np.uint8)
        found = 0
        for w, top in last.items():
            for i in range(top + 3):  # the batches in flight at the kill too
                for j in range(4):
                    k = f"w{w}-{i}-{j}"
                    try:
                        n = fresh.get_into(k, buf)
                    except kvtier.ObjectNotFoundError:
                        continue
                    assert n == (256 << 10) + 4096 * j and (buf[:n] == _content(k, n)).all(), k
                    found += 1
        assert found >= 4 * sum(last.values())  # what was acknowledged is there (no eviction)
    finally:
        srv.close()
