"""A drop-in ``mooncake.store`` backed by kvtier's L3 store.

An engine written against Mooncake's Python store switches to kvtier by changing one import::

    # from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    from kvtier.mooncake_compat import MooncakeDistributedStore, ReplicateConfig

``MooncakeDistributedStore`` has every public method of Mooncake 0.3.13's class, with the
same arguments, return codes and semantics, checked side by side against a real Mooncake
master and client (bindings/tests/test_mooncake_real.py; the method-name check in
bindings/tests/test_mooncake_api.py keeps the set from shrinking). Codes are Mooncake's
(``ErrorCode``, exported from the l3 crate's one table).

Where the store lives is chosen by ``master_server_addr``:

- ``"embedded"`` or ``"embedded://NAME"`` (also ``""``, ``"local"``): an in-process store
  shared by every client of this process naming it. Each client mounts its
  ``global_segment_size`` bytes into it, as every Mooncake client mounts its segment into the
  cluster; objects land in any contributing client's segment and those in a client's segment
  are gone when it closes. A client with ``global_segment_size=0`` alone cannot put (-200).
- ``"HOST:PORT"`` or ``"kvtier://HOST:PORT"``: a ``kvtier-l3`` server, which holds the
  memory: its own segment, and each client's ``global_segment_size``, which the client mounts
  there as above (a server started with ``--segment-bytes 0`` is then Mooncake's master:
  the clients' segments are all the memory). Token from the dict key ``kvtier_token`` or
  ``KVTIER_L3_TOKEN``.

Deliberate differences are listed in docs/python.md (pointer calls accept registered memory
only, numpy/DLPack tensors accepted, explicit parallelism requests and segment/task
management not supported, ...).
"""

from __future__ import annotations

from ._store import MooncakeDistributedStore
from ._tensor import TensorError
from ._types import (
    BufferHandle,
    Descriptor,
    DiskDescriptor,
    ErrorCode,
    MemoryDescriptor,
    ObjectDataType,
    ParallelAxis,
    QueryTaskResponse,
    ReadTarget,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    TaskStatus,
    TaskType,
    TensorParallelism,
)

__all__ = [
    "BufferHandle",
    "Descriptor",
    "DiskDescriptor",
    "ErrorCode",
    "MemoryDescriptor",
    "MooncakeDistributedStore",
    "ObjectDataType",
    "ParallelAxis",
    "QueryTaskResponse",
    "ReadTarget",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "ReplicateConfig",
    "SoftPinAction",
    "TaskStatus",
    "TaskType",
    "TensorError",
    "TensorParallelism",
]
