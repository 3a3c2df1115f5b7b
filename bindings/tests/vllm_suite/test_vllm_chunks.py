"""kvtier.vllm.chunks: vLLM's chunk keys as kvtier radix page chains (hypothesis).

Keys are built the way vLLM builds them (``make_offload_key``: a block hash plus the group
index); positions are recorded in any order, as vLLM's scheduler may (sliding-window
backfills), with partial-tail boundary keys and holes mixed in.
"""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.kv_offload.base import make_offload_key

from kvtier.vllm.chunks import ChunkChains, chains_of, group_of, page_of


def _key(prompt: int, chunk: int, group: int, partial: bool = False) -> bytes:
    h = hashlib.sha256(f"{prompt}/{chunk}/{'p' if partial else 'f'}".encode()).digest()
    return make_offload_key(h, group)


groups_st = st.dictionaries(st.integers(0, 3), st.tuples(st.integers(0, 12), st.sampled_from([16, 32, 64])),
                            min_size=1, max_size=3)


@settings(max_examples=200, deadline=None)
@given(groups=groups_st, order=st.randoms(use_true_random=False), partial=st.booleans())
def test_chains_are_each_groups_full_chunks_in_prefix_order(groups, order, partial):
    positions = {}
    want = {}
    for g, (n, tpc) in groups.items():
        want[g] = [_key(1, i, g) for i in range(n)]
        for i, k in enumerate(want[g]):
            positions[k] = (i + 1) * tpc
        if partial:  # a partial tail: ends inside the chunk after the last full one
            positions[_key(1, n, g, partial=True)] = n * tpc + tpc // 2
    items = list(positions.items())
    order.shuffle(items)
    chains = chains_of(dict(items), {g: tpc for g, (_, tpc) in groups.items()})
    for g, (n, _) in groups.items():
        c = chains.get(g)
        got = c.keys if c else []
        assert got == want[g]
        if c:
            assert c.pages == [page_of(k) for k in want[g]]
            assert all(c.index[k] == i for i, k in enumerate(want[g]))
            assert all(group_of(k) == g for k in c.keys)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 12), hole=st.integers(0, 11), tpc=st.sampled_from([16, 32]))
def test_a_chain_stops_at_its_first_hole(n, hole, tpc):
    hole %= n
    keys = [_key(2, i, 0) for i in range(n)]
    positions = {k: (i + 1) * tpc for i, k in enumerate(keys) if i != hole}
    c = chains_of(positions, {0: tpc}).get(0)
    assert (c.keys if c else []) == keys[:hole]


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 8))
def test_pages_separate_groups_and_an_unknown_group_has_no_chain(n):
    h = hashlib.sha256(b"same block").digest()
    assert page_of(make_offload_key(h, 0)) != page_of(make_offload_key(h, 1))
    assert group_of(make_offload_key(h, 7)) == 7
    positions = {_key(3, i, 1): (i + 1) * 16 for i in range(n)}
    assert chains_of(positions, {0: 16}) == {}


def test_chains_follow_new_keys_and_unknown_keys_are_not_pages():
    tracker = ChunkChains({0: 16})
    positions = {_key(4, 0, 0): 16}
    assert tracker.locate(positions, _key(4, 0, 0))[1] == 0
    positions[_key(4, 1, 0)] = 32  # vLLM recorded the next chunk
    chain, i = tracker.locate(positions, _key(4, 1, 0))
    assert i == 1 and len(chain.pages) == 2
    assert tracker.locate(positions, _key(9, 0, 0)) is None
    positions[_key(4, 2, 0, partial=True)] = 40
    assert tracker.locate(positions, _key(4, 2, 0, partial=True)) is None


@settings(max_examples=300, deadline=None)
@given(groups=groups_st, order=st.randoms(use_true_random=False), partial=st.booleans(),
       cuts=st.lists(st.integers(0, 40), max_size=6), dup=st.integers(-1, 12), stranger=st.booleans())
def test_chains_grown_key_by_key_equal_chains_rebuilt_from_scratch(groups, order, partial, cuts, dup, stranger):
    """ChunkChains extends its chains with the keys recorded since its last call; whatever
    the order vLLM records them in (holes filled later, partial tails, a second key for a
    chunk, a group kvtier does not offload), each update equals ``chains_of`` of all the
    positions so far, and every key of a chain is located at its index."""
    tpcs = {g: tpc for g, (_, tpc) in groups.items()}
    items = []
    for g, (n, tpc) in groups.items():
        items += [(_key(5, i, g), (i + 1) * tpc) for i in range(n)]
        if partial:
            items.append((_key(5, n, g, partial=True), n * tpc + tpc // 2))
        if 0 <= dup < n:
            items.append((_key(6, dup, g), (dup + 1) * tpc))  # a second key for one chunk
    if stranger:
        items.append((_key(7, 0, 9), 16))  # group 9 is not offloaded
    order.shuffle(items)
    tracker = ChunkChains(tpcs)
    positions = {}
    bounds = sorted({min(c, len(items)) for c in cuts} | {len(items)})
    done = 0
    for b in bounds:
        for k, pos in items[done:b]:
            positions[k] = pos
        done = b
        got = tracker.update(positions)
        assert got == chains_of(positions, tpcs)
        for c in got.values():
            for i, k in enumerate(c.keys):
                assert tracker.locate(positions, k) == (c, i)
