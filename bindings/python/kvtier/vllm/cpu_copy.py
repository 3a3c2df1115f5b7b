"""KV offloading for vLLM on CPU: the worker side of vLLM's offloading with plain CPU copies.

Why: vLLM refuses KV offloading when it runs on CPU (``CPUOffloadingSpec.get_worker``:
"CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"), and its copy
handler assumes CUDA streams, events and a batch-copy kernel the CPU build lacks. Yet the
scheduler side (host slots, managers, tiers) is device-free, and on CPU "GPU" KV blocks and
host slots are both host memory: one ``memmove`` per (block, layer) moves a chunk. So every
kvtier spec (and ``KvtierCpuOffloadingSpec`` / ``KvtierTieringOffloadingSpec``, vLLM's own
CPU offloading and tiering) takes this worker when vLLM runs on CPU, and vLLM's own worker
otherwise: the choice is automatic (``CpuCopyMixin.get_worker``).

How: ``CpuCopyHandler`` is vLLM's ``SingleDirectionOffloadingHandler`` minus the device: the
same copy descriptors (vLLM's own ``_fill_direct_ops`` and sub-block arithmetic: partial
first chunks, several KV groups), executed at submission with ``ctypes.memmove`` (which
releases the GIL). The GPU side of a transfer is what the running vLLM hands the worker
(compat.py): 0.34's ``DevicePointers`` (vLLM resolved each block's address from the KV
caches) or 0.32's and 0.33's ``GPULoadStoreSpec`` (block ids, resolved here from the KV
tensors). On CPU the model's forward pass has finished writing the blocks a store
reads before the connector submits it, and a load is reported done before the request is
scheduled again, so a synchronous copy keeps vLLM's ordering. vLLM's canonical host layout
is not served on CPU (a typed error at startup).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any, List, Optional, Tuple

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.gpu_worker import SingleDirectionOffloadingHandler

from .. import KvtierError
from .compat import device_pointers

__all__ = ["CpuCopyHandler", "CpuCopyWorker", "CpuOffloadError", "on_cpu"]


class CpuOffloadError(KvtierError, ValueError):
    """An offloading setup kvtier's CPU copy path cannot serve (vLLM's canonical host layout,
    KV tensors that are not in host memory); raised when vLLM builds the worker."""


def on_cpu() -> bool:
    """Whether vLLM runs on CPU here (its ``current_platform``)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class CpuCopyHandler(SingleDirectionOffloadingHandler):
    """One direction (KV blocks -> host slots, or back) with plain CPU copies; see the module doc."""

    def __init__(self, kv_tensors: List[torch.Tensor], host_tensors: List[torch.Tensor], blocks_per_chunk: int,
                 layer_refs_per_group: list, to_host: bool):
        # Not SingleDirectionOffloadingHandler.__init__: it asserts CUDA/XPU tensors and sets
        # up streams. The attributes its descriptor fill reads are set here.
        if len(kv_tensors) != len(host_tensors) or not kv_tensors:
            raise CpuOffloadError("kvtier CPU copy: one host view per KV tensor is needed")
        for kv, host in zip(kv_tensors, host_tensors):
            if kv.device.type != "cpu" or host.device.type != "cpu":
                raise CpuOffloadError(f"kvtier CPU copy: KV tensors must be in host memory, got {kv.device}")
            if kv.dtype != torch.int8 or host.dtype != torch.int8 or kv.ndim != 2 or host.ndim != 2:
                raise CpuOffloadError("kvtier CPU copy: KV and host views are 2-D int8 (vLLM's canonical tensors)")
            if host.shape[1] != kv.shape[1] * blocks_per_chunk:
                raise CpuOffloadError(f"kvtier CPU copy: a host page of {host.shape[1]} bytes is not "
                                      f"{blocks_per_chunk} KV pages of {kv.shape[1]}")
        self.host_tensors = host_tensors
        self.gpu_to_cpu = to_host
        self.layer_refs_per_group = layer_refs_per_group
        # What vLLM's descriptor fill reads. 0.32, 0.33: block ids on both sides.
        self.src_tensors = kv_tensors if to_host else host_tensors
        self.dst_tensors = host_tensors if to_host else kv_tensors
        self.src_blocks_per_chunk = 1 if to_host else blocks_per_chunk
        self.dst_blocks_per_chunk = blocks_per_chunk if to_host else 1
        # 0.34: device pointers on the GPU side, chunk ids into these on the host side.
        self.cpu_tensors = host_tensors
        self.blocks_per_chunk = blocks_per_chunk
        self._canonical_copy_plans = None
        self._fill_group_ops = self._fill_direct_ops
        self._done: List[TransferResult] = []
        self.copies = 0  # memmoves issued (tests)

    def transfer(self, job_id: int, gpu_side: Any, host_spec: LoadStoreSpec) -> bool:
        """Copies a transfer's blocks (to host or from host, as this handler's direction), its
        GPU side as this vLLM passes it (module doc), and reports it done."""
        if not isinstance(host_spec, BlockIDsLoadStoreSpec):
            raise CpuOffloadError(f"kvtier CPU copy: host chunk ids expected, got {type(host_spec).__name__}")
        t0 = time.perf_counter()
        if device_pointers(gpu_side):
            op, total, ops = self._ops_of_pointers(gpu_side, host_spec.block_ids)
        elif isinstance(gpu_side, GPULoadStoreSpec):
            op, total, ops = self._ops_of_block_ids(gpu_side, host_spec.block_ids)
        else:
            raise CpuOffloadError(f"kvtier CPU copy: GPU blocks expected, got {type(gpu_side).__name__}")
        move = ctypes.memmove
        all_src, all_dst, all_sizes = ops
        for s, d, k in zip(all_src[:op].tolist(), all_dst[:op].tolist(), all_sizes[:op].tolist()):
            move(d, s, k)
        self.copies += op
        self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=total,
                                         transfer_time=time.perf_counter() - t0))
        return True

    @staticmethod
    def _buffers(n: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        return np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)

    def _ops_of_pointers(self, ptrs: Any, host_blocks: np.ndarray):
        """vLLM 0.34's transfer_async group walk (``iter_pointer_groups``: partial first chunks
        per group): the copy descriptors, their count and bytes."""
        from vllm.v1.kv_offload.pointer_utils import iter_pointer_groups

        ops = self._buffers(self._estimate_max_copy_ops(ptrs.group_block_counts))
        host_off = op = total = 0
        for g in iter_pointer_groups(ptrs, self.blocks_per_chunk):
            host_end = host_off + g.n_chunks
            if host_end > len(host_blocks):
                raise CpuOffloadError("kvtier CPU copy: the transfer's block lists are shorter than its groups")
            op, nbytes = self._fill_group_ops(g.group_idx, device_ptrs=ptrs, dev_ptr_offset=g.dev_ptr_offset,
                                              cpu_block_ids=host_blocks[host_off:host_end], group_size=g.group_size,
                                              cpu_skip_count=g.skip, all_src=ops[0], all_dst=ops[1],
                                              all_sizes=ops[2], op_idx=op)
            total += nbytes
            host_off = host_end
        return op, total, ops

    def _ops_of_block_ids(self, gpu_spec: GPULoadStoreSpec, host_blocks: np.ndarray):
        """vLLM 0.32's and 0.33's transfer_async group walk (partial first chunks per group)."""
        if self.gpu_to_cpu:
            src_blocks, dst_blocks = gpu_spec.block_ids, host_blocks
        else:
            src_blocks, dst_blocks = host_blocks, gpu_spec.block_ids
        group_sizes, block_indices = gpu_spec.group_sizes, gpu_spec.block_indices
        ops = self._buffers(self._estimate_max_copy_ops(group_sizes))
        src_off = dst_off = op = total = 0
        for g, (size, idx) in enumerate(zip(group_sizes, block_indices)):
            if size == 0:
                continue
            src_skip = idx % self.src_blocks_per_chunk
            dst_skip = idx % self.dst_blocks_per_chunk
            src_end = src_off + cdiv(size + src_skip, self.src_blocks_per_chunk)
            dst_end = dst_off + cdiv(size + dst_skip, self.dst_blocks_per_chunk)
            if src_end > len(src_blocks) or dst_end > len(dst_blocks):
                raise CpuOffloadError("kvtier CPU copy: the transfer's block lists are shorter than its groups")
            op, nbytes = self._fill_group_ops(g, group_src=src_blocks[src_off:src_end],
                                              group_dst=dst_blocks[dst_off:dst_end], group_size=size,
                                              src_skip_count=src_skip, dst_skip_count=dst_skip, all_src=ops[0],
                                              all_dst=ops[1], all_sizes=ops[2], op_idx=op)
            total += nbytes
            src_off, dst_off = src_end, dst_end
        return op, total, ops

    def get_finished(self) -> List[TransferResult]:
        out, self._done = self._done, []
        return out

    def wait(self, job_ids) -> None:
        return None  # every copy finished when it was submitted

    def shutdown(self) -> None:
        self._done = []
        self.src_tensors = []
        self.dst_tensors = []
        self.host_tensors = self.cpu_tensors = []


class CpuCopyWorker(OffloadingWorker):
    """vLLM's ``CPUOffloadingWorker`` on CPU: KV blocks <-> host chunk slots (a private tensor,
    or this worker's views of the shared /dev/shm ``region``)."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int,
                 region: Optional[Any] = None, canonical_layout: bool = False):
        if canonical_layout:
            raise CpuOffloadError("kvtier CPU copy: vLLM's canonical_layout is not served on CPU; "
                                  "remove canonical_layout from kv_connector_extra_config")
        self.region = region
        kv, host = [], []
        for t in kv_caches.tensors:
            if not isinstance(t.tensor, torch.Tensor):
                raise CpuOffloadError(f"kvtier CPU copy: KV tensors are torch tensors, got {type(t.tensor).__name__}")
            page = int(t.page_size_bytes)
            kv.append(t.tensor.view(torch.int8).view((-1, page)))
            if region is not None:
                host.append(region.create_next_worker_view(page * blocks_per_chunk))
            else:
                host.append(torch.zeros((num_chunks, page * blocks_per_chunk), dtype=torch.int8))
        refs = kv_caches.group_data_refs
        self.store = CpuCopyHandler(kv, host, blocks_per_chunk, refs, to_host=True)
        self.load = CpuCopyHandler(kv, host, blocks_per_chunk, refs, to_host=False)

    # The GPU side: vLLM 0.34's DevicePointers, 0.32's and 0.33's GPULoadStoreSpec (compat.py).
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec) -> bool:
        return self.store.transfer(job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: Any, expedited: bool = False) -> bool:
        return self.load.transfer(job_id, dst_spec, src_spec)

    def get_finished(self) -> List[TransferResult]:
        return self.store.get_finished() + self.load.get_finished()

    def wait(self, job_ids) -> None:
        return None

    def shutdown(self) -> None:
        self.store.shutdown()
        self.load.shutdown()
        if self.region is not None:
            self.region.cleanup()
            self.region = None


class CpuCopyMixin:
    """Mixed into a vLLM ``CPUOffloadingSpec`` (or a subclass): on CPU its worker is
    ``CpuCopyWorker``, over the host region ``_cpu_region()`` gives (None: a private
    tensor); elsewhere vLLM's own worker. An MLA model vLLM's CPU build serves without prefix
    caching is refused when the spec is built (``refuse_mla_without_prefix_caching``)."""

    # the vLLM spec's, which this is mixed into
    _worker: Optional[OffloadingWorker]
    blocks_per_chunk: int
    num_chunks: int
    config: Any

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        from .keys import engine_vllm_config
        from .spec_config import refuse_mla_without_prefix_caching

        refuse_mla_without_prefix_caching(engine_vllm_config(), on_cpu())
        super().__init__(config, *args, **kwargs)  # type: ignore[call-arg]

    def _cpu_region(self) -> Optional[Any]:
        return None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not on_cpu():
            return super().get_worker(kv_caches)  # type: ignore[misc]
        if not self._worker:
            region = self._cpu_region()
            try:
                self._worker = CpuCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, region,
                                             canonical_layout=bool(getattr(self.config, "canonical_layout", False)))
            except Exception:
                if region is not None:
                    region.cleanup()
                raise
        return self._worker
