"""A drop-in ``MooncakeDistributedStore`` backed by kvtier's L3 store.

An engine written against Mooncake's Python store switches to kvtier by changing one import::

    # from mooncake.store import MooncakeDistributedStore
    from kvtier.mooncake_compat import MooncakeDistributedStore

Same method names, arguments and integer return conventions as ``mooncake.store``:
``setup`` (seven positional arguments plus keywords, or one dict) returns 0 or a negative code;
``put``/``put_from``/``remove`` return 0 or a negative code; ``get_into`` and ``get_size`` the
size or a negative code; ``is_exist`` 1, 0 or a negative code; batch calls a list of those;
``get`` the bytes (``b""`` when missing); ``remove_all`` the number removed. Codes are
Mooncake's (-704 OBJECT_NOT_FOUND, -706 OBJECT_HAS_LEASE, -600 INVALID_PARAMS, -1 not set
up / internal, ...). As Mooncake 0.3.13's client does (checked side by side against a real
master in tests/test_mooncake_real.py): a put of a key that exists returns 0 and keeps the
first value; a read into a buffer smaller than the object returns -600. Wrong argument
types raise ``TypeError`` as pybind11 does.

Where the store lives is chosen by ``master_server_addr``:

- ``"embedded"`` or ``"embedded://NAME"`` (also ``""``, ``"local"``): an in-process store
  shared by every client of this process naming it (``global_segment_size`` sizes it when the
  first client creates it);
- ``"HOST:PORT"`` or ``"kvtier://HOST:PORT"``: a ``kvtier-l3`` server (token from the dict key
  ``kvtier_token`` or the ``KVTIER_L3_TOKEN`` environment variable).

Differences from Mooncake, on purpose: pointer arguments (``put_from``, ``get_into``,
``batch_*``) must lie inside memory registered with ``register_buffer`` — anything else
returns -600 instead of reading or writing wild memory (Mooncake documents registration as
required too); calls before ``setup`` or after ``close`` return -1 instead of crashing.
``local_hostname``, ``metadata_server``, ``protocol`` and ``rdma_devices`` are accepted and
ignored (kvtier moves bytes in-process or over its own TCP transport).
"""

from __future__ import annotations

import os
import socket
from typing import Any, Dict, List, Optional, Sequence

from ._native import L3Store, MooncakeCore

__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "ErrorCode"]


class ErrorCode:
    """Mooncake's integer error codes (the ones kvtier returns)."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    NO_AVAILABLE_HANDLE = -200
    INVALID_KEY = -400
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    RPC_FAIL = -900
    UNAVAILABLE_IN_CURRENT_STATUS = -1010


class ReplicateConfig:
    """Mooncake's replication settings; kvtier keeps one replica and honours nothing else
    yet, but accepts the object so calls written for Mooncake run unchanged."""

    def __init__(self) -> None:
        self.replica_num: int = 1
        self.with_soft_pin: bool = False
        self.with_hard_pin: bool = False
        self.preferred_segment: str = ""
        self.prefer_alloc_in_same_node: bool = False

    def __repr__(self) -> str:
        return f"ReplicateConfig(replica_num={self.replica_num}, with_soft_pin={self.with_soft_pin})"


_SETUP_FIELDS = (
    "local_hostname",
    "metadata_server",
    "global_segment_size",
    "local_buffer_size",
    "protocol",
    "rdma_devices",
    "master_server_addr",
)


def _int(v: Any, name: str) -> int:
    if isinstance(v, bool):
        raise TypeError(f"{name}: expected int, got bool")
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            raise TypeError(f"{name}: expected int, got {v!r}") from None
    if hasattr(v, "__index__"):
        return int(v.__index__())
    raise TypeError(f"{name}: expected int, got {type(v).__name__}")


def _check_str(v: Any, name: str) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{name}: expected str, got {type(v).__name__}")
    return v


def _check_int(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if hasattr(v, "__index__") and not isinstance(v, bool):
            return int(v.__index__())
        raise TypeError(f"{name}: expected int, got {type(v).__name__}")
    return v


def _check_list(v: Any, name: str) -> list:
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
        raise TypeError(f"{name}: expected a list, got {type(v).__name__}")
    return list(v)


def _check_keys(keys: Any) -> List[str]:
    return [_check_str(k, "keys[i]") for k in _check_list(keys, "keys")]


def _one_range(call, key: str, buffer_ptr: int, size: int) -> int:
    """``call(key, ptr, size)`` for a checked key and range; INVALID_PARAMS for a bad range."""
    _check_str(key, "key")
    ptr = _check_int(buffer_ptr, "buffer_ptr")
    n = _check_int(size, "size")
    if ptr <= 0 or n < 0:
        return ErrorCode.INVALID_PARAMS
    return call(key, ptr, n)


def _masked(call, keys: List[str], ptrs: list, sizes: list, bad: List[bool]) -> List[int]:
    """``call(keys, ptrs, sizes)`` with the keys whose ranges are ``bad`` reported as
    INVALID_PARAMS (every key when the lists differ in length)."""
    if len(keys) != len(ptrs) or len(keys) != len(sizes):
        return [ErrorCode.INVALID_PARAMS] * len(keys)
    out = call(keys, ptrs, sizes)
    return [ErrorCode.INVALID_PARAMS if b else r for b, r in zip(bad, out)]


class MooncakeDistributedStore:
    """kvtier's store with Mooncake's ``MooncakeDistributedStore`` interface."""

    def __init__(self) -> None:
        self._core = MooncakeCore()
        self._hostname = ""

    # ---- lifecycle --------------------------------------------------------------------

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr, engine=None, enable_ssd_offload=False,
        ssd_offload_path="", tenant_id="default", ...)`` or ``setup(config_dict)``.
        Returns 0, or a negative code."""
        if len(args) == 1 and not kwargs and isinstance(args[0], dict):
            cfg: Dict[str, Any] = dict(args[0])
            if "local_hostname" not in cfg or "metadata_server" not in cfg:
                return ErrorCode.INVALID_PARAMS
        else:
            if len(args) > len(_SETUP_FIELDS) + 6:
                raise TypeError("setup(): too many positional arguments")
            names = list(_SETUP_FIELDS) + [
                "engine",
                "enable_ssd_offload",
                "ssd_offload_path",
                "tenant_id",
                "enable_client_http_server",
                "client_http_port",
            ]
            cfg = dict(zip(names, args))
            for k, v in kwargs.items():
                if k in cfg:
                    raise TypeError(f"setup(): {k} given twice")
                cfg[k] = v
            missing = [n for n in _SETUP_FIELDS if n not in cfg]
            if missing:
                raise TypeError(f"setup(): missing arguments {missing}")
            _check_str(cfg["local_hostname"], "local_hostname")
            _check_str(cfg["metadata_server"], "metadata_server")
            _check_str(cfg["protocol"], "protocol")
            _check_str(cfg["rdma_devices"], "rdma_devices")
            _check_str(cfg["master_server_addr"], "master_server_addr")
        seg = _int(cfg.get("global_segment_size", 16 << 20), "global_segment_size")
        _int(cfg.get("local_buffer_size", 16 << 20), "local_buffer_size")
        if seg < 0:
            return ErrorCode.INVALID_PARAMS
        tenant = str(cfg.get("tenant_id", "default") or "default")
        master = str(cfg.get("master_server_addr", "") or "")
        self._hostname = str(cfg.get("local_hostname", ""))
        if self._core.is_setup():
            return ErrorCode.OK  # Mooncake: a second setup on a live client is a no-op
        if master in ("", "local", "embedded") or master.startswith("embedded://"):
            name = master[len("embedded://"):] if master.startswith("embedded://") else "default"
            return self._core.setup_embedded(name or "default", seg, tenant)
        if master.startswith("kvtier://"):
            master = master[len("kvtier://"):]
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            return ErrorCode.INVALID_PARAMS
        host = host.strip("[]")
        try:
            ip = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0][4][0]
        except (OSError, UnicodeError):
            return ErrorCode.RPC_FAIL
        addr = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        token = cfg.get("kvtier_token") or os.environ.get("KVTIER_L3_TOKEN")
        return self._core.setup_remote(addr, tenant, token)

    def setup_with_store(self, store: L3Store) -> int:
        """kvtier extension: use an existing ``kvtier.L3Store`` handle (and its tenant)."""
        if not isinstance(store, L3Store):
            raise TypeError("setup_with_store: expected kvtier.L3Store")
        return self._core.setup_from(store)

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int) -> int:
        """Mooncake's legacy initializer: an embedded store of ``mount_segment_size`` bytes."""
        _check_str(protocol, "protocol")
        _check_str(device_name, "device_name")
        return self._core.setup_embedded("default", _int(mount_segment_size, "mount_segment_size"), "default")

    def close(self) -> int:
        """Detaches from the store and forgets registered buffers. Returns 0."""
        return self._core.close()

    def health_check(self) -> int:
        """0 when the store answers, else a negative code."""
        return self._core.health_check()

    def get_hostname(self) -> str:
        return self._hostname

    # ---- memory registration ----------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Registers ``[buffer_ptr, buffer_ptr + size)`` for ``put_from``/``get_into``.
        The caller keeps that memory alive until ``unregister_buffer``."""
        ptr = _check_int(buffer_ptr, "buffer_ptr")
        n = _check_int(size, "size")
        if ptr <= 0 or n <= 0:
            return ErrorCode.INVALID_PARAMS
        return self._core.register_buffer(ptr, n)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        ptr = _check_int(buffer_ptr, "buffer_ptr")
        if ptr <= 0:
            return ErrorCode.INVALID_PARAMS
        return self._core.unregister_buffer(ptr)

    # ---- copying API ------------------------------------------------------------------

    def put(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        _check_str(key, "key")
        return self._core.put(key, value)

    def put_parts(self, key: str, *parts: Any, config: Optional[ReplicateConfig] = None) -> int:
        _check_str(key, "key")
        return self._core.put(key, b"".join(bytes(memoryview(p)) for p in parts))

    def put_batch(self, keys: List[str], values: List[Any], config: Optional[ReplicateConfig] = None) -> int:
        keys = _check_keys(keys)
        return self._core.put_batch(keys, _check_list(values, "values"))

    def get(self, key: str) -> bytes:
        _check_str(key, "key")
        return self._core.get(key)

    def get_batch(self, keys: List[str]) -> List[bytes]:
        keys = _check_keys(keys)
        return self._core.get_batch(keys)

    # ---- zero-copy API ------------------------------------------------------------------

    def put_from(self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None) -> int:
        return _one_range(self._core.put_from, key, buffer_ptr, size)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        return _one_range(self._core.get_into, key, buffer_ptr, size)

    def _batch_args(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]):
        keys = _check_keys(keys)
        ptrs = [_check_int(p, "buffer_ptrs[i]") for p in _check_list(ptrs, "buffer_ptrs")]
        sizes = [_check_int(s, "sizes[i]") for s in _check_list(sizes, "sizes")]
        bad = [p <= 0 or s < 0 for p, s in zip(ptrs, sizes)]
        return keys, [max(p, 0) for p in ptrs], sizes, bad

    def batch_put_from(
        self, keys: List[str], buffer_ptrs: List[int], sizes: List[int], config: Optional[ReplicateConfig] = None
    ) -> List[int]:
        return _masked(self._core.batch_put_from, *self._batch_args(keys, buffer_ptrs, sizes))

    def batch_get_into(self, keys: List[str], buffer_ptrs: List[int], sizes: List[int]) -> List[int]:
        return _masked(self._core.batch_get_into, *self._batch_args(keys, buffer_ptrs, sizes))

    def _multi_args(self, keys, all_ptrs, all_sizes):
        keys = _check_keys(keys)
        ptrs = [[_check_int(p, "all_buffer_ptrs[i][j]") for p in _check_list(ps, "all_buffer_ptrs[i]")]
                for ps in _check_list(all_ptrs, "all_buffer_ptrs")]
        sizes = [[_check_int(n, "all_sizes[i][j]") for n in _check_list(ns, "all_sizes[i]")]
                 for ns in _check_list(all_sizes, "all_sizes")]
        bad = [any(p <= 0 for p in ps) or any(n < 0 for n in ns) for ps, ns in zip(ptrs, sizes)]
        ptrs = [[max(p, 0) for p in ps] for ps in ptrs]
        return keys, ptrs, sizes, bad

    def batch_put_from_multi_buffers(
        self, keys: List[str], all_buffer_ptrs: List[List[int]], all_sizes: List[List[int]],
        config: Optional[ReplicateConfig] = None,
    ) -> List[int]:
        """Stores each key from several registered buffers, concatenated in order."""
        args = self._multi_args(keys, all_buffer_ptrs, all_sizes)
        return _masked(self._core.batch_put_from_multi_buffers, *args)

    def batch_get_into_multi_buffers(
        self, keys: List[str], all_buffer_ptrs: List[List[int]], all_sizes: List[List[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> List[int]:
        """Reads each key and scatters its bytes over several registered buffers in order."""
        args = self._multi_args(keys, all_buffer_ptrs, all_sizes)
        return _masked(self._core.batch_get_into_multi_buffers, *args)

    # ---- metadata -----------------------------------------------------------------------

    def is_exist(self, key: str) -> int:
        _check_str(key, "key")
        return self._core.is_exist(key)

    def batch_is_exist(self, keys: List[str]) -> List[int]:
        keys = _check_keys(keys)
        return self._core.batch_is_exist(keys)

    def get_size(self, key: str) -> int:
        _check_str(key, "key")
        return self._core.get_size(key)

    def remove(self, key: str, force: bool = False) -> int:
        _check_str(key, "key")
        return self._core.remove(key, bool(force))

    def batch_remove(self, keys: List[str], force: bool = False) -> List[int]:
        keys = _check_keys(keys)
        return self._core.batch_remove(keys, bool(force))

    def remove_all(self, force: bool = False) -> int:
        return self._core.remove_all(bool(force))

    def __repr__(self) -> str:
        return f"kvtier.mooncake_compat.MooncakeDistributedStore(setup={self._core.is_setup()})"
