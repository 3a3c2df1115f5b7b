"""kvtier's L3 below ``KvtierOffloadingManager``: the plan is kvtier's, the bytes move on
kvtier's I/O threads.

Why a part of its own: what to back up and what is in L3 are decided by the scheduler
crate (``OffloadManager`` with ``l3_backups="write-through"``: ``plan_backups``, pages
answered ``"in-l3"``); this module only turns those decisions into jobs of a
``KvtierSecondaryTier`` (tier.py) — the same store, keys and I/O threads as the tier of
docs/vllm.md, over the host slots vLLM's workers write — and reports the jobs back.

How: a lookup that kvtier answers ``"in-l3"``, or that its tier's probe finds in L3, starts
a **Prefetch**: an ordinary kvtier store job (slots after the host-resident prefix, evictions
reported as events) whose bytes come from L3, answered HIT_PENDING until it lands. Prefetches
are submitted in a batch at ``on_schedule_end``, with the step's **BackUps**
(``plan_backups``: stored host pages L3 lacks, their slots pinned until the copy ends; also
right when stores complete, before the next step's stores could evict them unbacked).
Finished jobs are polled at ``on_schedule_end``; a failed prefetch marks its pages lost
(``l3_lost``) and frees its slots, so vLLM's next lookup misses and recomputes.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from .chunks import Chain

__all__ = ["L3Plan"]

_BACKUP_CTX = ReqContext(req_id="kvtier-backup")


class L3Plan:
    """The L3 half of ``KvtierOffloadingManager`` (a mixin: uses its ``native``, ``_pending``
    and ``_key_of``)."""

    l3 = None  # a KvtierSecondaryTier, or None: no L3

    def _l3_init(self, tier) -> None:
        self.l3 = tier
        self._queued: List[Tuple[int, List[bytes], List[bytes], List[int], ReqContext]] = []
        self._l3_jobs: Dict[int, Tuple[str, int, List[bytes]]] = {}  # tier job -> (kind, kvtier job, pages)
        self._next_l3_job = 1

    def _l3_lookup(self, chain: Chain, i: int, key: bytes, ctx: ReqContext) -> Optional[LookupResult]:
        """A host miss: L3 may have it. None: a plain miss."""
        if self.l3 is None:
            return None
        probe = self.l3.lookup(key, ctx)
        if probe is LookupResult.RETRY:
            return LookupResult.RETRY
        if probe is not LookupResult.HIT:
            return None
        self.native.l3_found([chain.pages[i]])
        return self._prefetch(chain, i, ctx)

    def _prefetch(self, chain: Chain, i: int, ctx: ReqContext) -> LookupResult:
        plan = self.native.prepare_store(chain.pages[: i + 1], i + 1)
        if plan is None:
            return LookupResult.MISS  # no room (everything pinned): vLLM computes it
        job, frm, slots, _evicted = plan  # evictions reach vLLM as events
        pages = chain.pages[frm:frm + len(slots)]
        keys = chain.keys[frm:frm + len(slots)]
        for p, k in zip(pages, keys):
            self._pending[p] = k
        self._queued.append((job, pages, keys, slots, ctx))
        return LookupResult.HIT_PENDING

    def _l3_step(self) -> None:
        """The step's prefetches and backups to kvtier's I/O threads; finished jobs back."""
        if self.l3 is None:
            return
        for job, pages, keys, slots, ctx in self._queued:
            self._submit("prefetch", job, pages, keys, slots, ctx)
        self._queued = []
        self._l3_backups()
        self._l3_poll()

    def _l3_backups(self) -> None:
        """Backs up what the host tree just took: called as soon as stores complete, so the
        pages are pinned by their backup before the next step's stores may evict them."""
        if self.l3 is None:
            return
        for job, pages, slots in self.native.plan_backups():
            keys = [self._key_of[p] for p in pages]
            self._submit("backup", job, pages, keys, slots, _BACKUP_CTX)

    def _submit(self, kind: str, job: int, pages, keys, slots, ctx) -> None:
        tid = self._next_l3_job
        self._next_l3_job += 1
        self._l3_jobs[tid] = (kind, job, list(pages))
        t = TransferJob(job_id=tid, keys=list(keys), chunk_ids=np.asarray(slots, dtype=np.int64),
                        is_promotion=kind == "prefetch", req_context=ctx)
        (self.l3.submit_load if kind == "prefetch" else self.l3.submit_store)(t)

    def _l3_poll(self) -> None:
        for r in list(self.l3.get_finished_jobs()):
            kind, job, pages = self._l3_jobs.pop(r.job_id)
            outcome = "done" if r.success else "failed"
            if kind == "backup":
                self.native.complete_backup(job, outcome)
                continue
            if not r.success:
                self.native.l3_lost(pages)
            self.native.complete_store(job, outcome)
        self._drain()

    def _l3_busy(self) -> bool:
        return self.l3 is not None and bool(self._queued or self._l3_jobs or self.l3.has_pending_work())

    def _l3_unreported(self) -> int:
        """kvtier store jobs the L3 half has not reported (prefetches queued or running)."""
        if self.l3 is None:
            return 0
        return len(self._queued) + sum(1 for kind, _, _ in self._l3_jobs.values() if kind == "prefetch")

    def _l3_reset(self) -> None:
        if self.l3 is not None:
            self.l3.drain_jobs()
            list(self.l3.get_finished_jobs())  # results of the old tree's jobs: dropped with it
            self._queued, self._l3_jobs = [], {}
