"""The radix backend's L3 I/O: the per-step hook, the I/O thread and the ranks' agreement.

Why apart from ``radix.py``: that file decides what SGLang's requests get (match, load-back,
store); this one carries out what kvtier planned against the L3 store and tells kvtier how it
went. Every L3 call is a ``_Job`` (a prefetch, a backup, a probe of the pages after a host
prefix, a read of the store's loss journal), run on the I/O thread when there is one
(``io_threads``) or inline; its outcome is applied to kvtier's ``OffloadManager`` when the
hook polls it. Under tensor parallelism a rank's outcome is one word of an all-reduce MIN
over SGLang's TP CPU group (``RankAgreement``), so every rank's manager applies the same
outcome (a page read by one rank only is lost for all), and the ranks' losses are united.

``L3Io`` is a mixin of ``KvtierRadixCache``: it uses the cache's ``manager``, ``store``,
``counters``, ``namespace``, ``tp_rank``/``tp_size``, ``_group``, ``_agreement``,
``_agreeing``, ``_pool``, ``_jobs``, ``_journal``, ``_from_l3``, ``_host_flat`` and
``page_bytes``, all set in its ``__init__``.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

import kvtier

if TYPE_CHECKING:
    from .radix import Counters

logger = logging.getLogger("kvtier.sglang.radix")

_EXISTS = int(kvtier._native.ERROR_CODES["OBJECT_ALREADY_EXISTS"])


class _Dropped(Exception):
    """A queued job that was never run: reset or shutdown found the store not answering."""


@dataclass
class _Job:
    kind: str  # "prefetch" | "backup" | "probe" (of the pages after a host prefix) | "losses" (the journal)
    job: int
    pages: int
    run: Callable[[], Any]
    future: Optional[Future] = None
    handle: Any = None
    page_hashes: Optional[List[bytes]] = None


class L3Io:
    """The per-step hook's L3 I/O of ``KvtierRadixCache`` (module doc)."""

    # KvtierRadixCache's (radix.py), which this is mixed into
    manager: kvtier.OffloadManager
    store: Optional[kvtier.L3Store]
    counters: Counters
    namespace: str
    page_bytes: int
    tp_rank: int
    tp_size: int
    agreements: int
    _group: Any
    _agreement: kvtier.RankAgreement
    _agreeing: Dict[int, _Job]
    _host_flat: np.ndarray
    _jobs: List[_Job]
    _from_l3: set
    _pool: Optional[ThreadPoolExecutor]
    if TYPE_CHECKING:

        def l3_keys(self, chain: List[bytes]) -> List[str]: ...

    def _start(self, job: _Job) -> None:
        if self._pool is not None:
            job.future = self._pool.submit(job.run)
        self._jobs.append(job)

    def _io_off_thread(self) -> bool:
        """Probes and journal reads go to the I/O thread too: with one, and on one rank (under TP
        their answers are agreed by collectives that every rank reaches in the same call)."""
        return self._pool is not None and self.tp_size == 1

    def _all_min(self, v: np.ndarray) -> None:
        """In-place element-wise minimum over the tensor-parallel ranks (SGLang's CPU group)."""
        import torch.distributed as dist

        t = torch.from_numpy(v)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group)

    def _finish(self, job: _Job, result: Any, err: Optional[BaseException]) -> None:
        if job.kind == "losses":
            if not isinstance(err, _Dropped):
                self._apply_losses(*self._losses_read(lambda: (result, err)))
            return
        if isinstance(err, _Dropped):
            self.counters.dropped_jobs += 1
        elif isinstance(err, kvtier.L3Error):
            self.counters.store_errors += 1
            logger.warning("kvtier: L3 %s failed: %r", job.kind, err)
        elif err is not None:
            raise err
        if job.kind == "probe":  # one rank (_io_off_thread): what it found is L3's (under TP the
            # probe runs inline and the ranks agree their finds: the manager refuses l3_found)
            run = 0 if err is not None else _leading_hits(np.asarray(result))
            if run:
                self.manager.l3_found((job.page_hashes or [])[:run])
            return
        if self.tp_size > 1:
            # This rank's outcome; the ranks' minimum is applied by _agree.
            if job.kind == "prefetch":
                self._agreement.push(kvtier.PrefetchDone(job.job, 0 if err is not None else int(result)))
            else:
                self._agreement.push(kvtier.BackUpDone(job.job, err is None and bool(result)))
            self._agreeing[job.job] = job
            return
        self._apply(job, 0 if err is not None else int(result) if job.kind == "prefetch" else bool(result))

    def _agree(self) -> None:
        """The ranks' outcomes of the jobs each finished, reduced to their minimum (a page read
        by one rank only is lost for all), applied to every rank's manager alike."""
        if self.tp_size == 1:
            return
        events = self._agreement.reduce(self.manager, lambda v: self._all_min(v))
        self.agreements += 1
        for ev in events:
            self.manager.apply_agreed(ev)
            assert isinstance(ev, (kvtier.PrefetchDone, kvtier.BackUpDone))  # the agreed jobs' ends
            job = self._agreeing.pop(ev.op)
            if job.kind == "prefetch":
                assert isinstance(ev, kvtier.PrefetchDone)
                outcome: Any = int(ev.completed)
            else:
                assert isinstance(ev, kvtier.BackUpDone)
                outcome = bool(ev.success)
            self._apply(job, outcome, applied=True)

    def _apply(self, job: _Job, outcome: Any, applied: bool = False) -> None:
        if job.kind == "prefetch":
            done = int(outcome)
            if not applied:
                self.manager.complete_prefetch(job.job, done)
            self._from_l3.update((job.page_hashes or [])[:done])
            self.counters.prefetched_pages += done
            self.counters.prefetch_lost_pages += job.pages - done
        else:
            ok = bool(outcome)
            if not applied:
                self.manager.complete_backup(job.job, "done" if ok else "failed")
            if ok:
                self.counters.backed_up_pages += job.pages
            else:
                self.counters.backup_failures += 1

    def _poll_io(self, block: bool, drop_when_unanswered: bool = False) -> None:
        """Applies the jobs that are done (all of them with ``block``). With
        ``drop_when_unanswered``, once one fails because the store did not answer, the jobs
        not yet begun are dropped as failed, not each left to wait out its own RPC timeout."""
        block = block or self.tp_size > 1  # ranks finish the same jobs at the same point
        keep = []
        unanswered = False
        e: Optional[BaseException]
        for i, job in enumerate(self._jobs):
            if unanswered and (job.future is None or job.future.cancelled()):
                r, e = None, _Dropped()
            elif job.future is None:
                try:
                    r, e = job.run(), None
                except Exception as ex:  # noqa: BLE001 (typed below)
                    r, e = None, ex
            elif block or job.future.done():
                e = job.future.exception()
                r = None if e is not None else job.future.result()
            else:
                keep.append(job)
                continue
            # a store that did not answer raises (RpcFailError: its RPC timed out or failed)
            if drop_when_unanswered and not unanswered and isinstance(e, kvtier.L3Error):
                unanswered = True
                # All at once: the I/O thread starts the next job the moment this one ends.
                for later in self._jobs[i + 1:]:
                    if later.future is not None:
                        later.future.cancel()
            self._finish(job, r, e)
        self._jobs = keep
        self._agree()

    def _drain_io(self, drop_when_unanswered: bool = False) -> None:
        while self._jobs:
            self._poll_io(block=True, drop_when_unanswered=drop_when_unanswered)

    def flush_pending_backups(self) -> None:
        """SGLang's per-step hook: finishes the L3 reads and writes that are done, then starts
        the backups kvtier plans (host pages L3 lacks)."""
        self._take_host_events()
        if self.store is None:
            return
        self._poll_io(block=False)
        self._take_losses()
        self._start_backups()
        if self._pool is None and self._jobs:
            # I/O in the hook itself: the backups just planned end here, so the host pages they
            # pin are free for the next step's stores.
            self._poll_io(block=True)

    def _start_backups(self) -> None:
        """Starts the backups kvtier plans; each pins its host pages until it ends."""
        for job, pages, slots in self.manager.plan_backups():
            keys = self.l3_keys(list(pages))
            store, flat, pb = self.store, self._host_flat, self.page_bytes
            assert store is not None  # the manager plans no backups without one (l3_backups "off")
            ids = np.asarray(slots, dtype=np.int64)

            def write(keys=keys, ids=ids) -> bool:
                codes = np.asarray(store.batch_put_pages(keys, flat, ids, pb))
                return bool(((codes == 0) | (codes == _EXISTS)).all())

            self.counters.backups += 1
            self._start(_Job("backup", job, len(pages), write))

    def _take_host_events(self) -> None:
        """kvtier's host events since the last step (it keeps them until read): pages that left
        host no longer count as prefetched-from-L3 for the hit metrics."""
        for removed, pages in self.manager.drain_events():
            if removed:
                self._from_l3.difference_update(pages)
        self.manager.take_dropped()

    def _take_losses(self) -> None:
        """Pages the store reports lost (its loss journal: evicted, removed, a node gone) stop
        counting as L3-resident, so kvtier neither prefetches them nor skips their backup;
        under TP the ranks' losses are united (``RankAgreement.agree_losses``, every step).
        With the I/O thread on one rank the journal is read there, one read in flight."""
        store = self.store  # not None while there is a journal to read
        if self._journal and self._io_off_thread():
            assert store is not None
            if not any(j.kind == "losses" for j in self._jobs):
                self._start(_Job("losses", 0, 0, store.drain_losses))
            return

        def read():
            assert store is not None
            try:
                return store.drain_losses(), None
            except kvtier.L3Error as e:
                return None, e

        self._apply_losses(*self._losses_read(read) if self._journal else ([], False))

    def _losses_read(self, read: Callable[[], Tuple[Any, Optional[BaseException]]]) -> Tuple[List[bytes], bool]:
        """This rank's lost pages and overflow flag from one journal read (``read`` returns the
        store's answer or its error)."""
        answer, err = read()
        if isinstance(err, kvtier.UnavailableError):
            self._journal = False  # a store without a journal: losses show at read time
            return [], False
        if isinstance(err, kvtier.L3Error):
            self.counters.store_errors += 1
            logger.warning("kvtier: reading L3 losses failed: %r", err)
            return [], False
        if err is not None:
            raise err
        keys, over = answer
        pages: List[bytes] = []
        prefix, suffix = f"{self.namespace}:", f":{self.tp_rank}"
        for k in keys:
            if k.startswith(prefix) and k.endswith(suffix):
                try:
                    h = bytes.fromhex(k[len(prefix):-len(suffix)])
                except ValueError:
                    continue
                if len(h) == 32:
                    pages.append(h)
        self.counters.l3_lost_pages += len(pages)
        return pages, bool(over)

    def _apply_losses(self, pages: List[bytes], over: bool) -> None:
        if self.tp_size == 1:
            if over:
                self.manager.l3_lost_all()
            elif pages:
                self.manager.l3_lost(pages)
            return
        if pages:
            self._agreement.lost_pages(pages)
        if over:
            self._agreement.lost_all()
        self._agreement.agree_losses(self.manager, self._all_gather)

    def _all_gather(self, words: np.ndarray) -> List[np.ndarray]:
        import torch.distributed as dist

        n = np.array([len(words)], dtype=np.int64)
        self._all_max(n)
        mine = torch.zeros(int(n[0]), dtype=torch.int64)
        mine[: len(words)] = torch.from_numpy(np.asarray(words, dtype=np.int64))
        out = [torch.zeros_like(mine) for _ in range(self.tp_size)]
        dist.all_gather(out, mine, group=self._group)
        return [t.numpy() for t in out]

    def _all_max(self, v: np.ndarray) -> None:
        import torch.distributed as dist

        dist.all_reduce(torch.from_numpy(v), op=dist.ReduceOp.MAX, group=self._group)

    def wait_io(self) -> None:
        """Finishes every L3 read and write in flight (tests, shutdown)."""
        self._drain_io()


def _leading_hits(found: np.ndarray) -> int:
    """How many of ``batch_is_exist``'s answers lead with 1 (the run of pages the store holds)."""
    hit = np.asarray(found) == 1
    return int(np.argmin(hit)) if not hit.all() else len(hit)
