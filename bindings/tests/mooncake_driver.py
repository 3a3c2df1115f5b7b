"""Runs inside a network namespace with a real mooncake_master (see mooncake_netns.sh).

Prints one JSON document: the results of the same call sequence against the real
``mooncake.store.MooncakeDistributedStore`` and against kvtier's compatible class, and the
outcome of the reference executor serving prompts through the real store.
"""

import json
import sys
import traceback

import numpy as np

import kvtier
from kvtier.engine import Engine, MooncakeL3Backend
from kvtier.mooncake_compat import MooncakeDistributedStore as KvtierStore
from mooncake_api_driver import api_behaviours
from mooncake_parity_driver import parity_behaviours

MASTER = "127.0.0.1:50051"


def real_store():
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 256 << 20, 64 << 20, "tcp", "", MASTER)
    if rc != 0:
        raise RuntimeError(f"mooncake setup failed: {rc}")
    return s


def compat_store():
    s = KvtierStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 256 << 20, 64 << 20, "tcp", "", "embedded://driver") == 0
    return s


def behaviours(s):
    """A call sequence whose every result is recorded."""
    out = {}
    raw = np.zeros(1 << 20, dtype=np.uint8)
    buf = raw[: 1 << 19]
    dst = raw[1 << 19 :]
    buf[:] = np.arange(buf.size, dtype=np.uint64).astype(np.uint8)
    out["register_src"] = s.register_buffer(buf.ctypes.data, buf.nbytes)
    out["register_dst"] = s.register_buffer(dst.ctypes.data, dst.nbytes)
    sp, dp = buf.ctypes.data, dst.ctypes.data
    out["put"] = s.put("b-a", b"hello")
    out["put_dup"] = s.put("b-a", b"again")
    out["get"] = s.get("b-a").decode()
    out["get_missing"] = s.get("b-missing").decode()
    out["is_exist"] = s.is_exist("b-a")
    out["is_exist_missing"] = s.is_exist("b-missing")
    out["batch_is_exist"] = s.batch_is_exist(["b-a", "b-missing"])
    out["get_size"] = s.get_size("b-a")
    out["get_size_missing"] = s.get_size("b-missing")
    out["put_from"] = s.put_from("b-z", sp, 4096)
    out["get_into"] = s.get_into("b-z", dp, 4096)
    out["get_into_equal"] = bool(np.array_equal(dst[:4096], buf[:4096]))
    out["get_into_small"] = s.get_into("b-z", dp, 100)
    out["get_into_missing"] = s.get_into("b-missing", dp, 4096)
    keys = [f"b-k{i}" for i in range(4)]
    out["batch_put_from"] = s.batch_put_from(keys, [sp + i * 1024 for i in range(4)], [1024] * 4)
    out["batch_get_into"] = s.batch_get_into(keys + ["b-missing"], [dp + i * 1024 for i in range(5)], [1024] * 5)
    out["batch_put_from_dup"] = s.batch_put_from(keys[:2], [sp, sp + 1024], [1024, 1024])
    out["put_from_dup"] = s.put_from("b-z", sp, 4096)
    out["batch_get_into_small"] = s.batch_get_into(keys[:2], [dp, dp + 1024], [1024, 100])
    out["get_then_remove"] = (s.get("b-k1") != b"", s.remove("b-k1"))
    out["get_into_then_remove"] = (s.get_into("b-k2", dp, 1024), s.remove("b-k2"))
    mk = ["b-m0", "b-m1"]
    out["multi_put"] = s.batch_put_from_multi_buffers(
        mk, [[sp, sp + 4096], [sp + 8192, sp + 12288]], [[1024, 512], [256, 256]])
    dst[:16384] = 0
    out["multi_get"] = s.batch_get_into_multi_buffers(
        mk + ["b-missing"], [[dp, dp + 4096], [dp + 8192, dp + 12288], [dp + 16384]], [[1024, 512], [256, 256], [64]])
    out["multi_equal"] = bool(np.array_equal(dst[:1024], buf[:1024]) and np.array_equal(dst[4096:4608], buf[4096:4608])
                              and np.array_equal(dst[12288:12544], buf[12288:12544]))
    out["multi_size"] = s.get_size("b-m0")
    out["remove"] = s.remove("b-k0", True)
    out["remove_missing"] = s.remove("b-missing")
    out["remove_all"] = s.remove_all(True)
    out["is_exist_after_remove_all"] = s.is_exist("b-a")
    out["unregister"] = s.unregister_buffer(sp)
    s.unregister_buffer(dp)
    return out


def serve(store, tag):
    cfg = kvtier.SchedulerConfig(
        page_size=16, device_pages=256, host_pages=512, max_batch_size=16, token_budget=512,
        chunked_prefill_size=256, max_context_tokens=2048, l3_enabled=True, prefetch_threshold=2,
        namespace={"model": f"driver-{tag}", "dtype": "", "layout": "", "tenant": "", "adapter": ""},
    )
    backend = MooncakeL3Backend(store)
    prompts = [list(range(i * 10_000, i * 10_000 + 200)) for i in range(6)]
    a = Engine(kvtier.Scheduler(cfg), backend, page_bytes=256)
    for i, p in enumerate(prompts):
        a.submit(i, p, 8)
    a.run_to_idle()
    b = Engine(kvtier.Scheduler(cfg), backend, page_bytes=256)  # a second instance, cold cache
    for i, p in enumerate(prompts):
        b.submit(100 + i, p, 8)
    b.run_to_idle()
    backend.detach()
    sb = b.s.stats()
    return {
        "a_written": a.stats.l3_pages_written,
        "b_l3_hit_tokens": sb["l3_hit_tokens"],
        "b_computed_tokens": sb["computed_tokens"],
        "b_pages_checked": b.stats.pages_checked,
        "b_l3_probes": b.stats.l3_probes,
        "b_l3_pages_read": b.stats.l3_pages_read,
        "all_generated": all(len(a.generated(i)) == 8 and len(b.generated(100 + i)) == 8 for i in range(6)),
    }


def parity(res):
    """mooncake_parity_driver.py on each class, before any other client is mounted (Mooncake
    places objects in any mounted segment); kvtier's against a kvtier-l3 server with
    the real master's lease TTL (1 s: mooncake_netns.sh starts it with
    --default_kv_lease_ttl=1000, so the lease sections wait 1.5 s, not 5.5)."""
    import mooncake.store as mod

    try:
        res["real_parity"] = parity_behaviours(mod.MooncakeDistributedStore, MASTER, mod, 1000)
    except Exception:  # noqa: BLE001
        res["real_parity_error"] = traceback.format_exc()
    import kvtier.mooncake_compat as kmod

    # As the real master, the server holds no memory: the clients' segments are the memory.
    with kvtier.L3Server(0, lease_ttl_ms=1000) as srv:
        try:
            res["compat_parity"] = parity_behaviours(KvtierStore, srv.addr, kmod, 1000)
        except Exception:  # noqa: BLE001
            res["compat_parity_error"] = traceback.format_exc()


def main():
    res = {}
    parity(res)
    try:
        real = real_store()
    except Exception as e:  # noqa: BLE001
        res["setup_error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(res))
        return
    compat = compat_store()
    for name, s in (("real", real), ("compat", compat)):
        try:
            res[f"{name}_behaviours"] = behaviours(s)
        except Exception:  # noqa: BLE001
            res[f"{name}_behaviours_error"] = traceback.format_exc()
        try:
            if name == "real":
                import mooncake.store as mod
                args = (mod.MooncakeDistributedStore, MASTER, mod)
            else:
                import kvtier.mooncake_compat as mod
                args = (KvtierStore, "embedded://driver", mod)
            res[f"{name}_api"] = api_behaviours(s, *args)
        except Exception:  # noqa: BLE001
            res[f"{name}_api_error"] = traceback.format_exc()
        try:
            res[f"{name}_serve"] = serve(s, name)
        except Exception:  # noqa: BLE001
            res[f"{name}_serve_error"] = traceback.format_exc()
    compat.close()
    real.close()
    print("KVTIER-DRIVER-RESULT " + json.dumps(res))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
