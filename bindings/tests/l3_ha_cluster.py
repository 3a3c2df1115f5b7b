"""An etcd HA L3 deployment of real processes for the Python tests (test_l3_ha.py,
test_l3_ha_engines.py, vllm_suite/test_vllm_ha.py): 3 Debian ``etcd`` members on 127.0.0.1
(ephemeral ports), ``kvtier-l3 --role master --etcd`` masters (1 s leader lease) and store
nodes with SSD tiers of target/release, all stopped by PID; and the leader, read from etcd."""

import base64
import json
import random
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

L3_BIN = Path(__file__).resolve().parents[2] / "target" / "release" / "kvtier-l3"
ETCD = shutil.which("etcd")
MISSING = None if ETCD is not None and L3_BIN.exists() else (
    "needs Debian's etcd (apt-get install etcd-server) and target/release/kvtier-l3")


def free_port():
    """A free port below the kernel's default ephemeral range (32768 and up), as the Rust
    tests' LocalEtcd picks: a port bind(0) hands out can be taken by an outgoing connection
    (etcd members dial each other) before the process that was given it binds it."""
    for _ in range(256):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
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


@contextmanager
def ha_cluster(tmp_path, n_masters=2, nodes=2):
    """Yields ``(locator, {address: master Popen})`` once a leader serves and every node mounted."""
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
        for _ in range(n_masters):
            listen = f"127.0.0.1:{free_port()}"
            masters[listen] = subprocess.Popen(
                [str(L3_BIN), "--role", "master", "--listen", listen, "--etcd", endpoints, "--cluster", "py",
                 "--leader-ttl-s", "1", "--client-ttl-ms", "5000"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(masters[listen])
        assert wait_for(lambda: leader_addr(locator) in masters), "no leader elected"
        for i in range(1, nodes + 1):
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


