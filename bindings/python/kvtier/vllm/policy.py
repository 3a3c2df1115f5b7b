"""kvtier's eviction policies for vLLM's host cache (a ``CachePolicy``).

Why: vLLM's CPU offloading tier evicts by ``lru`` or ``arc``. kvtier's ``freq-depth``
policy (docs/sim.md) was measured on conversation traffic, where most chunks a prompt brings
are never read again while a chunk's chance of another read grows with its reads and falls
with its depth: it credits each read and debits depth. vLLM hands a policy, when a request
finishes, the request's keys in prefix order with their end-token positions — exactly the
radix structure (depth) and the uses kvtier's policies rank by.

How: the ranks are computed by kvtier's own code (``kvtier.eviction_ranks``, the
``EvictionPolicy::rank_of`` of ``kvtier-radix`` the radix tree evicts by), on counters kept
here per chunk in numpy columns: the access clock (LRU order: a request's prefix is more
recent than its tail, so tails go first), the traffic clock and depth in 64-token pages
(the unit the policy's settings are measured in; token positions come from vLLM), and the
distinct reads. ``evict`` ranks every evictable chunk in one vectorized call and takes the
lowest (ties: the older chunk), or returns None and changes nothing when it cannot evict
``n``. vLLM names a policy by class: ``KvtierLruPolicy``, ``KvtierFreqDepthPolicy``.

As kvtier's radix tree (``radix/src/memory.rs``), a policy that ranks by reads remembers the
reads of the chunks it evicted (``USE_MEMORY_CAPACITIES`` times the cache's chunks, oldest
forgotten first): a chunk stored again starts with them plus one (the read that missed it),
so a prefix read again after its eviction is not ranked like a one-off tail.
"""

from __future__ import annotations

from collections import deque
from typing import ClassVar, Deque, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

import kvtier

PAGE_TOKENS = 64  # the unit of kvtier's policy settings (docs/sim.md)
USE_MEMORY_CAPACITIES = 5  # the radix tree's (radix/src/memory.rs)

__all__ = ["KvtierCachePolicy", "KvtierLruPolicy", "KvtierFreqDepthPolicy", "PAGE_TOKENS"]


class KvtierCachePolicy(CachePolicy):
    """A vLLM host-cache policy ranked by kvtier's ``POLICY`` (see the module doc)."""

    POLICY: ClassVar[str] = "freq-depth"

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        kvtier.eviction_ranks(self.POLICY, [0], [0], [0], [0])  # a bad POLICY fails here
        self._slot: Dict[OffloadKey, int] = {}
        self._keys: List[Optional[OffloadKey]] = []
        self._chunks: List[Optional[ChunkStatus]] = []
        self._free: List[int] = []
        self._grow(max(16, cache_capacity))
        self._tick = 0  # access clock
        self._traffic_tokens = 0  # traffic clock, in tokens (ranked in pages)
        # Reads of evicted chunks: key -> (reads, stamp), and (stamp, key) oldest first (an
        # entry whose stamp differs from the map's is stale). LRU ranks no reads: no memory.
        self._memory_capacity = 0 if self.POLICY == "lru" else USE_MEMORY_CAPACITIES * max(1, cache_capacity)
        self._memory: Dict[OffloadKey, Tuple[int, int]] = {}
        self._memory_order: Deque[Tuple[int, OffloadKey]] = deque()
        self._stamp = 0

    def _grow(self, n: int) -> None:
        old = len(self._keys)
        self._keys += [None] * n
        self._chunks += [None] * n
        self._free += range(old + n - 1, old - 1, -1)
        for name, dt in (("_access", np.uint64), ("_use", np.uint64), ("_uses", np.uint32),
                         ("_end", np.uint64), ("_seq", np.uint64)):
            col = np.zeros(old + n, dtype=dt)
            if old:
                col[:old] = getattr(self, name)
            setattr(self, name, col)
        for name in ("_evictable", "_pending"):
            col = np.zeros(old + n, dtype=bool)
            if old:
                col[:old] = getattr(self, name)
            setattr(self, name, col)

    # ---- vLLM's CachePolicy -----------------------------------------------------------------

    def get(self, key: OffloadKey) -> Optional[ChunkStatus]:
        s = self._slot.get(key)
        return None if s is None else self._chunks[s]

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: Optional[ReqContext] = None) -> None:
        # vLLM 0.32 calls insert(key, chunk), 0.33 and 0.34 insert(key, chunk, req_context): without a
        # context the chunk's depth is learned when its request finishes.
        if key in self._slot:
            self.remove(key)
        if not self._free:
            self._grow(len(self._keys))
        s = self._free.pop()
        self._slot[key], self._keys[s], self._chunks[s] = s, key, chunk
        self._tick += 1
        pos = None if req_context is None else req_context.get_offload_key_position(key)
        self._access[s], self._seq[s] = self._tick, self._tick
        self._use[s] = self._traffic_tokens // PAGE_TOKENS
        recalled = self._memory.pop(key, None)
        self._uses[s] = 0 if recalled is None else min(recalled[0] + 1, np.iinfo(np.uint32).max)
        self._end[s] = 0 if pos is None else pos // PAGE_TOKENS
        self._evictable[s] = chunk.ref_cnt == 0
        # Not used yet by a finished request (stored for a running one, or promoted for one
        # about to load it): evicted only after every other candidate. Otherwise a deep chunk
        # just promoted ranks first under freq-depth, and promoting a request's later chunks
        # evicts its earlier ones before it can load them all (a livelock of the tier).
        self._pending[s] = True

    def remove(self, key: OffloadKey) -> None:
        s = self._slot.pop(key, None)
        if s is None:
            return
        self._keys[s] = self._chunks[s] = None
        self._evictable[s] = self._pending[s] = False
        self._free.append(s)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in reversed(list(keys)):  # the head of a prefix ends up most recent
            s = self._slot.get(key)
            if s is not None:
                self._tick += 1
                self._access[s] = self._tick

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: Set[OffloadKey],
                            reused_keys: Set[OffloadKey], req_context: ReqContext) -> None:
        keys = order_request_keys(key_groups, req_context)
        ends = [req_context.get_offload_key_position(k) for k in keys]
        self._traffic_tokens += max((e for e in ends if e is not None), default=0)
        now = self._traffic_tokens // PAGE_TOKENS
        for key, end in zip(reversed(keys), reversed(ends)):
            s = self._slot.get(key)
            if s is None:
                continue
            self._tick += 1
            self._access[s] = self._tick
            self._pending[s] = False
            self._use[s] = now
            if end is not None:
                self._end[s] = end // PAGE_TOKENS
            if key in reused_keys:
                self._uses[s] = min(int(self._uses[s]) + 1, np.iinfo(np.uint32).max)

    def mark_evictable(self, key: OffloadKey) -> None:
        s = self._slot.get(key)
        if s is not None:
            self._evictable[s] = True

    def mark_non_evictable(self, key: OffloadKey) -> None:
        s = self._slot.get(key)
        if s is not None:
            self._evictable[s] = False

    def evict(self, n: int, protected: Set[OffloadKey]) -> Optional[List[Tuple[OffloadKey, ChunkStatus]]]:
        if n <= 0:
            return []
        mask = self._evictable.copy()
        for key in protected:
            s = self._slot.get(key)
            if s is not None:
                mask[s] = False
        cand = np.flatnonzero(mask)
        if len(cand) < n:
            return None
        ranks = kvtier.eviction_ranks(self.POLICY, self._access[cand], self._use[cand], self._uses[cand],
                                      self._end[cand])
        order = cand[np.lexsort((self._seq[cand], ranks, self._pending[cand]))]
        chosen = [int(s) for s in order if self._chunks[s] is not None and self._chunks[s].ref_cnt == 0][:n]
        if len(chosen) < n:
            return None
        out = [(self._keys[s], self._chunks[s]) for s in chosen]
        for s, (key, _) in zip(chosen, out):
            self._remember(key, int(self._uses[s]))
            self.remove(key)
        return out

    def _remember(self, key: OffloadKey, reads: int) -> None:
        if self._memory_capacity == 0:
            return
        self._stamp += 1
        self._memory[key] = (reads, self._stamp)
        self._memory_order.append((self._stamp, key))
        while len(self._memory_order) > self._memory_capacity:
            stamp, old = self._memory_order.popleft()
            if self._memory.get(old, (0, -1))[1] == stamp:
                del self._memory[old]

    def clear(self) -> None:
        cap = self.cache_capacity
        KvtierCachePolicy.__init__(self, cap)  # its subclasses only name their POLICY

    def __len__(self) -> int:
        return len(self._slot)


class KvtierFreqDepthPolicy(KvtierCachePolicy):
    """kvtier's frequency- and depth-aware policy, conversation setting (docs/sim.md)."""

    POLICY = "freq-depth"


class KvtierLruPolicy(KvtierCachePolicy):
    """kvtier's LRU (prefix heads outlive tails)."""

    POLICY = "lru"
