"""What the tests of kvtier's scheduler as vLLM's offloading manager share: the
``KvtierOffloadingSpec`` transfer config, engines built with it (with kvtier's L3 below or
not), a run that checks kvtier's consistency after every step, and the test prompts."""

from __future__ import annotations

import time
import uuid

from harness import BLOCK, Engine
from vllm.config import KVTransferConfig

from kvtier.vllm import KvtierOffloadingManager


CHUNK_BYTES = 2 * 4096  # 2 blocks of 2 layers x (K, V) x 2 heads x 16 dims x fp16


def kvtier_config(chunks: int, eviction: str = "lru", **extra) -> KVTransferConfig:
    ex = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm",
          "cpu_bytes_to_use": chunks * CHUNK_BYTES, "block_size": 2 * BLOCK, "kvtier_eviction": eviction, **extra}
    return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=ex,
                            engine_id=f"kvtier-mgr-{uuid.uuid4().hex[:12]}")


def engine(root, chunks: int = 256, eviction: str = "lru", **kw) -> Engine:
    e = Engine(str(root), [], kv_config=kvtier_config(chunks, eviction), **kw)
    assert isinstance(e.manager, KvtierOffloadingManager), type(e.manager)
    return e


def run_checked(e: Engine, timeout_s: float = 120.0) -> int:
    """Engine.run with kvtier's consistency check after every step; the number of steps."""
    deadline, steps = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        if not (e.sched.has_requests() or e.manager.has_pending_work()):
            return steps
        e.step()
        e.manager.check()
        steps += 1
    raise AssertionError("engine did not go idle")


def offloaded(root, chunks: int = 32):
    """An engine that ran one 4-chunk prompt (so kvtier's host tier holds it), and the prompt."""
    e = engine(root, chunks=chunks)
    p = prompt(1, 4)
    e.add("a", p)
    run_checked(e)
    return e, p


def prompt(conv: int, chunks: int, shared: int = 0, extra: int = 5):
    """``shared`` chunks common to every conversation, then ``chunks - shared`` of its own,
    then ``extra`` tokens (a partial chunk)."""
    toks = []
    for c in range(chunks):
        base = 10_000 + c if c < shared else 100_000 + conv * 1_000 + c
        toks += [base * 7 % 997 + j for j in range(2 * BLOCK)]
    return toks + list(range(1, extra + 1))


def l3_engine(root, l3_name: str, chunks: int = 8) -> Engine:
    """kvtier's manager with kvtier's L3 below it (an embedded store engines in this process
    share by name)."""
    kv = kvtier_config(chunks, kvtier_l3={"segment_bytes": "64MB", "name": l3_name})
    e = Engine(str(root), [], kv_config=kv)
    assert e.manager.l3 is not None
    return e
