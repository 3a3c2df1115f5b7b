"""kvtier.mooncake_compat.MooncakeDistributedStore: Mooncake's methods, arguments and codes."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier.mooncake_compat import ErrorCode, MooncakeDistributedStore, ReplicateConfig

_names = itertools.count()


def new_store(master=None, seg=1 << 24):
    s = MooncakeDistributedStore()
    master = master or f"embedded://compat-{next(_names)}"
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", seg, 1 << 20, "tcp", "", master) == 0
    return s


def registered(store, nbytes):
    raw = np.zeros(nbytes + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    buf = raw[off : off + nbytes]
    assert store.register_buffer(buf.ctypes.data, nbytes) == 0
    return raw, buf


def test_setup_positional_dict_and_keywords():
    a = new_store("embedded://shared-setup")
    b = MooncakeDistributedStore()
    assert b.setup({"local_hostname": "h", "metadata_server": "P2PHANDSHAKE",
                    "global_segment_size": str(1 << 20), "local_buffer_size": 1 << 20,
                    "protocol": "tcp", "master_server_addr": "embedded://shared-setup"}) == 0
    c = MooncakeDistributedStore()
    assert c.setup("h", "P2PHANDSHAKE", 1 << 20, 1 << 20, "tcp", "", "embedded://shared-setup",
                   tenant_id="other") == 0
    assert a.put("k", b"v") == 0
    assert b.get("k") == b"v"  # same store, same tenant
    assert c.is_exist("k") == 0  # another tenant
    assert a.setup("h", "m", 1, 1, "tcp", "", "embedded://x") == 0  # second setup: no-op
    assert MooncakeDistributedStore().setup({"local_hostname": "h"}) == ErrorCode.INVALID_PARAMS
    with pytest.raises(TypeError):
        MooncakeDistributedStore().setup("h", "m")
    with pytest.raises(TypeError):
        MooncakeDistributedStore().setup("h", "m", "lots", 1, "tcp", "", "embedded")
    # host:port as Mooncake reports it; a second setup (a no-op) does not rename the client
    host, _, port = a.get_hostname().rpartition(":")
    assert host == "127.0.0.1" and port.isdigit() and int(port) > 0
    assert b.get_hostname().startswith("h:") and b.get_hostname() != a.get_hostname()
    assert a.health_check() == 0 and a.close() == 0


def test_put_get_codes():
    s = new_store()
    assert s.put("a", b"hello") == 0
    assert s.put("a", b"again") == 0  # as Mooncake: first writer wins, the call succeeds
    assert s.get("a") == b"hello"
    assert s.get("missing") == b""
    assert s.is_exist("a") == 1 and s.is_exist("missing") == 0
    assert s.batch_is_exist(["a", "missing", "a"]) == [1, 0, 1]
    assert s.get_size("a") == 5 and s.get_size("missing") == -704
    assert s.put("b", np.arange(10, dtype=np.uint8), ReplicateConfig()) == 0
    assert s.put_parts("c", b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0
    assert s.get("c") == b"abcdef"
    assert s.put_batch(["d", "e"], [b"1", b"2"]) == 0
    assert s.get_batch(["d", "e", "zz"]) == [b"1", b"2", b""]
    assert s.put("", b"x") == ErrorCode.INVALID_KEY


@pytest.mark.parametrize("where", ["embedded", "server"])
def test_an_upsert_refused_for_its_value_keeps_the_old_object(where):
    """An upsert whose new value no store takes (0 bytes, or past the object limit) is -600
    and leaves the old object readable: it removed the old object first, so a bad call
    destroyed state (Mooncake checks the size before it touches the key)."""
    srv = kvtier.L3Server(1 << 24, max_object_bytes=1 << 20) if where == "server" else None
    s = new_store(srv.addr if srv else None)
    _, buf = registered(s, 2 << 20)
    p = buf.ctypes.data
    calls = [
        lambda: s.upsert_from("x", p, 0),
        lambda: s.batch_upsert_from(["x"], [p], [0])[0],
        lambda: s._multi(s._core.batch_upsert_from_multi_buffers, ["x"], [[p]], [[0]])[0],
    ]
    if srv:
        big = (1 << 20) + 1
        calls += [
            lambda: s.upsert_from("x", p, big),
            lambda: s.upsert("x", b"z" * big),
            lambda: s.upsert_batch(["x"], [b"z" * big]),
        ]
    for i, call in enumerate(calls):
        s.remove("x", True)
        assert s.put("x", b"old") == 0
        assert (i, call()) == (i, ErrorCode.INVALID_PARAMS)
        assert (i, s.get("x")) == (i, b"old")
    # a good value in the same batch as a refused one still replaces its own key
    assert s.batch_upsert_from(["x", "y"], [p, p], [4, 0]) == [0, -600]
    assert s.get("x") == bytes(4)
    s.close()
    if srv:
        srv.shutdown()


MOST = 256  # the object limit of the property's store
_sizes = st.sampled_from([0, 1, 7, MOST, MOST + 1, 300])
_op = st.tuples(
    st.sampled_from(["put", "upsert", "upsert_from", "batch_upsert_from"]),
    st.lists(st.sampled_from("abc"), min_size=1, max_size=3, unique=True),
    st.lists(_sizes, min_size=3, max_size=3),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_op, min_size=1, max_size=12))
def test_every_write_leaves_each_key_as_mooncakes_model_says(ops):
    """Any sequence of puts and upserts (bytes and registered memory) over a few keys, with
    values of 0 bytes, at the object limit and past it: each key reads what a model of
    Mooncake says (a put keeps an existing object, an upsert replaces it, a value no store
    takes is -600 and changes nothing)."""
    s = MooncakeDistributedStore()
    assert s.setup_with_store(kvtier.L3Store.embedded(1 << 22, max_object_bytes=MOST)) == 0
    _, buf = registered(s, 3 * 512)
    model = {}
    for n, (call, keys, sizes) in enumerate(ops):
        vals = [bytes([(n * 3 + i) % 251 + 1]) * sz for i, sz in enumerate(sizes[: len(keys)])]
        ok = [0 < len(v) <= MOST for v in vals]
        for i, v in enumerate(vals):
            buf[512 * i : 512 * i + len(v)] = np.frombuffer(v, np.uint8)
        ptrs = [buf.ctypes.data + 512 * i for i in range(len(keys))]
        if call == "put":
            got = [s.put(keys[0], vals[0])]
        elif call == "upsert":
            got = [s.upsert(keys[0], vals[0])]
        elif call == "upsert_from":
            got = [s.upsert_from(keys[0], ptrs[0], len(vals[0]))]
        else:
            got = s.batch_upsert_from(keys, ptrs, [len(v) for v in vals])
        for k, v, good, code in zip(keys, vals, ok, got):
            assert code == (0 if good else -600), (call, k, len(v))
            if good and (call != "put" or k not in model):
                model[k] = v
        for k in "abc":
            assert s.get(k) == model.get(k, b""), (n, call, k)
    s.close()


@pytest.mark.parametrize("where", ["embedded", "server"])
def test_batches_past_the_stores_batch_limit_answer_per_key(where):
    """Mooncake takes any number of keys in a batch; kvtier's store takes max_batch_keys
    (65,536 by default) a request. Every key of a longer batch was -600 (SGLang's own
    Mooncake backend asks batch_is_exist about a whole prompt: no hit past 65,536 pages).
    The calls go max_batch_keys keys at a time; a limit of 100 here, batches of 250."""
    limit, n = 100, 250
    srv = kvtier.L3Server(1 << 24, max_batch_keys=limit) if where == "server" else None
    s = MooncakeDistributedStore()
    if srv:
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", srv.addr) == 0
    else:
        assert s.setup_with_store(kvtier.L3Store.embedded(1 << 24, max_batch_keys=limit)) == 0
    _, src = registered(s, 16 * n)
    _, dst = registered(s, 16 * n)
    src[:] = np.arange(16 * n) % 251
    keys = [f"b{i}" for i in range(n)]
    ptrs = [src.ctypes.data + 16 * i for i in range(n)]
    assert s.batch_put_from(keys, ptrs, [8] * n) == [0] * n
    assert s.batch_upsert_from(keys, ptrs, [16] * n) == [0] * n
    assert s.batch_is_exist(keys + ["nope"]) == [1] * n + [0]
    assert s.batch_get_into(keys, [dst.ctypes.data + 16 * i for i in range(n)], [16] * n) == [16] * n
    assert np.array_equal(dst, src)
    half = [[dst.ctypes.data + 16 * i, dst.ctypes.data + 16 * i + 8] for i in range(n)]
    dst[:] = 0
    assert s.batch_get_into_multi_buffers(keys, half, [[8, 8]] * n) == [16] * n
    assert np.array_equal(dst, src)
    parts = [[p, p + 8] for p in ptrs]
    assert s.batch_put_from_multi_buffers([f"m{i}" for i in range(n)], parts, [[8, 8]] * n) == [0] * n
    assert s.put_batch([f"v{i}" for i in range(n)], [b"x"] * n) == 0
    assert s.upsert_batch([f"v{i}" for i in range(n)], [b"y"] * n) == 0
    assert s.get_batch([f"v{i}" for i in range(n)]) == [b"y"] * n
    assert s.batch_remove(keys, True) == [0] * n
    s.close()
    if srv:
        srv.shutdown()


def test_remove_force_and_remove_all():
    s = new_store()
    s.put("x", b"1")
    s.put("y", b"2")
    s.put("z", b"3")
    assert s.remove("missing") == -704
    assert s.get("x") == b"1"  # takes a lease
    assert s.remove("x") == ErrorCode.OBJECT_HAS_LEASE == -706
    assert s.remove("x", force=True) == 0
    assert s.is_exist("x") == 0
    assert s.batch_remove(["y", "missing"], True) == [0, -704]
    assert s.remove_all(True) == 1
    assert s.is_exist("z") == 0


def test_zero_copy_with_registered_buffers():
    s = new_store()
    _, src = registered(s, 1 << 16)
    _, dst = registered(s, 1 << 16)
    src[:] = np.random.default_rng(1).integers(0, 256, size=src.size, dtype=np.uint8)
    sp, dp = src.ctypes.data, dst.ctypes.data
    assert s.put_from("z0", sp, 4096) == 0
    assert s.get_into("z0", dp, 4096) == 4096
    assert np.array_equal(dst[:4096], src[:4096])
    keys = [f"zb{i}" for i in range(8)]
    assert s.batch_put_from(keys, [sp + i * 1024 for i in range(8)], [1024] * 8) == [0] * 8
    assert s.batch_get_into(keys, [dp + i * 1024 for i in range(8)], [1024] * 8) == [1024] * 8
    assert np.array_equal(dst[: 8 * 1024], src[: 8 * 1024])
    assert s.get_into("z0", dp, 100) == ErrorCode.INVALID_PARAMS  # Mooncake: -600, not -10
    assert s.batch_get_into(["zb0", "zb1"], [dp, dp + 1024], [1024, 100]) == [1024, -600]
    assert s.put_from("z0", sp, 4096) == 0  # duplicate: success, first value kept
    assert s.batch_put_from(keys[:2], [sp, sp], [1024, 1024]) == [0, 0]
    assert s.get_into("nope", dp, 4096) == -704
    assert s.batch_get_into(["zb0", "nope"], [dp, dp + 2048], [1024, 1024]) == [1024, -704]
    # destinations overlapping each other are refused, not raced
    assert s.batch_get_into(["zb0", "zb1"], [dp, dp + 512], [1024, 1024]) == [-600, -600]
    assert s.unregister_buffer(sp) == 0
    assert s.put_from("z1", sp, 16) == ErrorCode.INVALID_PARAMS
    assert s.unregister_buffer(sp) == ErrorCode.INVALID_PARAMS


def test_unregistered_or_bad_pointers_are_refused():
    s = new_store()
    raw, buf = registered(s, 4096)
    p = buf.ctypes.data
    assert s.put_from("k", p + 4000, 200) == -600  # runs past the registration
    assert s.put_from("k", 12345, 10) == -600  # never registered
    assert s.put_from("k", p, -1) == -600
    assert s.get_into("k", -5, 10) == -600
    assert s.get_into("k", 0, 10) == -600
    assert s.batch_put_from(["a", "b"], [p, 99], [16, 16]) == [0, -600]
    assert s.batch_put_from(["a"], [p, p], [16]) == [-600]
    assert s.register_buffer(p + 10, 10) == -600  # overlaps an existing registration
    assert s.register_buffer(0, 10) == -600 and s.register_buffer(p, 0) == -600
    with pytest.raises(TypeError):
        s.put_from("k", "not a pointer", 10)
    with pytest.raises(TypeError):
        s.put_from(123, p, 10)
    with pytest.raises(TypeError):
        s.batch_get_into("abc", [p], [1])


def test_calls_before_setup_and_after_close():
    s = MooncakeDistributedStore()
    assert s.put("a", b"1") == -1
    assert s.get("a") == b""
    assert s.is_exist("a") == -1 and s.get_size("a") == -1
    assert s.batch_is_exist(["a", "b"]) == [-1, -1]
    assert s.remove("a") == -1 and s.remove_all() == -1
    s2 = new_store()
    s2.put("a", b"1")
    assert s2.close() == 0
    # health_check: 1 when not set up or closed (Mooncake's documented and measured code)
    assert s2.get("a") == b"" and s2.is_exist("a") == -1 and s2.health_check() == 1
    assert s.health_check() == 1


def test_remote_master_through_kvtier_server():
    with kvtier.L3Server(1 << 22) as srv:
        s = MooncakeDistributedStore()
        host, port = srv.addr.rsplit(":", 1)
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", f"localhost:{port}") == 0
        assert s.put("r", b"remote") == 0 and s.get("r") == b"remote"
        t = MooncakeDistributedStore()
        assert t.setup({"local_hostname": "x", "metadata_server": "y", "master_server_addr": f"kvtier://{srv.addr}"}) == 0
        assert t.is_exist("r") == 1
    bad = MooncakeDistributedStore()
    assert bad.setup("h", "m", 0, 0, "tcp", "", "127.0.0.1:1") == -900
    assert bad.setup("h", "m", 0, 0, "tcp", "", "no-port") == -600


def test_clients_segments_on_a_server_are_capped():
    """A Mooncake client's global segment mounted into a kvtier server is memory the *server*
    holds: past ``client_segments_max_bytes`` (default: the host's memory) setup answers
    -200 and mounts nothing, and a closed client's segment gives its room back."""
    mib = 1 << 20
    with kvtier.L3Server(0, client_segments_max_bytes=8 * mib) as srv:
        a, b = MooncakeDistributedStore(), MooncakeDistributedStore()
        assert a.setup("127.0.0.1", "P2PHANDSHAKE", 6 * mib, 1 << 20, "tcp", "", srv.addr) == 0
        assert b.setup("127.0.0.1", "P2PHANDSHAKE", 6 * mib, 1 << 20, "tcp", "", srv.addr) == -200
        assert a.put("k", b"x" * mib) == 0 and a.get("k") == b"x" * mib
        assert a.close() == 0
        assert b.setup("127.0.0.1", "P2PHANDSHAKE", 8 * mib, 1 << 20, "tcp", "", srv.addr) == 0
        assert b.put("k2", b"y" * 4 * mib) == 0 and b.get("k2") == b"y" * 4 * mib
        b.close()
    with kvtier.L3Server(0) as srv:
        c = MooncakeDistributedStore()
        too_big = 1 << 50  # 1 PiB: past any host's memory
        assert c.setup("127.0.0.1", "P2PHANDSHAKE", too_big, 1 << 20, "tcp", "", srv.addr) == -200


def test_setup_with_existing_l3store():
    st = kvtier.L3Store.embedded(1 << 20, tenant="eng")
    st.put("shared", b"yes")
    s = MooncakeDistributedStore()
    assert s.setup_with_store(st) == 0
    assert s.get("shared") == b"yes"


def test_multi_buffer_batches():
    s = new_store()
    _, src = registered(s, 1 << 14)
    _, dst = registered(s, 1 << 14)
    src[:] = np.arange(src.size, dtype=np.uint64).astype(np.uint8)
    sp, dp = src.ctypes.data, dst.ctypes.data
    # key i = K half (512 bytes) + V half (512 bytes) from two places
    keys = ["mb0", "mb1"]
    assert s.batch_put_from_multi_buffers(keys, [[sp, sp + 8192], [sp + 1024, sp + 9216]],
                                          [[512, 512], [512, 512]]) == [0, 0]
    assert s.get_size("mb0") == 1024
    got = s.batch_get_into_multi_buffers(keys + ["nope"], [[dp, dp + 4096], [dp + 1024, dp + 5120], [dp + 12000]],
                                         [[512, 512], [512, 512], [16]])
    assert got == [1024, 1024, -704]
    assert np.array_equal(dst[:512], src[:512]) and np.array_equal(dst[4096:4608], src[8192:8704])
    assert np.array_equal(dst[5120:5632], src[9216:9728])
    assert s.batch_put_from_multi_buffers(["bad"], [[sp, 77]], [[16, 16]]) == [-600]
    assert s.batch_put_from_multi_buffers(["bad"], [[sp]], [[16, 16]]) == [-600]
    assert s.batch_get_into_multi_buffers(["mb0"], [[dp]], [[100]]) == [-600]  # too small
