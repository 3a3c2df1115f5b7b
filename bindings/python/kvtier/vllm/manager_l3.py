"""kvtier's L3 below ``KvtierOffloadingManager``: the plan is kvtier's, the bytes move on
kvtier's I/O threads, and under tensor parallelism every rank's shard moves on its own.

Why a part of its own: what to back up and what is in L3 are decided by the scheduler
crate (``OffloadManager`` with ``l3_backups="write-through"``: ``plan_backups``, pages
answered ``"in-l3"``); this module only turns those decisions into jobs of
``KvtierSecondaryTier``s (tier.py) — the same store, keys and I/O threads as the tier of
docs/vllm.md, over the host slots vLLM's workers write — and reports the jobs back.

How: a lookup that kvtier answers ``"in-l3"``, or that its tier's probe finds in L3, starts
a **Prefetch** (``prepare_prefetch_held``: slots after the host-resident prefix as for a store,
evictions reported as events) whose bytes come from L3, answered HIT_PENDING until it
lands, and then held on host for that request until its load locks the pages or it ends
(a store in between would otherwise evict them as the coldest leaves: read for nothing). Prefetches are submitted in a batch at ``on_schedule_end``, with the step's
**BackUps** (``plan_backups``: stored host pages L3 lacks, their slots pinned until the copy
ends; also right when stores complete, before the next step's stores could evict them
unbacked). Finished jobs are polled at ``on_schedule_end``.

**Ranks.** vLLM runs this manager once, but under tensor parallelism each worker rank owns
its shard of every host slot (bytes ``[rank * shard, (rank + 1) * shard)`` of each row of the
/dev/shm region). There is one tier per rank, moving only that shard under keys suffixed by
the rank (docs/page-keys.md), and one ``kvtier.RankAgreement`` per rank holding what that
rank's tier reported: ``PrefetchDone(job, pages read)``, ``BackUpDone(job, success)``.
``OffloadManager.agree`` applies the element-wise minimum over ranks, so a prefetch lands
only when every rank's shard did (and only the pages every rank read: the rest are lost in
L3 for all ranks, and vLLM recomputes them on every rank), a backup counts only when every
rank wrote its shard, and a probe is a hit only if every rank's shard is there (each rank's
find recorded on its agreement, ``RankAgreement.found_pages``, and marked by
``OffloadManager.agree_found``: the manager refuses a direct ``l3_found`` under TP). A shard one
rank finds gone (its read fails) is thereby lost for every rank in the same step; so is one
its store reports lost (the store's loss journal, ``lost_keys``: evicted, removed), recorded
on that rank's agreement (``RankAgreement.lost_pages``) and agreed in the same poll
(``agree_losses``: the union is forgotten on every rank), so no rank prefetches a chunk
another rank's store no longer has. With one rank (or vLLM's replicated or canonical layouts, where rows are not
sharded) there is one tier over whole rows, with the tier's own keys.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob

import kvtier

from .chunks import Chain, page_of
from .spec_config import tenant_of

if TYPE_CHECKING:
    from .manager_metrics import ManagerCounters

# How long an engine step sleeps while a prefetch is in flight (_l3_step): long enough for
# the I/O thread waiting on the GIL to take it, short beside a step.
PREFETCH_YIELD_S = 1e-4

__all__ = ["L3Plan"]

_BACKUP_CTX = ReqContext(req_id="kvtier-backup")


@dataclass
class _RoomWait:
    """When a request's prefetch first found no free host slot (None: not waiting)."""

    since: Optional[float]


class L3Plan:
    """The L3 half of ``KvtierOffloadingManager`` (a mixin: uses its ``native``, ``_pending``
    and ``_key_of``)."""

    l3 = None  # rank 0's KvtierSecondaryTier, or None: no L3
    l3_ranks: List = []
    # the manager's (manager.py), which this is mixed into
    native: kvtier.OffloadManager
    counters: ManagerCounters
    _pending: Dict[bytes, bytes]
    _key_of: Dict[bytes, bytes]
    if TYPE_CHECKING:

        def _drain(self) -> None: ...

    def _l3_init(self, tiers, room_wait_s: float) -> None:
        self.room_wait_s = room_wait_s
        self.l3_ranks = list(tiers or [])
        self.l3 = self.l3_ranks[0] if self.l3_ranks else None
        self.agreements = [kvtier.RankAgreement() for _ in self.l3_ranks]
        self._queued: List[Tuple[int, List[bytes], List[bytes], List[int], ReqContext]] = []
        # The native generation right after the last ``plan_backups``: that call takes the
        # manager's whole backup queue, and only a change (a new generation) refills it.
        self._planned_at: Optional[int] = None
        self._l3_jobs: Dict[int, Tuple[str, int]] = {}  # kvtier job -> (kind, pages)
        self._reports: Dict[int, int] = {}  # kvtier job -> ranks that reported it
        # Held prefetches by request id: kept on host for that request until its load locked
        # them or it ended (kvtier's ``prepare_prefetch_held``).
        self._holds: Dict[str, List[int]] = {}

    def _l3_lookup(self, chain: Chain, i: int, key: bytes, ctx: ReqContext) -> Optional[LookupResult]:
        """A host miss: L3 may have it (every rank's shard). None: a plain miss."""
        if self.l3 is None:
            return None
        retry = False
        for t in self.l3_ranks:
            probe = t.lookup(key, ctx)
            if probe is LookupResult.RETRY:
                retry = True
            elif probe is not LookupResult.HIT:
                return None
        if retry:
            return LookupResult.RETRY
        if len(self.l3_ranks) > 1:  # every rank's tier found its shard: agreed, as a manager
            for agreement in self.agreements:  # of several ranks refuses a direct l3_found
                agreement.found_pages([chain.pages[i]])
            self.native.agree_found(self.agreements)
        else:
            self.native.l3_found([chain.pages[i]])
        return self._prefetch(chain, i, ctx)

    def _prefetch(self, chain: Chain, i: int, ctx: ReqContext) -> LookupResult:
        # Pages i.. and the L3 run after them, held for this request once they land: a store
        # of another request (vLLM prepares a step's stores after its lookups) must not evict
        # them before this request's next lookup loads them.
        plan = self.native.prepare_prefetch_held(chain.pages, i + 1, tenant_of(ctx))
        if plan is None:
            return self._no_room(ctx)
        w = ctx.get_state(_RoomWait)
        if w is not None:
            w.since = None  # a later wait of this request starts its own budget
        job, frm, slots, _evicted = plan  # evictions reach vLLM as events
        self._holds.setdefault(ctx.req_id, []).append(job)
        pages = chain.pages[frm:frm + len(slots)]
        keys = chain.keys[frm:frm + len(slots)]
        for p, k in zip(pages, keys):
            self._pending[p] = k
        self._queued.append((job, pages, keys, slots, ctx))
        self.counters.prefetch_jobs += 1
        self.counters.chunks_prefetched += len(slots)
        return LookupResult.HIT_PENDING

    def _release_holds(self, ctx: ReqContext) -> None:
        """The request's prefetched pages are locked by its load, or it ended: its holds go."""
        for job in self._holds.pop(ctx.req_id, ()):
            self.native.release_hold(job)

    def _no_room(self, ctx: ReqContext) -> LookupResult:
        """No host slot can take the prefetch: each is held by a copy in flight (the
        prefetches of the requests vLLM looked up just before this one in the same pass,
        loads to the GPU, stores, backups) or by the tenant's cap. While copies are in flight
        the request waits (RETRY: vLLM looks it up again next step instead of computing what
        L3 holds), for at most ``room_wait_s`` from its first wait; then MISS, and vLLM
        computes it."""
        u = self.native.usage()
        if u["stores"] + u["loads"] + u["backups"] == 0 and u["locked"] == 0:
            return LookupResult.MISS  # nothing will free a slot (a tenant's cap)
        now = time.monotonic()
        w = ctx.get_state(_RoomWait)
        if w is None:
            w = _RoomWait(None)
            ctx.set_state(w)
        if w.since is None:
            w.since = now
        if now - w.since >= self.room_wait_s:
            return LookupResult.MISS
        self.counters.room_waits += 1
        return LookupResult.RETRY

    def _l3_step(self) -> None:
        """The step's prefetches and backups to kvtier's I/O threads; finished jobs back."""
        if self.l3 is None:
            return
        if self._queued:
            for job, pages, keys, slots, ctx in self._queued:
                self._submit("prefetch", job, keys, slots, ctx)
            self._queued = []
        self._l3_poll()
        # After the poll: a prefetch that landed there may have let a store waiting on it
        # into the tree, and its pages are backed up in this step, not whenever the engine
        # steps again (an idle engine may not).
        if self.native.generation != self._planned_at:
            self._l3_backups()
        if self._l3_jobs and any(kind == "prefetch" for kind, _ in self._l3_jobs.values()):
            # A request waits for these bytes, which move on the tier's I/O threads; vLLM's
            # loop steps again at once (a waiting request is looked up every step), holding
            # the GIL those threads need between their native calls, so they would run only
            # at the interpreter's forced switches (every 5 ms) and a 4 MiB prefetch took
            # seconds. Sleeping releases the GIL and lets them run (docs/vllm/benchmarks.md).
            time.sleep(PREFETCH_YIELD_S)

    def _l3_backups(self) -> None:
        """Backs up what the host tree just took: called as soon as stores complete, so the
        pages are pinned by their backup before the next step's stores may evict them."""
        if self.l3 is None:
            return
        for job, pages, slots in self.native.plan_backups():
            keys = [self._key_of[p] for p in pages]
            self._submit("backup", job, keys, slots, _BACKUP_CTX)
            self.counters.backup_jobs += 1
        self._planned_at = self.native.generation

    def _submit(self, kind: str, job: int, keys, slots, ctx) -> None:
        self._l3_jobs[job] = (kind, len(keys))
        ids = np.asarray(slots, dtype=np.int64)
        for t in self.l3_ranks:
            tj = TransferJob(job_id=job, keys=list(keys), chunk_ids=ids, is_promotion=kind == "prefetch",
                             req_context=ctx)
            (t.submit_load if kind == "prefetch" else t.submit_store)(tj)

    def _l3_poll(self) -> None:
        """Every rank's finished jobs and store losses into its agreement, then the agreed
        outcomes and the union of the losses applied once. A step with nothing finished and
        nothing lost (most steps) changes nothing: the manager is not called."""
        news = False
        for t, agreement in zip(self.l3_ranks, self.agreements):
            for r in t.get_finished_jobs():  # a list (or an empty tuple), taken out
                news = True
                kind, n = self._l3_jobs[r.job_id]
                if kind == "backup":
                    agreement.push(kvtier.BackUpDone(r.job_id, bool(r.success)))
                else:
                    read = n if r.success else len(r.successful_keys or ())
                    agreement.push(kvtier.PrefetchDone(r.job_id, read))
                self._reports[r.job_id] = self._reports.get(r.job_id, 0) + 1
                if self._reports[r.job_id] == len(self.l3_ranks):  # agreed below
                    del self._reports[r.job_id]
                    del self._l3_jobs[r.job_id]
            lost, overflowed = t.lost_keys()
            if overflowed:
                news = True
                agreement.lost_all()
            if lost:
                news = True
                agreement.lost_pages([page_of(k) for k in lost])
        if not news:
            return  # what the agreements hold from earlier steps waits for the other ranks
        self.native.agree(self.agreements)
        if any(a.pending_losses() != (0, False) for a in self.agreements):
            # In-process ranks: the all-gather is every rank's words.
            gathered = [a.loss_words() for a in self.agreements]
            for a in self.agreements:
                a.agree_losses(self.native, lambda _words: gathered)
        self._drain()

    def _l3_busy(self) -> bool:
        if self.l3 is None:
            return False
        if self._queued or self._l3_jobs:
            return True
        for t in self.l3_ranks:  # (vLLM asks every step: no generator)
            if t.has_pending_work():
                return True
        return False

    def _l3_books(self) -> Dict[str, int]:
        """The L3 half's per-request and per-job books (``KvtierOffloadingManager.books``)."""
        out = {"holds": len(self._holds), "queued": len(self._queued), "l3_jobs": len(self._l3_jobs),
               "reports": len(self._reports),
               "agreement_events": sum(a.pending() for a in self.agreements),
               "agreement_losses": sum(a.pending_losses()[0] for a in self.agreements)}
        for r, t in enumerate(self.l3_ranks):
            for k, v in t.books().items():
                out[f"tier{r}_{k}"] = v
        return out

    def _l3_unreported(self) -> int:
        """kvtier store jobs the L3 half has not reported (prefetches queued or running)."""
        if self.l3 is None:
            return 0
        return len(self._queued) + sum(1 for kind, _ in self._l3_jobs.values() if kind == "prefetch")

    def _l3_reset(self) -> None:
        for t in self.l3_ranks:
            t.drain_jobs()
            list(t.get_finished_jobs())  # results of the old tree's jobs: dropped with it
        self._queued, self._l3_jobs, self._reports, self._holds = [], {}, {}, {}
        self._planned_at = None
        self.agreements = [kvtier.RankAgreement() for _ in self.l3_ranks]
