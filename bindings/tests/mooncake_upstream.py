"""Runs Mooncake's own store tests (``mooncake-wheel/tests/`` of kvcache-ai/Mooncake) against
kvtier's compatible class, the way Mooncake's CI (scripts/run_tests.sh) runs them against a
real master and real client — or against those real processes, for the reference count.

Why: the side-by-side drivers (mooncake_driver.py) check the calls we thought of; Mooncake's
tests are what a new user runs first. Each test file imports ``mooncake.store``; for
``--impl kvtier`` a shim package on ``PYTHONPATH`` makes that import kvtier.mooncake_compat,
and ``kvtier-l3`` servers (``kvtier.L3Server``; for the SSD tests, which need offload on
eviction, the ``kvtier-l3`` binary of target/release) stand where Mooncake's CI starts its
master (127.0.0.1:50051, lease TTL 500 ms) and its real client for dummy clients (:50052).
For ``--impl real`` the PyPI package's ``mooncake_master`` and ``mooncake_client`` are started
there instead. The fixed ports are why this runs inside ``unshare -n`` (only loopback): it
re-executes itself there when not already inside.

Usage: python mooncake_upstream.py --impl kvtier|real --tests DIR [FILE ...]
Prints ``KVTIER-UPSTREAM-RESULT {json}``: per test id, "passed" / "failed" / "skipped".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

# Mooncake's store tests that need only a master and a client (no GPU, RDMA or etcd), with the
# master flags its CI passes for each (run_tests.sh); the kvtier server is configured to match.
STORE_TESTS = {
    "test_distributed_object_store.py": {},
    "test_replicated_distributed_object_store.py": {},
    "test_batch_replica_clear.py": {},
    "test_dummy_client.py": {"real_client": True},
    # two processes at once, as Mooncake's CI runs it (each waits for the other's key)
    "test_multi_dummy_clients.py": {"real_client": True, "pair": ("client1", "client2")},
    "test_promotion_on_hit.py": {"ssd": True, "segment": 32 << 20},
    "test_offload_on_eviction.py": {"ssd": True, "segment": 128 << 20},
}
LEASE_MS = 500
L3_BIN = Path(__file__).resolve().parents[2] / "target" / "release" / "kvtier-l3"
SHIM = "from kvtier.mooncake_compat import *  # noqa: F401,F403\nfrom kvtier.mooncake_compat import __all__  # noqa: F401\n"


def _wait_port(port: int, deadline_s: float = 20.0) -> None:
    import socket

    end = time.time() + deadline_s
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


_KVTIER_SERVER = r"""
import signal, sys, kvtier
port, seg, ssd = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] or None
s = kvtier.L3Server(seg, addr=f"127.0.0.1:{port}", lease_ttl_ms=%d, ssd_dir=ssd)
signal.signal(signal.SIGTERM, lambda *a: (s.shutdown(), sys.exit(0)))
signal.pause()
""" % LEASE_MS


def _start_servers(impl: str, spec: dict, work: Path) -> list:
    procs = []
    ssd = work / "ssd"
    ssd.mkdir(exist_ok=True)
    if impl == "kvtier" and spec.get("ssd"):
        # Mooncake's CI runs these with --offload_on_evict=true --promotion_on_hit=true
        # --promotion_admission_threshold=1: objects reach SSD only when evicted, and come back
        # when read. kvtier.L3Server writes through, so the kvtier-l3 binary serves them. As
        # Mooncake's master, it holds no memory of its own: the test's client mounts its
        # segment (of the size the test sets up) into it.
        procs.append(subprocess.Popen([str(L3_BIN), "--listen", "127.0.0.1:50051", "--segment-bytes", "0",
                                       "--ssd-dir", str(ssd), "--offload", "on-evict", "--promotion-on-hit",
                                       "--promotion-admission-threshold", "1", "--lease-ms", str(LEASE_MS)]))
        _wait_port(50051)
        return procs
    if impl == "kvtier":
        # At :50051 the master: like Mooncake's, no memory of its own (every client that sets
        # up mounts its global segment into it); at :50052 the real client of dummy clients,
        # which holds their memory.
        for port in (50051, 50052) if spec.get("real_client") else (50051,):
            seg = spec.get("segment", 3 << 30) if port == 50052 else 0
            procs.append(subprocess.Popen([sys.executable, "-c", _KVTIER_SERVER, str(port), str(seg),
                                           str(ssd) if spec.get("ssd") else ""]))
            _wait_port(port)
        return procs
    import mooncake

    mc = Path(mooncake.__file__).parent
    flags = [f"--default_kv_lease_ttl={LEASE_MS}", "--rpc_address=127.0.0.1", "--rpc_port=50051",
             "--metrics_host=127.0.0.1", "--metrics_port=9003"]
    if spec.get("ssd"):
        flags += [f"--root_fs_dir={ssd}", "--enable_offload=true", "--offload_on_evict=true",
                  "--promotion_on_hit=true", "--promotion_admission_threshold=1"]
    log = open(work / "master.log", "w")
    procs.append(subprocess.Popen([str(mc / "mooncake_master"), *flags], stdout=log, stderr=log))
    _wait_port(50051)
    if spec.get("real_client"):
        procs.append(subprocess.Popen([str(mc / "mooncake_client"), "--master_server_address=127.0.0.1:50051",
                                       "--protocol=tcp", "--metadata_server=P2PHANDSHAKE",
                                       "--host=127.0.0.1", "--port=50052"], stdout=log, stderr=log))
        _wait_port(50052)
    return procs


def _stop(procs: list) -> None:
    for p in reversed(procs):
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_file(impl: str, tests: Path, name: str, timeout_s: int, log_dir: Path = None) -> dict:
    spec = STORE_TESTS.get(name, {})
    with tempfile.TemporaryDirectory(prefix="mc-upstream-") as tmp:
        work = Path(tmp)
        env = dict(os.environ, DEFAULT_KV_LEASE_TTL=str(LEASE_MS), MC_METADATA_SERVER="P2PHANDSHAKE",
                   MASTER_SERVER="127.0.0.1:50051", PROTOCOL="tcp", DEVICE_NAME="",
                   MOONCAKE_OFFLOAD_FILE_STORAGE_PATH=str(work / "ssd"),
                   # what test_promotion_on_hit asks of a real client (its bucket flush limits)
                   MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT="10", MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES="10485760")
        if impl == "kvtier":
            pkg = work / "shim" / "mooncake"
            pkg.mkdir(parents=True)
            (pkg / "__init__.py").write_text("")
            (pkg / "store.py").write_text(SHIM)
            env["PYTHONPATH"] = os.pathsep.join([str(work / "shim"), env.get("PYTHONPATH", "")])
        procs = _start_servers(impl, spec, work)
        xml = work / "junit.xml"
        try:
            if "pair" in spec:
                return _run_pair(tests / name, spec["pair"], env, work, timeout_s, log_dir, impl)
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                                str(work), f"--junitxml={xml}", str(tests / name)], env=env, cwd=str(work),
                               timeout=timeout_s, capture_output=True, text=True)
            if log_dir is not None:
                (log_dir / f"{impl}-{name}.log").write_text(r.stdout + r.stderr)
        except subprocess.TimeoutExpired:
            pass
        finally:
            _stop(procs)
        return _outcomes(xml, name)


def _run_pair(path: Path, ids: tuple, env: dict, work: Path, timeout_s: int, log_dir, impl: str) -> dict:
    """The file as a script in one process per client id at once: passed if all exit 0."""
    procs = [subprocess.Popen([sys.executable, str(path), "--client-id", i], env=env, cwd=str(work),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in ids]
    ok, logs = True, []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        ok = ok and p.returncode == 0
        logs.append(out)
    if log_dir is not None:
        (log_dir / f"{impl}-{path.name}.log").write_text("\n".join(logs))
    return {f"{path.name}::pair": "passed" if ok else "failed"}


def _outcomes(xml: Path, name: str) -> dict:
    if not xml.exists():
        return {f"{name}::<run>": "failed"}
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        tid = f"{name}::{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        kinds = {c.tag for c in case}
        out[tid] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
    return out or {f"{name}::<collect>": "failed"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("kvtier", "real"), required=True)
    ap.add_argument("--tests", required=True, type=Path)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--log-dir", type=Path, help="keep each file's pytest output here")
    ap.add_argument("files", nargs="*")
    a = ap.parse_args()
    if os.environ.get("KVTIER_UPSTREAM_NETNS") != "1":
        unshare = shutil.which("unshare")
        if unshare is None:
            print("unshare (util-linux) is needed", file=sys.stderr)
            return 2
        env = dict(os.environ, KVTIER_UPSTREAM_NETNS="1")
        return subprocess.call([unshare, "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
                                sys.executable, *sys.argv], env=env)
    results = {}
    for name in a.files or list(STORE_TESTS):
        results.update(run_file(a.impl, a.tests.resolve(), name, a.timeout, a.log_dir))
    print("KVTIER-UPSTREAM-RESULT " + json.dumps(results, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
