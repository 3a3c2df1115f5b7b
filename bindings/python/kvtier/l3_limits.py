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


def object_refusal(store: kvtier.L3Store, nbytes: int, key_len: int) -> Optional[str]:
    """Why ``store`` refuses an object of ``nbytes`` under a key of ``key_len`` bytes, or None
    when a put of one is accepted (given room, which the store makes by evicting). The DRAM
    capacity holds what a replica is charged (``kvtier.l3_charge``: value, key, metadata), not
    its value alone. Raises ``kvtier.L3Error`` when a server's stats cannot be read."""
    most = int(store.max_object_bytes)
    if nbytes > most:
        return f"an object of {nbytes} bytes is larger than the store's max_object_bytes {most}"
    cap = int(store.stats()["mem_capacity_bytes"])
    charged = kvtier.l3_charge(nbytes, key_len)
    if charged > cap:
        return (f"an object of {nbytes} bytes (charged {charged} with its key and metadata) is larger "
                f"than the store's DRAM capacity {cap}")
    return None
