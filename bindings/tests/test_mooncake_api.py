"""kvtier.mooncake_compat against Mooncake's API surface and documented semantics.

The method set and argument names are compared with the real ``mooncake.store`` class
(introspected in a subprocess: its pybind11 signatures), so a gap cannot come back. Semantics
that cannot be compared side by side (tests/test_mooncake_real.py) because they depend on a
cluster's placement or on time are checked here against what the real client was measured to
do (see docs/python.md): a closing client's segment takes its objects with it, a client with
no segment alone cannot put (-200), the lease TTL set in setup, the dummy client.
"""

import itertools
import json
import re
import subprocess
import sys
import inspect

import numpy as np
import pytest
import torch

import kvtier
from kvtier import _native
from kvtier.mooncake_compat import ErrorCode, MooncakeDistributedStore, ReplicateConfig, SoftPinAction

_names = itertools.count()

_INTROSPECT = r"""
import json, mooncake.store as m
C = m.MooncakeDistributedStore
print("NAMES " + json.dumps({n: (getattr(C, n).__doc__ or "").split("\n")[0]
                             for n in dir(C) if not n.startswith("_")}))
"""


@pytest.fixture(scope="module")
def real_methods():
    r = subprocess.run([sys.executable, "-c", _INTROSPECT], capture_output=True, text=True, timeout=120)
    lines = [l for l in r.stdout.splitlines() if l.startswith("NAMES ")]
    assert r.returncode == 0 and lines, f"cannot introspect mooncake.store: {r.stderr[-2000:]}"
    return json.loads(lines[0][len("NAMES "):])


def _params(doc: str):
    """Argument names of a pybind11 signature line, without self (None for *args forms)."""
    m = re.match(r"\w+\((.*)\) ->", doc)
    if not m or "*args" in m.group(1):
        return None
    names = [a.split(":")[0].strip() for a in re.split(r",\s*(?![^\[]*\])", m.group(1)) if a.strip()]
    return [n for n in names if n != "self"]


def test_every_real_method_exists_with_its_arguments(real_methods):
    ours = {n for n in dir(MooncakeDistributedStore) if not n.startswith("_")}
    missing = sorted(set(real_methods) - ours)
    assert not missing, f"methods of mooncake.store.MooncakeDistributedStore missing in kvtier: {missing}"
    assert len(real_methods) >= 97
    wrong = {}
    for name, doc in real_methods.items():
        want = _params(doc)
        if want is None or any(n.startswith("arg") for n in want):
            continue  # overloads, *args, or positional-only pybind names (arg0)
        got = [p for p in inspect.signature(getattr(MooncakeDistributedStore, name)).parameters if p != "self"]
        if got != want:
            wrong[name] = (want, got)
    assert not wrong, f"argument names differ (mooncake, kvtier): {wrong}"


def store(name=None, seg=1 << 24, **extra):
    s = MooncakeDistributedStore()
    cfg = dict(local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE", protocol="tcp",
               master_server_addr=name or f"embedded://api-{next(_names)}", global_segment_size=seg,
               local_buffer_size=1 << 20, **extra)
    assert s.setup(cfg) == 0
    return s


def test_error_codes_come_from_the_l3_table():
    assert _native.ERROR_CODES["OBJECT_NOT_FOUND"] == -704
    assert {e.name: int(e) for e in ErrorCode} == dict(_native.ERROR_CODES)
    assert len(_native.ERROR_CODES) == len(set(_native.ERROR_CODES.values())) >= 40
    from kvtier import engine
    assert engine.LEASE_EXPIRED == ErrorCode.LEASE_EXPIRED == -707


def test_sizes_as_text_and_bad_sizes_are_codes():
    for text, ok in [("16MB", True), ("16 MB", True), ("1.5GB", True), ("50%", False), ("16MiB", False), ("", False)]:
        s = MooncakeDistributedStore()
        rc = s.setup(dict(local_hostname="h", metadata_server="m", master_server_addr=f"embedded://sz-{next(_names)}",
                          global_segment_size=text))
        assert (rc == 0) == ok, (text, rc)
        s.close()
    with pytest.raises(TypeError):  # positional form: ints only, as pybind11
        MooncakeDistributedStore().setup("h", "m", "16MB", 1, "tcp", "", "embedded")


def test_a_closing_client_takes_its_segment_objects_with_it():
    name = f"embedded://seg-{next(_names)}"
    a = store(name, seg=1 << 20)
    b = store(name, seg=8 << 20)  # more free space: the master places objects here first
    keys = [f"o{i}" for i in range(20)]
    assert [b.put(k, bytes([i]) * 1000) for i, k in enumerate(keys)] == [0] * 20
    where = {k: a.get_replica_desc(k)[0].get_memory_descriptor().buffer_descriptor.transport_endpoint for k in keys}
    assert set(where.values()) <= {a.get_hostname(), b.get_hostname()}
    in_b = [k for k in keys if where[k] == b.get_hostname()]
    assert in_b, where
    assert b.close() == 0
    assert [a.is_exist(k) for k in in_b] == [0] * len(in_b)
    survivors = [k for k in keys if k not in in_b]
    assert [a.is_exist(k) for k in survivors] == [1] * len(survivors)
    assert a.put("after", b"s") == 0 and a.get("after") == b"s"  # a's segment alone now
    assert a.put("too-big", b"x" * (2 << 20)) == ErrorCode.NO_AVAILABLE_HANDLE


def test_no_segment_alone_cannot_put_and_local_buffer_zero_refuses_bytes():
    s = store(seg=0)
    assert s.put("k", b"v") == ErrorCode.NO_AVAILABLE_HANDLE
    u = MooncakeDistributedStore()
    assert u.setup(dict(local_hostname="h", metadata_server="m", master_server_addr=f"embedded://lb-{next(_names)}",
                        local_buffer_size=0)) == 0
    assert u.put("k", b"v") == ErrorCode.INVALID_PARAMS and u.get("k") == b""
    assert u.put_tensor("t", torch.ones(2)) == 0  # tensor puts do not stage in the local buffer


def test_lease_ttl_from_setup():
    s = store(default_kv_lease_ttl=50)
    assert s._core.lease_ttl_ms() == 50
    assert s.put("k", b"v") == 0 and s.get("k") == b"v"
    assert s.remove("k") == ErrorCode.OBJECT_HAS_LEASE
    assert s.batch_replica_clear(["k"]) == []
    assert s._core.advance_clock_ms(60)
    assert s.batch_replica_clear(["k"]) == ["k"] and s.is_exist("k") == 0
    assert MooncakeDistributedStore().setup(dict(local_hostname="h", metadata_server="m",
                                                 default_kv_lease_ttl="soon")) == ErrorCode.INVALID_PARAMS


def test_dummy_client_against_a_kvtier_server(server):
    d = MooncakeDistributedStore()
    assert d.setup_dummy(1 << 16, 1 << 20, server.addr) == 0
    assert d.get_hostname() == ""
    p = d.alloc_from_mem_pool(4096)
    q = d.alloc_from_mem_pool(4096)
    assert p and q and q >= p + 4096 and d.alloc_from_mem_pool(1 << 20) == 0
    src = np.frombuffer(bytes(range(256)) * 16, dtype=np.uint8)
    assert d.put("dk", src.tobytes()) == 0
    assert d.get_into("dk", q, 4096) == 4096
    assert d.put_from("dp", q, 100) == 0 and d.get("dp") == src.tobytes()[:100]
    assert d.close() == 0
    assert MooncakeDistributedStore().setup_dummy(1 << 16, 1 << 20, "127.0.0.1:1") == -1


def test_tensors_from_numpy_and_dlpack_and_safetensors(tmp_path):
    s = store()
    a = np.arange(12, dtype=np.int16).reshape(3, 4)
    assert s.put_tensor("np", a) == 0
    assert torch.equal(s.get_tensor("np"), torch.from_numpy(a))
    t = torch.arange(6, dtype=torch.bfloat16)

    class DLPackOnly:  # any producer of the DLPack protocol, not a tensor or an array
        def __init__(self, x):
            self.x = x

        def __dlpack__(self, **kw):
            return self.x.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.x.__dlpack_device__()

    assert s.put_tensor("dl", DLPackOnly(torch.arange(4.0))) == 0
    assert torch.equal(s.get_tensor("dl"), torch.arange(4.0))
    assert s.put_tensor("bad", object()) == ErrorCode.INVALID_PARAMS
    assert s.put_tensor("bf", t) == 0
    f = tmp_path / "x.safetensors"
    assert s.save_tensor_to_safetensor("bf", str(f)) == 0
    back = s.load_tensor_from_safetensor("copy", str(f))
    assert back is not None and torch.equal(back, t) and torch.equal(s.get_tensor("copy"), t)
    assert s.save_tensor_to_safetensor("missing", str(f)) == ErrorCode.OBJECT_NOT_FOUND
    dst = torch.zeros(6, dtype=torch.bfloat16)
    assert s.get_tensor_into_cuda("bf", dst) == 12 and torch.equal(dst, t)


def test_sessions_and_unsupported_calls():
    s = store()
    raw = np.arange(4096, dtype=np.uint8)
    assert s.register_buffer(raw.ctypes.data, raw.nbytes) == 0
    p = raw.ctypes.data
    assert s.batch_put_session_start(["s1", "s2"], [8, 4]) == [0, 0]
    assert s.batch_put_from_multi_buffer_ranges(["s1"], [[p, p + 100]], [[4, 4]], [[4, 0]]) == [0]
    assert s.batch_put_session_revoke(["s2"]) == [0]
    assert s.batch_put_session_end(["s1", "s2"]) == [0, ErrorCode.OBJECT_NOT_FOUND]
    assert s.get("s1") == bytes([100, 101, 102, 103, 0, 1, 2, 3])
    assert s.batch_get_session_start(["s1", "nope"]) == [0, ErrorCode.OBJECT_NOT_FOUND]
    dst = np.zeros(16, dtype=np.uint8)
    assert s.register_buffer(dst.ctypes.data, 16) == 0
    assert s.batch_get_into_multi_buffer_ranges(["s1"], [[dst.ctypes.data]], [[4]], [[2]]) == [4]
    assert dst[:4].tolist() == [102, 103, 0, 1]
    assert s.batch_get_session_end(["s1"]) == 0
    assert s.remove_by_regex("^s") == 0  # s1 is leased by the get above
    assert s.remove_by_regex("^s", True) == 1 and s.is_exist("s1") == 0
    assert s.query_task((1, 2)) == (None, ErrorCode.TASK_NOT_FOUND)
    cfg = ReplicateConfig()
    cfg.soft_pin_action = SoftPinAction.ENABLE
    assert s.put("pinned", b"v", cfg) == 0
    with pytest.raises(TypeError):
        cfg.replica_num = "2"


@pytest.mark.parametrize("where", ["embedded", "server"])
def test_remove_by_regex_in_the_store_per_tenant(server, where):
    """The store filters keys itself, per tenant (a client never reaches another tenant's
    keys), embedded and over the tarpc server; the side-by-side driver compares the codes
    with real Mooncake."""
    name = f"embedded://rx-{next(_names)}" if where == "embedded" else server.addr
    a, b = store(name, tenant_id="ta"), store(name, tenant_id="tb")
    keys = [f"doc/{i}/kv" for i in range(10)] + ["other", "DOC/1"]
    assert [a.put(k, b"a") for k in keys] == [0] * len(keys)
    assert [b.put(k, b"b") for k in keys] == [0] * len(keys)
    assert a.remove_by_regex(r"^doc/[0-4]/") == 5
    assert a.batch_is_exist(keys) == [0] * 5 + [1] * 7
    assert b.batch_is_exist(keys) == [1] * len(keys)
    assert a.remove_by_regex("(") == ErrorCode.INVALID_PARAMS and a.is_exist("other") == 1
    assert a.remove_by_regex("(?i)doc") == ErrorCode.INVALID_PARAMS  # not ECMAScript: Mooncake's -600
    assert a.get("other") == b"a" and a.remove_by_regex("other") == 0  # leased
    assert a.remove_by_regex("", True) == 7 and a.batch_is_exist(keys) == [0] * len(keys)
    assert b.remove_by_regex("DOC|other") == 2 and b.get("doc/0/kv") == b"b"
    with pytest.raises(TypeError):
        a.remove_by_regex(None)
    assert MooncakeDistributedStore().remove_by_regex("x") == -1  # before setup
    a.close()
    b.close()


def test_native_l3_store_remove_by_regex_raises_typed(server):
    for s in (kvtier.L3Store.embedded(1 << 20), kvtier.L3Store.connect(server.addr, tenant="rx-native")):
        s.put("a1", b"x")
        s.put("b1", b"y")
        assert s.remove_by_regex("^a") == 1 and s.remove_by_regex("^a") == 0
        with pytest.raises(kvtier.InvalidParamsError) as e:
            s.remove_by_regex("[")
        assert e.value.code == -600 and s.get("b1") == b"y"


def test_replica_tasks_between_two_clients_segments():
    """create_copy_task / create_move_task over the embedded store between two clients'
    segments (named by get_hostname, as in Mooncake): they run before returning, query_task
    reports them done, bad input gives Mooncake's codes and changes nothing."""
    from kvtier.mooncake_compat import TaskStatus, TaskType

    name = f"embedded://tasks-{next(_names)}"
    a, b = store(name), store(name)
    ha, hb = a.get_hostname(), b.get_hostname()
    data = bytes(range(256)) * 20
    assert a.put("t1", data) == 0
    n = lambda: len(a.get_replica_desc("t1"))  # noqa: E731
    assert n() == 1
    for call, code in [(lambda: a.create_copy_task("nope", [hb]), ErrorCode.OBJECT_NOT_FOUND),
                       (lambda: a.create_copy_task("t1", ["nope:1"]), ErrorCode.INVALID_PARAMS),
                       (lambda: a.create_copy_task("t1", [ha, "nope:1"]), ErrorCode.INVALID_PARAMS),
                       (lambda: a.create_copy_task("t1", []), ErrorCode.INVALID_PARAMS),
                       (lambda: a.create_move_task("t1", ha, ha), ErrorCode.INVALID_PARAMS),
                       (lambda: a.create_move_task("t1", "nope:1", hb), ErrorCode.INVALID_PARAMS),
                       (lambda: a.create_move_task("nope", ha, hb), ErrorCode.OBJECT_NOT_FOUND)]:
        assert call() == ((0, 0), code)
        assert n() == 1
    with pytest.raises(TypeError):
        a.create_copy_task("t1", hb)
    with pytest.raises(TypeError):
        a.create_move_task("t1", ha, None)
    tid, rc = a.create_copy_task("t1", [ha, hb])
    assert rc == 0 and tid != (0, 0) and n() == 2
    r, rc = a.query_task(tid)
    assert rc == 0 and r.id == tid and r.type == TaskType.REPLICA_COPY and r.status == TaskStatus.SUCCESS
    assert a.create_copy_task("t1", [hb])[1] == 0 and n() == 2  # already there
    segs = sorted(d.get_memory_descriptor().buffer_descriptor.transport_endpoint for d in a.get_replica_desc("t1"))
    assert segs == sorted([ha, hb])
    tid, rc = a.create_move_task("t1", hb, ha)  # ha holds one: hb's goes
    assert rc == 0 and n() == 1 and a.query_task(tid)[0].type == TaskType.REPLICA_MOVE
    src = a.get_replica_desc("t1")[0].get_memory_descriptor().buffer_descriptor.transport_endpoint
    other = hb if src == ha else ha
    assert a.create_move_task("t1", other, src) == ((0, 0), ErrorCode.INVALID_PARAMS)  # holds none
    assert a.create_move_task("t1", src, other)[1] == 0 and n() == 1
    assert a.get_replica_desc("t1")[0].get_memory_descriptor().buffer_descriptor.transport_endpoint == other
    assert b.get("t1") == data
    # The mover's segment goes with its client: the object, now only there, goes too.
    (a if other == ha else b).close()
    survivor = b if other == ha else a
    assert survivor.is_exist("t1") == 0
    survivor.close()
