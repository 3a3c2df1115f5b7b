"""The L3 namespace of vLLM chunks (kvtier/vllm/keys.py), as a property over vLLM's own
``OffloadingConfig``: two engine configurations share a namespace exactly when their chunk
bytes are interchangeable — same model, dtype, chunking, chunk size, KV layout, groups,
tenant, and parallel shape unless vLLM declares the layout parallelism-agnostic."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvtier.vllm import l3_key, namespace_of

SHAPE = st.fixed_dictionaries({
    "model": st.sampled_from(["m/a", "m/b"]),
    "dtype": st.sampled_from(["float16", "bfloat16"]),
    "bpc": st.sampled_from([1, 4]),
    "tp": st.sampled_from([1, 2]),
    "pp": st.sampled_from([1, 2]),
    "agnostic": st.booleans(),
    "layout": st.sampled_from(["LBHNC", "BLHNC"]),
    "layers": st.sampled_from([("l0", "l1"), ("l0", "l1", "l2")]),
    "tenant": st.sampled_from(["default", "t2"]),
    "chunk": st.sampled_from([8192, 16384]),
})


def config(s) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=s["layers"], group_id=0),),
        worker_kv_bytes_per_block=4096, enable_kv_cache_events=False, extra_config={}, engine_id="e",
        model=OffloadingModelConfig(name=s["model"], dtype=s["dtype"]),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=s["bpc"]),
        parallel=OffloadingParallelConfig(rank=0, world_size=s["tp"] * s["pp"], tp_size=s["tp"], pp_size=s["pp"],
                                          pcp_size=1, dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=s["agnostic"]),
        kv_cache_layout=s["layout"],
    )


def interchangeable(a, b) -> bool:
    same = all(a[k] == b[k] for k in ("model", "dtype", "bpc", "layout", "layers", "tenant", "chunk", "agnostic"))
    return same and (a["agnostic"] or (a["tp"], a["pp"]) == (b["tp"], b["pp"]))


@settings(max_examples=300, deadline=None)
@given(SHAPE, SHAPE)
def test_namespaces_are_equal_exactly_when_chunks_are_interchangeable(a, b):
    na = namespace_of(config(a), a["chunk"], a["tenant"])
    nb = namespace_of(config(b), b["chunk"], b["tenant"])
    assert (na == nb) == interchangeable(a, b)
    assert l3_key(na, b"\x01" * 36) == f"{na}:{'01' * 36}"
