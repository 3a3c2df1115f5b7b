"""The Python clients follow an etcd HA L3 across a master failover: ``kvtier.L3Store.connect``
and the Mooncake compat class with ``master_server_addr="etcd://a;b;c"`` (Mooncake's form).

Real processes: 3 Debian ``etcd`` members on 127.0.0.1 (ephemeral ports, stopped by PID),
2 ``kvtier-l3 --role master --etcd`` and 2 store nodes of target/release (built by
``cargo test --workspace`` before pytest runs in scripts/test-all). The leader master is
SIGKILLed; every acknowledged put must read back with its bytes, and calls succeed again
within a few lease TTLs. (What survives a failover is what has an SSD copy: docs/l3.md.)"""

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

import kvtier
from kvtier.mooncake_compat import MooncakeDistributedStore

L3_BIN = Path(__file__).resolve().parents[2] / "target" / "release" / "kvtier-l3"
ETCD = shutil.which("etcd")

pytestmark = pytest.mark.skipif(
    ETCD is None or not L3_BIN.exists(),
    reason="needs Debian's etcd (apt-get install etcd-server) and target/release/kvtier-l3",
)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, limit=20.0):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def ha(tmp_path):
    procs = []
    try:
        peers = [(f"m{i}", free_port(), free_port()) for i in range(3)]
        initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, _, p in peers)
        for n, c, p in peers:
            procs.append(subprocess.Popen(
                [ETCD, "--name", n, "--data-dir", str(tmp_path / n),
                 "--listen-client-urls", f"http://127.0.0.1:{c}", "--advertise-client-urls", f"http://127.0.0.1:{c}",
                 "--listen-peer-urls", f"http://127.0.0.1:{p}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{p}",
                 "--initial-cluster", initial, "--heartbeat-interval", "50", "--election-timeout", "500"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        endpoints = ",".join(f"127.0.0.1:{c}" for _, c, _ in peers)
        locator = "etcd://" + ";".join(f"127.0.0.1:{c}" for _, c, _ in peers) + "/py"
        masters = {}
        for _ in range(2):
            listen = f"127.0.0.1:{free_port()}"
            masters[listen] = subprocess.Popen(
                [str(L3_BIN), "--role", "master", "--listen", listen, "--etcd", endpoints, "--cluster", "py",
                 "--leader-ttl-s", "1", "--client-ttl-ms", "5000"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(masters[listen])
        assert wait_for(lambda: leader_addr(locator) in masters), "no leader elected"
        for i in (1, 2):
            node = subprocess.Popen(
                [str(L3_BIN), "--role", "node", "--listen", "127.0.0.1:0", "--segment-bytes", str(1 << 24),
                 "--ping-ms", "100", "--master-timeout-ms", "1000", "--master", locator, "--node-id", str(i),
                 "--ssd-dir", str(tmp_path / f"ssd{i}")],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            procs.append(node)
            assert node.stdout.readline().startswith("LISTENING "), "a node did not mount"
        yield locator, masters
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()


def leader_addr(locator):
    """The leader's address, read from etcd's JSON gateway (a linearizable read, as the Rust client's)."""
    members, _, cluster = locator[len("etcd://"):].partition("/")
    key = base64.b64encode(f"/kvtier/{cluster}/leader".encode()).decode()
    for m in members.split(";"):
        try:
            req = urllib.request.Request(f"http://{m}/v3/kv/range", data=json.dumps({"key": key}).encode())
            kvs = json.load(urllib.request.urlopen(req, timeout=1)).get("kvs", [])
        except OSError:
            continue
        if kvs and kvs[0].get("value"):
            return base64.b64decode(kvs[0]["value"]).decode()
    return None


def kill_leader(locator, masters):
    """SIGKILLs the leader master; returns the time of the kill."""
    assert wait_for(lambda: leader_addr(locator) in masters)
    leader = masters.pop(leader_addr(locator))
    leader.send_signal(signal.SIGKILL)
    leader.wait()
    return time.monotonic()


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
