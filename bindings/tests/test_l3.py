"""kvtier.L3Store, embedded and as a client of an in-process kvtier-l3 server."""

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import kvtier


@pytest.fixture(params=["embedded", "remote"])
def l3(request):
    if request.param == "embedded":
        yield kvtier.L3Store.embedded(1 << 24)
    else:
        srv = kvtier.L3Server(1 << 24)
        yield kvtier.L3Store.connect(srv.addr)
        srv.shutdown()


def test_put_get_roundtrip(l3):
    data = np.arange(1000, dtype=np.uint8)
    l3.put("k1", data)
    l3.put("k2", b"abc")
    l3.put("k3", bytearray(b"xyz"))
    l3.put("k4", memoryview(b"12345")[1:4])
    assert l3.get("k1") == data.tobytes()
    assert l3.get("k2") == b"abc" and l3.get("k3") == b"xyz" and l3.get("k4") == b"234"
    assert l3.get_size("k1") == 1000
    out = np.zeros(1200, dtype=np.uint8)
    assert l3.get_into("k1", out) == 1000 and np.array_equal(out[:1000], data)
    ba = bytearray(4)
    assert l3.get_into("k2", ba) == 3 and bytes(ba[:3]) == b"abc"
    assert l3.is_exist("k1") and not l3.is_exist("nope")
    assert l3.batch_is_exist(["k1", "nope", "k2"]).tolist() == [1, 0, 1]
    # A probe that asks for promotion answers the same (and takes no lease: removable).
    assert l3.batch_is_exist(["k1", "nope", "k2"], prefetch_to_memory=True).tolist() == [1, 0, 1]


def test_typed_errors_carry_mooncake_codes(l3):
    with pytest.raises(kvtier.ObjectNotFoundError) as e:
        l3.get("missing")
    assert e.value.code == -704 and isinstance(e.value, kvtier.L3Error)
    l3.put("dup", b"1")
    with pytest.raises(kvtier.ObjectAlreadyExistsError) as e:
        l3.put("dup", b"2")
    assert e.value.code == -705
    with pytest.raises(kvtier.BufferOverflowError) as e:
        l3.get_into("dup", bytearray(0))
    assert e.value.code == -10
    with pytest.raises(kvtier.InvalidKeyError):
        l3.put("", b"x")
    l3.get("dup")  # a read takes a lease
    with pytest.raises(kvtier.ObjectHasLeaseError) as e:
        l3.remove("dup")
    assert e.value.code == -706
    l3.remove("dup", force=True)
    assert not l3.is_exist("dup")


def test_batches_and_pages(l3):
    pool = np.zeros((8, 64), dtype=np.uint8)
    for i in range(8):
        pool[i] = i + 1
    keys = [f"p{i}" for i in range(4)]
    assert l3.batch_put_pages(keys, pool, [1, 3, 5, 7], 64).tolist() == [0, 0, 0, 0]
    dst = np.zeros((8, 64), dtype=np.uint8)
    got = l3.batch_get_pages(keys + ["nope"], dst, [0, 2, 4, 6, 1], 64)
    assert got.tolist() == [64, 64, 64, 64, -704]
    assert [int(dst[i, 0]) for i in (0, 2, 4, 6)] == [2, 4, 6, 8]
    bufs = [bytearray(64) for _ in keys]
    assert l3.batch_get_into(keys, bufs).tolist() == [64] * 4
    assert l3.batch_put_from(["a", "b", "p0"], [b"1", b"22", b"333"]).tolist() == [0, 0, -705]
    st = l3.stats()
    assert st["objects"] >= 6
    with pytest.raises(ValueError, match="outside the pool"):
        l3.batch_get_pages(["p0"], dst, [8], 64)
    with pytest.raises(ValueError, match="twice"):
        l3.batch_get_pages(["p0", "p1"], dst, [3, 3], 64)
    with pytest.raises(ValueError, match="differ"):
        l3.batch_put_pages(["p0"], pool, [1, 2], 64)


def test_query_then_get_with_query(l3):
    pool = np.zeros((4, 32), dtype=np.uint8)
    pool[:] = 9
    l3.batch_put_pages(["q0", "q1", "q2"], pool, [0, 1, 2], 32)
    q = l3.batch_query(["q0", "q1", "q2", "q3"])
    assert len(q) == 4 and q.hit_prefix() == 3
    assert q.codes.tolist() == [0, 0, 0, -704]
    assert q.sizes.tolist() == [32, 32, 32, 0]
    assert q.keys == ["q0", "q1", "q2", None]
    assert q.min_deadline(3) is not None and q.min_deadline(4) is None
    dst = np.zeros((4, 32), dtype=np.uint8)
    assert l3.batch_get_pages_with_query(q, dst, [3, 2], 32, 1).tolist() == [32, 32]
    assert (dst[3] == 9).all() and (dst[2] == 9).all() and (dst[0] == 0).all()
    with pytest.raises(ValueError):
        l3.batch_get_pages_with_query(q, dst, [0, 1, 2, 3], 32)


def test_lease_expiry_is_refused_not_read():
    st = kvtier.L3Store.embedded(1 << 20, lease_ttl_ms=1000)
    st.put("x", b"a" * 16)
    q = st.batch_query(["x"])
    assert q.valid_prefix(st.now_ms()) == 1
    st.advance_clock_ms(5000)
    assert q.valid_prefix(st.now_ms()) == 0
    dst = np.zeros((1, 16), dtype=np.uint8)
    assert st.batch_get_pages_with_query(q, dst, [0], 16).tolist() == [-707]
    assert (dst == 0).all()


def test_a_store_that_could_never_hold_an_object_is_refused():
    # A private embedded store (no name) of 0 bytes has no segment and none can be mounted
    # into it: every put failed with -200 while the store looked fine. A named one may get
    # a Mooncake client's segment later, so 0 is taken there.
    with pytest.raises(kvtier.InvalidParamsError, match="segment_bytes"):
        kvtier.L3Store.embedded(0)
    named = kvtier.L3Store.embedded(0, name="zero-segment-test")
    assert named.is_embedded
    # A zero read lease refused every query-then-get (-707) while plain gets worked.
    with pytest.raises(kvtier.InvalidParamsError, match="lease"):
        kvtier.L3Store.embedded(1 << 20, lease_ttl_ms=0)


def test_a_named_store_is_not_opened_again_with_another_ssd_tier(tmp_path):
    # Handles naming one store share it, and an opener's SSD tier was ignored when the store
    # was already open: L3Store.embedded(name=N, ssd_dir=D) on a DRAM-only N got no SSD
    # tier (nothing persisted, silently). Asking for another tier than the store has is
    # refused; the same one (or none: attach) is taken.
    dram = kvtier.L3Store.embedded(1 << 20, name="ssd-mismatch-a")
    with pytest.raises(kvtier.InvalidParamsError, match="ssd"):
        kvtier.L3Store.embedded(1 << 20, name="ssd-mismatch-a", ssd_dir=str(tmp_path / "d1"))
    assert not (tmp_path / "d1").exists()
    with_ssd = kvtier.L3Store.embedded(1 << 20, name="ssd-mismatch-b", ssd_dir=str(tmp_path / "d2"))
    with pytest.raises(kvtier.InvalidParamsError, match="ssd"):
        kvtier.L3Store.embedded(1 << 20, name="ssd-mismatch-b", ssd_dir=str(tmp_path / "d3"))
    same = kvtier.L3Store.embedded(1 << 20, name="ssd-mismatch-b", ssd_dir=str(tmp_path / "d2") + "/")
    attach = kvtier.L3Store.embedded(name="ssd-mismatch-b")
    same.put("k", b"v", wait_persisted=True)
    assert attach.get("k") == b"v" and with_ssd.stats()["disk_objects"] == 1 and dram.is_embedded


def test_an_ssd_capacity_without_a_tier_or_of_no_bytes_is_refused(tmp_path):
    # ssd_capacity_bytes without ssd_dir was ignored (a DRAM-only store, where the caller
    # asked for a capacity of SSD); a tier of 0 bytes failed every SSD write (-1103).
    with pytest.raises(kvtier.InvalidParamsError, match="ssd_dir"):
        kvtier.L3Store.embedded(1 << 20, ssd_capacity_bytes=1 << 30)
    with pytest.raises(kvtier.InvalidParamsError, match="capacity"):
        kvtier.L3Store.embedded(1 << 20, ssd_dir=str(tmp_path / "ssd"), ssd_capacity_bytes=0)
    assert not (tmp_path / "ssd").exists()
    s = kvtier.L3Store.embedded(1 << 20, ssd_dir=str(tmp_path / "ssd"), ssd_capacity_bytes=1 << 20)
    s.put("k", b"v", wait_persisted=True)


def test_tenants_are_isolated():
    a = kvtier.L3Store.embedded(1 << 20, tenant="a", name="tenants-test")
    b = a.with_tenant("b")
    a.put("k", b"A")
    assert not b.is_exist("k")
    b.put("k", b"B")
    assert a.get("k") == b"A" and b.get("k") == b"B"
    assert a.tenant == "a" and b.tenant == "b"
    shared = kvtier.L3Store.embedded(tenant="a", name="tenants-test")
    assert shared.get("k") == b"A"
    with pytest.raises(kvtier.InvalidParamsError):
        a.with_tenant("bad/tenant")


def test_remove_all_and_server_lifecycle():
    with kvtier.L3Server(1 << 20) as srv:
        c = kvtier.L3Store.connect(srv.addr)
        assert not c.is_embedded and c.now_ms() is None
        c.batch_put_from(["a", "b"], [b"1", b"2"])
        assert c.remove_all() == 2
        assert srv.running
    assert not srv.running
    with pytest.raises(kvtier.RpcFailError):
        kvtier.L3Store.connect(srv.addr, rpc_timeout_ms=2000).put("a", b"1")


@pytest.mark.parametrize("where", ["embedded", "remote"])
@pytest.mark.parametrize("most", [1, 4096, 1 << 20])
def test_object_limits_are_read_without_a_put(where, most):
    """``max_object_bytes`` (the server's, for a client) and ``object_refusal``: a page size is
    checked against the store's limits, nothing written; the limit given is the one enforced."""
    from kvtier.l3_limits import object_refusal

    seg = 1 << 16
    srv = kvtier.L3Server(seg, max_object_bytes=most) if where == "remote" else None
    try:
        s = kvtier.L3Store.connect(srv.addr) if srv else kvtier.L3Store.embedded(seg, max_object_bytes=most)
        assert s.max_object_bytes == most
        # the DRAM boundary: an object under a 6-byte key ("k64692") whose charge fills the
        # segment exactly, and one byte more
        edge = seg - kvtier.l3_charge(0, 6)
        for n in sorted({1, most, most + 1, edge, edge + 1, seg, seg + 1}):
            key = f"k{n}"
            why = object_refusal(s, n, len(key))
            assert (why is None) == (n <= most and kvtier.l3_charge(n, len(key)) <= seg), (n, why)
            if n <= most:  # what a put does with an object of n bytes agrees
                try:
                    s.put(key, bytes(n))
                    assert why is None
                except kvtier.L3Error:
                    assert why is not None
    finally:
        if srv:
            srv.shutdown()


def test_a_clients_object_limit_is_what_one_frame_carries():
    """A server's default limits (1 GiB objects, 64 MiB frames): a client reported 1 GiB, so
    an engine's startup check passed a 64 MiB chunk whose every put then failed with -600."""
    from kvtier.l3_limits import object_refusal

    srv = kvtier.L3Server(1 << 20)
    try:
        s = kvtier.L3Store.connect(srv.addr)
        assert 63 << 20 < s.max_object_bytes < 64 << 20
        assert object_refusal(s, 64 << 20, len("big")) is not None
        with pytest.raises(kvtier.InvalidParamsError):
            s.put("big", bytes(s.max_object_bytes + 1))
    finally:
        srv.shutdown()


def test_remote_token():
    srv = kvtier.L3Server(1 << 20, token="s3cret")
    try:
        with pytest.raises(kvtier.L3Error):
            kvtier.L3Store.connect(srv.addr, token="wrong")
        ok = kvtier.L3Store.connect(srv.addr, token="s3cret")
        ok.put("t", b"1")
        assert ok.get("t") == b"1"
    finally:
        srv.shutdown()


def test_wait_persisted_puts_are_on_disk_when_they_return(tmp_path):
    s = kvtier.L3Store.embedded(1 << 24, ssd_dir=str(tmp_path))
    for i in range(8):
        s.put(f"p{i}", bytes([i]) * 1000, wait_persisted=True)
        # No flush: the put returned only once its SSD copy was registered.
        assert s.stats()["disk_objects"] == i + 1
    codes = s.batch_put_from(["b0", "b1"], [b"x" * 10, b"y" * 10], wait_persisted=True)
    assert codes.tolist() == [0, 0] and s.stats()["disk_objects"] == 10
    pool = np.arange(4 * 64, dtype=np.uint8).reshape(4, 64)
    codes = s.batch_put_pages(["g0", "g1"], pool, np.array([1, 3]), 64, wait_persisted=True)
    assert codes.tolist() == [0, 0] and s.stats()["disk_objects"] == 12
    del s
    # A restart finds every one of them.
    s = kvtier.L3Store.embedded(1 << 24, ssd_dir=str(tmp_path))
    assert s.get("p3") == bytes([3]) * 1000 and s.get("g1") == pool[3].tobytes()


def test_a_forked_worker_does_not_keep_the_ssd_dir_locked(tmp_path):
    """An engine forks its workers after opening its store (Python multiprocessing's fork).
    A ``flock`` on the SSD directory was shared with every such child, so once the store was
    dropped, a new one on the same directory was refused ("in use by another process") for as
    long as a worker lived. The directory lock is now a record lock, never inherited."""
    s = kvtier.L3Store.embedded(1 << 24, ssd_dir=str(tmp_path))
    s.put("k", b"v" * 100, wait_persisted=True)
    pid = os.fork()
    if pid == 0:  # the worker: lives on, touching nothing
        time.sleep(30)
        os._exit(0)
    try:
        del s
        s = kvtier.L3Store.embedded(1 << 24, ssd_dir=str(tmp_path))
        assert s.get("k") == b"v" * 100
        # ...and the new store holds it: a second one in this process is refused.
        with pytest.raises(kvtier.L3Error, match="in use"):
            kvtier.L3Store.embedded(1 << 24, ssd_dir=str(tmp_path))
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_forked_worker_opens_the_ssd_dir_once_the_engine_let_go(tmp_path):
    """The other side of the test above: a worker forked while the engine's store was open
    inherited the process's set of held directory locks, so after the engine dropped its
    store the worker still could not open one on that directory ("in use"), though no process
    held it. The worker tries while the engine holds it (refused), then after the engine's
    drop (a pipe says when) opens it and reads what the engine persisted."""
    s = kvtier.L3Store.embedded(1 << 24, ssd_dir=str(tmp_path))
    s.put("k", b"v" * 100, wait_persisted=True)
    tried_r, tried_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker
        code = 0
        try:
            try:
                kvtier.L3Store.embedded(1 << 24, ssd_dir=str(tmp_path))
                code = 2  # opened while the engine held it
            except kvtier.L3Error:
                pass
            os.write(tried_w, b"t")
            os.read(go_r, 1)
            if code == 0:
                mine = kvtier.L3Store.embedded(1 << 24, ssd_dir=str(tmp_path))
                code = 0 if mine.get("k") == b"v" * 100 else 5
        except kvtier.L3Error:
            code = 4  # refused after the engine let go
        except BaseException:
            code = 6
        os._exit(code)
    os.close(tried_w)
    try:
        assert os.read(tried_r, 1) == b"t"
        del s
        os.write(go_w, b"g")
        deadline = time.monotonic() + 30
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() < deadline, "the worker did not end"
            time.sleep(0.05)
        pid = 0
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
            f"worker status {status}: exit 2 opened it while held, 4 refused after the drop, 5 read other bytes")
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        for fd in (tried_r, go_r, go_w):
            os.close(fd)


@pytest.mark.parametrize("ms", [0, 1 << 36, 2**64 - 1])
def test_out_of_range_rpc_timeout_is_a_typed_error(ms):
    srv = kvtier.L3Server(1 << 20)
    try:
        with pytest.raises(kvtier.InvalidParamsError):
            kvtier.L3Store.connect(srv.addr, rpc_timeout_ms=ms)
    finally:
        srv.shutdown()


def test_epoch_fenced_has_its_own_class_still_caught_as_unavailable():
    """L3Error::EpochFenced (a put straddling a master failover) is kvtier.EpochFencedError:
    a caller can tell "put it again" from a plain -1010, and ``except UnavailableError``
    (the class it was raised as before) still catches it, with the same Mooncake code."""
    e = kvtier.EpochFencedError
    assert issubclass(e, kvtier.UnavailableError) and issubclass(e, kvtier.L3Error)
    assert e.code == kvtier.UnavailableError.code == -1010
    assert not issubclass(kvtier.UnavailableInModeError, e)
    with pytest.raises(kvtier.UnavailableError) as caught:
        raise e("epoch fenced: the put started under master epoch 1, the leader is now epoch 2")
    assert caught.value.code == -1010
    stub = (Path(__file__).resolve().parents[1] / "python" / "kvtier" / "_native.pyi").read_text()
    assert "class EpochFencedError(UnavailableError)" in stub


@pytest.mark.parametrize("shm", [True, False])
def test_a_shut_down_server_serves_no_more_requests_on_open_channels(shm):
    """After ``L3Server.shutdown()`` returns, every call of a connected client fails, also on
    the transfer or shared-memory channel it opened before: the serving thread woke on the
    next request and served it (``is_exist`` answered, a put over shared memory reported
    success for an object nobody could read), checking the stop flag only before reading."""
    srv = kvtier.L3Server(1 << 24)
    c = kvtier.L3Store.connect(srv.addr, shm=shm)
    c.put("a", b"A" * 8)
    assert c.is_exist("a")  # the channel is open
    srv.shutdown()
    assert not srv.running
    for call in (lambda: c.is_exist("a"), lambda: c.put("z", b"Z" * 8), lambda: c.get("a")):
        with pytest.raises(kvtier.L3Error):
            call()


L3_BIN = Path(__file__).resolve().parents[2] / "target" / "release" / "kvtier-l3"


@pytest.mark.skipif(not L3_BIN.exists(), reason="needs target/release/kvtier-l3")
def test_a_server_of_another_protocol_version_is_refused_with_its_own_class():
    """A server announcing another wire protocol version (the test hook
    KVTIER_L3_TEST_PROTOCOL_VERSION_OVERRIDE) is refused at connect with
    kvtier.ProtocolMismatchError (-300, an L3Error) naming both versions, never served."""
    import subprocess

    e = kvtier.ProtocolMismatchError
    assert issubclass(e, kvtier.L3Error) and e.code == -300
    env = dict(os.environ, KVTIER_L3_TEST_PROTOCOL_VERSION_OVERRIDE="4000000000")
    env.pop("KVTIER_L3_TOKEN", None)
    p = subprocess.Popen(
        [str(L3_BIN), "--listen", "127.0.0.1:0", "--segment-bytes", "16777216"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("LISTENING "), line
        addr = line.split()[1]
        with pytest.raises(kvtier.ProtocolMismatchError) as caught:
            kvtier.L3Store.connect(addr)
        assert caught.value.code == -300
        assert "the server 4000000000" in str(caught.value), str(caught.value)
    finally:
        p.kill()
        p.wait()
