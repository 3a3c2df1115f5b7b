"""Registered memory and the compatible core's state under concurrent calls: memory the
documented contract lets a caller free is never touched afterwards, and teardown racing a
call neither crashes nor hangs.

Each scenario runs in a child process: before these fixes they crashed the interpreter
(SIGSEGV) or hung it, and a test must fail, not take pytest down with it.
"""

import subprocess
import sys
import textwrap

import pytest


def run_child(code: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("teardown", ["unregister", "close"])
def test_teardown_waits_for_pointer_calls_in_flight(teardown):
    # docs/bindings.md: "Keep a buffer alive until unregister_buffer (or close) returns".
    # A get_into copying 128 MiB with the GIL released was still writing when
    # unregister_buffer / close returned at once; the buffer freed then (its own mmap)
    # made the copy fault. Now both wait for the calls using registered memory, and the
    # buffer holds, when they return, exactly what it holds at the end.
    r = run_child(
        f"""
        import threading, time
        import numpy as np
        from kvtier._native import MooncakeCore
        N = 128 << 20
        holder = MooncakeCore()   # holds the object: closing `c` leaves it there
        assert holder.setup_embedded("lifetimes-{teardown}", 1 << 30, "default", "h:1") == 0
        assert holder.put("k", np.full(N, 7, np.uint8)) == 0
        c = MooncakeCore()
        for attempt in range(6):
            if attempt == 0 or "{teardown}" == "close":
                assert c.setup_embedded("lifetimes-{teardown}", 0, "default", "") == 0
            buf = np.zeros(N, np.uint8)
            ptr = buf.ctypes.data
            assert c.register_buffer(ptr, N) == 0
            started = threading.Event()
            res = []
            def reader():
                started.set()
                res.append(c.get_into("k", ptr, N))
            t = threading.Thread(target=reader)
            t.start()
            started.wait()
            time.sleep(0.002 * attempt)
            if "{teardown}" == "unregister":
                assert c.unregister_buffer(ptr) == 0
            else:
                assert c.close() == 0
            seen = buf[:: 1 << 16].copy()   # what the buffer holds once teardown returned
            t.join()
            assert res[0] in (N, -600), res   # done before, or refused after
            assert (buf[:: 1 << 16] == seen).all(), "written after teardown returned"
            del buf                            # freed: the contract allows it now
        print("ok")
        """
    )
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    assert r.stdout.strip().endswith("ok")


def test_a_second_pool_keeps_the_first_pools_memory():
    # setup_pool called again (close() then setup_dummy again) freed the first pool while
    # its allocations stayed registered: get_into wrote into freed memory (SIGSEGV).
    r = run_child(
        """
        from kvtier._native import MooncakeCore
        c = MooncakeCore()
        assert c.setup_embedded("lifetimes-pool", 64 << 20, "default", "h:1") == 0
        assert c.setup_pool(64 << 20) == 0
        a = c.alloc_from_mem_pool(1 << 20)
        assert a
        assert c.put("k", b"x" * (1 << 20)) == 0
        assert c.setup_pool(64 << 20) == 0
        b = c.alloc_from_mem_pool(1 << 20)
        assert b and b != a
        assert c.get_into("k", a, 1 << 20) == 1 << 20
        assert c.read_registered(a, 4) == b"xxxx"
        assert c.get_into("k", b, 1 << 20) == 1 << 20
        print("ok")
        """
    )
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    assert r.stdout.strip().endswith("ok")


@pytest.mark.parametrize("where", ["embedded", "server"])
def test_a_pool_larger_than_memory_is_a_code_and_a_smaller_one_then_works(where):
    # setup_dummy's mem_pool_size was allocated with an infallible allocation: a pool the
    # host cannot give (1 TiB here, under an 8 GiB address-space limit for determinism)
    # aborted the interpreter ("memory allocation of 1099511627776 bytes failed"). It is a
    # negative code now, with the client left unset (a retry with a smaller pool set it up).
    r = run_child(
        f"""
        import resource
        import kvtier
        from kvtier.mooncake_compat import MooncakeDistributedStore
        srv = kvtier.L3Server(1 << 24) if {where!r} == "server" else None
        addr = srv.addr if srv else "embedded://lifetimes-huge-pool"
        if not srv:  # the real client, whose segment holds the objects
            real = MooncakeDistributedStore()
            assert real.setup("h", "", 1 << 24, 1 << 20, "tcp", "", addr) == 0
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
        s = MooncakeDistributedStore()
        assert s.setup_dummy(1 << 40, 1 << 20, addr) < 0
        assert s.health_check() == 1  # not set up
        assert s.setup_dummy(1 << 20, 1 << 20, addr) == 0
        a = s.alloc_from_mem_pool(4096)
        assert a and s.put("k", b"v" * 10) == 0 and s.get_into("k", a, 4096) == 10
        print("ok")
        """
    )
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    assert r.stdout.strip().endswith("ok")


def test_replica_clear_racing_close_does_not_hang():
    # batch_replica_clear held the core's state lock while it waited for the GIL; close()
    # held the GIL and waited for that lock: both threads stopped for ever.
    r = run_child(
        """
        import threading, time
        from kvtier import L3Server
        from kvtier.mooncake_compat import MooncakeDistributedStore
        srv = L3Server(64 << 20)
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", srv.addr) == 0
        keys = [f"k{i}" for i in range(20_000)]
        out = []
        t = threading.Thread(target=lambda: out.append(s.batch_replica_clear(keys)))
        t.start()
        time.sleep(0.2)
        assert s.close() == 0
        t.join()
        assert out and isinstance(out[0], list)
        srv.shutdown()
        print("ok")
        """,
        timeout=90,
    )
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    assert r.stdout.strip().endswith("ok")


@pytest.mark.parametrize("shm", [True, False])
def test_a_client_refuses_calls_from_a_forked_child(shm):
    # A child forked after L3Store.connect shared its parent's socket and shared-memory
    # ring: parent and child each read the other's replies (another key's bytes, answered
    # as their own), or hung. The child's calls through the parent's client are refused
    # (-1011), it connects its own, and the parent's client is untouched.
    r = run_child(
        f"""
        import os
        import kvtier
        srv = kvtier.L3Server(1 << 24)
        c = kvtier.L3Store.connect(srv.addr, shm={shm}, rpc_timeout_ms=5000)
        c.put("p", b"parent" * 100)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                c.get("p")
                code = 2
            except kvtier.UnavailableInModeError:
                own = kvtier.L3Store.connect(srv.addr, shm={shm}, rpc_timeout_ms=5000)
                own.put("c", b"child" * 100)
                code = 0 if own.get("p") == b"parent" * 100 else 3
            except BaseException:
                code = 4
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
        assert c.get("p") == b"parent" * 100
        assert c.get("c") == b"child" * 100
        print("ok")
        """,
        timeout=60,
    )
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    assert r.stdout.strip().endswith("ok")
