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

Probes take no leases: an ``L3Query`` op is answered with a lease-free existence check
(``batch_is_exist``), because most probes are not followed by a read (too few hits, the
request admitted from local pages meanwhile) and a probe that leased every hit key would keep
the store from evicting them for a lease TTL — the probe-starves-eviction problem. The
``Prefetch`` takes its leases with one batched query right before its read and reads with those
results (no second lookup inside the read); results whose lease expired are queried again,
never read blindly (kvtier's store refuses an expired lease with -707, which triggers a
re-query).

Backends:
- ``KvtierL3Backend(kvtier.L3Store)``: lease-free probes; batched query + get-with-query-results
  for reads;
- ``MooncakeL3Backend(store)``: any object with Mooncake's ``MooncakeDistributedStore``
  methods — the real ``mooncake.store.MooncakeDistributedStore`` or
  ``kvtier.mooncake_compat.MooncakeDistributedStore``. Mooncake's Python API has no
  get-with-query-results call: its reads look the replicas up inside ``batch_get_into``.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import (
    BackUpDone,
    ConfigError,
    ExecutionPlan,
    L3Error,
    L3QueryDone,
    L3Store,
    LoadBackDone,
    PlannedOp,
    PrefetchDone,
    Scheduler,
    SchedulerConfig,
    UnavailableError,
    WriteBackDone,
    page_hashes,
    parse_l3_key,
)
from ._native import ERROR_CODES

__all__ = [
    "Engine",
    "EngineStats",
    "IntegrityError",
    "KvtierL3Backend",
    "L3Backend",
    "MooncakeL3Backend",
    "key_hash",
    "page_content",
    "read_losses",
    "refuse_tensor_parallel",
]

OBJECT_ALREADY_EXISTS = ERROR_CODES["OBJECT_ALREADY_EXISTS"]  # -705, from l3's one table
LEASE_EXPIRED = ERROR_CODES["LEASE_EXPIRED"]  # -707


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

    def detach_pools(self, pools: Sequence[np.ndarray]) -> None:
        """Called with pools given to ``attach_pools`` once no read or write targets them
        (their owner closed); a backend shared by several owners keeps the others'."""

    def probe(self, keys: List[str]) -> int:
        """How many leading keys exist, without taking leases (answers ``L3Query``)."""
        raise NotImplementedError

    def query(self, keys: List[str]) -> QueryRecord:
        """Leases the leading keys that exist, for a read that follows at once."""
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

    def losses(self) -> Tuple[List[str], bool]:
        """Keys the store lost since the last call, and whether some went unreported. A
        store that reports none answers ``([], False)``: the scheduler's L3 marks are hints."""
        return [], False


class KvtierL3Backend(L3Backend):
    """kvtier's own store (embedded or remote): lease-free probes; a read leases its keys with
    one batched query and reads with its results (no second metadata lookup)."""

    name = "kvtier"

    def __init__(self, store: L3Store, lease_ttl_ms: float = 10_000.0) -> None:
        self.store = store
        self.lease_ttl_ms = lease_ttl_ms
        self.no_journal = False

    def probe(self, keys: List[str]) -> int:
        # Lease-free, and SSD-only hits are promoted to DRAM for the prefetch that follows.
        return _leading_found(self.store.batch_is_exist(keys, prefetch_to_memory=True))

    def query(self, keys: List[str]) -> QueryRecord:
        t0 = _now_ms()
        r = self.store.batch_query(keys)
        return QueryRecord(keys, r.hit_prefix(), r, t0 + self.lease_ttl_ms)

    def get_with_query(self, q, offset, pool, page_ids):
        return self.store.batch_get_pages_with_query(
            q.handle, pool, page_ids, pool.shape[1] * pool.itemsize, offset
        )

    def put(self, keys, pool, page_ids):
        return self.store.batch_put_pages(keys, pool, page_ids, pool.shape[1] * pool.itemsize)

    def losses(self) -> Tuple[List[str], bool]:
        # The store's loss journal, read with this handle's cursor; a store without one
        # (-1011) leaves the scheduler's L3 marks as hints, as before.
        if self.no_journal:
            return [], False
        try:
            return self.store.drain_losses()
        except UnavailableError:
            self.no_journal = True
            return [], False


class MooncakeL3Backend(L3Backend):
    """Any store with Mooncake's Python API (real Mooncake or kvtier's compat class).

    ``lease_ttl_ms``: the master's ``default_kv_lease_ttl`` (Mooncake's default 5 s)."""

    name = "mooncake"

    def __init__(self, store: Any, lease_ttl_ms: float = 5_000.0) -> None:
        self.store = store
        self.lease_ttl_ms = lease_ttl_ms
        self._registered: List[int] = []

    def attach_pools(self, pools: Sequence[np.ndarray]) -> None:
        done: List[np.ndarray] = []
        for p in pools:
            if p.size == 0:
                continue
            rc = self.store.register_buffer(p.ctypes.data, p.nbytes)
            if rc != 0:
                # all or nothing: the caller being built raises, and nobody would give back
                # what this call registered before the refusal
                self.detach_pools(done)
                raise RuntimeError(f"register_buffer failed: {rc}")
            self._registered.append(p.ctypes.data)
            done.append(p)

    def detach_pools(self, pools: Sequence[np.ndarray]) -> None:
        for p in pools:
            ptr = p.ctypes.data
            if p.size and ptr in self._registered:
                self.store.unregister_buffer(ptr)
                self._registered.remove(ptr)

    def detach(self) -> None:
        for ptr in self._registered:
            self.store.unregister_buffer(ptr)
        self._registered.clear()

    def probe(self, keys: List[str]) -> int:
        return _leading_found(self.store.batch_is_exist(keys))

    def query(self, keys: List[str]) -> QueryRecord:
        t0 = _now_ms()
        hit = self.probe(keys)
        return QueryRecord(keys, hit, None, t0 + self.lease_ttl_ms)

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


def refuse_tensor_parallel(cfg: Dict[str, Any], engine: str) -> None:
    """A single-rank engine (it feeds completions and the store's losses straight to its
    scheduler) refuses a scheduler that is one rank of several: its first loss report would
    be refused (``LossNeedsAgreementError``), and its unreduced completions would diverge the
    ranks' plans anyway. Raises ``ConfigError`` naming ``tp_ranks``."""
    if cfg.get("tp_ranks", 1) != 1:
        raise ConfigError(f"{engine} runs a single rank and reports L3 losses directly; this scheduler is rank"
                          f" {cfg['rank']} of tp_ranks={cfg['tp_ranks']}: an engine of a tensor-parallel group agrees"
                          " completions and losses across ranks (kvtier.RankAgreement: reduce, lost, agree_losses)")


@dataclass
class EngineStats:
    steps: int = 0
    forwards: int = 0
    pages_checked: int = 0
    l3_queries: int = 0
    """Batched lease-taking queries (one per Prefetch, plus re-queries after -707)."""
    l3_probes: int = 0
    """Lease-free existence probes (one per L3Query op)."""
    lease_expired_on_read: int = 0
    """Keys the store refused with -707 (lease expired) and that were re-queried."""
    l3_pages_read: int = 0
    l3_pages_written: int = 0
    l3_errors: int = 0
    """L3 calls that raised (the server down or unreachable): each answered as a failed op
    (a probe that found nothing, a read of the pages read before it, a failed backup), a
    loss journal that could not be read as losses unknown; ``last_l3_error`` says the latest."""
    last_l3_error: Optional[str] = None
    ops: Dict[str, int] = field(default_factory=dict)


def read_losses(backend: L3Backend) -> Tuple[List[str], bool, Optional[L3Error]]:
    """``backend.losses()``, and the error when the store could not be asked: unread, the
    journal may hold anything (a server restarted empty lost it all), so the losses are
    unknown (``overflowed``) and every "in L3" mark goes, so that no host page is dropped on
    the strength of one. An engine serves on while its L3 is down (``Engine``, ``TorchEngine``)."""
    try:
        keys, overflowed = backend.losses()
        return keys, overflowed, None
    except L3Error as e:
        return [], True, e


def _leading_found(codes: Sequence[int] | np.ndarray) -> int:
    """Length of the leading run of 1s (``batch_is_exist``: 1 exists, 0 missing, <0 error)."""
    n = 0
    for c in codes:
        if int(c) != 1:
            break
        n += 1
    return n


def leading_pages_read(codes: np.ndarray, page_bytes: int) -> int:
    """Length of the leading run of keys read whole: the store answers each key with the
    bytes it read or a negative code, and an object shorter than a page (another writer's,
    a truncated one) leaves the rest of the page as it was: a miss, not a page."""
    bad = np.flatnonzero(np.asarray(codes) != page_bytes)
    return int(bad[0]) if bad.size else int(np.asarray(codes).size)


def _detach_pools(backend: Optional[L3Backend], pools: List[np.ndarray]) -> None:
    detach = getattr(backend, "detach_pools", None)  # a duck-typed backend may have none
    if detach is not None:
        detach(pools)


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
    ) -> None:
        if page_bytes < 32:
            raise ValueError("page_bytes must be at least 32 (a page hash)")
        cfg = scheduler.config()
        refuse_tensor_parallel(cfg, "kvtier.engine.Engine")
        self.s = scheduler
        self.page_size: int = cfg["page_size"]
        self.page_bytes = page_bytes
        self.device = np.zeros((cfg["device_pages"], page_bytes), dtype=np.uint8)
        self.host = np.zeros((cfg["host_pages"] if cfg["host_enabled"] else 0, page_bytes), dtype=np.uint8)
        self.backend = backend
        if backend is not None:
            backend.attach_pools([self.device, self.host])
        # What the backend registered goes back when the engine is closed or collected: a
        # Mooncake-API store kept registrations of freed memory and refused the next engine's
        # pools, allocated where these were (register_buffer -600).
        self._detach = weakref.finalize(self, _detach_pools, backend, [self.device, self.host])
        self.check = check
        self.tables: Dict[int, List[int]] = {}
        self.tokens: Dict[int, List[int]] = {}
        self._hashes: Dict[int, np.ndarray] = {}
        self._scopes: Dict[int, Dict[str, Any]] = {}
        self.ended: List[Tuple[int, str]] = []
        self.outputs: Dict[int, List[int]] = {}
        self.stop_after: Dict[int, int] = {}
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
        # the scheduler converts and checks the prompt (a str or non-integer tokens are a
        # TypeError); the engine keeps the tokens it accepted
        self.s.submit(req, prompt, max_new_tokens, now_ms, **scope)
        accepted = self.s.request_tokens(req)
        assert accepted is not None  # submit() returned: the scheduler holds the request
        self.tokens[req] = accepted.tolist()
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

    def _l3_failed(self, e: L3Error) -> None:
        # An L3 that fails is a slower engine, not a dead one: the op fails (module doc).
        self.stats.l3_errors += 1
        self.stats.last_l3_error = f"{type(e).__name__}: {e}"

    def _l3_query(self, op: PlannedOp):
        if self.backend is None:
            return L3QueryDone(op.id, 0)
        self.stats.l3_probes += 1
        try:
            return L3QueryDone(op.id, self.backend.probe(op.keys))
        except L3Error as e:
            self._l3_failed(e)
            return L3QueryDone(op.id, 0)

    def _prefetch(self, op: PlannedOp):
        keys = op.keys
        pool = self._pool(op.dst_tier)
        ids = np.asarray(op.dst)
        if self.backend is None or not keys:
            return PrefetchDone(op.id, 0)
        done = 0
        # Lease what is read now, read with those results; a lease the store refuses (-707)
        # is queried again once, never read blindly.
        for attempt in range(2):
            try:
                q = self.backend.query(keys[done:])
                self.stats.l3_queries += 1
                n_try = min(len(keys) - done, q.hit)
                if n_try <= 0:
                    break
                codes = self.backend.get_with_query(q, 0, pool, ids[done : done + n_try])
            except L3Error as e:
                self._l3_failed(e)  # what was read before stands; the rest is a miss
                break
            ok = leading_pages_read(codes, self.page_bytes)
            done += ok
            if ok == n_try or int(codes[ok]) != LEASE_EXPIRED or attempt == 1:
                break
            self.stats.lease_expired_on_read += int((codes == LEASE_EXPIRED).sum())
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
        try:
            codes = self.backend.put(keys, pool, ids)
        except L3Error as e:
            self._l3_failed(e)
            return BackUpDone(op.id, False)
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
        step = plan.step
        if step is None:
            raise ValueError("the plan has no forward (its step is None)")
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
        self.s.forward_done(step, np.asarray(reqs, dtype=np.uint64), np.asarray(toks, dtype=np.uint32), stops)

    # ---- the loop -----------------------------------------------------------------------------

    def close(self) -> None:
        """Gives the backend's registrations of this engine's pools back (also when the engine
        is collected); the engine must not step again. Closing twice is harmless."""
        self._detach()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def step(self, now_ms: int) -> ExecutionPlan:
        """One engine step: losses reported, plan, ops (every one acknowledged at once),
        forward."""
        self.report_losses()
        plan = self.s.next_execution_plan(now_ms)
        for r, outcome in plan.ended:
            # What only a live request needs goes now; its outcome and tokens wait in
            # ``ended`` and ``generated`` until ``take_ended`` hands them back.
            for book in (self.tables, self._hashes, self.tokens, self._scopes, self.stop_after):
                book.pop(r, None)
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

    def report_losses(self) -> None:
        """Passes what the L3 store lost to the scheduler, so that a write-back never drops a
        host page on the strength of a stale "in L3" mark."""
        if self.backend is None:
            return
        keys, overflowed, err = read_losses(self.backend)
        if err is not None:
            self._l3_failed(err)
        if overflowed:
            self.s.l3_lost_all()
        elif keys:
            self.s.l3_lost(keys)

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
        """Tokens generated for ``req`` so far (an ended request's until ``take_ended``)."""
        return list(self.outputs.get(req, []))

    def take_ended(self) -> List[Tuple[int, str, List[int]]]:
        """The requests that ended since the last call, each ``(id, outcome, generated
        tokens)`` in the order they ended, handed back and forgotten here: after it the
        engine keeps nothing of them. Until taken they stay in ``ended`` and ``generated``,
        so a long-running loop takes them (every step or so) or its memory grows with every
        request it served. (An id submitted again before its end was taken hands back no
        tokens: the new request's replaced them.)"""
        out = [(r, o, [] if r in self.tokens else self.outputs.pop(r, [])) for r, o in self.ended]
        self.ended = []
        return out
