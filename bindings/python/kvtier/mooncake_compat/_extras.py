"""The rest of Mooncake's store class: put/get sessions and ranged multi-buffer calls,
segment management, replica tasks, ``remove_by_regex`` and offload counters (mixed into the
store class).

Sessions are emulated on the client: ``batch_put_session_start`` reserves a zeroed staging
buffer per key, ranged puts copy registered memory into it, ``batch_put_session_end`` stores
it (``revoke`` drops it); a get session needs no cached state in kvtier (every ranged read
looks the object up). Calls that need what kvtier does not have return a documented code:
segment mounting beyond ``setup`` (kvtier's store owns its memory) returns -1011
UNAVAILABLE_IN_CURRENT_MODE.

Replica tasks (``create_copy_task``, ``create_move_task``) run in the store (embedded, server)
and are complete when the call returns: Mooncake hands them to a client to execute and
``query_task`` reports PENDING until then; kvtier records each created task as SUCCESS, so
``query_task`` answers what Mooncake answers once the task has run. Segments are named as
Mooncake names them: a client's ``get_hostname()``, or the names kvtier reports in replica
descriptors. A split deployment (``--role master``) returns -1011 for them.
``remove_by_regex`` runs in the store (embedded, server or split master), which filters the
caller's tenant's keys itself: no key listing crosses to Python.
"""

from __future__ import annotations

import random
import time
from typing import Any, Dict, List, Optional, Tuple

from ._setup import check_int, check_str
from ._types import ErrorCode, QueryTaskResponse, ReplicateConfig, TaskStatus, TaskType, config_code

INVALID = int(ErrorCode.INVALID_PARAMS)
UNAVAILABLE = int(ErrorCode.UNAVAILABLE_IN_CURRENT_MODE)


class ExtraCalls:
    """Mixin: needs ``self._core``, ``self._sessions`` (key → staging bytearray) and
    ``self._tasks`` (task id → QueryTaskResponse)."""

    # MooncakeDistributedStore's (_store.py), which this is mixed into
    _core: Any  # OwnedKeys over a MooncakeCore: it forwards every call
    _sessions: Dict[str, bytearray]
    _tasks: Dict[Tuple[int, int], QueryTaskResponse]

    # ---- put sessions ---------------------------------------------------------------------

    def batch_put_session_start(self, keys: List[str], sizes: List[int], config: Optional[ReplicateConfig] = None) -> List[int]:
        keys = [check_str(k, "keys[i]") for k in keys]
        sizes = [check_int(n, "sizes[i]") for n in sizes]
        rc = config_code(config)
        if rc or len(keys) != len(sizes):
            return [rc or INVALID] * len(keys)
        out = []
        for k, n in zip(keys, sizes):
            if n <= 0 or k in self._sessions:
                out.append(INVALID if n <= 0 else int(ErrorCode.OBJECT_ALREADY_EXISTS))
            elif self._core.is_exist(k) == 1:
                out.append(int(ErrorCode.OBJECT_ALREADY_EXISTS))
            else:
                self._sessions[k] = bytearray(n)
                out.append(0)
        return out

    def batch_put_from_multi_buffer_ranges(self, keys: List[str], all_buffer_ptrs: List[List[int]],
                                           all_sizes: List[List[int]], all_dst_offsets: List[List[int]]) -> List[int]:
        """Copies registered ranges into the keys' session buffers at ``dst_offsets``."""
        out = []
        for i, k in enumerate(keys):
            stage = self._sessions.get(k)
            try:
                ptrs, sizes, offs = all_buffer_ptrs[i], all_sizes[i], all_dst_offsets[i]
            except IndexError:
                out.append(INVALID)
                continue
            if stage is None or not len(ptrs) == len(sizes) == len(offs):
                out.append(INVALID if stage is not None else int(ErrorCode.OBJECT_NOT_FOUND))
                continue
            rc = 0
            for p, n, o in zip(ptrs, sizes, offs):
                b = self._core.read_registered(check_int(p, "ptr"), check_int(n, "size"))
                if b is None or o < 0 or o + n > len(stage):
                    rc = INVALID
                    break
                stage[o:o + n] = b
            out.append(rc)
        return out

    def batch_put_session_end(self, keys: List[str]) -> List[int]:
        out = []
        for k in keys:
            stage = self._sessions.pop(check_str(k, "keys[i]"), None)
            out.append(int(ErrorCode.OBJECT_NOT_FOUND) if stage is None else self._core.put(k, bytes(stage)))
        return out

    def batch_put_session_revoke(self, keys: List[str]) -> List[int]:
        return [0 if self._sessions.pop(check_str(k, "keys[i]"), None) is not None
                else int(ErrorCode.OBJECT_NOT_FOUND) for k in keys]

    # ---- get sessions ---------------------------------------------------------------------

    def batch_get_session_start(self, keys: List[str]) -> List[int]:
        """Per key 0 if it exists, else its code (kvtier caches nothing: each ranged read
        looks the object up)."""
        res = self._core.batch_is_exist([check_str(k, "keys[i]") for k in keys])
        return [0 if r == 1 else (int(ErrorCode.OBJECT_NOT_FOUND) if r == 0 else r) for r in res]

    def batch_get_session_end(self, keys: List[str]) -> int:
        return 0

    def batch_get_into_multi_buffer_ranges(self, keys: List[str], all_buffer_ptrs: List[List[int]],
                                           all_sizes: List[List[int]], all_src_offsets: List[List[int]]) -> List[int]:
        """Per key: copies ``size`` bytes from ``src_offset`` of the object to each
        registered buffer; the bytes copied in all, or the first negative code."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_src_offsets):
            return [INVALID] * len(keys)
        dst = [[list(p)] for p in all_buffer_ptrs]  # absolute pointers: buffer 0 + offset
        res = self._core.get_into_ranges(
            [0] * len(keys), [[check_str(k, "keys[i]")] for k in keys], dst,
            [[list(o)] for o in all_src_offsets], [[list(n)] for n in all_sizes])
        out = []
        for per_key in res:
            codes = per_key[0] if per_key else [INVALID]
            neg = [c for c in codes if c < 0]
            out.append(neg[0] if neg else sum(codes))
        return out

    # ---- segments, tasks, misc --------------------------------------------------------------

    def allocate_and_mount_segment(self, size: int, protocol: str = "tcp", location: str = "") -> Dict[str, Any]:
        return {"error_code": UNAVAILABLE}

    def mount_segment(self, path: str, size: int, offset: int = 0, protocol: str = "tcp",
                      location: str = "") -> Dict[str, Any]:
        return {"error_code": UNAVAILABLE}

    def unmount_segment(self, segment_ids: List[str], grace_period_seconds: int = 0) -> int:
        return UNAVAILABLE

    def unmount_and_free_segment(self, segment_ids: List[str], grace_period_seconds: int = 0) -> int:
        return UNAVAILABLE

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        return UNAVAILABLE

    def create_copy_task(self, key: str, targets: List[str]) -> Tuple[Tuple[int, int], int]:
        """Adds a replica of ``key`` in each target segment (one already there is kept):
        ``(task id, 0)``, or ``((0, 0), code)``: -704 missing key, -600 no target or an
        unknown segment (checked before any copy)."""
        key = check_str(key, "key")
        if not isinstance(targets, (list, tuple)):
            raise TypeError(f"targets: expected a list of str, got {type(targets).__name__}")
        targets = [check_str(t, "targets[i]") for t in targets]
        return self._task(TaskType.REPLICA_COPY, self._core.copy_replica(key, targets))

    def create_move_task(self, key: str, source: str, target: str) -> Tuple[Tuple[int, int], int]:
        """Moves the replica of ``key`` in ``source`` to ``target``: ``(task id, 0)``, or
        ``((0, 0), code)``: -704 missing key, -600 unknown segment, ``source == target`` or
        no replica in ``source``."""
        rc = self._core.move_replica(check_str(key, "key"), check_str(source, "source"),
                                     check_str(target, "target"))
        return self._task(TaskType.REPLICA_MOVE, rc)

    def _task(self, kind: TaskType, rc: int) -> Tuple[Tuple[int, int], int]:
        if rc != 0:
            return (0, 0), rc
        now = int(time.time() * 1000)
        r = QueryTaskResponse()
        r.id = (random.getrandbits(64), random.getrandbits(64))
        r.type, r.status = kind, TaskStatus.SUCCESS
        r.created_at_ms_epoch = r.last_updated_at_ms_epoch = now
        r.assigned_client = self._client_id
        r.message = "Task completed successfully"
        self._tasks[r.id] = r
        return r.id, 0

    @property
    def _client_id(self) -> Tuple[int, int]:
        cid = getattr(self, "_task_client", None)
        if cid is None:
            cid = self._task_client = (random.getrandbits(64), random.getrandbits(64))
        return cid

    def query_task(self, task_id: Tuple[int, int]) -> Tuple[Optional[QueryTaskResponse], int]:
        """The task's response and 0, or ``(None, -1400)`` for an id this client did not
        create."""
        if not isinstance(task_id, tuple) or len(task_id) != 2:
            raise TypeError("query_task(): task_id must be tuple[int, int]")
        r = self._tasks.get((check_int(task_id[0], "task_id[0]"), check_int(task_id[1], "task_id[1]")))
        return (None, int(ErrorCode.TASK_NOT_FOUND)) if r is None else (r, 0)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Removes the keys in which the pattern is found (Mooncake's ECMAScript
        ``regex_search``); leased or unfinished objects stay unless ``force``. The count
        removed, or -600 for an invalid pattern (the store filters its own tenant's keys)."""
        return self._core.remove_by_regex(check_str(regex_pattern, "regex_pattern"), bool(force))

    def get_offload_rpc_read_count(self) -> int:
        return 0
