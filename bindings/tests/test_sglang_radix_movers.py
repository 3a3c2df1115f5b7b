"""The radix backend's page copies (``kvtier/sglang/copies.py``): kvtier.torch's ``kernel``
mover, run by Triton's CPU interpreter (the code a GPU runs, on CPU tensors), against the
index copies, through SGLang's own scheduler pieces (``sglang_engine.Engine``) with the KV
oracle checking every reused row; L3 objects written by one copier and read by the other
(same host page layout whatever copies it); and the ``mover`` key's typed errors."""

from __future__ import annotations

import pytest
import torch

import kvtier
from sglang_engine import Engine
from test_sglang_radix import kvtier_cache, prompts

from kvtier.sglang import radix as kr
from kvtier.sglang.copies import IndexCopier, MoverCopier
from kvtier.torch import make_mover


@pytest.fixture
def interpreted_kernel(monkeypatch):
    """The kernel mover compiled for Triton's CPU interpreter in this process (Triton decides
    at compile time), and compiled afresh afterwards."""
    from kvtier.torch.movers import kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel._kernel.cache_clear()
    yield
    kernel._kernel.cache_clear()


def test_the_kernel_mover_serves_the_radix_backend_exactly_as_index_copies(interpreted_kernel):
    """Every workload (write-through and write-back, MHA and MLA, host hits in one engine and
    L3 hits in a second) gives the same hits and the oracle-checked rows with the kernel mover
    as with index copies, and L3 pages cross between engines using different copiers."""
    ps = prompts(7, 4, 24)
    out = {}
    runs = [(m, m, policy, mla) for m in ("torch", "kernel") for policy in ("write_through", "write_back")
            for mla in (False, True)]
    # L3 pages crossing between copiers: one engine's kernel stores read by index copies, and back
    runs += [("kernel", "torch", "write_through", False), ("torch", "kernel", "write_back", True)]
    for first, second, policy, mla in runs:
        store = kvtier.L3Store.embedded(1 << 24)
        model = f"m-{mla}"
        e = Engine(kvtier_cache(host_pages=64, store=store, mover=first, write_policy=policy, model=model),
                   device_tokens=40, mla=mla)
        e.run([e.request(p) for p in ps])
        e.run([e.request(p) for p in ps])
        e.cache.flush_pending_backups()
        e.cache.wait_io()
        two = Engine(kvtier_cache(host_pages=64, store=store, mover=second, model=model), mla=mla)
        two.run([two.request(p) for p in ps])
        e.check_pools()
        two.check_pools()
        s1, s2 = e.cache.stats(), two.cache.stats()
        assert (s1["mover"], s2["mover"]) == (first, second), (s1["mover"], s2["mover"])
        assert s1["mover_fallbacks"] == 0 and s2["mover_fallbacks"] == 0
        out[(first, second, policy, mla)] = (
            e.prefix_hits, two.prefix_hits, s1["host_hit_tokens"], s2["l3_hit_tokens"],
            e.checked_rows, two.checked_rows)
    for (first, second, policy, mla), got in out.items():
        assert got == out[("torch", "torch", policy, mla)], (first, second, policy, mla, got)
        assert got[2] > 0 and got[3] == 20 * len(ps), got  # host hits in engine one, every page from L3 in two


def test_slots_that_are_not_whole_pages_are_copied_by_index(interpreted_kernel):
    """A copy whose token slots are not whole device pages in order falls back to index copies,
    counted, with the same bytes as the kernel's would be."""
    g = torch.Generator().manual_seed(3)
    bufs = [torch.randint(0, 255, (64, 32), generator=g, dtype=torch.uint8) for _ in range(4)]
    host_a = torch.zeros((6, 4 * 4 * 32), dtype=torch.uint8)
    host_b = host_a.clone()
    mc = MoverCopier(make_mover("kernel"), bufs, host_a, 4)
    ic = IndexCopier(bufs, host_b, 4)
    aligned = torch.tensor([8, 9, 10, 11, 40, 41, 42, 43])
    skewed = torch.tensor([5, 6, 7, 8, 20, 21, 22, 23])
    for idx, slots in ((aligned, [0, 3]), (skewed, [1, 5])):
        mc.to_host(idx, slots)
        ic.to_host(idx, slots)
    assert torch.equal(host_a, host_b) and mc.fallbacks == 1
    for b in bufs:
        b.zero_()
    mc.to_device([3, 0], torch.tensor([12, 13, 14, 15, 28, 29, 30, 31]))
    want = [torch.zeros((64, 32), dtype=torch.uint8) for _ in range(4)]
    IndexCopier(want, host_b, 4).to_device([3, 0], torch.tensor([12, 13, 14, 15, 28, 29, 30, 31]))
    assert all(torch.equal(a, b) for a, b in zip(bufs, want)) and mc.fallbacks == 1
    assert bufs[0][12:16].any(), "the load wrote something"


def test_auto_uses_index_copies_on_cpu():
    e = Engine(kvtier_cache(host_pages=16), device_tokens=40)
    e.run([e.request(p) for p in prompts(3, 2, 12)])
    assert e.cache.stats()["mover"] == "torch"


@pytest.mark.parametrize("mover", ["dma", "kernel"])
def test_a_gpu_mover_named_where_it_cannot_run_is_a_typed_error_at_startup(monkeypatch, mover):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the movers can run")
    with pytest.raises(kr.RadixConfigError, match=f"mover '{mover}' cannot run here"):
        Engine(kvtier_cache(host_pages=16, mover=mover), device_tokens=40)


def test_a_bad_mover_name_is_refused_by_the_config():
    with pytest.raises(kr.RadixConfigError, match="mover is"):
        kr.RadixBackendConfig.from_dict({"mover": "memcpy"})
