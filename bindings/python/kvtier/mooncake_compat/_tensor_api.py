"""The tensor calls of ``MooncakeDistributedStore`` (mixed into the store class).

Every call stores Mooncake's layout ``[304-byte TensorMetadata][data]`` (``_tensor.py``), so
``get_tensor_into`` buffers and ``put_tensor_from`` buffers mean what they mean in Mooncake.
Tensor-parallel calls store one key per rank, ``<key>_tp_<rank>``, each a shard split evenly
along ``split_dim`` (a dimension that does not divide is -600, as in Mooncake); a read with
``tp_size == 1`` reads ``<key>`` itself.

Return conventions (measured against Mooncake 0.3.13): puts return 0 or a negative code;
reads return the tensor or None (missing key, bytes that are not a tensor, buffer too small).
The ``*_with_parallelism`` calls accept ``parallelism=None`` / ``target=None`` (plain tensor
calls); explicit ``TensorParallelism``/``ReadTarget`` requests are not supported by kvtier
(-600 / None). The ``*_cuda`` calls copy into any caller tensor (no GPU transport).
"""

from __future__ import annotations

import json
import struct
from typing import TYPE_CHECKING, Any, List, Optional

from . import _tensor
from ._setup import check_int, check_str
from ._tensor import TensorError
from ._types import ErrorCode, ReplicateConfig, config_code

INVALID = int(ErrorCode.INVALID_PARAMS)


_SAFETENSORS = {0: "F32", 1: "F64", 2: "I8", 3: "U8", 4: "I16", 5: "U16", 6: "I32", 7: "U32", 8: "I64",
                9: "U64", 10: "BOOL", 11: "F16", 12: "BF16", 13: "F8_E4M3", 14: "F8_E5M2"}


def _shard_key(key: str, rank: int, size: int) -> str:
    return key if size == 1 else f"{key}_tp_{rank}"


class TensorCalls:
    """Mixin: needs ``self._core`` (the integer-code core) and the byte calls."""

    # MooncakeDistributedStore's (_store.py), which this is mixed into
    _core: Any  # OwnedKeys over a MooncakeCore: it forwards every call
    if TYPE_CHECKING:

        def put_from(self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None) -> int: ...
        def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None) -> int: ...
        def get_into(self, key: str, buffer_ptr: int, size: int) -> int: ...
        def is_exist(self, key: str) -> int: ...

    # ---- puts ---------------------------------------------------------------------------

    def _put_tensor(self, key: Any, tensor: Any, upsert: bool, config=None) -> int:
        check_str(key, "key")
        rc = config_code(config)
        if rc:
            return rc
        try:
            data = _tensor.serialize(tensor)
        except TensorError:
            return INVALID
        return (self._core.upsert if upsert else self._core.put)(key, data)

    def put_tensor(self, key: str, tensor: Any) -> int:
        return self._put_tensor(key, tensor, False)

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        return self._put_tensor(key, tensor, True)

    def pub_tensor(self, key: str, tensor: Any, config: Optional[ReplicateConfig] = None) -> int:
        return self._put_tensor(key, tensor, False, config)

    def upsert_pub_tensor(self, key: str, tensor: Any, config: Optional[ReplicateConfig] = None) -> int:
        return self._put_tensor(key, tensor, True, config)

    def _batch(self, one, keys, tensors, *extra) -> List[int]:
        keys = [check_str(k, "keys[i]") for k in keys]
        tensors = list(tensors)
        if len(keys) != len(tensors):
            return [INVALID] * len(keys)
        return [one(k, t, *extra) for k, t in zip(keys, tensors)]

    def batch_put_tensor(self, keys: List[str], tensors_list: list) -> List[int]:
        return self._batch(self.put_tensor, keys, tensors_list)

    def batch_upsert_tensor(self, keys: List[str], tensors_list: list) -> List[int]:
        return self._batch(self.upsert_tensor, keys, tensors_list)

    def batch_pub_tensor(self, keys: List[str], tensors_list: list, config: Optional[ReplicateConfig] = None) -> List[int]:
        return self._batch(self.pub_tensor, keys, tensors_list, config)

    def batch_upsert_pub_tensor(self, keys: List[str], tensors_list: list,
                                config: Optional[ReplicateConfig] = None) -> List[int]:
        return self._batch(self.upsert_pub_tensor, keys, tensors_list, config)

    def _read_tensor_buffer(self, buffer_ptr: int, size: int) -> Optional[bytes]:
        b = self._core.read_registered(check_int(buffer_ptr, "buffer_ptr"), check_int(size, "size"))
        if b is None:
            return None
        try:
            _tensor.deserialize(b)
        except TensorError:
            return None
        return b

    def _put_tensor_from(self, key: str, buffer_ptr: int, size: int, upsert: bool) -> int:
        check_str(key, "key")
        if self._read_tensor_buffer(buffer_ptr, size) is None:
            return INVALID  # not registered, or not [TensorMetadata][data]
        return (self.upsert_from if upsert else self.put_from)(key, buffer_ptr, size)

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._put_tensor_from(key, buffer_ptr, size, False)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._put_tensor_from(key, buffer_ptr, size, True)

    def _batch_from(self, one, keys, ptrs, sizes) -> List[int]:
        keys, ptrs, sizes = list(keys), list(ptrs), list(sizes)
        if not len(keys) == len(ptrs) == len(sizes):
            return [INVALID] * len(keys)
        return [one(k, p, n) for k, p, n in zip(keys, ptrs, sizes)]

    def batch_put_tensor_from(self, keys: List[str], buffer_ptrs: List[int], sizes: List[int]) -> List[int]:
        return self._batch_from(self.put_tensor_from, keys, buffer_ptrs, sizes)

    def batch_upsert_tensor_from(self, keys: List[str], buffer_ptrs: List[int], sizes: List[int]) -> List[int]:
        return self._batch_from(self.upsert_tensor_from, keys, buffer_ptrs, sizes)

    # ---- reads --------------------------------------------------------------------------

    def get_tensor(self, key: str) -> Any:
        check_str(key, "key")
        data = self._core.get(key)
        try:
            return _tensor.deserialize(data) if data else None
        except TensorError:
            return None

    def batch_get_tensor(self, keys: List[str]) -> list:
        return [self.get_tensor(k) for k in keys]

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Reads the stored ``[TensorMetadata][data]`` into the registered buffer and returns
        the tensor (a copy of the buffer's bytes: kvtier hands out no views of raw memory)."""
        n = self.get_into(key, buffer_ptr, size)
        if n <= 0:
            return None
        b = self._core.read_registered(check_int(buffer_ptr, "buffer_ptr"), n)
        try:
            return _tensor.deserialize(b) if b is not None else None
        except TensorError:
            return None

    def batch_get_tensor_into(self, keys: List[str], buffer_ptrs: List[int], sizes: List[int]) -> list:
        keys, ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        if not len(keys) == len(ptrs) == len(sizes) or any(p == 0 for p in ptrs):
            # Mooncake (store_py.cpp): INVALID_PARAMS for every key, not None (its
            # test_dummy_client checks ``result < 0``)
            return [INVALID] * len(keys)
        return [self.get_tensor_into(k, p, n) for k, p, n in zip(keys, ptrs, sizes)]

    def get_tensor_into_cuda(self, key: str, tensor: Any) -> int:
        """Copies the stored tensor into ``tensor`` (same dtype and element count, any
        device); its payload size in bytes, or a negative code."""
        t = self.get_tensor(key)
        if t is None:
            return int(ErrorCode.OBJECT_NOT_FOUND) if self.is_exist(key) != 1 else INVALID
        try:
            if tensor.dtype != t.dtype or tensor.numel() != t.numel():
                return INVALID
            tensor.copy_(t.reshape(tensor.shape))
        except (AttributeError, RuntimeError, TypeError):
            return INVALID
        return int(t.numel() * t.element_size())

    def batch_get_tensor_into_cuda(self, keys: List[str], tensors_list: list) -> List[int]:
        return self._batch(self.get_tensor_into_cuda, keys, tensors_list)

    # ---- tensor parallelism ----------------------------------------------------------------

    def _put_tp(self, key, tensor, tp_rank, tp_size, split_dim, config=None, upsert=False) -> int:
        check_str(key, "key")
        rank, size, dim = check_int(tp_rank, "tp_rank"), check_int(tp_size, "tp_size"), check_int(split_dim, "split_dim")
        rc = config_code(config)
        if rc or size < 1 or not 0 <= rank < size:
            return rc or INVALID
        try:
            parts = _tensor.shards(tensor, size, dim)
        except TensorError:
            return INVALID
        put = self._core.upsert if upsert else self._core.put
        for r, p in enumerate(parts):
            rc = put(f"{key}_tp_{r}", p)
            if rc != 0:
                return rc
        return 0

    def put_tensor_with_tp(self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> int:
        """Splits ``tensor`` in ``tp_size`` shards along ``split_dim``; stores them all."""
        return self._put_tp(key, tensor, tp_rank, tp_size, split_dim)

    def pub_tensor_with_tp(self, key: str, tensor: Any, config: Optional[ReplicateConfig] = None,
                           tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> int:
        return self._put_tp(key, tensor, tp_rank, tp_size, split_dim, config)

    def put_tensor_with_tp_from(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> int:
        b = self._read_tensor_buffer(buffer_ptr, size)
        if b is None:
            return INVALID
        return self._put_tp(key, _tensor.deserialize(b), tp_rank, tp_size, split_dim)

    def batch_put_tensor_with_tp(self, base_keys: List[str], tensors_list: list, tp_rank: int = 0,
                                 tp_size: int = 1, split_dim: int = 0) -> List[int]:
        return self._batch(self._put_tp, base_keys, tensors_list, tp_rank, tp_size, split_dim)

    def batch_pub_tensor_with_tp(self, base_keys: List[str], tensors_list: list, config: Optional[ReplicateConfig] = None,
                                 tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> List[int]:
        return self._batch(self._put_tp, base_keys, tensors_list, tp_rank, tp_size, split_dim, config)

    def batch_put_tensor_with_tp_from(self, base_keys: List[str], buffer_ptrs: List[int], sizes: List[int],
                                      tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> List[int]:
        def one(k, p, n):
            return self.put_tensor_with_tp_from(k, p, n, tp_rank, tp_size, split_dim)
        return self._batch_from(one, base_keys, buffer_ptrs, sizes)

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> Any:
        return self.get_tensor(_shard_key(check_str(key, "key"), check_int(tp_rank, "tp_rank"), check_int(tp_size, "tp_size")))

    def get_tensor_with_tp_into(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> Any:
        return self.get_tensor_into(_shard_key(check_str(key, "key"), tp_rank, tp_size), buffer_ptr, size)

    def batch_get_tensor_with_tp(self, base_keys: List[str], tp_rank: int = 0, tp_size: int = 1) -> list:
        return [self.get_tensor_with_tp(k, tp_rank, tp_size) for k in base_keys]

    def batch_get_tensor_with_tp_into(self, base_keys: List[str], buffer_ptrs: List[int], sizes: List[int],
                                      tp_rank: int = 0, tp_size: int = 1) -> list:
        keys = [_shard_key(check_str(k, "base_keys[i]"), tp_rank, tp_size) for k in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    # ---- parallelism requests (None only) ------------------------------------------------

    def put_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                    config: Optional[ReplicateConfig] = None, writer_partition: Any = None) -> int:
        if parallelism is not None or writer_partition is not None:
            return INVALID
        return self._put_tensor(key, tensor, False, config)

    def upsert_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                       config: Optional[ReplicateConfig] = None, writer_partition: Any = None) -> int:
        if parallelism is not None or writer_partition is not None:
            return INVALID
        return self._put_tensor(key, tensor, True, config)

    def put_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int, parallelism: Any = None,
                                         config: Optional[ReplicateConfig] = None, writer_partition: Any = None) -> int:
        if parallelism is not None or writer_partition is not None or config_code(config):
            return INVALID
        return self.put_tensor_from(key, buffer_ptr, size)

    def upsert_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int, parallelism: Any = None,
                                            config: Optional[ReplicateConfig] = None,
                                            writer_partition: Any = None) -> int:
        if parallelism is not None or writer_partition is not None or config_code(config):
            return INVALID
        return self.upsert_tensor_from(key, buffer_ptr, size)

    def batch_put_tensor_with_parallelism(self, keys: List[str], tensors_list: list, parallelisms: Any = None,
                                          config: Optional[ReplicateConfig] = None, writer_partitions: Any = None) -> List[int]:
        return self._batch(self.put_tensor_with_parallelism, keys, tensors_list, None if parallelisms is None else 1,
                           config, writer_partitions)

    def batch_upsert_tensor_with_parallelism(self, keys: List[str], tensors_list: list, parallelisms: Any = None,
                                             config: Optional[ReplicateConfig] = None,
                                             writer_partitions: Any = None) -> List[int]:
        return self._batch(self.upsert_tensor_with_parallelism, keys, tensors_list,
                           None if parallelisms is None else 1, config, writer_partitions)

    def batch_put_tensor_with_parallelism_from(self, keys, buffer_ptrs, sizes, parallelisms: Any = None,
                                               config: Optional[ReplicateConfig] = None,
                                               writer_partitions: Any = None) -> List[int]:
        if parallelisms is not None or writer_partitions is not None:
            return [INVALID] * len(keys)
        return self.batch_put_tensor_from(keys, buffer_ptrs, sizes)

    def batch_upsert_tensor_with_parallelism_from(self, keys, buffer_ptrs, sizes, parallelisms: Any = None,
                                                  config: Optional[ReplicateConfig] = None,
                                                  writer_partitions: Any = None) -> List[int]:
        if parallelisms is not None or writer_partitions is not None:
            return [INVALID] * len(keys)
        return self.batch_upsert_tensor_from(keys, buffer_ptrs, sizes)

    def get_tensor_with_parallelism(self, key: str, target: Any = None) -> Any:
        return self.get_tensor(key) if target is None else None

    def get_tensor_with_parallelism_into(self, key: str, buffer_ptr: int, size: int, target: Any = None) -> Any:
        return self.get_tensor_into(key, buffer_ptr, size) if target is None else None

    def batch_get_tensor_with_parallelism(self, keys: List[str], targets: Any = None) -> list:
        return [self.get_tensor(k) if targets is None else None for k in keys]

    def batch_get_tensor_with_parallelism_into(self, keys: List[str], buffer_ptrs: List[int], sizes: List[int],
                                               targets: Any = None) -> list:
        if targets is not None:
            return [None] * len(keys)
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    # ---- safetensors ---------------------------------------------------------------------

    def save_tensor_to_safetensor(self, key: str, file_name: Optional[str] = None) -> int:
        """Writes the tensor under ``key`` to a safetensors file (named after the key if no
        name is given); 0 or a negative code."""
        data = self._core.get(check_str(key, "key"))
        try:
            code, shape, raw = _tensor.to_parts(_tensor.deserialize(data)) if data else (None, None, None)
        except TensorError:
            return INVALID
        if code is None or shape is None or raw is None:
            return int(ErrorCode.OBJECT_NOT_FOUND)
        st = _SAFETENSORS[code]
        head = json.dumps({key: {"dtype": st, "shape": list(shape), "data_offsets": [0, raw.nbytes]}}).encode()
        try:
            with open(file_name or key, "wb") as f:
                f.write(struct.pack("<Q", len(head)) + head + raw.tobytes())
        except OSError:
            return int(ErrorCode.FILE_WRITE_FAIL)
        return 0

    def load_tensor_from_safetensor(self, key: Optional[str] = None, file_name: str = "") -> Any:
        """Reads a tensor from a safetensors file (the one named ``key``, else the first),
        stores it under ``key`` (or the file name) and returns it; None on failure."""
        try:
            with open(check_str(file_name, "file_name"), "rb") as f:
                blob = f.read()
            (n,) = struct.unpack_from("<Q", blob, 0)
            meta = {k: v for k, v in json.loads(blob[8:8 + n]).items() if k != "__metadata__"}
            name = key if key in meta else next(iter(meta))
            ent = meta[name]
            code = {v: k for k, v in _SAFETENSORS.items()}[ent["dtype"]]
            lo, hi = ent["data_offsets"]
            raw = blob[8 + n + lo:8 + n + hi]
            t = _tensor.deserialize(_tensor.header(code, tuple(ent["shape"]), tuple(ent["shape"]), len(raw)) + raw)
        except (OSError, ValueError, KeyError, StopIteration, struct.error, TensorError):
            return None
        return t if self.upsert_tensor(key if key is not None else file_name, t) == 0 else None
