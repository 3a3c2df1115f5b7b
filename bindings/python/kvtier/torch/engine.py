"""An engine loop around a Hugging Face model: kvtier plans, the executor moves KV, the model
computes over paged KV, completions go back to the scheduler.

Why it exists: it is the smallest complete engine that serves real tokens through every
tier (device, host, L3) with real KV, so the tests can compare its output with
transformers' own ``generate()``. It is also the loop an engine author copies
(``examples/torch_engine.py`` is this, shorter): the order of the calls is the contract in
docs/scheduler.md.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import ExecutionPlan, Scheduler
from ..engine import L3Backend
from .errors import PoolLayoutError
from .executor import Executor, LoadWait, Ordering
from .movers import Mover
from .model import PagedRow, layout_of, run_row, use_paged_attention
from .pools import DevicePool, HostPool, Pinning

__all__ = ["TorchEngine"]


class TorchEngine:
    """Serves requests of ``scheduler`` with ``model`` (a transformers causal LM), KV in
    pools sized from the scheduler's config, L3 through ``backend``."""

    def __init__(
        self,
        scheduler: Scheduler,
        model: Any,
        backend: Optional[L3Backend] = None,
        *,
        mover: "Mover | str" = "torch",
        ordering: Ordering = Ordering.ENFORCED,
        loads: LoadWait = LoadWait.PER_LAYER,
        l3_workers: int = 2,
        prefetch_chunk_pages: int = 4,
    ) -> None:
        cfg = scheduler.config()
        if not cfg["host_enabled"]:
            raise PoolLayoutError("kvtier.torch needs the host tier (host_enabled=True): L3 I/O runs from host pages")
        self.s = scheduler
        self.model = model
        dev = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        layout = layout_of(model.config, cfg["page_size"], dtype)
        self.page_size = cfg["page_size"]
        self.device_pool = DevicePool.allocate(layout, cfg["device_pages"], dev)
        self.host_pool = HostPool.allocate(layout, cfg["host_pages"], Pinning.AUTO)
        self.executor = Executor(self.device_pool, self.host_pool, backend, mover=mover, ordering=ordering,
                                 l3_workers=l3_workers, prefetch_chunk_pages=prefetch_chunk_pages)
        self.loads = loads
        use_paged_attention(model)
        self.tables: Dict[int, List[int]] = {}
        self.tokens: Dict[int, List[int]] = {}
        self.outputs: Dict[int, List[int]] = {}
        self.first_logits: Dict[int, torch.Tensor] = {}
        self.ended: List[Tuple[int, str]] = []
        self.forwards = 0
        self.terminated = 0
        """Prefetches the scheduler stopped (``plan.terminate_prefetch``)."""

    # ---- requests --------------------------------------------------------------------

    def submit(self, req: int, prompt: Sequence[int], max_new_tokens: int, now_ms: Optional[int] = None) -> None:
        toks = [int(t) for t in prompt]
        self.s.submit(req, np.asarray(toks, dtype=np.uint32), max_new_tokens, now_ms)
        self.tokens[req] = toks
        self.outputs[req] = []

    def generated(self, req: int) -> List[int]:
        return list(self.outputs.get(req, []))

    # ---- one step ----------------------------------------------------------------------

    def _apply(self, req: int, start: Optional[int], pages: Any) -> None:
        t = self.tables.setdefault(req, [])
        if start is not None:
            del t[start:]
            t.extend(int(p) for p in pages)

    def _row(self, req: int, start: int) -> PagedRow:
        pages = torch.as_tensor(self.tables[req], dtype=torch.long, device=self.device_pool.device)
        return PagedRow(self.device_pool, pages, start, self.executor.wait_for_layer)

    def _forward(self, plan: ExecutionPlan) -> Tuple[List[int], List[int]]:
        reqs: List[int] = []
        toks: List[int] = []
        for c in plan.prefill:
            self._apply(c.req, c.table_from, c.table_pages)
            logits = run_row(self.model, self._row(c.req, c.start), c.tokens.tolist())
            tok = 0
            if c.last:
                tok = int(torch.argmax(logits))
                if not self.outputs[c.req] and c.req not in self.first_logits:
                    self.first_logits[c.req] = logits.cpu()
                self.tokens[c.req].append(tok)
                self.outputs[c.req].append(tok)
            reqs.append(c.req)
            toks.append(tok)
        frm, offs, pages = plan.decode_table_from, plan.decode_table_offsets, plan.decode_table_pages
        for i, (r, p) in enumerate(zip(plan.decode_reqs.tolist(), plan.decode_positions.tolist())):
            if frm[i] >= 0:
                self._apply(r, int(frm[i]), pages[offs[i] : offs[i + 1]])
            logits = run_row(self.model, self._row(r, p), [self.tokens[r][p]])
            tok = int(torch.argmax(logits))
            self.tokens[r].append(tok)
            self.outputs[r].append(tok)
            reqs.append(r)
            toks.append(tok)
        return reqs, toks

    def step(self, now_ms: int) -> ExecutionPlan:
        """Plan, start the ops, stop terminated prefetches, forward, report completions."""
        plan = self.s.next_execution_plan(now_ms)
        for r, outcome in plan.ended:
            self.tables.pop(r, None)
            self.ended.append((r, outcome))
        for r in plan.retracted:
            self.tables.pop(r, None)
        ex = self.executor
        ex.submit(plan.ops)
        ex.terminate(plan.terminate_prefetch)
        self.terminated += len(plan.terminate_prefetch)
        if plan.step is None:
            for ev in ex.poll():
                self.s.on_event(ev)
            return plan
        ex.wait_before_forward(plan, self.loads)
        reqs, toks = self._forward(plan)
        self.forwards += 1
        need = [op.id for op in plan.ops if op.before_forward]
        for c in plan.prefill:
            need.extend(int(x) for x in c.waits_for)
        for ev in ex.poll(require=need):  # completions before the forward that waited on them
            self.s.on_event(ev)
        self.s.forward_done(plan.step, np.asarray(reqs, dtype=np.uint64), np.asarray(toks, dtype=np.uint32))
        return plan

    def run_to_idle(self, max_steps: int = 100_000, start_ms: int = 0, ms_per_step: int = 1) -> int:
        """Steps until every request ended and every op was reported; returns steps taken."""
        now = start_ms
        for i in range(max_steps):
            idle = self.s.is_idle() and self.executor.in_flight() == 0
            plan = self.step(now)
            if idle:
                return i
            if plan.step is None and not plan.ops:
                self.executor.wait_any(0.05)
            now += ms_per_step
        raise RuntimeError(f"not idle after {max_steps} steps: {self.s.stats()}")

    def close(self) -> None:
        self.executor.close()

    def __enter__(self) -> "TorchEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
