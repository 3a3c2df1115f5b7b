"""Reads into caller memory never write two keys' bytes into one place.

Every read that takes several destinations (``L3Store.batch_get_into``'s buffers, the
Mooncake-compatible ``batch_get_into`` and ``batch_get_into_multi_buffers``) refuses
destinations that overlap: ``L3Store`` with a ``ValueError`` before anything is read, the
Mooncake calls with -600 for exactly the keys whose destination overlaps another's, as
docs/bindings.md promises. Before, only adjacent destinations of ``batch_get_into`` were
compared, and the other calls compared none: a key reported success while its buffer held
another key's bytes. ``get_into_ranges`` is Mooncake's own exception: it copies its ranges in
order (a later range overwrites an earlier one), which the parity test against real Mooncake
(``test_mooncake_real.py``) measures, so kvtier does the same.
"""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier.mooncake_compat import MooncakeDistributedStore

_names = itertools.count()
INVALID = -600
SPAN = 256  # the registered buffer the generated destinations lie in


def mooncake(nbytes=4096):
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 22, 1 << 20, "tcp", "", f"embedded://overlap-{next(_names)}") == 0
    raw = np.zeros(nbytes + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    buf = raw[off : off + nbytes]
    assert s.register_buffer(buf.ctypes.data, nbytes) == 0
    return s, raw, buf


def overlaps_another(spans, i):
    """Whether non-empty span ``i`` (start, length) shares a byte with another non-empty one."""
    a, n = spans[i]
    return n > 0 and any(j != i and m > 0 and a < b + m and b < a + n for j, (b, m) in enumerate(spans))


def test_l3store_refuses_aliased_or_overlapping_buffers_and_reads_nothing():
    s = kvtier.L3Store.embedded(1 << 20)
    s.put("a", b"A" * 8)
    s.put("b", b"B" * 8)
    buf = bytearray(8)
    with pytest.raises(ValueError, match="overlap"):
        s.batch_get_into(["a", "b"], [buf, buf])
    arr = np.zeros(12, np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        s.batch_get_into(["a", "b"], [arr[0:8], arr[4:12]])
    assert not arr.any() and buf == bytearray(8)  # refused before reading anything
    # one buffer holding two small ones that do not touch each other: both still overlap it
    big = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        s.batch_get_into(["a", "b", "a"], [big[0:64], big[0:8], big[40:48]])
    # adjacent, disjoint views of one array are fine
    out = np.zeros(16, np.uint8)
    assert s.batch_get_into(["a", "b"], [out[0:8], out[8:16]]).tolist() == [8, 8]
    assert out.tobytes() == b"A" * 8 + b"B" * 8


def test_mooncake_refuses_a_destination_inside_another_even_when_not_adjacent():
    # sorted by start: big [0, 64), x [8, 16), y [40, 48): y overlaps big, not x
    s, _, buf = mooncake()
    p = buf.ctypes.data
    for k in ("a", "b", "c"):
        assert s.put(k, k.encode() * 8) == 0
    assert s.batch_get_into(["a", "b", "c"], [p, p + 8, p + 40], [8, 8, 8]) == [8, 8, 8]
    assert s.put("big", b"Z" * 64) == 0
    assert s.batch_get_into(["big", "a", "b"], [p + 1000, p + 1008, p + 1040], [64, 8, 8]) == [INVALID] * 3
    assert not buf[1000:1064].any()


def test_mooncake_multi_buffers_refuse_overlapping_destinations_and_ranges_copy_in_order():
    s, _, buf = mooncake()
    p = buf.ctypes.data
    assert s.put("ka", b"A" * 8) == 0 and s.put("kb", b"B" * 8) == 0
    # the bug report's calls: two keys' destinations overlap by 4 bytes
    assert s.batch_get_into_multi_buffers(["ka", "kb"], [[p + 1000], [p + 1004]], [[8], [8]]) == [INVALID, INVALID]
    assert not buf[1000:1012].any()
    # get_into_ranges, as Mooncake: in order, the later range wins where they overlap
    r = s.get_into_ranges([p], [["ka", "kb"]], [[[2000], [2004]]], [[[0], [0]]], [[[8], [8]]])
    assert r == [[[8], [8]]]
    assert buf[2000:2012].tobytes() == b"A" * 4 + b"B" * 8
    # one key's own parts overlapping each other
    assert s.batch_get_into_multi_buffers(["ka"], [[p + 3000, p + 3002]], [[4, 4]]) == [INVALID]
    # disjoint destinations still work, a refused key does not hold back the others
    r = s.batch_get_into_multi_buffers(["ka", "kb", "ka"], [[p, p + 4], [p + 16], [p + 20]], [[4, 4], [8], [8]])
    assert r == [8, INVALID, INVALID]
    assert buf[0:8].tobytes() == b"A" * 8
    r = s.get_into_ranges([p], [["ka", "kb"]], [[[100, 104], [108]]], [[[0, 4], [0]]], [[[4, 4], [8]]])
    assert r == [[[4, 4], [8]]]
    assert buf[100:116].tobytes() == b"A" * 8 + b"B" * 8


spans = st.lists(st.tuples(st.integers(0, SPAN - 1), st.integers(0, 24)), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(spans)
def test_mooncake_batch_get_into_refuses_exactly_the_overlapping_keys(dst):
    """-600 for exactly the keys whose non-empty destination overlaps another's (or a size
    ≤ 0, or one past the registration); every other key gets its bytes."""
    s, _, buf = mooncake(SPAN + 32)
    p = buf.ctypes.data
    keys = [f"k{i}" for i in range(len(dst))]
    for i, (_, n) in enumerate(dst):
        assert s.put(keys[i], bytes([i + 1]) * max(n, 1)) == 0
    got = s.batch_get_into(keys, [p + a for a, _ in dst], [n for _, n in dst])
    for i, (a, n) in enumerate(dst):
        if n <= 0 or overlaps_another(dst, i):
            assert got[i] == INVALID, (i, dst, got)
        else:
            assert got[i] == n and buf[a : a + n].tobytes() == bytes([i + 1]) * n, (i, dst, got)


@settings(max_examples=150, deadline=None)
@given(spans)
def test_l3store_batch_get_into_refuses_iff_two_buffers_overlap(dst):
    s = kvtier.L3Store.embedded(1 << 20)
    arr = np.zeros(SPAN + 32, np.uint8)
    keys = [f"k{i}" for i in range(len(dst))]
    for i, (_, n) in enumerate(dst):
        s.put(keys[i], bytes([i + 1]) * n if n else b"\0")
    views = [arr[a : a + n] for a, n in dst]
    if any(overlaps_another(dst, i) for i in range(len(dst))):
        with pytest.raises(ValueError, match="overlap"):
            s.batch_get_into(keys, views)
        assert not arr.any()
    else:
        got = s.batch_get_into(keys, views).tolist()
        for i, (a, n) in enumerate(dst):
            if n:
                assert got[i] == n and arr[a : a + n].tobytes() == bytes([i + 1]) * n
