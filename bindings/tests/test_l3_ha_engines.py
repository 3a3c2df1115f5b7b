"""The engines' L3 backends configured with an ``etcd://`` address keep serving across a SIGKILL
of the leader master: SGLang's HiCache backend (``KvtierHiCacheStorage``, ``"server":
"etcd://..."``), SGLang's radix-cache backend (``KvtierRadixCache``, same key) and the
Mooncake compat class (``master_server_address="etcd://..."``).

Real processes (l3_ha_cluster.py): 3 etcd members, 2 ``kvtier-l3 --role
master --etcd`` (1 s leader lease), 2 store nodes with SSD tiers. A writer thread stores pages
without pause while the leader is SIGKILLed under it. Checked: a store answered True (0 for
Mooncake) reads back with its bytes after the failover; a store that straddled the failover is
reported as failed (False / a negative code), never as a silent success; no read ever returns
wrong bytes; the backend serves again within a few lease TTLs, with no restart of the engine.
(The vLLM tier: vllm_suite/test_vllm_ha.py, in vLLM's venv.)"""

import threading
import time

import pytest

from l3_ha_cluster import MISSING, ha_cluster, kill_leader

pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
pytest.importorskip("torch")
pytest.importorskip("sglang")

from sglang_pools import fill, mha_pool, page_bytes, page_indices, storage_config  # noqa: E402

from kvtier.mooncake_compat import MooncakeDistributedStore  # noqa: E402
from kvtier.sglang import KvtierHiCacheStorage  # noqa: E402

PS = 4
PAGES = 16


@pytest.fixture
def ha(tmp_path):
    with ha_cluster(tmp_path) as c:
        yield c


def hicache(pool, server):
    b = KvtierHiCacheStorage(storage_config({"interface_v1": 1, "server": server, "rpc_timeout_ms": 5000}), {})
    b.register_mem_pool_host(pool)
    return b


def store_until(stop, put):
    """Calls ``put(i)`` for i = 0, 1, ... until ``stop``; returns {i: succeeded}."""
    out = {}
    i = 0
    while not stop.is_set():
        out[i] = put(i)
        i += 1
    return out


def across_a_leader_kill(locator, masters, put):
    """Runs ``put`` in a thread while the leader is SIGKILLed; returns its results and the kill time."""
    stop = threading.Event()
    res = {}
    t = threading.Thread(target=lambda: res.update(store_until(stop, put)))
    t.start()
    time.sleep(0.3)
    killed = kill_leader(locator, masters)
    time.sleep(2.5)  # past the 1 s lease: a new leader serves
    stop.set()
    t.join(60)
    assert not t.is_alive()
    failed = sum(1 for v in res.values() if v is False or (v is not True and v != 0))
    print(f"{len(res)} stores across the kill, {failed} reported failed")
    return res, killed


def test_sglang_hicache_backend_on_etcd_keeps_serving_across_a_leader_kill(ha):
    locator, masters = ha
    src = mha_pool("page_first", host_pages=PAGES)
    fill(src, 7)
    b = hicache(src, locator)
    assert not b.store.is_embedded

    def put(i):
        page = i % PAGES
        return b.batch_set_v1([f"p{i}"], page_indices([page], PS)) == [True]

    res, killed = across_a_leader_kill(locator, masters, put)
    assert sum(res.values()) >= 1, "nothing was stored before the kill"
    # Service back: a fresh backend-side store succeeds within a few lease TTLs of the kill.
    end = killed + 10.0
    while b.batch_set_v1(["after"], page_indices([0], PS)) != [True]:
        assert time.monotonic() < end, "the backend did not serve again within 10 s"
        time.sleep(0.1)
    dst = mha_pool("page_first", host_pages=PAGES)
    reader = hicache(dst, locator)
    for i, ok in res.items():
        got = reader.batch_get_v1([f"p{i}"], page_indices([i % PAGES], PS))
        if ok:
            assert got == [True], f"page p{i} was acknowledged and is gone"
        if got == [True]:
            # Acknowledged or not, what is read is exactly what was stored.
            assert page_bytes(dst, i % PAGES) == page_bytes(src, i % PAGES), f"wrong bytes for p{i}"
    assert reader.batch_get_v1(["after"], page_indices([1], PS)) == [True]
    assert page_bytes(dst, 1) == page_bytes(src, 0)


def test_mooncake_compat_on_etcd_reports_a_put_straddling_the_failover(ha):
    locator, masters = ha
    members, _, cluster = locator[len("etcd://"):].partition("/")
    m = MooncakeDistributedStore()
    assert m.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", f"etcd://{members}/{cluster}") == 0

    def value(i):
        return f"mooncake value {i} ".encode() * (1 + i % 7)

    res, killed = across_a_leader_kill(locator, masters, lambda i: m.put(f"mk{i}", value(i)))
    assert all(isinstance(rc, int) for rc in res.values())
    assert any(rc == 0 for rc in res.values()), "nothing was stored before the kill"
    assert all(rc == 0 or rc < 0 for rc in res.values()), res
    end = killed + 10.0
    while m.put("after", b"again") != 0:
        assert time.monotonic() < end, "the compat store did not serve again within 10 s"
        time.sleep(0.1)
    for i, rc in res.items():
        got = m.get(f"mk{i}")
        if rc == 0:
            assert got == value(i), f"mk{i} was acknowledged (0) and reads {got[:32]!r}"
        else:
            assert got in (b"", value(i)), f"a failed put of mk{i} left wrong bytes"
    assert m.get("after") == b"again"


def test_sglang_radix_backend_on_etcd_serves_l3_prefixes_across_a_leader_kill(ha):
    """Engine one (SGLang's scheduler pieces, kvtier's radix backend, ``"server": "etcd://..."``)
    backs its prefixes up; the leader is SIGKILLed; engine one keeps serving and backing up new
    prefixes through the new leader, and a fresh engine two gets both sets from L3, every
    reused row checked by the KV oracle."""
    from sglang_engine import Engine
    from test_sglang_radix import kvtier_cache, prompts

    locator, masters = ha
    old, new = prompts(41, 3, 24), prompts(42, 3, 24)
    one = Engine(kvtier_cache(host_pages=64, server=locator, rpc_timeout_ms=5000))
    assert not one.cache.store.is_embedded
    one.run([one.request(p) for p in old])
    one.cache.flush_pending_backups()
    one.cache.wait_io()
    killed = kill_leader(locator, masters)
    end = killed + 15.0
    while True:  # engine one's next backups go to the new leader once it serves
        one.run([one.request(p) for p in new])
        one.cache.flush_pending_backups()
        one.cache.wait_io()
        two = Engine(kvtier_cache(host_pages=64, server=locator, rpc_timeout_ms=5000))
        two.run([two.request(p) for p in old + new])
        if two.prefix_hits[3:] == [20] * 3:
            break
        assert time.monotonic() < end, f"no L3 hit for the new prefixes 15 s after the kill: {two.prefix_hits}"
        time.sleep(0.5)
    assert two.prefix_hits[:3] == [20] * 3, "the prefixes backed up before the kill are gone"
    assert two.cache.stats()["l3_hit_tokens"] == 120
    one.check_pools()
    two.check_pools()
