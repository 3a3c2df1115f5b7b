"""What the executor checks and tracks per op: op ids, page lists and L3 keys as the
scheduler gives them, and per page of a tier its last writer, its readers in flight and the
copy that last filled it (the ordering rules and failure propagation of
:mod:`kvtier.torch.executor`)."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Sequence

import numpy as np

from .errors import ExecutorError
from .lanes import Signal


def _op_id(op: Any) -> int:
    """The op's id, which must be the scheduler's: an unsigned 64-bit integer (an id of
    another type was accepted and made every later poll raise, losing completions)."""
    return _checked_id(op.id)


def _checked_id(i: Any) -> int:
    if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
        raise ExecutorError(f"op id {i!r}: not an integer")
    if not 0 <= int(i) < 1 << 64:
        raise ExecutorError(f"op id {i}: not an unsigned 64-bit integer")
    return int(i)


def _op_ids(ids: Any) -> List[int]:
    """Op ids given to ``terminate`` or ``poll(require=)``, every one checked before any is
    acted on (``int(i)`` took a float for another op's id, and a string of digits as one id
    per character)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ExecutorError(f"op ids must be a sequence of integers, not {ids!r}")
    return [_checked_id(i) for i in ids]


def _l3_keys(op: Any) -> None:
    """Refuses keys that are not a sequence of strings: a string was split into characters
    (a BackUp stored its pages under 'a', 'b', ...), other keys failed in the L3 worker."""
    keys = op.keys
    if isinstance(keys, (str, bytes)) or not isinstance(keys, (list, tuple, np.ndarray)) \
            or not all(isinstance(k, str) for k in keys):
        raise ExecutorError(f"{op.kind} {op.id}: keys must be a list of strings, got {keys!r:.80}")


def _written_once(dst: np.ndarray, what: str) -> None:
    """Refuses a copy that writes one page twice (which source lands would be undefined)."""
    if np.unique(dst).size != dst.size:
        raise ExecutorError(f"{what}: a destination page appears twice")


class _Pages:
    """Last writer and readers in flight of each page of one tier, and which pages' last
    writer was a copy (``filled_by``): a reader of such a page fails when that copy failed."""

    def __init__(self) -> None:
        self.writer: Dict[int, Signal] = {}
        self.readers: Dict[int, List[Signal]] = {}
        self.filled_by: Dict[int, Signal] = {}

    def fillers(self, reads: Iterable[int]) -> List[Signal]:
        """The copies that last wrote ``reads`` (finished or not), each once."""
        out: Dict[int, Signal] = {}
        for p in reads:
            s = self.filled_by.get(p)
            if s is not None:
                out[id(s)] = s
        return list(out.values())

    def deps(self, reads: Iterable[int], writes: Iterable[int], out: List[Signal]) -> None:
        for p in reads:
            w = self.writer.get(p)
            if w is not None and not w.done():
                out.append(w)
        for p in writes:
            w = self.writer.get(p)
            if w is not None and not w.done():
                out.append(w)
            out.extend(r for r in self.readers.get(p, ()) if not r.done())

    def record(self, reads: Iterable[int], writes: Iterable[int], sig: Signal, copy: bool = False) -> None:
        for p in reads:
            lst = [r for r in self.readers.get(p, ()) if not r.done()]
            lst.append(sig)
            self.readers[p] = lst
        for p in writes:
            self.writer[p] = sig
            self.readers.pop(p, None)
            if copy:
                self.filled_by[p] = sig
            else:
                self.filled_by.pop(p, None)


def _refuse_failed_fillers(what: str, fillers: Sequence[Signal]) -> None:
    """Raises (failing the op) when a copy that was to fill a page the op reads failed: its
    bytes are whatever the page held before (a WriteBack's host page backed up to L3 under
    the new page's key, a LoadBack's device page stored or loaded on)."""
    for s in fillers:
        if s.error is not None:
            raise ExecutorError(f"{what}: a page it reads was never filled (its copy failed: {s.error})")
