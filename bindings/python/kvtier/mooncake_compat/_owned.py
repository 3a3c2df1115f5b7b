"""The objects a client of a ``kvtier-l3`` server would hold in its own Mooncake segment.

Why: in Mooncake every client that sets up with a ``global_segment_size`` mounts that memory,
its puts land there, and ``close()`` (``tear_down_all``) unmounts it: a get after a close and a
new setup answers ``b""`` (Mooncake's own ``test_client_tear_down``). A client of a
``kvtier-l3`` server mounts nothing — the server holds the memory — so without help its
objects outlived it. ``OwnedKeys`` wraps the native core, remembers the keys this client
wrote successfully while it stands for a segment, and ``release`` removes them (forced, as an
unmount does) when the client closes. Keys written with ``replica_num > 1`` are kept: in
Mooncake their other replicas lie in other clients' segments and survive the close. At most
``MAX_KEYS`` keys are remembered (a removal forgets its keys; beyond the cap the oldest
writes are forgotten), so a long-lived client's memory stays bounded. An embedded client mounts a real segment and a dummy
client has none, so neither tracks anything. The remembered keys change under a lock: a
client is called from several threads (two trimming past the cap took the same oldest key,
or one iterated while another inserted, and a put that had succeeded raised KeyError or
RuntimeError).
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List

# Keys remembered at most (the oldest written are forgotten first, and then outlive the close):
# a long-lived client of a server must not grow without bound with the keys it ever wrote.
MAX_KEYS = 1 << 20

# The native calls that write objects: (name, is the first argument a list of keys).
_WRITES = {
    "put": False, "upsert": False, "put_from": False, "upsert_from": False,
    "put_batch": True, "upsert_batch": True, "batch_put_from": True, "batch_upsert_from": True,
    "batch_put_from_multi_buffers": True, "batch_upsert_from_multi_buffers": True,
}


class OwnedKeys:
    """A native ``MooncakeCore`` that records, while ``tracking``, the keys written with
    success (a batch's int result covers every key; a list result is per key)."""

    def __init__(self, core: Any, max_keys: int = MAX_KEYS) -> None:
        self._inner = core
        self.tracking = False
        self._max = max_keys
        self._keys: Dict[str, None] = {}  # insertion-ordered: the oldest write first
        self._lock = threading.Lock()  # held while _keys changes, never across a native call

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name in ("remove", "batch_remove", "remove_all"):
            return self._removing(name, attr)
        if name not in _WRITES:
            return attr
        many = _WRITES[name]

        def write(keys: Any, *args: Any, **kwargs: Any) -> Any:
            out = attr(keys, *args, **kwargs)
            if self.tracking:
                self._note(keys if many else [keys], out)
            return out

        return write

    def _removing(self, name: str, attr: Any) -> Any:
        """A removal forgets the keys it names (``remove_all`` every key)."""

        def remove(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                if name == "remove_all":
                    self._keys.clear()
                else:
                    for k in [args[0]] if name == "remove" else args[0]:
                        self._keys.pop(k, None)
            return attr(*args, **kwargs)

        return remove

    def _note(self, keys: List[str], out: Any) -> None:
        if isinstance(out, list):
            done = [k for k, rc in zip(keys, out) if isinstance(rc, int) and rc >= 0]
        else:
            done = keys if isinstance(out, int) and out >= 0 else []
        with self._lock:
            for k in done:
                self._keys.pop(k, None)
                self._keys[k] = None
            while len(self._keys) > self._max:
                del self._keys[next(iter(self._keys))]

    def spare(self, keys: List[str], config: Any) -> None:
        """Keeps ``keys`` written with ``config.replica_num > 1`` out of the release: Mooncake
        placed their other replicas in other clients' segments, which outlive this client's
        close (its test_replication_failure_tolerance reads them after it)."""
        if config is not None and getattr(config, "replica_num", 1) > 1:
            with self._lock:
                for k in keys:
                    self._keys.pop(k, None)

    def release(self) -> None:
        """Removes (forced) the objects written while tracking; forgets them."""
        with self._lock:
            keys, self._keys = list(self._keys), {}
        if keys and self._inner.is_setup():
            self._inner.batch_remove(keys, True)
        self.tracking = False
