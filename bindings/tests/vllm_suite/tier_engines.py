"""What the tests of kvtier's L3 as vLLM's secondary offloading tier share: the tier's
config, an embedded store of its own, serving prompts on a harness engine (the ``engines``
fixture is conftest.py's)."""

from __future__ import annotations

import uuid

from harness import BLOCK, Engine


PROMPT = list(range(100, 100 + BLOCK * 8 + 5))  # 8 full blocks = 4 chunks of 2 blocks
FULL = BLOCK * 8


def tier(**kw):
    return {"type": "KvtierSecondaryTier", "module_path": "kvtier.vllm", **kw}


def embedded(**kw):
    kw.setdefault("name", f"t-{uuid.uuid4().hex[:8]}")
    return tier(segment_bytes="64MB", **kw)


def serve(engine: Engine, prompts, salt=None):
    for i, p in enumerate(prompts):
        engine.add(f"r{i}-{uuid.uuid4().hex[:6]}", p, cache_salt=salt)
    engine.run()
    return [engine.finished[r] for r in list(engine.finished)[-len(prompts):]]
