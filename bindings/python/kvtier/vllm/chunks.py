"""vLLM's chunk keys as kvtier radix pages.

Why: kvtier's radix tree knows a page only as a link of a chain — the page hashes of a
prompt in prefix order — because a page is reusable only with its whole prefix, and its
residency on every tier is prefix-closed. vLLM's offloading manager is asked about one chunk
key at a time (``OffloadKey``: the block hash of the chunk's last block plus the KV group
index, 4 bytes big-endian), with the request's ``ReqContext`` recording each key's end-token
position. This module is the one place that turns those keys into chains and back:

- **one page per full chunk**: page ``i`` of a group's chain is the chunk ending at token
  ``(i + 1) * tokens_per_chunk``; the page hash is SHA-256 over a domain tag and the whole
  offload key (which already chains over the prefix, salt and LoRA);
- **prefix order** by position, not by the order vLLM recorded the keys in (a sliding-window
  backfill records them out of order); the chain stops at the first missing chunk, since
  pages past a hole cannot be placed in a prefix tree;
- **partial chunks** (a boundary key of a request's partial tail, whose position is not a
  multiple of the chunk size) are not pages: kvtier neither stores nor finds them;
- **groups**: each KV cache group is its own chain (the group index is in every key, so two
  groups' pages never collide in the one tree).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from itertools import islice
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Mapping, Optional, Tuple

__all__ = ["Chain", "ChunkChains", "chains_of", "group_of", "page_of"]

_TAG = b"kvtier.vllm.chunk\0"


@lru_cache(maxsize=1 << 16)
def page_of(key: bytes) -> bytes:
    """The kvtier page hash (32 bytes) of one vLLM offload key (cached: a shared prefix's
    keys recur in every request that reuses it)."""
    return hashlib.sha256(_TAG + bytes(key)).digest()


def group_of(key: bytes) -> int:
    """The KV cache group index of an offload key (its last 4 bytes, big-endian)."""
    k = bytes(key)
    if len(k) < 5:
        raise ValueError(f"an offload key is a block hash plus 4 bytes of group, got {len(k)} bytes")
    return int.from_bytes(k[-4:], "big")


@dataclass
class Chain:
    """One group's full chunks of a request in prefix order: ``keys[i]`` is page ``i``.
    ``host`` is the manager's kept answer for it (manager.py, ``_host_prefix``): ``(the
    manager's generation, host prefix, pages asked about)``; not part of the chain's value."""

    keys: List[bytes] = field(default_factory=list)
    pages: List[bytes] = field(default_factory=list)
    index: Dict[bytes, int] = field(default_factory=dict)
    host: Optional[Tuple[int, int, int]] = field(default=None, compare=False, repr=False)


def chains_of(positions: Mapping[bytes, int], tokens_per_chunk: Mapping[int, int]) -> Dict[int, Chain]:
    """Each group's chain from ``{offload key: end-token position}``. A group missing from
    ``tokens_per_chunk`` is not offloaded by kvtier (no chain)."""
    by_group: Dict[int, List[Tuple[int, bytes]]] = {}
    for key, pos in positions.items():
        g = group_of(key)
        tpc = tokens_per_chunk.get(g)
        if tpc is None or pos <= 0 or pos % tpc:
            continue  # another group's layout, or a partial chunk
        by_group.setdefault(g, []).append((pos // tpc - 1, bytes(key)))
    out: Dict[int, Chain] = {}
    for g, items in by_group.items():
        items.sort()
        c = Chain()
        for i, key in items:
            if i != len(c.keys):
                break  # a hole (or a duplicate position): the chain ends before it
            c.index[key] = i
            c.keys.append(key)
            c.pages.append(page_of(key))
        out[g] = c
    return out


class ChunkChains:
    """A request's chains, kept in its ``ReqContext`` (``set_state``) and extended as vLLM
    records new keys: only the keys recorded since the last call are read (vLLM's positions
    only grow, in insertion order), so a request's chains cost O(its keys) over its life, not
    per manager call. Anything that is not a plain extension (a key at an index the chain
    holds another key for, fewer positions than seen) rebuilds with ``chains_of``, which
    stays the definition: ``update`` returns exactly ``chains_of(positions, ...)``."""

    def __init__(self, tokens_per_chunk: Mapping[int, int]):
        self.tokens_per_chunk = dict(tokens_per_chunk)
        # The 4 group bytes every key ends with -> (group, tokens per chunk).
        self._groups = {g.to_bytes(4, "big"): (g, t) for g, t in self.tokens_per_chunk.items()}
        self._seen = 0
        self._chains: Dict[int, Chain] = {}
        self._ahead: Dict[int, Dict[int, bytes]] = {}  # full chunks past a group's hole, by index
        self._exact = True  # False after an anomaly: every change rebuilds with chains_of
        # The manager's kept answer (manager.py, ``lookup``): ``(its generation, positions
        # seen, the keys found in their chain's host prefix)``; not part of the chains' value.
        self.on_host: Optional[Tuple[int, int, FrozenSet[bytes]]] = None

    def update(self, positions: Mapping[bytes, int]) -> Dict[int, Chain]:
        n = len(positions)
        if n == self._seen:
            return self._chains
        if n > self._seen and self._exact and self._extend(islice(positions.items(), self._seen, None)):
            self._seen = n
            return self._chains
        self._exact = False
        self._chains = chains_of(positions, self.tokens_per_chunk)
        self._seen = n
        return self._chains

    def _extend(self, items) -> bool:
        """Adds newly recorded keys; False on anything chains_of must decide."""
        groups, chains, aheads = self._groups, self._chains, self._ahead
        for key, pos in items:
            if len(key) < 5:
                return False  # not an offload key: chains_of says so
            gt = groups.get(key[-4:])
            if gt is None:
                continue  # a group kvtier does not offload
            g, tpc = gt
            if pos <= 0 or pos % tpc:
                continue  # a partial chunk
            i = pos // tpc - 1
            c = chains.get(g)
            if c is None:
                c = chains[g] = Chain()
            if type(key) is not bytes:
                key = bytes(key)
            n = len(c.keys)
            if i < n:
                return False  # a second key for a chunk the chain holds
            ahead = aheads.get(g)
            if i == n and not ahead:  # the next chunk, nothing waiting: vLLM's usual order
                c.index[key] = n
                c.keys.append(key)
                c.pages.append(page_of(key))
                continue
            if ahead is None:
                ahead = aheads[g] = {}
            if i in ahead:
                return False
            ahead[i] = key
            while len(c.keys) in ahead:
                k = ahead.pop(len(c.keys))
                c.index[k] = len(c.keys)
                c.keys.append(k)
                c.pages.append(page_of(k))
        return True

    def group(self, key: bytes) -> Optional[int]:
        """The group of a key whose group kvtier offloads, else None."""
        gt = self._groups.get(bytes(key)[-4:])
        return None if gt is None else gt[0]

    def locate(self, positions: Mapping[bytes, int], key: bytes) -> Optional[Tuple[Chain, int]]:
        """The chain a key is a page of and its index, or None (partial chunk, past a hole,
        unknown key)."""
        if type(key) is not bytes:
            key = bytes(key)
        gt = self._groups.get(key[-4:])
        if gt is None:
            return None
        c = self.update(positions).get(gt[0])
        if c is None:
            return None
        i = c.index.get(key)
        return None if i is None else (c, i)
