"""Real SGLang host pools on CPU (tests and the benchmark): ``MHATokenToKVPoolHost`` /
``MLATokenToKVPoolHost`` from the installed sglang, built over small CPU "device" buffers,
and the ``HiCacheStorageConfig`` SGLang's controller passes to a storage backend."""

from __future__ import annotations

import warnings

warnings.filterwarnings("ignore", message=".*support.*currently", category=UserWarning)

import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import (  # noqa: E402
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402

from kvtier.sglang import KvtierHiCacheStorage  # noqa: E402

CPU = torch.device("cpu")


def _ptrs(ts):
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)


def mha_pool(layout: str, *, layers=2, heads=2, head_dim=8, page_size=4, host_pages=16,
             dtype=torch.bfloat16) -> MHATokenToKVPoolHost:
    """A real MHA host pool of ``host_pages`` pages."""
    dev_tokens = page_size  # the "device" pool only has to exist; the host pool is sized below
    k = tuple(torch.zeros(dev_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(dev_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=KVBufferLayout.NHD),
        page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=dtype, device=CPU,
    )
    return MHATokenToKVPoolHost(
        info, 1.0, 0, page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=dev_tokens, start_layer=0, end_layer=layers - 1,
        host_token_capacity=host_pages * page_size,
    )


def mla_pool(layout: str, *, layers=2, lora=8, rope=4, page_size=4, host_pages=16,
             dtype=torch.bfloat16) -> MLATokenToKVPoolHost:
    dev_tokens = page_size
    bufs = tuple(torch.zeros(dev_tokens, 1, lora + rope, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs, data_ptrs=_ptrs(bufs), layer_indices=tuple(range(layers)), device_layer_num=layers,
        page_size=page_size, kv_lora_rank=lora, qk_rope_head_dim=rope, kv_cache_dim=lora + rope,
        dtype=dtype, device=CPU,
    )
    return MLATokenToKVPoolHost(
        info, 1.0, 0, page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=dev_tokens, start_layer=0, end_layer=layers - 1, target_layer_num=layers,
        host_token_capacity=host_pages * page_size,
    )


def storage_config(extra=None, *, tp_rank=0, tp_size=1, mla=False, layout="page_first", model="meta-llama/Llama-3-8B"):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=True, is_page_first_layout=layout != "layer_first",
        model_name=model, extra_config=extra,
    )


def fill(pool, seed: int) -> None:
    """Random bytes over the whole pool (a bf16 view of random int16: every bit pattern)."""
    g = torch.Generator().manual_seed(seed)
    b = pool.kv_buffer.view(-1).view(torch.int16)
    b.copy_(torch.randint(-(1 << 15), 1 << 15, b.shape, generator=g, dtype=torch.int16))


def page_indices(pages, page_size) -> torch.Tensor:
    """Token indices of host pages ``pages`` (SGLang's host_indices)."""
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages]).to(torch.int64)


def page_bytes(pool, page: int) -> bytes:
    return pool.get_data_page(page * pool.page_size, flat=True).view(torch.int16).numpy().tobytes()


# ---- kvtier's storage backend over these pools (the SGLang test files' one set) ----------

LAYOUTS = ["page_first", "layer_first", "page_first_direct"]
PS = 4  # the pools' page size (tokens)


def backend(pool=None, *, mla=False, tp_rank=0, tp_size=1, model="meta-llama/Llama-3-8B", **extra):
    extra.setdefault("interface_v1", 1)
    extra.setdefault("segment_bytes", "64MB")
    layout = pool.layout if pool is not None else "page_first"
    sc = storage_config(extra, mla=mla, tp_rank=tp_rank, tp_size=tp_size, layout=layout, model=model)
    b = KvtierHiCacheStorage(sc, {})
    if pool is not None:
        b.register_mem_pool_host(pool)
    return b


def make_pool(layout, mla, **kw):
    return (mla_pool if mla else mha_pool)(layout, **kw)


def salt(s):
    return HiCacheStorageExtraInfo(extra_info={"cache_salt": s})


def snapshot(pool):
    return pool.kv_buffer.view(-1).view(torch.int16).clone()
