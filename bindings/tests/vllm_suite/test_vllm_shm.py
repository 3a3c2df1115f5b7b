"""kvtier's vLLM integrations reach a ``kvtier-l3`` server on the same host over shared memory
(issue 23) with their users' configs unchanged: ``KvtierSecondaryTier`` (``server=ADDR``) and
``KvtierOffloadingSpec`` with ``kvtier_l3={"server": ADDR}``, on the real vLLM 0.34 (harness.py)
against a real ``kvtier-l3`` process on 127.0.0.1. The bytes they store and the bytes a second
engine loads into its "GPU" blocks are the same over shared memory as over TCP
(``KVTIER_L3_SHM=off``, the off switch an operator sets)."""

from __future__ import annotations

import pathlib

from harness import Engine
from l3proc import L3Process
from manager_engines import BLOCK, kvtier_config, prompt, run_checked
from tier_engines import FULL, PROMPT, serve, tier


def memfd_maps(pid: int, name: str):
    """The server's mappings of this name's memfd segments (what a client shares with it)."""
    return [line for line in pathlib.Path(f"/proc/{pid}/maps").read_text().splitlines() if f"memfd:{name}" in line]


def secondary_tier_run(tmp_path, token: str):
    """Two engines with ``KvtierSecondaryTier(server=...)``: what the first stored in L3 and
    what the second loaded from it, and whether each tier's store is on shared memory."""
    srv = L3Process(token=token)
    made = []
    try:
        t = tier(server=srv.addr, token=token)
        e1 = Engine(str(tmp_path), [t])
        made.append(e1)
        serve(e1, [PROMPT])
        keys = [e1.tier.key(k) for k in e1.tier_keys_of(PROMPT)]
        stored = [bytes(e1.tier.store.get(k)) for k in keys]
        e2 = Engine(str(tmp_path), [t])
        made.append(e2)
        (b,) = serve(e2, [PROMPT])
        assert b.external_tokens == FULL and b.gpu_ok
        assert e2.tier.counters.chunks_loaded == 4
        shm = [e.tier.store.uses_shm for e in made]
        staging = len(memfd_maps(srv.proc.pid, "kvtier-shm-staging"))
        return stored, e2.gpu_bytes_of(b.req_id, PROMPT), shm, staging
    finally:
        for e in made:
            e.close()
        srv.kill()


def test_the_secondary_tier_uses_shared_memory_and_agrees_with_tcp(tmp_path, monkeypatch):
    stored, loaded, shm, staging = secondary_tier_run(tmp_path, "s3cret")
    assert shm == [True, True], "a server on this host is reached over shared memory"
    assert staging >= 1, "the server maps the tiers' staging segments"
    monkeypatch.setenv("KVTIER_L3_SHM", "off")
    stored_tcp, loaded_tcp, shm_tcp, staging_tcp = secondary_tier_run(tmp_path, "s3cret")
    assert shm_tcp == [False, False] and staging_tcp == 0
    assert stored == stored_tcp and len(stored) == 4
    assert loaded == loaded_tcp == b"".join(stored)


def manager_run(tmp_path):
    """Two engines with ``KvtierOffloadingSpec`` and ``kvtier_l3={"server": ...}``: the bytes
    the second loaded through L3, and whether each manager's L3 tier is on shared memory."""
    srv = L3Process(token=None)
    l3 = {"server": srv.addr, "rpc_timeout_ms": 5000}
    made = []
    try:
        p = prompt(1, 4)
        e1 = Engine(str(tmp_path), [], kv_config=kvtier_config(8, kvtier_l3=l3))
        made.append(e1)
        e1.add("a", p)
        run_checked(e1)
        assert e1.manager.l3.counters.chunks_stored == 4
        e2 = Engine(str(tmp_path), [], kv_config=kvtier_config(8, kvtier_l3=l3))
        made.append(e2)
        e2.add("b", p)  # an empty host: hits only through L3
        run_checked(e2)
        f = e2.finished["b"]
        assert f.gpu_ok and f.external_tokens == 4 * 2 * BLOCK, f
        assert e2.manager.l3.counters.chunks_loaded == 4
        return e2.gpu_bytes_of("b", p), [e.manager.l3.store.uses_shm for e in made]
    finally:
        for e in made:
            e.close()
        srv.kill()


def test_the_offloading_spec_uses_shared_memory_and_agrees_with_tcp(tmp_path, monkeypatch):
    loaded, used = manager_run(tmp_path)
    assert used == [True, True], "kvtier_l3's tier reaches the server over shared memory"
    monkeypatch.setenv("KVTIER_L3_SHM", "off")
    loaded_tcp, used_tcp = manager_run(tmp_path)
    assert used_tcp == [False, False]
    assert loaded_tcp == loaded and any(loaded), "the same non-empty bytes reached the blocks"
