"""The shared-memory path from Python (issue 23): ``kvtier.L3Store.connect`` and the Mooncake
compat class's dummy client reach a ``kvtier-l3`` process on this host through shared memory
without any change in the caller's code, agree byte for byte with a TCP client, and have an
off switch (``shm=False``, ``KVTIER_L3_SHM=off``, the server's ``--no-shm``).

The servers here are real ``kvtier-l3`` processes (the binary ``cargo test`` builds), so the
pool of a dummy client is checked to be mapped by the *server* (``/proc/<pid>/maps``).
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import kvtier
from kvtier.mooncake_compat import MooncakeDistributedStore

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(os.environ.get("KVTIER_L3_BIN", ROOT / "target" / "release" / "kvtier-l3"))


class Proc:
    def __init__(self, *extra, env=None, segment_bytes=64 << 20, base=None):
        if base is None:
            base = ("--listen", "127.0.0.1:0", "--segment-bytes", str(segment_bytes))
        if not BIN.exists():
            pytest.fail(f"{BIN} missing: build it with `cargo build --release -p kvtier-l3`")
        e = dict(os.environ)
        e.pop("KVTIER_L3_TOKEN", None)
        e.update(env or {})
        self.p = subprocess.Popen([str(BIN), *base, *extra],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=e)
        for line in self.p.stdout:
            if line.startswith("LISTENING"):
                self.addr = line.split()[1]
                break
        else:
            raise RuntimeError("kvtier-l3 did not start")

    def memfd_maps(self, name):
        with open(f"/proc/{self.p.pid}/maps") as f:
            return [l for l in f if f"memfd:{name}" in l]

    def close(self):
        self.p.kill()
        self.p.wait()


@pytest.fixture
def proc():
    p = Proc()
    yield p
    p.close()


def test_l3store_uses_shm_on_the_same_host_and_agrees_with_tcp(proc):
    fast = kvtier.L3Store.connect(proc.addr)
    slow = kvtier.L3Store.connect(proc.addr, shm=False)
    assert fast.uses_shm and not slow.uses_shm
    rng = np.random.default_rng(0)
    objs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 4096, 1 << 20, 3 << 20)]
    keys = [f"k{i}" for i in range(len(objs))]
    assert list(fast.batch_put_from(keys[:2], objs[:2])) == [0, 0]
    assert list(slow.batch_put_from(keys[2:], objs[2:])) == [0, 0]
    for reader in (fast, slow):
        outs = [np.zeros(len(o) + 5, dtype=np.uint8) for o in objs]
        assert list(reader.batch_get_into(keys, outs)) == [len(o) for o in objs]
        for o, b in zip(objs, outs):
            assert np.array_equal(b[:len(o)], o) and not b[len(o):].any()
    small = np.zeros(10, dtype=np.uint8)
    other = np.zeros(10, dtype=np.uint8)  # one buffer twice is refused (aliasing)
    assert list(fast.batch_get_into(["k2", "absent"], [small, other])) == \
        list(slow.batch_get_into(["k2", "absent"], [small, other]))
    # The server maps this client's staging segment (and nothing of the TCP client's).
    assert len(proc.memfd_maps("kvtier-shm-staging")) == 1


def test_in_place_copies_when_asked_agree_with_staging(proc):
    """Plain Python buffers are staged by default; with ``KVTIER_L3_SHM=inplace`` the server
    copies them in place (one copy), with the same bytes either way."""
    staged = kvtier.L3Store.connect(proc.addr)
    assert staged.uses_shm and not staged.uses_shm_in_place
    rng = np.random.default_rng(2)
    objs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 4099, 3 << 20)]
    keys = [f"ip{i}" for i in range(len(objs))]
    code = ("import kvtier, sys, numpy as np; s = kvtier.L3Store.connect(sys.argv[1]); "
            "rng = np.random.default_rng(2); "
            "objs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 4099, 3 << 20)]; "
            "print(s.uses_shm, s.uses_shm_in_place, *s.batch_put_from(sys.argv[2:], objs)); "
            "s.put('bytes', b'plain-bytes'); "
            "outs = [np.zeros(len(o) + 1, dtype=np.uint8) for o in objs]; "
            "print(*s.batch_get_into(sys.argv[2:], outs), "
            "all(np.array_equal(b[:len(o)], o) and b[-1] == 0 for o, b in zip(objs, outs)))")
    env = dict(os.environ, KVTIER_L3_SHM="inplace")
    out = subprocess.run([sys.executable, "-c", code, proc.addr, *keys], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.split() == ["True", "True", "0", "0", "0", "1", "4099", str(3 << 20), "True"], \
        out.stderr[-2000:]
    # Written in place by the other process, read back staged here.
    outs = [np.zeros(len(o), dtype=np.uint8) for o in objs]
    assert list(staged.batch_get_into(keys, outs)) == [len(o) for o in objs]
    assert all(np.array_equal(b, o) for o, b in zip(objs, outs))
    assert staged.get("bytes") == b"plain-bytes"


def test_off_switches(proc):
    code = ("import kvtier, sys; s = kvtier.L3Store.connect(sys.argv[1]); "
            "s.put('e', b'x'); print(s.uses_shm, s.get('e'))")
    env = dict(os.environ, KVTIER_L3_SHM="off")
    out = subprocess.run([sys.executable, "-c", code, proc.addr], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["False", "b'x'"], out.stderr[-2000:]
    off = Proc("--no-shm")
    try:
        s = kvtier.L3Store.connect(off.addr)
        s.put("k", b"v")
        assert not s.uses_shm and s.get("k") == b"v"
    finally:
        off.close()


def dummy_with_pool(addr, pool_bytes, n, seed):
    """A dummy client of ``addr`` whose pool is shared memory, two ``n``-byte pool buffers
    ``a`` (filled with random bytes ``src``, written through a view of the pool) and ``b``
    (and a view of ``b``)."""
    d = MooncakeDistributedStore()
    assert d.setup_dummy(pool_bytes, 1 << 20, addr) == 0
    assert d._core.pool_is_shared()
    a, b = d.alloc_from_mem_pool(n), d.alloc_from_mem_pool(n)
    assert a and b
    src = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(a))[:] = src
    pool_b = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(b))
    return d, a, b, pool_b, src


def test_dummy_client_pool_is_shared_with_the_server(proc):
    d, a, b, pool_b, src = dummy_with_pool(proc.addr, 8 << 20, 1 << 20, seed=1)
    assert len(proc.memfd_maps("kvtier-shm-region")) == 1, "the server maps the dummy client's pool"
    tcp = kvtier.L3Store.connect(proc.addr, shm=False)  # tenant "default", as the compat class
    n = 1 << 20
    assert d.register_buffer(a, n) == 0  # Mooncake: 0 on pool memory in dummy mode
    assert d.put_from("pf", a, n) == 0
    assert tcp.get("pf") == src.tobytes()
    assert d.get_into("pf", b, n) == n and np.array_equal(pool_b, src)
    # Batch forms and ranges of the pool.
    half = n // 2
    assert d.batch_put_from(["b0", "b1"], [a, a + half], [half, half]) == [0, 0]
    pool_b[:] = 0
    assert d.batch_get_into(["b1", "b0"], [b, b + half], [half, half]) == [half, half]
    assert np.array_equal(pool_b[:half], src[half:]) and np.array_equal(pool_b[half:], src[:half])
    assert d.batch_put_from_multi_buffers(["m"], [[a + 10, a + 100]], [[5, 7]]) == [0]
    assert tcp.get("m") == src[10:15].tobytes() + src[100:107].tobytes()
    # Caller memory registered with register_buffer goes through the staging segment.
    mine = np.arange(4096, dtype=np.uint8)
    assert d.register_buffer(mine.ctypes.data, mine.nbytes) == 0
    assert d.put_from("mine", mine.ctypes.data, mine.nbytes) == 0
    assert tcp.get("mine") == mine.tobytes()
    got = np.zeros(4096, dtype=np.uint8)
    assert d.register_buffer(got.ctypes.data, got.nbytes) == 0
    assert d.get_into("pf", got.ctypes.data, got.nbytes) < 0  # too small: Mooncake's code
    assert d.get_into("mine", got.ctypes.data, got.nbytes) == 4096 and np.array_equal(got, mine)
    assert d.close() == 0


def test_l3store_reaches_a_clusters_nodes_through_shm():
    """Against a split deployment's master, the bytes go to the store nodes: through each
    node's shared memory when it is on this host, byte for byte what a TCP client gets."""
    master = Proc(base=("--role", "master", "--listen", "127.0.0.1:0", "--no-state-dir"))
    nodes = [Proc(base=("--role", "node", "--master", master.addr, "--node-id", str(i), "--listen", "127.0.0.1:0",
                        "--segment-bytes", str(64 << 20))) for i in (1, 2)]
    try:
        fast = kvtier.L3Store.connect(master.addr)
        slow = kvtier.L3Store.connect(master.addr, shm=False)
        assert fast.uses_shm and not slow.uses_shm
        rng = np.random.default_rng(2)
        objs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 4096, 1 << 20, 3 << 20, 5000, 70000)]
        keys = [f"c{i}" for i in range(len(objs))]
        assert list(fast.batch_put_from(keys[:3], objs[:3])) == [0, 0, 0]
        assert list(slow.batch_put_from(keys[3:], objs[3:])) == [0, 0, 0]
        for reader in (fast, slow):
            outs = [np.zeros(len(o) + 5, dtype=np.uint8) for o in objs]
            assert list(reader.batch_get_into(keys, outs)) == [len(o) for o in objs]
            for o, b in zip(objs, outs):
                assert np.array_equal(b[:len(o)], o) and not b[len(o):].any()
        small = np.zeros(10, dtype=np.uint8)
        other = np.zeros(10, dtype=np.uint8)  # one buffer twice is refused (aliasing)
        assert list(fast.batch_get_into(["c2", "absent"], [small, other])) == \
            list(slow.batch_get_into(["c2", "absent"], [small, other]))
        # Each node maps this client's staging segment (one per node), nothing of the TCP one's.
        assert [len(n.memfd_maps("kvtier-shm-staging")) for n in nodes] == [1, 1]
    finally:
        for p in nodes + [master]:
            p.close()


def test_dummy_client_pool_is_shared_with_a_clusters_nodes():
    """A Mooncake dummy client in front of a split deployment's master: its pool is a region
    every store node on this host maps, so puts from and gets into pool memory cost no copy
    in the client (before, the pool was heap memory and every byte was staged)."""
    master = Proc(base=("--role", "master", "--listen", "127.0.0.1:0", "--no-state-dir"))
    nodes = [Proc(base=("--role", "node", "--master", master.addr, "--node-id", str(i), "--listen", "127.0.0.1:0",
                        "--segment-bytes", str(64 << 20))) for i in (1, 2)]
    try:
        n = 3 << 20
        d, a, b, pool_b, src = dummy_with_pool(master.addr, 16 << 20, n, seed=3)
        assert [len(n.memfd_maps("kvtier-shm-region")) for n in nodes] == [1, 1]
        tcp = kvtier.L3Store.connect(master.addr, shm=False)
        keys = [f"pool{i}" for i in range(6)]
        part = n // 6
        assert d.batch_put_from(keys, [a + i * part for i in range(6)], [part] * 6) == [0] * 6
        for i, k in enumerate(keys):
            assert tcp.get(k) == src[i * part:(i + 1) * part].tobytes(), k
        assert d.batch_get_into(keys[::-1], [b + i * part for i in range(6)], [part] * 6) == [part] * 6
        for i in range(6):
            assert np.array_equal(pool_b[i * part:(i + 1) * part], src[(5 - i) * part:(6 - i) * part])
        assert d.get_into("absent", b, part) < 0
        assert d.close() == 0
    finally:
        for p in nodes + [master]:
            p.close()
