"""``MooncakeDistributedStore``: lifecycle, bytes, zero-copy and metadata calls.

The tensor calls come from ``_tensor_api.TensorCalls``, the sessions, segment and task calls
from ``_extras.ExtraCalls``; the integer-code core (registered memory, the store calls with
the GIL released) is ``kvtier._native.MooncakeCore``.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._native import L3Store, MooncakeCore, join_parts
from . import _setup
from ._extras import ExtraCalls
from ._owned import OwnedKeys
from ._setup import check_int, check_str
from ._tensor_api import TensorCalls
from ._types import BufferHandle, ErrorCode, QueryTaskResponse, ReplicaDescriptor, ReplicateConfig, config_code

INVALID = int(ErrorCode.INVALID_PARAMS)
NO_BUFFER = INVALID  # Mooncake: a bytes put without a local buffer (local_buffer_size=0)


def _check_list(v: Any, name: str) -> list:
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
        raise TypeError(f"{name}: expected a list, got {type(v).__name__}")
    return list(v)


def _check_keys(keys: Any) -> List[str]:
    return [check_str(k, "keys[i]") for k in _check_list(keys, "keys")]


def _ints(v: Any, name: str) -> List[int]:
    return [check_int(x, f"{name}[i]") for x in _check_list(v, name)]


# Most replicas the store places (kvtier_l3::MAX_REPLICA_NUM); Mooncake takes any size_t as
# "best effort", which is never more replicas than segments: a larger count asks for the same.
MAX_REPLICAS = 64


def _replicas(config: Any) -> Dict[str, int]:
    """The native write calls' ``replica_num`` keyword for a (validated) config: the store
    places that many replicas on segments of distinct clients (best effort)."""
    n = getattr(config, "replica_num", 1) if config is not None else 1
    return {"replica_num": min(n, MAX_REPLICAS)} if n != 1 else {}


def _masked(call, keys: List[str], ptrs: list, sizes: list, **kw: int) -> List[int]:
    """``call(keys, ptrs, sizes)`` with non-positive pointers or negative sizes reported as
    INVALID_PARAMS (every key when the lists differ in length)."""
    if len(keys) != len(ptrs) or len(keys) != len(sizes):
        return [INVALID] * len(keys)
    bad = [p <= 0 or s < 0 for p, s in zip(ptrs, sizes)]
    out = call(keys, [max(p, 0) for p in ptrs], sizes, **kw)
    return [INVALID if b else r for b, r in zip(bad, out)]


class MooncakeDistributedStore(TensorCalls, ExtraCalls):
    """kvtier's store with Mooncake's ``MooncakeDistributedStore`` interface."""

    def __init__(self) -> None:
        self._core = OwnedKeys(MooncakeCore())
        self._hostname = ""
        self._remote = False  # a kvtier-l3 server's client with a segment of its own
        self._pool: Dict[int, int] = {}  # dummy client: alloc_from_mem_pool's (address, size)
        self._pool_registered: set = set()
        self._local_buffer = _setup.DEFAULT_SIZE
        self._sessions: Dict[str, bytearray] = {}
        self._tasks: Dict[Tuple[int, int], QueryTaskResponse] = {}

    # ---- lifecycle --------------------------------------------------------------------

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr, engine=None, enable_ssd_offload=False,
        ssd_offload_path="", tenant_id="default", ...)`` or ``setup(config_dict)`` (sizes
        there may be text, "16MB"). kvtier keys: ``default_kv_lease_ttl`` (ms, the embedded
        store's lease TTL when this call creates it), ``kvtier_token``. 0 or a negative code."""
        cfg, rc = _setup.read_args(args, kwargs)
        if cfg is None:
            return rc
        if self._core.is_setup():
            return 0  # Mooncake: a second setup on a live client is a no-op
        tenant = str(cfg.get("tenant_id", "default") or "default")
        master = str(cfg.get("master_server_addr", "") or "")
        host = _setup.hostname_with_port(str(cfg.get("local_hostname", "")))
        name = _setup.embedded_name(master)
        if name is not None:
            ttl = _setup.parse_size(cfg.get("default_kv_lease_ttl", 10_000))
            if ttl is None or ttl == 0:
                return INVALID
            rc = self._core.setup_embedded(name, cfg["global_segment_size"], tenant, host, ttl)
        else:
            addr, rc = _setup.resolve(master)
            if addr is not None:
                token = cfg.get("kvtier_token") or os.environ.get("KVTIER_L3_TOKEN")
                rc = self._core.setup_remote(addr, tenant, token, cfg["global_segment_size"], host)
                # it stands for a Mooncake client that mounted a segment: its objects go
                # when it closes (its segment on the server, and see _owned.py)
                self._remote = rc == 0 and cfg["global_segment_size"] > 0
                self._core.tracking = self._remote
        if rc == 0:
            self._hostname, self._local_buffer = host, cfg["local_buffer_size"]
            _setup.TAKEN.add(host)
        return rc

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Mooncake's dummy client: no segment of its own; the "real client" at
        ``server_address`` holds the memory. In kvtier that is a ``kvtier-l3`` server
        ("HOST:PORT") or an embedded store of this process ("embedded://NAME").
        ``mem_pool_size`` bytes of registered memory back ``alloc_from_mem_pool``.
        0, or -1 when the real client cannot be reached (as Mooncake) or the host cannot
        give the pool's memory (the client then stays unset)."""
        pool = check_int(mem_pool_size, "mem_pool_size")
        buf = check_int(local_buffer_size, "local_buffer_size")
        check_str(server_address, "server_address")
        if pool < 0 or buf < 0:
            return INVALID
        if self._core.is_setup():
            return 0
        name = _setup.embedded_name(server_address) if server_address.startswith("embedded") else None
        if name is not None:
            rc = self._core.setup_embedded(name, 0, "default", "", 10_000)
        else:
            addr, rc = _setup.resolve(server_address)
            rc = self._core.setup_remote(addr, "default", os.environ.get("KVTIER_L3_TOKEN")) if addr else rc
        if rc != 0:
            return int(ErrorCode.INTERNAL_ERROR)
        rc = self._core.setup_pool(pool)
        if rc != 0:  # a pool the host cannot give: -1, and this client is not set up
            self._core.close()
            return rc
        self._hostname, self._local_buffer = "", buf
        return 0

    def alloc_from_mem_pool(self, size: int) -> int:
        """``size`` bytes of the dummy client's pool, already registered (so ``put_from``
        and ``get_into`` accept them); the address, or 0 when the pool is exhausted."""
        n = check_int(size, "size")
        addr = self._core.alloc_from_mem_pool(n) if n > 0 else 0
        if addr:
            self._pool[addr] = n
        return addr

    def setup_with_store(self, store: L3Store) -> int:
        """kvtier extension: use an existing ``kvtier.L3Store`` handle (and its tenant)."""
        if not isinstance(store, L3Store):
            raise TypeError("setup_with_store: expected kvtier.L3Store")
        return self._core.setup_from(store)

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int) -> int:
        """Mooncake's legacy initializer: an embedded store with a segment of
        ``mount_segment_size`` bytes."""
        check_str(protocol, "protocol")
        check_str(device_name, "device_name")
        size = check_int(mount_segment_size, "mount_segment_size")
        if size < 0:
            return INVALID
        host = _setup.hostname_with_port("")
        rc = self._core.setup_embedded("default", size, "default", host, 10_000)
        if rc == 0:
            self._hostname = host
            _setup.TAKEN.add(host)
        return rc

    def close(self) -> int:
        """Unmounts this client's segment (the objects in it are gone, as in Mooncake),
        detaches, forgets registered buffers. Returns 0."""
        self._sessions.clear()
        _setup.TAKEN.discard(self._hostname)
        self._core.release()
        self._remote = False
        self._pool.clear()
        self._pool_registered.clear()
        return self._core.close()

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 store unreachable (Mooncake's codes)."""
        if not self._core.is_setup():
            return 1
        return 0 if self._core.health_check() == 0 else 2

    def get_hostname(self) -> str:
        """``host:port`` of this client (its segment's name); "" for a dummy client."""
        return self._hostname

    # ---- memory registration ----------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Registers ``[buffer_ptr, buffer_ptr + size)`` for the pointer calls: 0, or -600
        when the range is not mapped readable and writable right now (a wild pointer), or
        overlaps a registration. The caller keeps that memory alive until
        ``unregister_buffer`` (memory freed while registered is not noticed)."""
        ptr, n = check_int(buffer_ptr, "buffer_ptr"), check_int(size, "size")
        if ptr <= 0 or n <= 0:
            return INVALID
        if self._in_pool(ptr, n):
            # Mooncake's dummy client: pool memory is the real client's shared memory,
            # registered already; registering it (again) answers 0
            self._pool_registered.add(ptr)
            return 0
        return self._core.register_buffer(ptr, n)

    def _in_pool(self, ptr: int, n: int) -> bool:
        """Whether ``[ptr, ptr + n)`` lies inside one ``alloc_from_mem_pool`` allocation."""
        return any(a <= ptr and ptr + n <= a + size for a, size in self._pool.items())

    def unregister_buffer(self, buffer_ptr: int) -> int:
        ptr = check_int(buffer_ptr, "buffer_ptr")
        if ptr in self._pool_registered:
            self._pool_registered.discard(ptr)
            return 0  # the pool stays registered for the pointer calls, as in Mooncake
        return self._core.unregister_buffer(ptr) if ptr > 0 else INVALID

    # ---- bytes --------------------------------------------------------------------------

    def _bytes_put(self, call, key: Any, value: Any, config) -> int:
        check_str(key, "key")
        rc = config_code(config)
        if rc:
            return rc
        if self._local_buffer == 0 or not len(memoryview(value)):
            return NO_BUFFER  # Mooncake: no local buffer to stage in; an empty value is -600
        out = call(key, value, **_replicas(config))
        self._core.spare([key], config)
        return out

    def put(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        return self._bytes_put(self._core.put, key, value, config)

    def upsert(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        """Insert or replace (a replaced object's readers holding a lease see the old bytes
        until the lease ends in Mooncake; kvtier removes it first)."""
        return self._bytes_put(self._core.upsert, key, value, config)

    def put_parts(self, key: str, *parts: Any, config: Optional[ReplicateConfig] = None) -> int:
        return self.put(key, join_parts(list(parts)), config)

    def upsert_parts(self, key: str, *parts: Any, config: Optional[ReplicateConfig] = None) -> int:
        return self.upsert(key, join_parts(list(parts)), config)

    def _bytes_batch(self, call, keys, values, config) -> int:
        keys = _check_keys(keys)
        values = _check_list(values, "values")
        rc = config_code(config)
        if rc:
            return rc
        if self._local_buffer == 0:
            return NO_BUFFER
        out = call(keys, values, **_replicas(config))
        self._core.spare(keys, config)
        return out

    def put_batch(self, keys: List[str], values: List[Any], config: Optional[ReplicateConfig] = None) -> int:
        return self._bytes_batch(self._core.put_batch, keys, values, config)

    def upsert_batch(self, keys: List[str], values: List[Any], config: Optional[ReplicateConfig] = None) -> int:
        return self._bytes_batch(self._core.upsert_batch, keys, values, config)

    def get(self, key: str) -> bytes:
        check_str(key, "key")
        return self._core.get(key) if self._local_buffer else b""

    def get_batch(self, keys: List[str]) -> List[bytes]:
        keys = _check_keys(keys)
        return self._core.get_batch(keys) if self._local_buffer else [b""] * len(keys)

    def get_buffer(self, key: str) -> Optional[BufferHandle]:
        """The object's bytes in a ``BufferHandle`` (buffer protocol, ``ptr()``, ``size()``),
        or None when it is missing (as Mooncake)."""
        check_str(key, "key")
        if not self._local_buffer or not key:
            return None
        for _ in range(8):  # the object may be replaced between the size and the read
            n = self._core.get_size(key)
            if n <= 0:
                return None
            h = BufferHandle(n)
            r = self._core.get_into_buffer(key, h)
            if r >= 0:
                del h[r:]
                return h
            if r != int(ErrorCode.BUFFER_OVERFLOW):
                return None
        return None

    def batch_get_buffer(self, keys: List[str]) -> List[Optional[BufferHandle]]:
        return [self.get_buffer(k) for k in _check_keys(keys)]

    # ---- zero-copy ----------------------------------------------------------------------

    def _one(self, call, key, ptr, size, config=None) -> int:
        check_str(key, "key")
        rc = config_code(config)
        if rc:
            return rc
        out = _masked(call, [key], [check_int(ptr, "buffer_ptr")], [check_int(size, "size")], **_replicas(config))[0]
        self._core.spare([key], config)
        return out

    def _many(self, call, keys, ptrs, sizes, config=None) -> List[int]:
        keys = _check_keys(keys)
        ptrs, sizes = _ints(ptrs, "buffer_ptrs"), _ints(sizes, "sizes")
        rc = config_code(config)
        if rc:
            return [rc] * len(keys)
        out = _masked(call, keys, ptrs, sizes, **_replicas(config))
        self._core.spare(keys, config)
        return out

    def put_from(self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None) -> int:
        return self._one(self._core.batch_put_from, key, buffer_ptr, size, config)

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None) -> int:
        return self._one(self._core.batch_upsert_from, key, buffer_ptr, size, config)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._one(self._core.batch_get_into, key, buffer_ptr, size)

    def batch_put_from(self, keys: List[str], buffer_ptrs: List[int], sizes: List[int],
                       config: Optional[ReplicateConfig] = None) -> List[int]:
        return self._many(self._core.batch_put_from, keys, buffer_ptrs, sizes, config)

    def batch_upsert_from(self, keys: List[str], buffer_ptrs: List[int], sizes: List[int],
                          config: Optional[ReplicateConfig] = None) -> List[int]:
        return self._many(self._core.batch_upsert_from, keys, buffer_ptrs, sizes, config)

    def batch_get_into(self, keys: List[str], buffer_ptrs: List[int], sizes: List[int]) -> List[int]:
        return self._many(self._core.batch_get_into, keys, buffer_ptrs, sizes)

    def put_from_with_metadata(self, key: str, buffer_ptr: int, metadata_buffer_ptr: int, size: int,
                               metadata_size: int, config: Optional[ReplicateConfig] = None) -> int:
        """Stores ``[metadata][data]`` (metadata first, as Mooncake lays it out)."""
        check_str(key, "key")
        ptrs = [check_int(metadata_buffer_ptr, "metadata_buffer_ptr"), check_int(buffer_ptr, "buffer_ptr")]
        return self.batch_put_from_multi_buffers(
            [key], [ptrs], [[check_int(metadata_size, "metadata_size"), check_int(size, "size")]], config)[0]

    def _multi(self, call, keys, all_ptrs, all_sizes, config=None) -> List[int]:
        keys = _check_keys(keys)
        ptrs = [_ints(ps, "all_buffer_ptrs[i]") for ps in _check_list(all_ptrs, "all_buffer_ptrs")]
        sizes = [_ints(ns, "all_sizes[i]") for ns in _check_list(all_sizes, "all_sizes")]
        rc = config_code(config)
        if rc:
            return [rc] * len(keys)
        if len(keys) != len(ptrs) or len(keys) != len(sizes):
            return [INVALID] * len(keys)
        bad = [any(p <= 0 for p in ps) or any(n < 0 for n in ns) for ps, ns in zip(ptrs, sizes)]
        out = call(keys, [[max(p, 0) for p in ps] for ps in ptrs], sizes, **_replicas(config))
        self._core.spare(keys, config)
        return [INVALID if b else r for b, r in zip(bad, out)]

    def batch_put_from_multi_buffers(self, keys: List[str], all_buffer_ptrs: List[List[int]],
                                     all_sizes: List[List[int]], config: Optional[ReplicateConfig] = None) -> List[int]:
        """Stores each key from several registered buffers, concatenated in order."""
        return self._multi(self._core.batch_put_from_multi_buffers, keys, all_buffer_ptrs, all_sizes, config)

    def batch_get_into_multi_buffers(self, keys: List[str], all_buffer_ptrs: List[List[int]],
                                     all_sizes: List[List[int]], prefer_alloc_in_same_node: bool = False) -> List[int]:
        """Reads each key and scatters its bytes over several registered buffers in order."""
        return self._multi(self._core.batch_get_into_multi_buffers, keys, all_buffer_ptrs, all_sizes)

    def get_into_ranges(self, buffer_ptrs: List[int], all_keys: List[List[str]],
                        all_dst_offsets: List[List[List[int]]], all_src_offsets: List[List[List[int]]],
                        all_sizes: List[List[List[int]]]) -> List[List[List[int]]]:
        """Per buffer, per key, per range: copies ``size`` bytes from ``src_offset`` of the
        object to ``buffer + dst_offset`` (registered memory); the bytes copied or a code."""
        ptrs = _ints(buffer_ptrs, "buffer_ptrs")
        keys = [_check_keys(ks) for ks in _check_list(all_keys, "all_keys")]

        def nested(v, name):
            return [[_ints(r, name) for r in _check_list(k, name)] for k in _check_list(v, name)]

        dst, src = nested(all_dst_offsets, "all_dst_offsets"), nested(all_src_offsets, "all_src_offsets")
        sizes = nested(all_sizes, "all_sizes")
        return self._core.get_into_ranges([max(p, 0) for p in ptrs], keys, dst, src, sizes)

    # ---- metadata -----------------------------------------------------------------------

    def is_exist(self, key: str) -> int:
        return self._core.is_exist(check_str(key, "key"))

    def batch_is_exist(self, keys: List[str]) -> List[int]:
        return self._core.batch_is_exist(_check_keys(keys))

    def get_size(self, key: str) -> int:
        return self._core.get_size(check_str(key, "key"))

    def remove(self, key: str, force: bool = False) -> int:
        return self._core.remove(check_str(key, "key"), bool(force))

    def batch_remove(self, keys: List[str], force: bool = False) -> List[int]:
        return self._core.batch_remove(_check_keys(keys), bool(force))

    def remove_all(self, force: bool = False) -> int:
        return self._core.remove_all(bool(force))

    def get_replica_desc(self, key: str) -> List[ReplicaDescriptor]:
        """The object's replicas (empty when it is missing). Takes a read lease, as a
        replica lookup does."""
        return [ReplicaDescriptor.from_row(r) for r in self._core.replica_rows([check_str(key, "key")])[0]]

    def batch_get_replica_desc(self, keys: List[str]) -> Dict[str, List[ReplicaDescriptor]]:
        """Replicas of the keys that exist (missing keys are left out, as Mooncake)."""
        keys = _check_keys(keys)
        rows = self._core.replica_rows(keys)
        return {k: [ReplicaDescriptor.from_row(r) for r in rs] for k, rs in zip(keys, rows) if rs}

    def batch_replica_clear(self, keys: List[str], segment_name: str = "") -> List[str]:
        """Clears the replicas of the keys whose lease has expired (only those in segment
        ``segment_name`` if given: a replica in another segment keeps the object, as in
        Mooncake); returns the keys cleared. A client names its own segment with its
        ``get_hostname()``. A client of a server that took no segment from it (a split
        deployment's master, an HA cluster) stands for its objects' memory there, so its own
        name clears them whole."""
        segment = check_str(segment_name, "segment_name")
        if self._remote and segment == self._hostname and not self._core.has_segment():
            segment = ""
        return self._core.batch_replica_clear(_check_keys(keys), segment)

    def __repr__(self) -> str:
        return f"kvtier.mooncake_compat.MooncakeDistributedStore(setup={self._core.is_setup()})"


