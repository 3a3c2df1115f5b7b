"""The host-cache region in /dev/shm that vLLM's workers write and kvtier's scheduler-side
parts (``KvtierOffloadingSpec``'s L3, vLLM's tiering with kvtier's tier) read.

Why: the region is one file ``/dev/shm/vllm_offload_{engine_id}.mmap`` (0.33 and 0.34 may split a
large one into ``.mmap.1``, ``.mmap.2``... segments) that every worker and the scheduler
map. vLLM's engine builds its workers before its scheduler, so the workers must leave the
name in place until the scheduler has mapped it — vLLM's ``CPUOffloadingSpec`` unlinks it as
soon as the workers have, and a scheduler that maps it afterwards creates a separate, empty
file (kvtier then backed up zeros and prefetched into memory no worker reads). Once the
scheduler has mapped it the name is no longer needed: unlinking it then means no exit path,
SIGKILL included, leaves the file behind (the memory goes with the last mapping).

How: ``worker_region`` maps the region in a worker without unlinking it (vLLM's tiering
spec does the same), its cleanup leaving a name the scheduler already removed alone;
``scheduler_region`` maps the workers' region — a missing file is a typed error, never a new
region — and ``unlink_region`` removes the name (and segments).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, List

from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from .. import KvtierError

__all__ = ["RegionError", "region_paths", "scheduler_region", "unlink_region", "worker_region"]


class RegionError(KvtierError, RuntimeError):
    """The scheduler found no host region of its workers (they are on another node, or the
    region was removed): kvtier will not create a second one that no worker writes."""


class _WorkerRegion(SharedOffloadRegion):
    _creator: bool  # vLLM's region's: whether this process made the file

    def cleanup(self) -> None:
        if self._creator and not os.path.exists(self.mmap_path):
            self._creator = False  # the scheduler unlinked it once mapped (unlink_region)
        super().cleanup()


def region_paths(region: Any) -> List[str]:
    """The region's file names in /dev/shm (one, or 0.33's and 0.34's segments)."""
    segs = getattr(region, "_segments", None)
    return [p for p, _, _ in segs] if segs else [region.mmap_path]


def worker_region(spec: Any) -> SharedOffloadRegion:
    """A worker's view of ``spec``'s host region, its name left for the scheduler."""
    rank = 0 if getattr(spec, "replicated_layout", False) else int(spec.config.parallel.rank)
    return _WorkerRegion(engine_id=spec.config.engine_id, num_chunks=spec.num_chunks, rank=rank,
                         kv_bytes_per_chunk=spec.kv_bytes_per_chunk, cpu_page_size=spec.cpu_page_size_per_worker)


def scheduler_region(spec: Any) -> SharedOffloadRegion:
    """The scheduler's mapping of the region ``spec``'s workers created, then unlinked."""
    path = f"/dev/shm/vllm_offload_{spec.config.engine_id}.mmap"
    if not os.path.exists(path):
        raise RegionError(
            f"kvtier: the workers' host region {path} does not exist when the scheduler maps it (workers on "
            "another node, or removed): kvtier's L3 would back up a region no worker writes")
    region = SharedOffloadRegion(engine_id=spec.config.engine_id, num_chunks=spec.num_chunks, rank=None,
                                 kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
                                 cpu_page_size=spec.cpu_page_size_per_worker)
    unlink_region(region)
    return region


def unlink_region(region: Any) -> None:
    """Removes the region's names; the mappings stay valid."""
    for p in region_paths(region):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
    region._creator = False
