"""vLLM's own offloading specs with kvtier's CPU copy path: ``KvtierCpuOffloadingSpec``
(vLLM's ``CPUOffloadingSpec``: its host cache and manager) and
``KvtierTieringOffloadingSpec`` (vLLM's ``TieringOffloadingSpec``: host cache plus secondary
tiers, e.g. kvtier's ``KvtierSecondaryTier``).

Why: vLLM refuses offloading on CPU (cpu_copy.py); named in ``spec_name`` with
``"spec_module_path": "kvtier.vllm"``, these give a vLLM CPU deployment the offloading vLLM
ships, unchanged, with kvtier's CPU copies on CPU and vLLM's own worker on a GPU.

How: ``CpuCopyMixin`` picks the worker. The tiering spec's host region is the /dev/shm file
its scheduler side maps too (vLLM's tiering creates it in the worker without unlinking it);
kvtier unlinks the name as soon as the scheduler has mapped it (``shm.py``), so no file is
left when the engine ends, whether it shuts down or is killed.
"""

from __future__ import annotations

from typing import Any, Optional

from vllm.v1.kv_offload.base import OffloadingManager
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from .cpu_copy import CpuCopyMixin
from .spec_config import KvtierSpecConfigError
from .shm import unlink_region, worker_region

__all__ = ["KvtierCpuOffloadingSpec", "KvtierTieringOffloadingSpec"]


class KvtierCpuOffloadingSpec(CpuCopyMixin, CPUOffloadingSpec):
    """vLLM's ``CPUOffloadingSpec``; on CPU its worker copies with kvtier's CPU copy path."""


class KvtierTieringOffloadingSpec(CpuCopyMixin, TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec``; on CPU its worker copies with kvtier's CPU copy path."""

    def _cpu_region(self) -> Optional[Any]:
        if not self.num_chunks:
            # (vLLM's own ValueError "cannot mmap an empty file" otherwise)
            raise KvtierSpecConfigError(
                f"cpu_bytes_to_use {self.extra_config.get('cpu_bytes_to_use')!r} holds no host chunk: "
                "the tiers' host cache needs at least one chunk's bytes")
        return worker_region(self)

    def get_manager(self) -> OffloadingManager:
        fresh = not self._manager
        manager = super().get_manager()
        if fresh and self._scheduler_mmap is not None:
            unlink_region(self._scheduler_mmap)
        return manager
