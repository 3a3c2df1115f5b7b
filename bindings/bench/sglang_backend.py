"""SGLang HiCache storage backends, one batch of pages between a real host pool and the store.

Why: kvtier.sglang claims zero-copy page moves between SGLang's host pool and kvtier's L3;
this measures what a prefetch (``batch_get_v1``) and a backup (``batch_set_v1``) of one batch
cost against the backends SGLang ships, in one run on one machine, and prints ratios.

What: a real ``MHATokenToKVPoolHost`` (page_first, bf16) of 2 x PAGES pages; every backend
writes pages 0..PAGES-1 under fresh keys, then reads them into pages PAGES..2*PAGES-1 (bytes
checked), ``--repeat`` times after one warm-up round (median reported; the store is cleared
between rounds). Default
sizes: Llama-3-8B KV with 64-token pages (32 layers, 8 KV heads, head_dim 128: 8 MiB a page,
512 MiB a batch of 64). Backends:

- kvtier embedded and kvtier through a ``kvtier-l3`` server (``kvtier.L3Server`` in this
  process, on 127.0.0.1), twice: over its shared-memory path (what a client on the server's
  host gets by default) and over TCP (``KVTIER_L3_SHM=off`` while the client connects);
- SGLang's ``HiCacheFile`` (its v2 calls; files under a temporary directory);
- SGLang's ``MooncakeStore`` over the real Mooncake (PyPI ``mooncake-transfer-engine-non-cuda``,
  master at 127.0.0.1:50051: run this script through ``bindings/tests/mooncake_netns.sh``
  inside ``unshare -n``), and the same SGLang class over ``kvtier.mooncake_compat``.

    unshare -n bindings/tests/mooncake_netns.sh .venv/bin/python bindings/bench/sglang_backend.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import torch  # noqa: E402
from sglang_pools import fill, mha_pool, page_indices, storage_config  # noqa: E402

import kvtier  # noqa: E402
from kvtier.sglang import KvtierHiCacheStorage  # noqa: E402


def kvtier_backend(extra):
    return KvtierHiCacheStorage(storage_config({"interface_v1": 1, **extra}), {})


def tcp_only(make):
    """``make()`` with the shared-memory path off for the clients it connects."""
    old = os.environ.get("KVTIER_L3_SHM")
    os.environ["KVTIER_L3_SHM"] = "off"
    try:
        return make()
    finally:
        if old is None:
            del os.environ["KVTIER_L3_SHM"]
        else:
            os.environ["KVTIER_L3_SHM"] = old


def file_backend(path):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolName, PoolTransfer

    class V1(HiCacheFile):
        """HiCacheFile has only the v2 page calls; this maps v1 onto them (no copy added)."""

        def batch_set_v1(self, keys, idx, extra_info=None):
            return self.batch_set_v2([PoolTransfer(name=PoolName.KV, keys=keys, host_indices=idx)])[PoolName.KV]

        def batch_get_v1(self, keys, idx, extra_info=None):
            return self.batch_get_v2([PoolTransfer(name=PoolName.KV, keys=keys, host_indices=idx)])[PoolName.KV]

        def register_mem_pool_host(self, pool):
            super().register_mem_pool_host(pool)
            self.register_mem_host_pool_v2(pool, PoolName.KV)

    return V1(storage_config({"file_storage_path": path}))


def mooncake_backend(pool, master, segment):
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    extra = {"master_server_address": master, "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
             "protocol": "tcp", "global_segment_size": segment, "check_server": False}
    return MooncakeStore(storage_config(extra), pool)


def compat_mooncake_backend(pool, segment):
    sys.path.insert(0, str(HERE.parent / "tests"))
    from test_sglang import mooncake_is_kvtier

    with mooncake_is_kvtier():
        return mooncake_backend(pool, "embedded://bench-compat", segment)


def clear(b):
    if isinstance(b, KvtierHiCacheStorage) or hasattr(b, "_evictor"):
        b.clear()
    else:  # leased objects too (SGLang's clear() does not force; reads just leased them)
        b.store.remove_all(True)


def run(name, b, pool, n, ps, repeat):
    b.register_mem_pool_host(pool)
    src, dst = page_indices(range(n), ps), page_indices(range(n, 2 * n), ps)
    sets, gets = [], []
    for r in range(repeat + 1):  # round 0 warms up (faults the store's memory in); not counted
        keys = [f"{name}-{r}-{i:04d}" for i in range(n)]
        t0 = time.perf_counter()
        ok = b.batch_set_v1(keys, src)
        t1 = time.perf_counter()
        assert all(ok), (name, "set", ok.count(False))
        pool.kv_buffer[:, n * ps:].zero_()
        t2 = time.perf_counter()
        ok = b.batch_get_v1(keys, dst)
        t3 = time.perf_counter()
        assert all(ok), (name, "get", ok.count(False))
        raw = pool.kv_buffer.view(torch.int16)  # compare bits (random bf16 holds NaNs)
        assert torch.equal(raw[:, : n * ps], raw[:, n * ps:]), (name, "bytes differ")
        if r:
            sets.append(t1 - t0)
            gets.append(t3 - t2)
        clear(b)
    return statistics.median(sets), statistics.median(gets)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mooncake-master", default="127.0.0.1:50051",
                    help="real Mooncake master; '' skips the real-Mooncake backend")
    a = ap.parse_args()
    n, ps = a.pages, a.page_size
    pool = mha_pool("page_first", layers=a.layers, heads=a.heads, head_dim=a.head_dim, page_size=ps,
                    host_pages=2 * n)
    page = 2 * a.layers * a.heads * a.head_dim * ps * 2
    batch = n * page
    print(f"# {n} pages x {page / 2**20:.1f} MiB = {batch / 2**20:.0f} MiB per batch "
          f"({a.layers} layers, {a.heads} KV heads, head_dim {a.head_dim}, {ps}-token pages, bf16, page_first); "
          f"median of {a.repeat}; {os.cpu_count()} CPUs")
    fill(pool, 0)
    seg = 4 * batch + (64 << 20)  # room for a round whose predecessor's objects are still leased
    backends = {}
    tmp = tempfile.mkdtemp(prefix="sglang-bench-")
    backends["kvtier embedded"] = lambda: kvtier_backend({"segment_bytes": seg})
    srv = kvtier.L3Server(seg, max_object_bytes=max(page, 1 << 20))
    backends["kvtier kvtier-l3 same host, shm"] = lambda: kvtier_backend({"server": srv.addr})
    backends["kvtier kvtier-l3 loopback, TCP"] = lambda: tcp_only(lambda: kvtier_backend({"server": srv.addr}))
    backends["sglang HiCacheFile"] = lambda: file_backend(os.path.join(tmp, "file"))
    if a.mooncake_master:
        backends["sglang MooncakeStore, real Mooncake"] = lambda: mooncake_backend(pool, a.mooncake_master, seg)
    backends["sglang MooncakeStore, kvtier compat"] = lambda: compat_mooncake_backend(pool, seg)
    res = {}
    for name, make in backends.items():
        try:
            b = make()
            res[name] = run(name.split()[0], b, pool, n, ps, a.repeat)
        except Exception as e:  # a backend that cannot run here is reported, not hidden
            print(f"{name}: not measured: {e!r}")
            continue
        s, g = res[name]
        if "kvtier-l3" in name:  # which path the client took
            print(f"# {name}: uses_shm={b.store.uses_shm}")
        print(f"{name:38s} set {s * 1e3:8.1f} ms ({batch / s / 2**30:5.2f} GiB/s)   "
              f"get {g * 1e3:8.1f} ms ({batch / g / 2**30:5.2f} GiB/s)", flush=True)
    srv.shutdown()
    ref = res.get("kvtier embedded")
    if ref:
        print("# ratio = backend time / kvtier embedded time (>1: kvtier embedded is faster)")
        for name, (s, g) in res.items():
            print(f"{name:38s} set x{s / ref[0]:6.2f}   get x{g / ref[1]:6.2f}")


if __name__ == "__main__":
    main()
