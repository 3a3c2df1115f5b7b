"""An engine loop around a Hugging Face model: kvtier plans, the executor moves KV, the model
computes over paged KV, completions go back to the scheduler.

Why it exists: it is the smallest complete engine that serves real tokens through every
tier (device, host, L3) with real KV, so the tests can compare its output with
transformers' own ``generate()``. It is also the loop an engine author copies
(``examples/torch_engine.py`` is this, shorter): the order of the calls is the contract in
docs/scheduler.md.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch

from .. import ExecutionPlan, LoadBackDone, Scheduler, SchedulerConfig
from ..engine import L3Backend, read_losses, refuse_tensor_parallel
from .errors import NamespaceError, PoolLayoutError
from .executor import Executor, LoadWait, Ordering
from .movers import Mover
from .model import PagedRow, layout_of, run_row, use_paged_attention
from .namespace import kv_fields, torch_namespace
from .pools import DevicePool, HostPool, Pinning

__all__ = ["TorchEngine"]

_DEFAULT_CONTEXT = SchedulerConfig().max_context_tokens


def _eos_of(model: Any) -> Set[int]:
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def token_ids(values: Any, what: str, vocab: Optional[int]) -> List[int]:
    """``values`` as a list of token ids: integers (a list, or an integer numpy array or
    tensor), each in ``0 .. vocab`` when the model says its vocabulary. Floats, strings and
    bools are a ``TypeError`` (they were truncated or parsed), ids outside the vocabulary a
    ``ValueError`` (they failed inside a forward, with a step in flight)."""
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise TypeError(f"{what}: a tensor of {values.dtype}, not of integers")
        values = values.reshape(-1).tolist()
    elif isinstance(values, np.ndarray):
        if values.dtype.kind not in "iu":
            raise TypeError(f"{what}: an array of {values.dtype}, not of integers")
        values = values.reshape(-1).tolist()
    elif isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{what}: a sequence of token ids, not {type(values).__name__}")
    out = []
    for t in values:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"{what}: token ids must be integers, got {t!r}")
        t = int(t)
        if t < 0 or (vocab is not None and t >= vocab):
            raise ValueError(f"{what}: token id {t} is outside the vocabulary (0 .. {vocab})")
        out.append(t)
    return out


class TorchEngine:
    """Serves requests with ``model`` (a transformers causal LM), KV in pools sized from the
    scheduler's config, L3 through ``backend``.

    ``scheduler``: a :class:`SchedulerConfig` (the engine builds the scheduler: the namespace
    fields left empty are filled from :func:`kvtier.torch.namespace.torch_namespace`, and a
    ``max_context_tokens`` left at its default is capped to the device pool) or a
    :class:`Scheduler` built by the caller, whose namespace must name the model when
    ``backend`` is set (else :class:`NamespaceError`). ``kv_dtype``: the pools' dtype (default: the
    model's). ``stop_token_ids``: tokens that end a request (default: the model's
    ``generation_config.eos_token_id``; ``()`` for none); ``submit`` may override them per
    request. ``model_id``: the weights' name in the derived namespace."""

    def __init__(
        self,
        scheduler: Union[Scheduler, SchedulerConfig],
        model: Any,
        backend: Optional[L3Backend] = None,
        *,
        mover: "Mover | str" = "torch",
        ordering: Ordering = Ordering.ENFORCED,
        loads: LoadWait = LoadWait.PER_LAYER,
        l3_workers: int = 2,
        prefetch_chunk_pages: int = 4,
        kv_dtype: Optional[torch.dtype] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
        model_id: Optional[str] = None,
    ) -> None:
        dev = next(model.parameters()).device
        dtype = kv_dtype or next(model.parameters()).dtype
        if isinstance(scheduler, SchedulerConfig):
            scheduler = Scheduler(self._complete(scheduler, model, dtype, model_id))
        cfg = scheduler.config()
        refuse_tensor_parallel(cfg, "kvtier.torch.TorchEngine")
        if not cfg["host_enabled"]:
            raise PoolLayoutError("kvtier.torch needs the host tier (host_enabled=True): L3 I/O runs from host pages")
        if backend is not None and cfg["l3_enabled"] and not cfg["namespace"].get("model"):
            raise NamespaceError("an L3 store needs the model's namespace: pass a SchedulerConfig (the engine derives"
                                 " it) or set namespace=kvtier.torch.torch_namespace(model, layout)")
        layout = layout_of(model.config, cfg["page_size"], dtype)
        if backend is not None and cfg["l3_enabled"]:
            # A caller's namespace naming other KV bytes than these pools' (copied from another
            # engine's config) had this engine read that engine's L3 pages as its own KV; one
            # leaving them empty keyed fp16 and bf16 engines of one model alike.
            for field, want in kv_fields(layout).items():
                given = cfg["namespace"].get(field)
                if not given:
                    raise NamespaceError(f"the scheduler's namespace leaves {field} empty: engines of this model whose "
                                         f"KV pools hold other bytes would read each other's L3 pages; set "
                                         f"namespace[{field!r}]={want!r} (kvtier.torch.namespace.kv_fields)")
                if given != want:
                    raise NamespaceError(f"the scheduler's namespace has {field}={given!r}, but this engine's KV "
                                         f"pools are {field}={want!r}: its L3 pages would be another engine's KV")
        self.s = scheduler
        self.model = model
        self.page_size = cfg["page_size"]
        vocab = getattr(model.config, "vocab_size", None)
        self.stop_token_ids = _eos_of(model) if stop_token_ids is None else set(token_ids(stop_token_ids, "stop_token_ids", vocab))
        self.device_pool = DevicePool.allocate(layout, cfg["device_pages"], dev)
        self.host_pool = HostPool.allocate(layout, cfg["host_pages"], Pinning.AUTO)
        self.executor = Executor(self.device_pool, self.host_pool, backend, mover=mover, ordering=ordering,
                                 l3_workers=l3_workers, prefetch_chunk_pages=prefetch_chunk_pages)
        self.backend = backend
        self.loads = loads
        try:
            self.paged = use_paged_attention(model)
            self._probe(layout, dev)
        except BaseException:
            self.executor.close()
            if hasattr(self, "paged"):
                self.paged.restore()
            raise
        self.tables: Dict[int, List[int]] = {}
        self.tokens: Dict[int, List[int]] = {}
        self.outputs: Dict[int, List[int]] = {}
        self.stops: Dict[int, Set[int]] = {}
        self.first_logits: Dict[int, torch.Tensor] = {}
        self._first_set: Set[int] = set()  # the requests whose first_logits this step set
        self.ended: List[Tuple[int, str]] = []
        self.forwards = 0
        self.terminated = 0
        """Prefetches the scheduler stopped (``plan.terminate_prefetch``)."""
        self.l3_losses_reported = 0
        """L3 keys the store reported lost and the engine passed on (``l3_lost``)."""
        self.l3_lost_all_reported = 0
        # Loss journals that could not be read (the L3 down): each counted as losses unknown.
        self.l3_errors = 0
        self.last_l3_error: Optional[str] = None

    def _probe(self, layout: Any, dev: torch.device) -> None:
        """One token through the model over a scratch page: attention features refused only
        at a forward (attention sinks, a window kept in the mask) are refused here, before
        any request, with the model given back."""
        scratch = DevicePool.allocate(layout, 1, dev)
        run_row(self.model, PagedRow(scratch, torch.zeros(1, dtype=torch.long, device=dev), 0), [0])

    @staticmethod
    def _complete(cfg: SchedulerConfig, model: Any, dtype: torch.dtype, model_id: Optional[str]) -> SchedulerConfig:
        """The namespace and context limit the caller left at their defaults, filled in."""
        derived = torch_namespace(model, layout_of(model.config, cfg.page_size, dtype), model_id)
        given = cfg.namespace or {}
        cfg = cfg.replace(namespace={k: given.get(k) or v for k, v in derived.items()})  # a field set is kept
        cap = cfg.device_pages * cfg.page_size
        if cfg.max_context_tokens == _DEFAULT_CONTEXT and cap < _DEFAULT_CONTEXT:
            cfg = cfg.replace(max_context_tokens=cap)
        return cfg

    # ---- requests --------------------------------------------------------------------

    def submit(self, req: int, prompt: Sequence[int], max_new_tokens: int, now_ms: Optional[int] = None,
               stop_token_ids: Optional[Sequence[int]] = None) -> None:
        """Queues a request; it ends after ``max_new_tokens`` or at a stop token (the
        engine's unless ``stop_token_ids`` is given), which is kept in its output."""
        # Everything is checked before the scheduler queues the request: a refused call
        # changes nothing, and the same id can be submitted again.
        vocab = getattr(self.model.config, "vocab_size", None)
        toks = token_ids(prompt, "prompt", vocab)
        stops = self.stop_token_ids if stop_token_ids is None else set(token_ids(stop_token_ids, "stop_token_ids", vocab))
        self.s.submit(req, np.asarray(toks, dtype=np.uint32), max_new_tokens, now_ms)
        self.tokens[req] = toks
        self.outputs[req] = []
        self.stops[req] = stops
        self.first_logits.pop(req, None)  # an id used again: the new request's are recorded

    def abort(self, req: int) -> None:
        """Cancels a request (queued, running or retracted); its pages are released by the
        scheduler once no op or forward touches them. Unknown ids raise the scheduler's error."""
        self.s.abort(req)
        self.tables.pop(req, None)

    def generated(self, req: int) -> List[int]:
        """Tokens generated for ``req`` so far (an ended request's until ``take_ended``)."""
        return list(self.outputs.get(req, []))

    def take_ended(self) -> List[Tuple[int, str, List[int], Optional[torch.Tensor]]]:
        """The requests that ended since the last call, each ``(id, outcome, generated
        tokens, first-token logits or None)`` in the order they ended, handed back and
        forgotten here: after it the engine keeps nothing of them. Until taken they stay in
        ``ended``, ``generated`` and ``first_logits`` (a vocabulary-sized tensor a request),
        so a long-running loop takes them (every step or so) or its memory grows with every
        request it served. (An id submitted again before its end was taken hands back no
        tokens: the new request's replaced them.)"""
        out = []
        for r, o in self.ended:
            live = r in self.tokens
            out.append((r, o, [] if live else self.outputs.pop(r, []), None if live else self.first_logits.pop(r, None)))
        self.ended = []
        return out

    # ---- one step ----------------------------------------------------------------------

    def _apply(self, req: int, start: Optional[int], pages: Any) -> None:
        t = self.tables.setdefault(req, [])
        if start is not None:
            del t[start:]
            t.extend(int(p) for p in pages)

    def _row(self, req: int, start: int) -> PagedRow:
        pages = torch.as_tensor(self.tables[req], dtype=torch.long, device=self.device_pool.device)
        return PagedRow(self.device_pool, pages, start, self.executor.wait_for_layer)

    def _forward(self, plan: ExecutionPlan) -> Tuple[List[int], List[int], List[bool]]:
        reqs: List[int] = []
        toks: List[int] = []
        stops: List[bool] = []
        self._first_set = set()
        for c in plan.prefill:
            self._apply(c.req, c.table_from, c.table_pages)
            logits = run_row(self.model, self._row(c.req, c.start), c.tokens.tolist())
            tok = 0
            if c.last:
                tok = int(torch.argmax(logits))
                if not self.outputs[c.req] and c.req not in self.first_logits:
                    self.first_logits[c.req] = logits.cpu()
                    self._first_set.add(c.req)
                self.tokens[c.req].append(tok)
                self.outputs[c.req].append(tok)
            reqs.append(c.req)
            toks.append(tok)
            stops.append(c.last and tok in self.stops.get(c.req, ()))
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
            stops.append(tok in self.stops.get(r, ()))
        return reqs, toks, stops

    def step(self, now_ms: int) -> ExecutionPlan:
        """Report L3 losses, plan, start the ops, stop terminated prefetches, forward, report
        completions."""
        self.report_losses()
        plan = self.s.next_execution_plan(now_ms)
        for r, outcome in plan.ended:
            # What only a live request needs goes now; its outcome, tokens and first logits
            # wait in ``ended``, ``generated`` and ``first_logits`` until ``take_ended``.
            for book in (self.tables, self.tokens, self.stops):
                book.pop(r, None)
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
        reqs, toks, stops = self._forward(plan)
        self.forwards += 1
        need = [op.id for op in plan.ops if op.before_forward]
        for c in plan.prefill:
            need.extend(int(x) for x in c.waits_for)
        failed: Set[int] = set()
        for ev in ex.poll(require=need):  # completions before the forward that waited on them
            if isinstance(ev, LoadBackDone) and not ev.success:
                failed.add(int(ev.op))
            self.s.on_event(ev)
        if failed:
            self._discard_garbage(plan, failed, stops)
        self.s.forward_done(plan.step, np.asarray(reqs, dtype=np.uint64), np.asarray(toks, dtype=np.uint32), stops)
        return plan

    def _discard_garbage(self, plan: ExecutionPlan, failed: Set[int], stops: List[bool]) -> None:
        """A chunk that waited for a failed load-back read garbage: the scheduler discards its
        token and recomputes the request (docs/scheduler.md), so the engine drops the token it
        kept (before, it stayed in the output and the recompute's token came after it: every
        later position read the wrong token)."""
        for i, c in enumerate(plan.prefill):  # prefill rows come first, in this order
            if not c.last or not failed.intersection(int(x) for x in c.waits_for):
                continue
            self.tokens[c.req].pop()
            self.outputs[c.req].pop()
            if c.req in self._first_set:
                self.first_logits.pop(c.req, None)
            stops[i] = False

    def report_losses(self) -> None:
        """Passes what the L3 store lost (its loss journal) to the scheduler, so that no page
        is dropped from host on the strength of a stale "in L3" mark (docs/scheduler.md)."""
        if self.backend is None:
            return
        keys, overflowed, err = read_losses(self.backend)
        if err is not None:
            self.l3_errors += 1
            self.last_l3_error = f"{type(err).__name__}: {err}"
        if overflowed:
            self.s.l3_lost_all()
            self.l3_lost_all_reported += 1
        elif keys:
            self.s.l3_lost(keys)
            self.l3_losses_reported += len(keys)

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
        """Stops the executor and gives the model its own attention back (idempotent)."""
        self.executor.close()
        self.paged.restore()

    def __enter__(self) -> "TorchEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
