"""Whether an L3 store can hold one object of a given size, asked without writing one.

The engine integrations check at startup that one page (vLLM: one chunk) fits the store,
so a store that cannot hold it is a config error, not a failed job per page forever after.
They used to ask with a probe put and remove; on a full store that put evicted a real
object, for every engine started against it. The store's limits answer the same question
and change nothing: the largest object a put accepts and the DRAM a put allocates from.
"""

from __future__ import annotations

from typing import Optional

import kvtier


def object_refusal(store: kvtier.L3Store, nbytes: int) -> Optional[str]:
    """Why ``store`` refuses an object of ``nbytes``, or None when a put of one is accepted
    (given room, which the store makes by evicting). Raises ``kvtier.L3Error`` when a
    server's stats cannot be read."""
    most = int(store.max_object_bytes)
    if nbytes > most:
        return f"an object of {nbytes} bytes is larger than the store's max_object_bytes {most}"
    cap = int(store.stats()["mem_capacity_bytes"])
    if nbytes > cap:
        return f"an object of {nbytes} bytes is larger than the store's DRAM capacity {cap}"
    return None
