"""A reference executor: runs kvtier's execution plans against numpy KV pools and an L3 store.

This is the Python twin of the Rust test engine (scheduler/tests/common/mod.rs): numpy arrays
stand in for the GPU (device) and pinned-DRAM (host) KV pools, an L3 backend stands in for
the distributed store, and every forward checks that each page it reads holds the KV its
position requires.

Content model (the integrity oracle): a full page's KV is a pure function of its chained page
hash (``kvtier.page_hashes``): the 32-byte hash repeated over the page. Copies move bytes; a
forward writes each page it completes; a backup checks that what it stores matches its key
(the key carries the hash); a prefetch checks what it read the same way. A misaligned
prefetch offset, a page reused before its copy finished, or stale L3 data all show up as a
mismatch (``IntegrityError``).

L3 metadata reuse: an ``L3Query`` op is answered with one batched query; its results
(replica metadata with lease deadlines) are kept for the request and reused by the
``Prefetch`` planned after it while the leases hold, so that read pays no second metadata lookup. Results whose
lease expired are queried again, never read blindly (kvtier's store also refuses an expired
lease with -707, which triggers a re-query).

Backends:
- ``KvtierL3Backend(kvtier.L3Store)``: batched query + get-with-query-results (no second
  lookup);
- ``MooncakeL3Backend(store)``: any object with Mooncake's ``MooncakeDistributedStore``
  methods — the real ``mooncake.store.MooncakeDistributedStore`` or
  ``kvtier.mooncake_compat.MooncakeDistributedStore``. Mooncake's Python API has no
  get-with-query-results call, so with it the prefetch read reuses the query's existence and
  sizes (it skips keys known missing) but Mooncake's client looks the replicas up again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import (
    BackUpDone,
    ExecutionPlan,
    L3QueryDone,
    L3Store,
    LoadBackDone,
    PlannedOp,
    PrefetchDone,
    Scheduler,
    SchedulerConfig,
    WriteBackDone,
    page_hashes,
    parse_l3_key,
)

__all__ = [
    "Engine",
    "EngineStats",
    "IntegrityError",
    "KvtierL3Backend",
    "L3Backend",
    "MooncakeL3Backend",
    "key_hash",
    "page_content",
]

OBJECT_ALREADY_EXISTS = -705
LEASE_EXPIRED = -707


class IntegrityError(AssertionError):
    """A page held the wrong KV (the oracle caught a misplaced or stale copy)."""


def key_hash(key: str) -> bytes:
    """The 32-byte page hash an L3 key (``"{namespace}:{hex}:{rank}"``) names."""
    parsed = parse_l3_key(key)
    if parsed is None:
        raise IntegrityError(f"not a kvtier L3 key: {key!r}")
    return parsed[1]


def page_content(h: bytes, page_bytes: int) -> np.ndarray:
    """The KV bytes of the page whose hash is ``h``: the hash repeated over the page."""
    return np.resize(np.frombuffer(h, dtype=np.uint8), page_bytes)


def _now_ms() -> float:
    return time.monotonic() * 1000.0


# ---- L3 backends ------------------------------------------------------------------------


@dataclass
class QueryRecord:
    """One batched query's results, as a backend keeps them."""

    keys: List[str]
    hit: int
    handle: Any
    local_deadline_ms: float
    """Lease deadline estimated on this process's clock (remote stores)."""


class L3Backend:
    """What the executor needs from an L3 store (page-granular, on numpy pools)."""

    name = "l3"

    def attach_pools(self, pools: Sequence[np.ndarray]) -> None:
        """Called once with the KV pools reads and writes will target."""

    def query(self, keys: List[str]) -> QueryRecord:
        raise NotImplementedError

    def lease_valid(self, q: QueryRecord, offset: int, n: int, margin_ms: float) -> bool:
        raise NotImplementedError

    def get_with_query(
        self, q: QueryRecord, offset: int, pool: np.ndarray, page_ids: np.ndarray
    ) -> np.ndarray:
        """Reads keys ``offset .. offset + len(page_ids)`` of ``q`` into pool pages; per key
        the size or a negative code (-707 when the lease expired)."""
        raise NotImplementedError

    def put(self, keys: List[str], pool: np.ndarray, page_ids: np.ndarray) -> np.ndarray:
        """Stores pool pages under keys; per key 0 or a negative code."""
        raise NotImplementedError


class KvtierL3Backend(L3Backend):
    """kvtier's own store (embedded or remote): one batched query, then reads that reuse the
    query results (no second metadata lookup while the leases hold)."""

    name = "kvtier"

    def __init__(self, store: L3Store, lease_ttl_ms: float = 10_000.0) -> None:
        self.store = store
        self.lease_ttl_ms = lease_ttl_ms

    def query(self, keys: List[str]) -> QueryRecord:
        t0 = _now_ms()
        r = self.store.batch_query(keys)
        return QueryRecord(keys, r.hit_prefix(), r, t0 + self.lease_ttl_ms)

    def lease_valid(self, q: QueryRecord, offset: int, n: int, margin_ms: float) -> bool:
        d = q.handle.min_deadline(n, offset)
        if d is None:
            return False
        now = self.store.now_ms()
        if now is None:  # remote: deadlines are on the server's clock; use the local estimate
            return q.local_deadline_ms - margin_ms > _now_ms()
        return d > now + margin_ms

    def get_with_query(self, q, offset, pool, page_ids):
        return self.store.batch_get_pages_with_query(
            q.handle, pool, page_ids, pool.shape[1] * pool.itemsize, offset
        )

    def put(self, keys, pool, page_ids):
        return self.store.batch_put_pages(keys, pool, page_ids, pool.shape[1] * pool.itemsize)


class MooncakeL3Backend(L3Backend):
    """Any store with Mooncake's Python API (real Mooncake or kvtier's compat class).

    ``lease_ttl_ms``: the master's ``default_kv_lease_ttl`` (Mooncake's default 5 s); query
    results are reused for reads only within it."""

    name = "mooncake"

    def __init__(self, store: Any, lease_ttl_ms: float = 5_000.0) -> None:
        self.store = store
        self.lease_ttl_ms = lease_ttl_ms
        self._registered: List[int] = []

    def attach_pools(self, pools: Sequence[np.ndarray]) -> None:
        for p in pools:
            if p.size == 0:
                continue
            rc = self.store.register_buffer(p.ctypes.data, p.nbytes)
            if rc != 0:
                raise RuntimeError(f"register_buffer failed: {rc}")
            self._registered.append(p.ctypes.data)

    def detach(self) -> None:
        for ptr in self._registered:
            self.store.unregister_buffer(ptr)
        self._registered.clear()

    def query(self, keys: List[str]) -> QueryRecord:
        t0 = _now_ms()
        if hasattr(self.store, "batch_get_replica_desc"):
            desc = self.store.batch_get_replica_desc(keys)
            found = [bool(desc.get(k)) for k in keys]
        else:
            found = [r == 1 for r in self.store.batch_is_exist(keys)]
        hit = 0
        while hit < len(found) and found[hit]:
            hit += 1
        return QueryRecord(keys, hit, found, t0 + self.lease_ttl_ms)

    def lease_valid(self, q: QueryRecord, offset: int, n: int, margin_ms: float) -> bool:
        return offset + n <= q.hit and q.local_deadline_ms - margin_ms > _now_ms()

    def get_with_query(self, q, offset, pool, page_ids):
        keys = q.keys[offset : offset + len(page_ids)]
        return self._get(keys, pool, page_ids)

    def _get(self, keys, pool, page_ids):
        pb = pool.shape[1] * pool.itemsize
        base = pool.ctypes.data
        ptrs = [base + int(p) * pb for p in page_ids]
        return np.asarray(self.store.batch_get_into(list(keys), ptrs, [pb] * len(keys)), dtype=np.int64)

    def put(self, keys, pool, page_ids):
        pb = pool.shape[1] * pool.itemsize
        base = pool.ctypes.data
        ptrs = [base + int(p) * pb for p in page_ids]
        return np.asarray(self.store.batch_put_from(list(keys), ptrs, [pb] * len(keys)), dtype=np.int64)


# ---- the executor -------------------------------------------------------------------------


@dataclass
class EngineStats:
    steps: int = 0
    forwards: int = 0
    pages_checked: int = 0
    l3_queries: int = 0
    """Batched metadata queries sent (one per L3Query op, plus re-queries)."""
    prefetch_reused_query: int = 0
    """Prefetches served from an L3Query's results (no second lookup)."""
    prefetch_requeried: int = 0
    """Prefetches whose results had expired (or were missing) and were queried again."""
    lease_expired_on_read: int = 0
    """Keys the store refused with -707 (lease expired) and that were re-queried."""
    l3_pages_read: int = 0
    l3_pages_written: int = 0
    ops: Dict[str, int] = field(default_factory=dict)


def _leading_ok(codes: np.ndarray) -> int:
    bad = np.flatnonzero(codes < 0)
    return int(bad[0]) if bad.size else int(codes.size)


class Engine:
    """Runs plans of ``scheduler`` against numpy pools and ``backend``, feeding completions
    back. ``page_bytes``: bytes per KV page in the pools. ``check``: verify every page each
    forward reads (the integrity oracle)."""

    def __init__(
        self,
        scheduler: Scheduler,
        backend: Optional[L3Backend] = None,
        *,
        page_bytes: int = 64,
        check: bool = True,
        lease_margin_ms: float = 20.0,
    ) -> None:
        if page_bytes < 32:
            raise ValueError("page_bytes must be at least 32 (a page hash)")
        cfg = scheduler.config()
        self.s = scheduler
        self.page_size: int = cfg["page_size"]
        self.page_bytes = page_bytes
        self.device = np.zeros((cfg["device_pages"], page_bytes), dtype=np.uint8)
        self.host = np.zeros((cfg["host_pages"] if cfg["host_enabled"] else 0, page_bytes), dtype=np.uint8)
        self.backend = backend
        if backend is not None:
            backend.attach_pools([self.device, self.host])
        self.check = check
        self.lease_margin_ms = lease_margin_ms
        self.tables: Dict[int, List[int]] = {}
        self.tokens: Dict[int, List[int]] = {}
        self._hashes: Dict[int, np.ndarray] = {}
        self._scopes: Dict[int, Dict[str, Any]] = {}
        self.ended: List[Tuple[int, str]] = []
        self.outputs: Dict[int, List[int]] = {}
        self.stop_after: Dict[int, int] = {}
        # request -> its latest L3Query's results, for the Prefetch planned after it.
        self._queries: Dict[Optional[int], QueryRecord] = {}
        self.stats = EngineStats()

    # ---- requests -------------------------------------------------------------------------

    def submit(
        self,
        req: int,
        prompt: Sequence[int],
        max_new_tokens: int,
        now_ms: Optional[int] = None,
        **scope: Any,
    ) -> None:
        """Submits a request; ``scope``: ``cache_salt``, ``adapter``, ``extra_keys`` as
        ``Scheduler.submit`` takes them (the oracle hashes the request's pages in its scope)."""
        toks = [int(t) for t in prompt]
        self.s.submit(req, np.asarray(toks, dtype=np.uint32), max_new_tokens, now_ms, **scope)
        self.tokens[req] = toks
        self._scopes[req] = scope
        self.outputs[req] = []

    @staticmethod
    def token_for(req: int, pos: int) -> int:
        """The token the model 'generates' for ``req`` at ``pos`` (deterministic)."""
        return ((((req * 7919) & 0xFFFFFFFF) ^ ((pos * 104_729) & 0xFFFFFFFF)) % 1000) + 5000

    # ---- pages ------------------------------------------------------------------------------

    def _pool(self, tier: Optional[str]) -> np.ndarray:
        if tier == "device":
            return self.device
        if tier == "host":
            return self.host
        raise ValueError(f"no pool for tier {tier!r}")

    def _expected(self, req: int, pages: int) -> np.ndarray:
        h = self._hashes.get(req)
        if h is None or h.shape[0] < pages:
            toks = np.asarray(self.tokens[req], dtype=np.uint32)
            h = page_hashes(toks, self.page_size, **self._scopes.get(req, {}))
            self._hashes[req] = h
        return h[:pages]

    def _check_pages(self, req: int, upto_tokens: int) -> None:
        n = upto_tokens // self.page_size
        if n == 0 or not self.check:
            return
        table = self.tables.get(req, [])
        if len(table) < n:
            raise IntegrityError(f"request {req}: page table has {len(table)} pages, needs {n}")
        exp = self._expected(req, n)
        got = self.device[np.asarray(table[:n], dtype=np.int64), :32]
        if not np.array_equal(got, exp):
            bad = int(np.flatnonzero((got != exp).any(axis=1))[0])
            raise IntegrityError(
                f"request {req} reads wrong KV at page {bad} (device page {table[bad]})"
            )
        self.stats.pages_checked += n

    def _write_pages(self, req: int, from_tok: int, to_tok: int) -> None:
        ps = self.page_size
        first, last = from_tok // ps, to_tok // ps
        if last <= first:
            return
        exp = self._expected(req, last)
        table = self.tables[req]
        for i in range(first, last):
            self.device[table[i]] = page_content(exp[i].tobytes(), self.page_bytes)

    def _apply_delta(self, req: int, start: Optional[int], pages: np.ndarray) -> None:
        t = self.tables.setdefault(req, [])
        if start is not None:
            del t[start:]
            t.extend(int(p) for p in pages)

    def _verify_keys(self, what: str, keys: Sequence[str], pool: np.ndarray, ids: np.ndarray, n: int) -> None:
        if not self.check:
            return
        for i in range(n):
            if pool[int(ids[i]), :32].tobytes() != key_hash(keys[i]):
                raise IntegrityError(f"{what}: page {int(ids[i])} does not hold the KV of {keys[i]}")

    # ---- ops --------------------------------------------------------------------------------

    def _l3_query(self, op: PlannedOp):
        keys = op.keys
        if self.backend is None:
            return L3QueryDone(op.id, 0)
        q = self.backend.query(keys)
        self.stats.l3_queries += 1
        self._queries[op.req] = q
        return L3QueryDone(op.id, q.hit)

    def _cached_query(self, req: Optional[int], keys: List[str]) -> Optional[Tuple[QueryRecord, int]]:
        """The request's query record covering ``keys`` at consecutive indices (the prefetch
        may start later than the query did, when the local match grew meanwhile), if its
        leases still hold."""
        q = self._queries.pop(req, None)
        if q is None or not keys:
            return None
        try:
            off = q.keys.index(keys[0], 0, q.hit)
        except ValueError:
            return None
        if off + len(keys) > q.hit or q.keys[off : off + len(keys)] != keys:
            return None
        if not self.backend.lease_valid(q, off, len(keys), self.lease_margin_ms):
            return None
        return q, off

    def _prefetch(self, op: PlannedOp):
        keys = op.keys
        pool = self._pool(op.dst_tier)
        ids = np.asarray(op.dst)
        if self.backend is None or not keys:
            return PrefetchDone(op.id, 0)
        cached = self._cached_query(op.req, keys)
        if cached is not None:
            self.stats.prefetch_reused_query += 1
            q, off = cached
        else:
            self.stats.prefetch_requeried += 1
            q, off = self.backend.query(keys), 0
            self.stats.l3_queries += 1
        n_try = min(len(keys), q.hit - off)
        done = 0
        if n_try > 0:
            codes = self.backend.get_with_query(q, off, pool, ids[:n_try])
            done = _leading_ok(codes)
            if done < n_try and int(codes[done]) == LEASE_EXPIRED:
                # Never read blindly: query the rest again and read with fresh results.
                self.stats.lease_expired_on_read += int((codes == LEASE_EXPIRED).sum())
                rest = keys[done:]
                q2 = self.backend.query(rest)
                self.stats.l3_queries += 1
                m = min(len(rest), q2.hit)
                if m > 0:
                    codes2 = self.backend.get_with_query(q2, 0, pool, ids[done : done + m])
                    done += _leading_ok(codes2)
        self._verify_keys("prefetch", keys, pool, ids, done)
        self.stats.l3_pages_read += done
        return PrefetchDone(op.id, done)

    def _copy(self, op: PlannedOp, ev):
        src = self._pool(op.src_tier)
        dst = self._pool(op.dst_tier)
        s_ids = np.asarray(op.src, dtype=np.int64)
        d_ids = np.asarray(op.dst, dtype=np.int64)
        dst[d_ids] = src[s_ids]
        return ev(op.id, True)

    def _backup(self, op: PlannedOp):
        keys = op.keys
        pool = self._pool(op.src_tier)
        ids = np.asarray(op.src)
        self._verify_keys("backup", keys, pool, ids, len(keys))
        if self.backend is None:
            return BackUpDone(op.id, False)
        codes = self.backend.put(keys, pool, ids)
        ok = bool(((codes == 0) | (codes == OBJECT_ALREADY_EXISTS)).all())
        self.stats.l3_pages_written += int((codes == 0).sum())
        return BackUpDone(op.id, ok)

    def run_op(self, op: PlannedOp) -> None:
        """Executes one op and reports its completion."""
        kind = op.kind
        if kind == "L3Query":
            ev = self._l3_query(op)
        elif kind == "Prefetch":
            ev = self._prefetch(op)
        elif kind == "LoadBack":
            ev = self._copy(op, LoadBackDone)
        elif kind == "WriteBack":
            ev = self._copy(op, WriteBackDone)
        elif kind == "BackUp":
            ev = self._backup(op)
        else:  # pragma: no cover - the scheduler knows no other kind
            raise ValueError(f"unknown op kind {kind}")
        self.stats.ops[kind] = self.stats.ops.get(kind, 0) + 1
        self.s.on_event(ev)

    # ---- forward ----------------------------------------------------------------------------

    def run_forward(self, plan: ExecutionPlan) -> None:
        """Runs the plan's forward (checking every page read) and reports its results."""
        reqs: List[int] = []
        toks: List[int] = []
        stops: List[bool] = []
        for c in plan.prefill:
            self._apply_delta(c.req, c.table_from, c.table_pages)
            start, n = c.start, c.len
            if self.check and self.tokens[c.req][start : start + n] != c.tokens.tolist():
                raise IntegrityError(f"request {c.req}: chunk tokens differ from the prompt")
            self._check_pages(c.req, start)
            self._write_pages(c.req, start, start + n)
            tok, stop = 0, False
            if c.last:
                tok = self.token_for(c.req, start + n)
                self.tokens[c.req].append(tok)
                self.outputs[c.req].append(tok)
                stop = len(self.outputs[c.req]) >= self.stop_after.get(c.req, 1 << 62)
            reqs.append(c.req)
            toks.append(tok)
            stops.append(stop)
        d_reqs = plan.decode_reqs
        if d_reqs.size:
            pos = plan.decode_positions
            frm = plan.decode_table_from
            offs = plan.decode_table_offsets
            pages = plan.decode_table_pages
            for i in range(d_reqs.size):
                r = int(d_reqs[i])
                if frm[i] >= 0:
                    self._apply_delta(r, int(frm[i]), pages[offs[i] : offs[i + 1]])
                p = int(pos[i])
                if self.check and p + 1 != len(self.tokens[r]):
                    raise IntegrityError(f"request {r}: decode position {p}, sequence {len(self.tokens[r])}")
                self._check_pages(r, p)
                self._write_pages(r, p, p + 1)
                tok = self.token_for(r, p + 1)
                self.tokens[r].append(tok)
                self.outputs[r].append(tok)
                reqs.append(r)
                toks.append(tok)
                stops.append(len(self.outputs[r]) >= self.stop_after.get(r, 1 << 62))
        self.stats.forwards += 1
        self.s.forward_done(plan.step, np.asarray(reqs, dtype=np.uint64), np.asarray(toks, dtype=np.uint32), stops)

    # ---- the loop -----------------------------------------------------------------------------

    def step(self, now_ms: int) -> ExecutionPlan:
        """One engine step: plan, ops (every one acknowledged at once), forward."""
        plan = self.s.next_execution_plan(now_ms)
        for r, outcome in plan.ended:
            self.tables.pop(r, None)
            self._queries.pop(r, None)
            self._hashes.pop(r, None)
            self.ended.append((r, outcome))
        for r in plan.retracted:
            self.tables.pop(r, None)
        # Prefetches run synchronously below, so nothing is in flight to terminate.
        for op in plan.ops:
            self.run_op(op)
        if plan.step is not None:
            self.run_forward(plan)
        self.stats.steps += 1
        return plan

    def run_to_idle(self, max_steps: int = 100_000, start_ms: int = 0, ms_per_step: int = 1) -> int:
        """Steps until every request ended and every op was answered; returns steps taken."""
        now = start_ms
        for i in range(max_steps):
            if self.s.is_idle():
                self.step(now)  # collect what the last completions ended
                return i
            self.step(now)
            now += ms_per_step
        raise RuntimeError(f"not idle after {max_steps} steps: {self.s.stats()}")

    def generated(self, req: int) -> List[int]:
        """Tokens generated for ``req`` so far."""
        return list(self.outputs.get(req, []))
