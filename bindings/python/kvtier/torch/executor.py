"""The executor: runs a plan's ops on lanes, enforces the ordering contracts, and reports
completions only after the bytes have landed.

Why it tracks pages: the scheduler reuses a page as soon as it sees the completion that frees
it, and it plans ops that depend on each other (a ``BackUp`` of the host pages a
``WriteBack`` fills). With copies on several streams and L3 I/O on worker threads, "issued
before" does not mean "finished before" (vLLM #45704 and #47282 were exactly that: KV
overwritten by a copy still in flight). So every op states the pages it reads and writes,
and the executor makes it wait for

- the last writer of each page it reads (a ``BackUp`` never reads a host page before the
  ``WriteBack`` filling it finished),
- the last writer and every reader in flight of each page it writes (a page the scheduler
  released is not overwritten while an earlier copy still reads it),

and on GPU each copy also waits for the compute stream at the point the op was submitted
(the forward pass that wrote the pages a ``WriteBack`` reads, or reads the pages a
``LoadBack`` overwrites). A terminated prefetch stops between L3 reads and is reported by
its worker, after its last read returned: its in-flight writes landed before the scheduler
can hand its pages to anyone else.

``Ordering.UNCHECKED`` drops every one of these rules (and reports a terminated prefetch at
once). It exists so that the tests that prove each rule can show they fail without it.

Lanes: loads (host to device) and stores (device to host) have a lane each, so both
directions of the bus are used at once; L3 probes have their own lane so they never queue
behind a prefetch; prefetches and backups share ``l3_workers`` lanes. The native L3 calls
release the GIL, so they overlap the engine's Python.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from .. import BackUpDone, L3QueryDone, LoadBackDone, PrefetchDone, WriteBackDone
from ..engine import L3Backend, leading_pages_read
from .errors import ExecutorError, PoolLayoutError
from .lanes import Lane, LaneContext, Signal
from .movers import Direction, Mover, make_mover
from .pages import _l3_keys, _op_id, _op_ids, _Pages, _refuse_failed_fillers, _written_once
from .pools import DevicePool, HostPool, _refuse_overlaps

__all__ = ["Executor", "ExecutorStats", "LoadWait", "Ordering"]

OBJECT_ALREADY_EXISTS = -705
LEASE_EXPIRED = -707


class Ordering(enum.Enum):
    """``ENFORCED``: the contracts of the module docs. ``UNCHECKED``: none (tests only)."""

    ENFORCED = "enforced"
    UNCHECKED = "unchecked"


class LoadWait(enum.Enum):
    """How ``wait_before_forward`` treats this plan's load-backs: ``ALL`` waits for them
    whole; ``PER_LAYER`` leaves them to ``wait_for_layer(l)`` (attention of layer l starts
    while later layers still load)."""

    ALL = "all"
    PER_LAYER = "per_layer"


@dataclass
class ExecutorStats:
    ops: Dict[str, int] = field(default_factory=dict)
    l3_probes: int = 0
    l3_queries: int = 0
    lease_expired_on_read: int = 0
    l3_pages_read: int = 0
    l3_pages_written: int = 0
    device_backups: int = 0
    """BackUps of device pages (demotion with L3), staged through host pages."""
    pages_loaded: int = 0
    pages_stored: int = 0
    failed_ops: int = 0


@dataclass
class _Op:
    id: int
    kind: str
    done: Signal
    layers: List[Signal] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)
    value: int = 0
    """PrefetchDone.completed, L3QueryDone.hit_pages, or 1/0 success of a BackUp."""
    forced: bool = False


class Executor:
    """Runs ``PlannedOp``s between ``device`` and ``host`` pools and an L3 ``backend``.

    ``mover``: a :class:`Mover` or its name (``torch``, ``dma``, ``kernel``).
    ``prefetch_chunk_pages``: pages per L3 read of a prefetch (a termination takes effect
    between reads)."""

    def __init__(
        self,
        device: DevicePool,
        host: HostPool,
        backend: Optional[L3Backend] = None,
        *,
        mover: "Mover | str" = "torch",
        ordering: Ordering = Ordering.ENFORCED,
        l3_workers: int = 2,
        prefetch_chunk_pages: int = 16,
    ) -> None:
        if not isinstance(device, DevicePool):  # a swapped pair raised AttributeError below
            raise PoolLayoutError(f"device must be a DevicePool, got {type(device).__name__}")
        if not isinstance(host, HostPool):
            raise PoolLayoutError(f"host must be a HostPool, got {type(host).__name__}")
        if device.layout != host.layout:
            raise PoolLayoutError("device and host pools have different layouts")
        # On CPU both pools are host memory: a host pool over the device pool's tensors (or
        # part of them) turned every copy into one that also overwrote pages no op named.
        _refuse_overlaps([(f"device layer {l} component {c}", t) for l, comps in enumerate(device.tensors)
                          for c, t in enumerate(comps)] + [("the host pool", host.data)])
        for n in (l3_workers, prefetch_chunk_pages):
            if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n <= 0:
                raise ValueError(f"l3_workers and prefetch_chunk_pages must be positive integers, got {n!r}")
        self.device = device
        self.host = host
        self.mover = make_mover(mover) if isinstance(mover, str) else mover
        self.mover.check_pools(device, host)
        self.backend = backend
        self._host_bytes = None
        self._attached: List[np.ndarray] = []
        # One staging host pool per L3 lane (a lane runs one op at a time): a BackUp of device
        # pages copies them there, then stores them from there.
        staging: List[Tuple[HostPool, np.ndarray]] = []
        if backend is not None:
            self._host_bytes = host.byte_pages()  # raises PoolLayoutError unless page-first
            for _ in range(l3_workers):
                st = HostPool.allocate(host.layout, prefetch_chunk_pages)
                staging.append((st, st.byte_pages()))
            self._attached = [self._host_bytes, *(b for _, b in staging)]
            backend.attach_pools(self._attached)
        self.l3_lanes = [Lane(f"l3-{i}", torch.device("cpu")) for i in range(l3_workers)]
        self._staging: Dict[Lane, Tuple[HostPool, np.ndarray]] = dict(zip(self.l3_lanes, staging))
        self.ordering = ordering
        self.prefetch_chunk_pages = prefetch_chunk_pages
        self.cuda = device.device.type == "cuda"
        self.load_lane = Lane("load", device.device, gpu_deps_on_stream=self.mover.gpu_ordered)
        self.store_lane = Lane("store", device.device, gpu_deps_on_stream=self.mover.gpu_ordered)
        cpu = torch.device("cpu")
        self.probe_lane = Lane("l3-probe", cpu)
        self._l3_rr = itertools.cycle(range(l3_workers))
        self._pages = {"device": _Pages(), "host": _Pages()}
        self._ops: Dict[int, _Op] = {}
        self._last_batch_max = -1
        self._layer_waits: List[List[Signal]] = [[] for _ in range(device.layout.num_layers)]
        self._lock = threading.Lock()
        self.stats = ExecutorStats()
        self._closed = False

    # ---- submitting ---------------------------------------------------------------------

    def submit(self, ops: Sequence[Any]) -> None:
        """Starts ops (``PlannedOp`` or anything with its fields), in order. The whole batch is
        checked first: on ``ExecutorError`` nothing was started."""
        if self._closed:
            raise ExecutorError("executor is closed")
        ops = list(ops)
        seen: Set[int] = set()
        for op in ops:
            op_id = _op_id(op)
            if op_id in self._ops or op_id in seen:
                raise ExecutorError(f"op {op_id} is already in flight")
            if op_id <= self._last_batch_max:
                # The scheduler numbers ops from one counter and a plan's ops all come after
                # the last plan's: an older id is a plan applied twice (re-run, a LoadBack
                # overwrote a device page the scheduler had given to another request).
                raise ExecutorError(f"op {op_id} was already submitted (ids of earlier batches reach "
                                    f"{self._last_batch_max}): a plan applied twice?")
            seen.add(op_id)
            self._check(op)
        if seen:
            self._last_batch_max = max(self._last_batch_max, max(seen))
        compute: Optional[Signal] = None
        for op in ops:
            kind = op.kind
            if kind in ("LoadBack", "WriteBack"):
                if compute is None and self.cuda and self.ordering == Ordering.ENFORCED:
                    compute = self._compute_mark()
                self._copy(op, Direction.LOAD if kind == "LoadBack" else Direction.STORE, compute)
            elif kind == "Prefetch":
                self._prefetch(op)
            elif kind == "BackUp" and op.src_tier == "device":
                if compute is None and self.cuda and self.ordering == Ordering.ENFORCED:
                    compute = self._compute_mark()
                self._backup_device(op, compute)
            elif kind == "BackUp":
                self._backup(op)
            else:
                self._probe(op)
            self.stats.ops[kind] = self.stats.ops.get(kind, 0) + 1

    def _check(self, op: Any) -> None:
        kind = op.kind
        if kind in ("LoadBack", "WriteBack"):
            src = self._pages_of(op.src_tier, op.src, kind)
            dst = self._pages_of(op.dst_tier, op.dst, kind)
            if src.size != dst.size:
                raise ExecutorError(f"{kind} {op.id}: {src.size} source pages, {dst.size} destination pages")
            want = ("host", "device") if kind == "LoadBack" else ("device", "host")
            if (op.src_tier, op.dst_tier) != want:
                raise ExecutorError(f"{kind} {op.id}: {op.src_tier} -> {op.dst_tier}")
            _written_once(dst, f"{kind} {op.id}")
        elif kind in ("Prefetch", "BackUp"):
            _l3_keys(op)
            tier, pages = (op.dst_tier, op.dst) if kind == "Prefetch" else (op.src_tier, op.src)
            # A BackUp may read device pages (demotion with L3): staged through host pages.
            if tier != "host" and not (kind == "BackUp" and tier == "device"):
                raise ExecutorError(f"{kind} {op.id}: kvtier.torch moves L3 pages from host or device pages, not {tier}")
            arr = self._pages_of(tier, pages, kind)
            if len(op.keys) != arr.size:
                raise ExecutorError(f"{kind} {op.id}: {len(op.keys)} keys for {arr.size} pages")
            if kind == "Prefetch":
                _written_once(arr, f"{kind} {op.id}")
        elif kind == "L3Query":
            _l3_keys(op)
        else:
            raise ExecutorError(f"unknown op kind {kind!r}")

    def _compute_mark(self) -> Signal:
        s = Signal()
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device.device))
        s.resolve(ev)
        return s

    def _pages_of(self, tier: Optional[str], pages: Any, what: str) -> np.ndarray:
        if tier not in ("device", "host"):
            raise ExecutorError(f"{what}: no pool for tier {tier!r}")
        given = np.asarray(pages)
        if given.ndim != 1 or (given.size and given.dtype.kind not in "iu"):
            raise ExecutorError(f"{what}: page ids must be a flat sequence of integers, "
                                f"not shape {given.shape} of {given.dtype}")
        arr = given.astype(np.int64)
        n = self.device.num_pages if tier == "device" else self.host.num_pages
        if arr.size and (arr.min() < 0 or arr.max() >= n):
            raise ExecutorError(f"{what}: page outside the {tier} pool of {n} pages")
        return arr

    def _deps_and_record(self, reads: Tuple[str, np.ndarray], writes: Tuple[str, np.ndarray],
                         sig: Signal, extra: Optional[Signal] = None,
                         copy: bool = False) -> Tuple[List[Signal], List[Signal]]:
        """The signals the op waits for, and the copies that fill the pages it reads (the op
        fails if one of them failed). ``copy``: the op is a copy (its failure taints the pages
        it writes)."""
        deps: List[Signal] = []
        fillers: List[Signal] = []
        if self.ordering == Ordering.UNCHECKED:
            return deps, fillers
        if extra is not None:
            deps.append(extra)
        rt, rp = reads
        wt, wp = writes
        r_list, w_list = rp.tolist(), wp.tolist()
        if rt:
            self._pages[rt].deps(r_list, (), deps)
            fillers = self._pages[rt].fillers(r_list)
        if wt:
            self._pages[wt].deps((), w_list, deps)
        if rt:
            self._pages[rt].record(r_list, (), sig)
        if wt:
            self._pages[wt].record((), w_list, sig, copy)
        return deps, fillers

    def _copy(self, op: Any, direction: Direction, compute: Optional[Signal]) -> None:
        src = self._pages_of(op.src_tier, op.src, op.kind)
        dst = self._pages_of(op.dst_tier, op.dst, op.kind)
        nl = self.device.layout.num_layers
        rec = _Op(_op_id(op), op.kind, Signal())
        if direction == Direction.LOAD:
            rec.layers = [Signal() for _ in range(nl - 1)] + [rec.done]
            host_p, dev_p = src, dst
        else:
            host_p, dev_p = dst, src
        deps, fillers = self._deps_and_record((op.src_tier, src), (op.dst_tier, dst), rec.done, compute, copy=True)
        mover, device, host = self.mover, self.device, self.host
        what = f"{op.kind} {rec.id}"

        def task(ctx: LaneContext) -> None:
            _refuse_failed_fillers(what, fillers)
            if direction == Direction.LOAD:  # layer by layer, so attention of layer l can start early
                mover.copy_layers(direction, device, host, dev_p, host_p, range(nl),
                                  lambda l: ctx.mark(rec.layers[l]))
            else:
                mover.copy(direction, device, host, dev_p, host_p, range(nl))
                ctx.mark(rec.done)

        self._ops[rec.id] = rec
        lane = self.load_lane if direction == Direction.LOAD else self.store_lane
        lane.submit(deps, task, rec.layers if direction == Direction.LOAD else [rec.done])
        if direction == Direction.LOAD:
            self.stats.pages_loaded += int(src.size)
        else:
            self.stats.pages_stored += int(src.size)

    def _l3_op(self, op: Any, reads: Tuple[str, np.ndarray], writes: Tuple[str, np.ndarray], fn, lane: Lane) -> None:
        rec = _Op(_op_id(op), op.kind, Signal())
        deps, fillers = self._deps_and_record(reads, writes, rec.done)
        self._ops[rec.id] = rec
        what = f"{op.kind} {rec.id}"

        def task(ctx: LaneContext) -> None:
            _refuse_failed_fillers(what, fillers)
            fn(rec)
            ctx.mark(rec.done)

        lane.submit(deps, task, [rec.done])

    def _probe(self, op: Any) -> None:
        keys = list(op.keys)
        backend = self.backend

        def run(rec: _Op) -> None:
            rec.value = backend.probe(keys) if backend is not None and keys else 0
            with self._lock:
                self.stats.l3_probes += 1

        none = ("", np.zeros(0, dtype=np.int64))
        self._l3_op(op, none, none, run, self.probe_lane)

    def _backup(self, op: Any) -> None:
        keys = list(op.keys)
        src = self._pages_of(op.src_tier, op.src, "BackUp")
        backend, pool = self.backend, self._host_bytes

        def run(rec: _Op) -> None:
            if backend is None:
                rec.value = 0
                return
            assert pool is not None  # made with the backend
            codes = np.asarray(backend.put(keys, pool, src))
            rec.value = int(bool(((codes == 0) | (codes == OBJECT_ALREADY_EXISTS)).all()))
            with self._lock:
                self.stats.l3_pages_written += int((codes == 0).sum())

        self._l3_op(op, ("host", src), ("", np.zeros(0, dtype=np.int64)), run, self.l3_lanes[next(self._l3_rr)])

    def _backup_device(self, op: Any, compute: Optional[Signal]) -> None:
        """A BackUp of device pages (the scheduler's demotion with L3): chunk by chunk, the
        mover copies them into the lane's staging host pages, then the store reads those."""
        keys = list(op.keys)
        src = self._pages_of(op.src_tier, op.src, "BackUp")
        backend, lane = self.backend, self.l3_lanes[next(self._l3_rr)]
        mover, device, nl = self.mover, self.device, self.device.layout.num_layers
        rec = _Op(_op_id(op), op.kind, Signal())
        deps, fillers = self._deps_and_record(("device", src), ("", np.zeros(0, dtype=np.int64)), rec.done, compute)
        self._ops[rec.id] = rec
        self.stats.device_backups += 1
        what = f"BackUp {rec.id}"

        def task(ctx: LaneContext) -> None:
            _refuse_failed_fillers(what, fillers)
            if backend is None:
                ctx.mark(rec.done)
                return
            staging, staging_bytes = self._staging[lane]
            ok, written = True, 0
            for lo in range(0, src.size, staging.num_pages):
                chunk = src[lo : lo + staging.num_pages]
                slots = np.arange(chunk.size, dtype=np.int64)
                mover.copy(Direction.STORE, device, staging, chunk, slots, range(nl))
                if self.cuda:
                    torch.cuda.synchronize(device.device)  # the store reads the staged bytes next
                codes = np.asarray(backend.put(keys[lo : lo + chunk.size], staging_bytes, slots))
                ok = ok and bool(((codes == 0) | (codes == OBJECT_ALREADY_EXISTS)).all())
                written += int((codes == 0).sum())
            rec.value = int(ok)
            with self._lock:
                self.stats.l3_pages_written += written
            ctx.mark(rec.done)

        lane.submit(deps, task, [rec.done])

    def _prefetch(self, op: Any) -> None:
        keys = list(op.keys)
        dst = self._pages_of(op.dst_tier, op.dst, "Prefetch")
        backend, pool, chunk = self.backend, self._host_bytes, self.prefetch_chunk_pages

        def run(rec: _Op) -> None:
            if backend is None or not keys:
                return
            assert pool is not None  # made with the backend
            page_bytes = pool.shape[1] * pool.itemsize
            done, requeried = 0, False
            q, q_base = backend.query(keys), 0
            queries = 1
            hit = q.hit
            try:
                while done < min(len(keys), q_base + hit) and not rec.cancel.is_set():
                    n = min(chunk, q_base + hit - done)
                    codes = np.asarray(backend.get_with_query(q, done - q_base, pool, dst[done : done + n]))
                    ok = leading_pages_read(codes, page_bytes)
                    done += ok
                    rec.value = done
                    if ok == n:
                        continue
                    if int(codes[ok]) != LEASE_EXPIRED or requeried:
                        break
                    # The store refused an expired lease: query again once, never read blindly.
                    with self._lock:
                        self.stats.lease_expired_on_read += int((codes == LEASE_EXPIRED).sum())
                    requeried = True
                    q, q_base = backend.query(keys[done:]), done
                    queries += 1
                    hit = q.hit
            finally:
                with self._lock:
                    self.stats.l3_queries += queries
                    self.stats.l3_pages_read += done

        self._l3_op(op, ("", np.zeros(0, dtype=np.int64)), ("host", dst), run, self.l3_lanes[next(self._l3_rr)])

    # ---- terminating, waiting, reporting -------------------------------------------------

    def terminate(self, op_ids: Iterable[int]) -> None:
        """Stops prefetches: no read starts after this; each is reported by ``poll`` once the
        read in flight returned (``UNCHECKED``: at once, the bug the contract forbids)."""
        for i in _op_ids(op_ids):
            rec = self._ops.get(i)
            if rec is None or rec.kind != "Prefetch":
                continue
            rec.cancel.set()
            if self.ordering == Ordering.UNCHECKED:
                rec.forced = True

    def _wait(self, sig: Signal) -> None:
        if self.cuda:
            sig.wait_on_stream(torch.cuda.current_stream(self.device.device))
        else:
            sig.wait()

    def wait_before_forward(self, plan: Any, loads: LoadWait = LoadWait.ALL) -> None:
        """Makes the forward of ``plan`` wait for what it needs: the plan's ``before_forward``
        ops and the ops its chunks wait for, and every copy in flight that still touches a
        device page the forward will write (its table deltas). On GPU the current stream
        waits (the host does not block on copies); on CPU the caller blocks."""
        for lst in self._layer_waits:
            lst.clear()
        need: Set[int] = {op.id for op in plan.ops if op.before_forward}
        for c in plan.prefill:
            need.update(int(x) for x in c.waits_for)
        layerwise: Set[int] = set()
        for i in need:
            rec = self._ops.get(i)
            if rec is None:
                continue
            if loads == LoadWait.PER_LAYER and rec.kind == "LoadBack":
                layerwise.add(id(rec.done))
                for l, s in enumerate(rec.layers):
                    self._layer_waits[l].append(s)
            else:
                self._wait(rec.done)
        if self.ordering == Ordering.UNCHECKED:
            return
        written: List[int] = []
        for c in plan.prefill:
            written.extend(int(p) for p in c.table_pages)
        written.extend(int(p) for p in plan.decode_table_pages)
        for p in written:  # the forward fills these pages: a failed load of them no longer counts
            self._pages["device"].filled_by.pop(p, None)
        deps: List[Signal] = []
        self._pages["device"].deps((), written, deps)
        for s in deps:
            if id(s) not in layerwise:
                self._wait(s)

    def wait_for_layer(self, layer: int) -> None:
        """Waits (stream or host) for layer ``layer`` of the loads left to ``PER_LAYER``."""
        for s in self._layer_waits[layer]:
            self._wait(s)

    def _event(self, rec: _Op) -> Any:
        err = rec.done.error
        if err is not None:
            self.stats.failed_ops += 1
        k = rec.kind
        if k == "LoadBack":
            return LoadBackDone(rec.id, err is None)
        if k == "WriteBack":
            return WriteBackDone(rec.id, err is None)
        if k == "BackUp":
            return BackUpDone(rec.id, err is None and rec.value == 1)
        if k == "Prefetch":
            return PrefetchDone(rec.id, rec.value)
        return L3QueryDone(rec.id, rec.value if err is None else 0)

    def poll(self, require: Iterable[int] = ()) -> List[Any]:
        """Completion events of the ops that finished (their copies landed), each once. Ops in
        ``require`` are waited for first (the ops a forward waited on, before its
        ``forward_done``)."""
        for i in _op_ids(require):
            rec = self._ops.get(i)
            if rec is not None and not rec.forced:
                rec.done.wait()
        out = []
        for i in sorted(self._ops):
            rec = self._ops[i]
            if rec.forced or rec.done.done():
                out.append(self._event(rec))
                del self._ops[i]
        return out

    def in_flight(self) -> int:
        return len(self._ops)

    def wait_any(self, timeout: float) -> None:
        """Blocks until an op in flight finished or ``timeout`` seconds passed."""
        recs = list(self._ops.values())
        if not recs:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(r.done.done() or r.forced for r in recs):
                return
            time.sleep(0.0005)

    def drain(self) -> List[Any]:
        """Waits for every op in flight and returns their completions."""
        return self.poll(require=list(self._ops))

    def close(self) -> None:
        """Finishes the work in flight and stops the lanes (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for lane in [self.load_lane, self.store_lane, self.probe_lane, *self.l3_lanes]:
            lane.close()
        # The pools' memory is freed after this: a backend that registered it (Mooncake's
        # register_buffer) kept registrations of freed memory, and a later engine whose pools
        # landed there could not register them (-600, overlap).
        if self.backend is not None and self._attached:
            self.backend.detach_pools(self._attached)
            self._attached = []

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
