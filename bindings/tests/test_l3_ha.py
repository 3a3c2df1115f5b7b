"""The Python clients follow an etcd HA L3 across a master failover: ``kvtier.L3Store.connect``
and the Mooncake compat class with ``master_server_addr="etcd://a;b;c"`` (Mooncake's form).

Real processes: 3 Debian ``etcd`` members on 127.0.0.1 (ephemeral ports, stopped by PID),
2 ``kvtier-l3 --role master --etcd`` and 2 store nodes of target/release (built by
``cargo test --workspace`` before pytest runs in scripts/test-all). The leader master is
SIGKILLed; every acknowledged put must read back with its bytes, and calls succeed again
within a few lease TTLs. (What survives a failover is what has an SSD copy: docs/l3/ha.md.)"""

import os
import time

import pytest

import kvtier
from kvtier.mooncake_compat import MooncakeDistributedStore

from l3_ha_cluster import MISSING, ha_cluster, kill_leader

pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@pytest.fixture
def ha(tmp_path):
    with ha_cluster(tmp_path) as c:
        yield c


def test_l3store_follows_the_leader_across_a_sigkill(ha):
    locator, masters = ha
    s = kvtier.L3Store.connect(locator, tenant="py")
    data = {f"k{i}": os.urandom(2048) for i in range(16)}
    for k, v in data.items():
        s.put(k, v, wait_persisted=True)  # DRAM replicas do not survive a failover
    killed = kill_leader(locator, masters)
    for k, v in data.items():
        assert s.get(k) == v
    assert time.monotonic() - killed < 10.0, "re-attachment took longer than 10 lease TTLs"
    s.put("after", b"x")
    assert s.get("after") == b"x"


def test_mooncake_compat_takes_an_etcd_master_address(ha):
    locator, masters = ha
    members, _, cluster = locator[len("etcd://"):].partition("/")
    os.environ["MC_STORE_CLUSTER_ID"] = cluster
    try:
        m = MooncakeDistributedStore()
        assert m.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", f"etcd://{members}") == 0
    finally:
        del os.environ["MC_STORE_CLUSTER_ID"]
    assert m.put("mk", b"mooncake bytes") == 0
    kvtier.L3Store.connect(locator).flush()  # its SSD copy registered: it survives the failover
    kill_leader(locator, masters)
    assert m.get("mk") == b"mooncake bytes"
    assert m.put("mk2", b"again") == 0
    assert m.get("mk2") == b"again"
    assert m.is_exist("mk") == 1


def test_dummy_client_pool_on_etcd_stays_shared_with_the_nodes_across_a_leader_kill(ha):
    """A Mooncake dummy client of an etcd HA cluster: its pool is a region the store nodes map
    (they are on this host), and puts from / gets into the pool go on after the leader master
    is SIGKILLed: the nodes, which hold the bytes and the region, are not restarted."""
    import numpy as np

    locator, masters = ha
    d = MooncakeDistributedStore()
    assert d.setup_dummy(8 << 20, 1 << 20, locator) == 0
    assert d._core.pool_is_shared(), "the pool is memory the nodes map"
    n = 1 << 20
    a, b = d.alloc_from_mem_pool(n), d.alloc_from_mem_pool(n)
    view = lambda addr: np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(addr))  # noqa: E731
    src = np.frombuffer(os.urandom(n), dtype=np.uint8)
    view(a)[:] = src
    assert d.put_from("before", a, n) == 0
    kvtier.L3Store.connect(locator).flush()  # its SSD copy registered: it survives the failover
    killed = kill_leader(locator, masters)
    view(a)[:] = src[::-1]
    end = killed + 10.0
    while d.put_from("after", a, n) != 0:
        assert time.monotonic() < end, "no put from the pool within 10 s of the kill"
        time.sleep(0.1)
    assert d._core.pool_is_shared()
    assert d.get_into("before", b, n) == n and np.array_equal(view(b), src)
    assert d.get_into("after", b, n) == n and np.array_equal(view(b), src[::-1])
    assert d.close() == 0
