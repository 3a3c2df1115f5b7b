"""The vLLM tier (``KvtierSecondaryTier``) configured with an ``etcd://`` address keeps serving
across a SIGKILL of the leader master, against the real vLLM 0.34 on CPU (harness.py).

Real processes (../l3_ha_cluster.py): 3 etcd members, 2 ``kvtier-l3 --role master --etcd``
(1 s leader lease), 1 store node with an SSD tier. Checked: every request finishes with the
right bytes (``gpu_ok``: no wrong bytes from L3, before, during or after the failover); a chunk
stored before the kill is a hit for a new engine after it; a prompt served while the leader
is down is either a hit afterwards or its store was reported as failed (``store_failures``),
never dropped silently as a success; the engine serves hits again within a few lease TTLs."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from l3_ha_cluster import MISSING, ha_cluster, kill_leader  # noqa: E402
from tier_engines import FULL, PROMPT, serve, tier  # noqa: E402

pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def test_the_vllm_tier_on_etcd_keeps_serving_across_a_leader_kill(tmp_path, engines):  # noqa: F811
    with ha_cluster(tmp_path / "l3", nodes=1) as (locator, masters):
        t = tier(server=locator, rpc_timeout_ms=2000)
        e1 = engines([t])
        serve(e1, [PROMPT])
        killed = kill_leader(locator, masters)
        during = list(range(5000, 5000 + FULL + 3))
        (d,) = serve(e1, [during])  # the leader is dead: lookups miss or wait, stores may fail
        assert d.gpu_ok
        after = list(range(9000, 9000 + FULL + 3))
        end = killed + 15.0
        while True:
            serve(e1, [after])
            (c,) = serve(engines([t]), [after])
            assert c.gpu_ok
            if c.external_tokens == FULL:
                break
            assert time.monotonic() < end, "the tier did not serve hits again within 15 s"
            after = [x + 1 for x in after]
        e3 = engines([t])
        (p,) = serve(e3, [PROMPT])
        assert p.gpu_ok and p.external_tokens == FULL, "a chunk stored before the kill was lost"
        (q,) = serve(e3, [during])
        assert q.gpu_ok
        print(f"served while the leader was dead: {q.external_tokens}/{FULL} tokens hit after; "
              f"store failures {e1.tier.counters.store_failures}")
        if q.external_tokens < FULL:
            assert e1.tier.counters.store_failures >= 1, "a store across the failover vanished silently"
