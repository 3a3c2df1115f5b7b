"""Every buffer-accepting entry point refuses buffers that are not plain contiguous bytes
(issue 19, item 7): a numpy object array (its bytes are heap addresses of Python objects:
stored they leak addresses, written into they corrupt the interpreter) is a ``TypeError``, a
non-contiguous array or memoryview a ``ValueError``, a read-only buffer where kvtier writes a
``TypeError``; nothing is stored or written when a call refuses. And
``ReplicateConfig.replica_num`` takes what Mooncake's pybind11 ``size_t`` field takes
(0 ..= 2**64 - 1; anything else is a ``TypeError`` on assignment, as pybind11 raises).

The destination cases run in a child process: before the check, ``get_into`` into an object
array overwrote its object pointers and the interpreter crashed later.
"""

import itertools
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvtier
from kvtier.mooncake_compat import MooncakeDistributedStore, ReplicateConfig

_names = itertools.count()
PAGE = 64


def object_array():
    return np.array([None] * 16, dtype=object)  # 128 bytes of PyObject pointers


def bad_sources():
    """(name, buffer, expected exception) for buffers kvtier reads from."""
    return [
        ("object array", object_array(), TypeError),
        ("object 2-D array", np.array([[1, "a"]] * 8, dtype=object), TypeError),
        ("struct with an object field", np.zeros(8, dtype=[("a", "i8"), ("b", "O")]), TypeError),
        ("memoryview of an object array", memoryview(object_array()), TypeError),
        ("non-contiguous array", np.arange(256, dtype=np.uint8)[::2], ValueError),
        ("non-contiguous 2-D array", np.zeros((16, 16), dtype=np.uint8)[:, :8], ValueError),
        ("non-contiguous memoryview", memoryview(bytearray(256))[::2], ValueError),
    ]


def compat():
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 24, 1 << 20, "tcp", "",
                   f"embedded://bufin-{next(_names)}") == 0
    return s


def source_calls(l3, mc):
    """Every entry point that reads a caller's buffer: (name, call(buffer, key))."""
    return [
        ("L3Store.put", lambda b, k: l3.put(k, b)),
        ("L3Store.batch_put_from", lambda b, k: l3.batch_put_from([k], [b])),
        ("L3Store.batch_put_pages", lambda b, k: l3.batch_put_pages([k], b, [0], PAGE)),
        ("Mooncake.put", lambda b, k: mc.put(k, b)),
        ("Mooncake.upsert", lambda b, k: mc.upsert(k, b)),
        ("Mooncake.put_parts", lambda b, k: mc.put_parts(k, b"head", b)),
        ("Mooncake.upsert_parts", lambda b, k: mc.upsert_parts(k, b, b"tail")),
        ("Mooncake.put_batch", lambda b, k: mc.put_batch([k], [b])),
        ("Mooncake.upsert_batch", lambda b, k: mc.upsert_batch([k], [b])),
    ]


def test_sources_that_are_not_plain_bytes_are_refused_and_nothing_is_stored():
    l3, mc = kvtier.L3Store.embedded(1 << 24), compat()
    n = itertools.count()
    for call_name, call in source_calls(l3, mc):
        for buf_name, buf, exc in bad_sources():
            key = f"k{next(n)}"
            with pytest.raises(exc):
                call(buf, key)
                pytest.fail(f"{call_name} accepted a {buf_name}")
            assert not l3.is_exist(key) and mc.is_exist(key) == 0, (call_name, buf_name)
    # what is accepted still is: contiguous arrays of any dtype, read-only buffers
    ok = [np.arange(16, dtype=np.int64), np.frombuffer(b"x" * 128, dtype=np.uint8),
          memoryview(bytearray(b"y" * 128)).toreadonly(), np.zeros((4, 32), dtype=np.uint8),
          memoryview(np.arange(32, dtype=np.float32))]
    for call_name, call in source_calls(l3, mc):
        for buf in ok:
            key = f"k{next(n)}"
            r = call(buf, key)
            assert r is None or np.array_equal(np.ravel(r), [0]), (call_name, r)
            assert l3.is_exist(key) or mc.is_exist(key) == 1
    mc.close()


def test_replica_num_takes_a_size_t_like_mooncakes_pybind_field():
    mc = compat()
    cfg = ReplicateConfig()
    for field in ("replica_num", "nof_replica_num", "dfs_replica_num"):
        before = getattr(cfg, field)
        for bad in (2**64, 2**64 + 1, 2**100, -1, -(2**63)):
            with pytest.raises(TypeError):
                setattr(cfg, field, bad)
            assert getattr(cfg, field) == before, field
        for good in (0, 1, 2**64 - 1):
            setattr(cfg, field, good)
            assert getattr(cfg, field) == good
        setattr(cfg, field, before)
    with pytest.raises(TypeError):
        cfg.replica_num = 2.0
    cfg.replica_num = 2**64 - 1  # valid for Mooncake (best effort: as many as there are segments)
    assert mc.put("huge-replica-num", b"v", cfg) == 0
    cfg.replica_num = 0
    assert mc.put("zero-replicas", b"v", cfg) == -600 and mc.is_exist("zero-replicas") == 0
    mc.close()


_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import kvtier
    from kvtier.mooncake_compat import MooncakeDistributedStore

    PAGE = 64
    l3 = kvtier.L3Store.embedded(1 << 24)
    l3.put("src", bytes(range(128)))
    l3.batch_put_pages(["p0", "p1"], np.arange(128, dtype=np.uint8), [0, 1], PAGE)
    q = l3.batch_query(["p0", "p1"])
    calls = {
        "L3Store.get_into": lambda b: l3.get_into("src", b),
        "L3Store.batch_get_into": lambda b: l3.batch_get_into(["src"], [b]),
        "L3Store.batch_get_pages": lambda b: l3.batch_get_pages(["p0", "p1"], b, [0, 1], PAGE),
        "L3Store.batch_get_pages_with_query":
            lambda b: l3.batch_get_pages_with_query(q, b, [0, 1], PAGE),
    }
    def bufs():
        return {
            "object array": np.array([None] * 16, dtype=object),
            "struct with an object field": np.zeros(8, dtype=[("a", "i8"), ("b", "O")]),
            "memoryview of an object array": memoryview(np.array([None] * 16, dtype=object)),
            "non-contiguous array": np.zeros(256, dtype=np.uint8)[::2],
            "non-contiguous memoryview": memoryview(bytearray(256))[::2],
            "bytes": bytes(128),
            "read-only array": np.frombuffer(bytes(128), dtype=np.uint8),
            "read-only memoryview": memoryview(bytearray(128)).toreadonly(),
        }
    out = {}
    for cname, call in calls.items():
        for bname, b in bufs().items():
            before = bytes(memoryview(b)) if bname.startswith(("read", "bytes")) else None
            try:
                r = call(b)
                out[cname + " / " + bname] = "accepted " + repr(r)
            except Exception as e:
                out[cname + " / " + bname] = type(e).__name__
            if before is not None:
                assert bytes(memoryview(b)) == before, (cname, bname)
            print(cname, "/", bname, "->", out[cname + " / " + bname], file=sys.stderr, flush=True)
    print(json.dumps(out))
""")


def test_destinations_that_are_not_writable_plain_bytes_are_refused():
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (
        f"the child died (returncode {r.returncode}; -11 is SIGSEGV); its last lines: "
        f"{r.stderr[-1500:]!r}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    expected = {"object array": "TypeError", "struct with an object field": "TypeError",
                "memoryview of an object array": "TypeError",
                "non-contiguous array": "ValueError", "non-contiguous memoryview": "ValueError",
                "bytes": "TypeError", "read-only array": "TypeError",
                "read-only memoryview": "TypeError"}
    want = {f"{c} / {b}": e for c in ("L3Store.get_into", "L3Store.batch_get_into",
                                       "L3Store.batch_get_pages", "L3Store.batch_get_pages_with_query")
            for b, e in expected.items()}
    assert got == want
