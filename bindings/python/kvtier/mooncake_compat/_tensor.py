"""Mooncake's tensor format and the tensor calls of the store class.

Why the same bytes as Mooncake: ``put_tensor_from``/``get_tensor_into`` hand the caller the
stored layout ``[TensorMetadata][tensor data]``, so a buffer built for Mooncake must mean the
same here. The 304-byte header (checked byte for byte against ``mooncake.store._serialize_tensor``
and against shards written by a real client, bindings/tests/test_mooncake_real.py):

====== ===================================================================
offset field (little-endian)
====== ===================================================================
0      magic ``b"NOOM"``, u16 version 1, u16 header size 304
8      i32 dtype code, i32 ndim (≤ 8)
16     u32 1 for a tensor-parallel shard, else 0; u32 0
24     u64 data offset (304), u64 data bytes
40     i64[8] full shape, -1 padded
104    i64[8] stored (shard) shape, -1 padded
168    shard only: u32 1, u32 0, u32 1 (axes), u32 0, u32 rank, u32 size,
       u32 split_dim, u32 0, u64 shard extent along split_dim
====== ===================================================================

torch is optional and imported lazily: tensors in are torch tensors, numpy arrays or any
DLPack object (Mooncake refuses numpy with -600: a deliberate difference); tensors out are
torch tensors when torch is importable, else numpy arrays (bfloat16 and float8 then come back
as raw ``uint16``/``uint8`` views).
"""

from __future__ import annotations

import struct
from typing import Any, Optional, Tuple

import numpy as np

MAGIC = b"NOOM"
HEADER = 304
MAX_DIMS = 8

# Mooncake's dtype codes; (torch name, numpy dtype or None when numpy has none).
_DTYPES = {
    0: ("float32", np.float32), 1: ("float64", np.float64), 2: ("int8", np.int8),
    3: ("uint8", np.uint8), 4: ("int16", np.int16), 5: ("uint16", np.uint16),
    6: ("int32", np.int32), 7: ("uint32", np.uint32), 8: ("int64", np.int64),
    9: ("uint64", np.uint64), 10: ("bool", np.bool_), 11: ("float16", np.float16),
    12: ("bfloat16", None), 13: ("float8_e4m3fn", None), 14: ("float8_e5m2", None),
}
_BY_TORCH = {name: code for code, (name, _) in _DTYPES.items()}
_BY_NUMPY = {np.dtype(d): code for code, (_, d) in _DTYPES.items() if d is not None}
_RAW = {12: np.uint16, 13: np.uint8, 14: np.uint8}


class TensorError(ValueError):
    """A value that is not a tensor Mooncake can store, or bytes that are not one."""


def _torch():
    try:
        import torch  # noqa: PLC0415  (optional dependency, imported on first use)
    except ImportError:
        return None
    return torch


def to_parts(value: Any) -> Tuple[int, Tuple[int, ...], np.ndarray]:
    """(dtype code, shape, the C-contiguous bytes as a uint8 array) of a tensor-like value."""
    torch = _torch()
    if torch is not None and not isinstance(value, (torch.Tensor, np.ndarray)) and hasattr(value, "__dlpack__"):
        value = torch.from_dlpack(value)
    if torch is not None and isinstance(value, torch.Tensor):
        name = str(value.dtype).replace("torch.", "")
        if name not in _BY_TORCH or value.dim() > MAX_DIMS:
            raise TensorError(f"unsupported tensor for Mooncake tensor serialization: {value.dtype}")
        t = value.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
        return _BY_TORCH[name], tuple(t.shape), raw
    if not isinstance(value, np.ndarray) and hasattr(value, "__dlpack__"):
        value = np.from_dlpack(value)
    if not isinstance(value, np.ndarray):
        raise TensorError(f"expected a tensor, got {type(value).__name__}")
    if value.dtype not in _BY_NUMPY or value.ndim > MAX_DIMS:
        raise TensorError(f"unsupported array for Mooncake tensor serialization: {value.dtype}")
    a = np.ascontiguousarray(value)
    return _BY_NUMPY[a.dtype], a.shape, a.reshape(-1).view(np.uint8)


def _shape8(shape) -> list:
    return list(shape) + [-1] * (MAX_DIMS - len(shape))


def header(code: int, full: tuple, stored: tuple, nbytes: int, shard: Optional[Tuple[int, int, int]] = None) -> bytes:
    """The 304-byte header; ``shard`` = (rank, size, split_dim) for a tensor-parallel shard."""
    h = bytearray(HEADER)
    struct.pack_into("<4sHHiiII QQ", h, 0, MAGIC, 1, HEADER, code, len(stored), 1 if shard else 0, 0, HEADER, nbytes)
    struct.pack_into("<8q", h, 40, *_shape8(full))
    struct.pack_into("<8q", h, 104, *_shape8(stored))
    if shard:
        rank, size, dim = shard
        struct.pack_into("<IIIIIIIIQ", h, 168, 1, 0, 1, 0, rank, size, dim, 0, stored[dim])
    return bytes(h)


def serialize(value: Any) -> bytes:
    code, shape, raw = to_parts(value)
    return header(code, shape, shape, raw.nbytes) + raw.tobytes()


def shards(value: Any, size: int, dim: int):
    """The ``size`` serialized shards of a tensor split evenly along ``dim`` (TensorError if
    the dimension does not exist or does not divide, as Mooncake refuses with -600)."""
    code, shape, raw = to_parts(value)
    if not shape or not 0 <= dim < len(shape) or size < 1 or shape[dim] % size:
        raise TensorError(f"cannot split shape {shape} in {size} along dim {dim}")
    item = raw.nbytes // max(1, int(np.prod(shape)))
    arr = raw.reshape(*shape, item) if raw.nbytes else raw.reshape(*shape, 0)
    out = []
    for rank, part in enumerate(np.split(arr, size, axis=dim)):
        part = np.ascontiguousarray(part)
        stored = tuple(part.shape[:-1])
        out.append(header(code, shape, stored, part.nbytes, (rank, size, dim)) + part.tobytes())
    return out


def deserialize(buf) -> Any:
    """A tensor from ``[header][data]`` bytes; TensorError if they are not one."""
    mv = memoryview(buf).cast("B")
    if len(mv) < HEADER or bytes(mv[:4]) != MAGIC:
        raise TensorError("not a Mooncake tensor")
    _, ver, hsize, code, ndim, _, _, off, nbytes = struct.unpack_from("<4sHHiiIIQQ", mv, 0)
    if ver != 1 or hsize != HEADER or off != HEADER or code not in _DTYPES or not 0 <= ndim <= MAX_DIMS:
        raise TensorError("unsupported Mooncake tensor header")
    shape = struct.unpack_from("<8q", mv, 104)[:ndim]
    if off + nbytes != len(mv) or any(d < 0 for d in shape):
        raise TensorError("tensor header does not match its data")
    data = bytearray(mv[off:])
    name, npd = _DTYPES[code]
    torch = _torch()
    if torch is not None:
        dt = getattr(torch, name)
        t = torch.frombuffer(data, dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
        return t.view(dt).reshape(shape)
    return np.frombuffer(data, dtype=npd or _RAW[code]).reshape(shape)


def to_torch_like(value: Any) -> Any:
    """The tensor as torch if torch is importable (for copying into caller tensors)."""
    torch = _torch()
    return torch.as_tensor(value) if torch is not None else np.asarray(value)
