"""The module-level names of ``mooncake.store`` that engines import next to the store class:
``ReplicateConfig`` (all of Mooncake 0.3.13's fields), the enums (``SoftPinAction``,
``ReplicaStatus``, ``ObjectDataType``, ``TaskStatus``, ``TaskType``), the replica descriptors
``get_replica_desc`` returns, ``BufferHandle`` (``get_buffer``) and the parallelism requests of
the tensor calls. ``ErrorCode`` is built from ``kvtier._native.ERROR_CODES``, the one table in
the l3 crate (``l3/src/error.rs``), so no copy of Mooncake's codes can drift.
"""

from __future__ import annotations

import ctypes
import enum
from typing import TYPE_CHECKING, List, Optional

from .._native import ERROR_CODES

if TYPE_CHECKING:
    # The members are made at runtime from ERROR_CODES: to a type checker every member name
    # is an ErrorCode (the table is not copied here, see above).
    class _ErrorCodeMeta(enum.EnumMeta):
        def __getattr__(cls, name: str) -> ErrorCode: ...

    class ErrorCode(enum.IntEnum, metaclass=_ErrorCodeMeta): ...

else:
    ErrorCode = enum.IntEnum("ErrorCode", dict(ERROR_CODES))
ErrorCode.__doc__ = "Mooncake's integer error codes (kvtier._native.ERROR_CODES)."
ErrorCode.__module__ = __name__


_SIZE_T_MAX = 2**64 - 1


def _int_field(name: str):
    """A settable ``size_t`` attribute (Mooncake's ``def_readwrite`` of a ``size_t`` field):
    anything but an ``int`` in 0 ..= 2**64 - 1 is a ``TypeError``, as pybind11 raises when
    its integer caster refuses a value (it does not raise ``OverflowError``); the field
    keeps its value."""
    attr = "_" + name

    def get(self):
        return getattr(self, attr)

    def set_(self, v):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}: incompatible type {type(v).__name__}, expected int")
        if not 0 <= v <= _SIZE_T_MAX:
            raise TypeError(f"{name}: {v} is outside 0..=2**64-1 (a size_t)")
        setattr(self, attr, v)

    return property(get, set_)


def _soft_pin_action_field():
    """``soft_pin_action``: a ``SoftPinAction`` member only (an int, a bool or None is a
    ``TypeError``, as pybind11's enum caster refuses them); the field keeps its value."""

    def get(self):
        return self._soft_pin_action

    def set_(self, v):
        if not isinstance(v, SoftPinAction):
            raise TypeError(f"soft_pin_action: incompatible type {type(v).__name__}, expected SoftPinAction")
        self._soft_pin_action = v

    return property(get, set_)


def _soft_pin_ttl_field():
    """``soft_pin_ttl_ms``: Mooncake's ``std::optional<uint64_t>``: None (the store's
    default TTL) or an int in 0 ..= 2**64 - 1 (``True`` reads as 1, as pybind11 converts
    it); anything else is a ``TypeError`` and the field keeps its value."""

    def get(self):
        return self._soft_pin_ttl_ms

    def set_(self, v):
        if v is not None:
            if not isinstance(v, int):
                raise TypeError(f"soft_pin_ttl_ms: incompatible type {type(v).__name__}, expected int or None")
            if not 0 <= v <= _SIZE_T_MAX:
                raise TypeError(f"soft_pin_ttl_ms: {v} is outside 0..=2**64-1 (a uint64_t)")
            v = int(v)
        self._soft_pin_ttl_ms = v

    return property(get, set_)


class SoftPinAction(enum.Enum):
    """What a put does to the object's soft pin (Mooncake: keep as is, pin, unpin).

    A pybind11 enum in Mooncake, and so not an ``IntEnum`` here: members equal only
    themselves (``SoftPinAction.ENABLE == 1`` is False, as there), while ``int()``,
    ``operator.index`` and ``hash`` give the value."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2

    def __int__(self) -> int:
        return self.value

    def __index__(self) -> int:
        return self.value

    def __hash__(self) -> int:
        return hash(self.value)


class ObjectDataType(enum.IntEnum):
    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ReplicaStatus(enum.IntEnum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class TaskStatus(enum.IntEnum):
    PENDING = 0
    PROCESSING = 1
    SUCCESS = 3
    FAILED = 2


class TaskType(enum.IntEnum):
    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class ReplicateConfig:
    """Mooncake's replication settings, with every field of 0.3.13. kvtier keeps one replica
    per object (``replica_num`` must be ≥ 1: 0 is -600 as in Mooncake); a soft pin
    (``soft_pin_action=ENABLE``) is honoured (evicted last, store-wide pin TTL); the placement
    fields are accepted and do not steer placement."""

    replica_num = _int_field("replica_num")
    nof_replica_num = _int_field("nof_replica_num")
    dfs_replica_num = _int_field("dfs_replica_num")
    soft_pin_action = _soft_pin_action_field()
    soft_pin_ttl_ms = _soft_pin_ttl_field()

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms = None
        self.with_hard_pin: bool = False
        self.preferred_segment: str = ""
        self.preferred_segments: List[str] = []
        self.preferred_nof_segments: List[str] = []
        self.prefer_alloc_in_same_node: bool = False
        self.data_type: ObjectDataType = ObjectDataType.UNKNOWN
        self.group_ids = None

    def __str__(self) -> str:
        ttl = "default" if self.soft_pin_ttl_ms is None else self.soft_pin_ttl_ms
        return (
            f"ReplicateConfig: {{ replica_num: {self.replica_num}, nof_replica_num: {self.nof_replica_num}, "
            f"dfs_replica_num: {self.dfs_replica_num}, soft_pin_action: {SoftPinAction(self.soft_pin_action).name}, "
            f"soft_pin_ttl_ms: {ttl}, with_hard_pin: {int(bool(self.with_hard_pin))}, "
            f"preferred_segments: [{', '.join(self.preferred_segments)}], "
            f"preferred_nof_segments: [{', '.join(self.preferred_nof_segments)}], "
            f"prefer_alloc_in_same_node: {int(bool(self.prefer_alloc_in_same_node))}, "
            f"data_type: {ObjectDataType(self.data_type).name} }}"
        )

    __repr__ = __str__


def config_code(config: Optional[ReplicateConfig]) -> int:
    """0 if a put may go ahead with ``config``, else Mooncake's code for it."""
    if config is None:
        return 0
    if not isinstance(config, ReplicateConfig):
        raise TypeError("config: expected kvtier.mooncake_compat.ReplicateConfig")
    if config.replica_num < 1:
        return int(ErrorCode.INVALID_PARAMS)
    # Mooncake: a soft-pin TTL is only meaningful with ENABLE; with PRESERVE or DISABLE the
    # put is refused (-600), measured on 0.3.13 (mooncake_api_driver.py "soft_pin_*").
    if config.soft_pin_ttl_ms is not None and config.soft_pin_action is not SoftPinAction.ENABLE:
        return int(ErrorCode.INVALID_PARAMS)
    return 0


class Descriptor:
    """A memory replica: ``buffer_address`` is kvtier's allocation id inside the segment (not
    an address in this process: kvtier never hands out store memory), ``transport_endpoint``
    the name of the segment (the contributing client's ``get_hostname()``)."""

    def __init__(self, buffer_address: int = 0, size: int = 0, transport_endpoint: str = "") -> None:
        self.buffer_address = buffer_address
        self.size = size
        self.transport_endpoint = transport_endpoint

    def __repr__(self) -> str:
        return (f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
                f"transport_endpoint={self.transport_endpoint}>")


class MemoryDescriptor:
    def __init__(self, buffer_descriptor: Descriptor) -> None:
        self.buffer_descriptor = buffer_descriptor


class DiskDescriptor:
    def __init__(self, file_path: str, object_size: int) -> None:
        self.file_path = file_path
        self.object_size = object_size


class ReplicaDescriptor:
    """One replica of an object, as ``get_replica_desc`` returns it."""

    def __init__(self, memory: Optional[MemoryDescriptor], disk: Optional[DiskDescriptor]) -> None:
        self._memory, self._disk = memory, disk
        self.status = ReplicaStatus.COMPLETE

    @classmethod
    def from_row(cls, row) -> "ReplicaDescriptor":
        is_mem, name, where, size = row
        if is_mem:
            return cls(MemoryDescriptor(Descriptor(where, size, name)), None)
        return cls(None, DiskDescriptor(f"{name}@{where}", size))

    def is_memory_replica(self) -> bool:
        return self._memory is not None

    def is_disk_replica(self) -> bool:
        """False: Mooncake's DISK is a shared file system's copy, which kvtier has not."""
        return False

    def is_local_disk_replica(self) -> bool:
        """Whether this is an SSD copy: kvtier's SSD tier lies on the store node holding the
        segment, which Mooncake calls LOCAL_DISK (an offloaded object after eviction is
        LOCAL_DISK only, as Mooncake's promotion-on-hit test reads it)."""
        return self._disk is not None

    def get_memory_descriptor(self) -> MemoryDescriptor:
        if self._memory is None:
            raise RuntimeError("not a memory replica")
        return self._memory

    def get_disk_descriptor(self) -> DiskDescriptor:
        if self._disk is None:
            raise RuntimeError("not a disk replica")
        return self._disk


class BufferHandle(bytearray):
    """What ``get_buffer`` returns: the object's bytes in memory this handle owns, with
    Mooncake's ``ptr()``, ``size()`` and ``len()`` and the buffer protocol (``memoryview``,
    ``numpy.frombuffer``, ``torch.frombuffer``)."""

    def ptr(self) -> int:
        if not len(self):
            return 0
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def size(self) -> int:
        return len(self)


class ParallelAxis:
    def __init__(self) -> None:
        self.kind = 0
        self.rank = 0
        self.size = 1
        self.split_dim = 0
        self.expert_id = 0
        self.stage_id = 0


class TensorParallelism:
    def __init__(self) -> None:
        self.axes: List[ParallelAxis] = []


class ReadTarget:
    def __init__(self) -> None:
        self.mode = 0
        self.parallelism: Optional[TensorParallelism] = None


class QueryTaskResponse:
    """Response of ``query_task``: kvtier's replica tasks run to completion in the call that
    creates them, so a task is reported ``SUCCESS`` (or ``FAILED``) from the start."""

    def __init__(self) -> None:
        self.id = (0, 0)
        self.type = TaskType.REPLICA_COPY
        self.status = TaskStatus.PENDING
        self.created_at_ms_epoch = 0
        self.last_updated_at_ms_epoch = 0
        self.assigned_client = (0, 0)
        self.message = ""

    def __repr__(self) -> str:
        return (f"QueryTaskResponse(id={self.id[0]}-{self.id[1]}, type={int(self.type)}, "
                f"status={int(self.status)}, created_at={self.created_at_ms_epoch}, "
                f"last_updated_at={self.last_updated_at_ms_epoch}, "
                f"assigned_client={self.assigned_client[0]}-{self.assigned_client[1]}, "
                f'message="{self.message}")')
