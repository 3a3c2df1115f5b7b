#!/usr/bin/env python3
"""A PyTorch engine loop on kvtier: a Hugging Face Llama whose KV lives in kvtier's pools.

Each step: kvtier plans; the executor starts the plan's copies and L3 I/O; the forward waits
for what it reads (per layer); completions go back to the scheduler. Two conversations share
a system prompt, small pools push KV to host and L3, and a second engine that starts empty
finds the prefixes in L3. The tokens are checked against transformers' own generate().

    python examples/torch_engine.py                 # CPU, tiny random Llama
    python examples/torch_engine.py --device cuda --mover dma
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvtier
from kvtier.engine import KvtierL3Backend
from kvtier.torch import DevicePool, Executor, HostPool, LoadWait, torch_namespace
from kvtier.torch.model import PagedRow, layout_of, run_row, use_paged_attention


def tiny_llama(device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, dtype=torch.float32)
    return LlamaForCausalLM(cfg).eval().to(device)


def reference(ref: LlamaForCausalLM, prompt: list, max_new: int) -> list:
    """transformers' greedy generate() on one prompt. The attention mask is explicit: without
    it generate() infers one from pad_token_id, and a generated token equal to it inside a
    later turn's prompt would be masked out."""
    ref.generation_config.eos_token_id, ref.generation_config.pad_token_id = None, 0
    dev = next(ref.parameters()).device
    ids = torch.tensor([prompt], device=dev)
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt):].tolist()


def serve(prompts: dict, store: kvtier.L3Store, args) -> dict:
    """One engine instance: serves ``prompts`` ({request id: tokens}) to completion."""
    model = tiny_llama(args.device)
    use_paged_attention(model)  # attention reads and writes KV through kvtier's page tables
    layout = layout_of(model.config, page_size=4)
    # The L3 namespace names what makes KV incompatible (model, config, dtype, layout, page
    # size): another model on the same store never reads these pages as its own.
    sched = kvtier.Scheduler(kvtier.SchedulerConfig(
        page_size=4, device_pages=16, host_pages=64, max_batch_size=4, token_budget=64,
        chunked_prefill_size=32, max_context_tokens=64, l3_enabled=True, prefetch_threshold=2,
        keep_device_after_write_back=False, namespace=torch_namespace(model, layout)))
    device_pool = DevicePool.allocate(layout, 16, args.device)
    host_pool = HostPool.allocate(layout, 64)  # page-first, pinned when CUDA is available
    ex = Executor(device_pool, host_pool, KvtierL3Backend(store), mover=args.mover)
    tables, tokens, out = {}, {}, {}
    for r, p in prompts.items():
        sched.submit(r, np.asarray(p, dtype=np.uint32), args.max_new)
        tokens[r], out[r] = list(p), []

    def forward_row(req, start, toks):
        pages = torch.tensor(tables[req], dtype=torch.long, device=args.device)
        logits = run_row(model, PagedRow(device_pool, pages, start, ex.wait_for_layer), toks)
        return int(torch.argmax(logits))

    def apply(req, frm, pages):  # page tables arrive as deltas
        if frm is not None and frm >= 0:
            tables[req] = tables.get(req, [])[:frm] + [int(x) for x in pages]

    now = 0
    while not (sched.is_idle() and ex.in_flight() == 0):
        plan = sched.next_execution_plan(now)
        for r in [r for r, _ in plan.ended] + list(plan.retracted):
            tables.pop(r, None)
        ex.submit(plan.ops)                       # copies and L3 I/O start on their lanes
        ex.terminate(plan.terminate_prefetch)     # reported once their reads landed
        if plan.step is None:
            for ev in ex.poll():
                sched.on_event(ev)
            if not plan.ops:
                ex.wait_any(0.05)
            now += 1
            continue
        ex.wait_before_forward(plan, LoadWait.PER_LAYER)  # layer l waits in wait_for_layer(l)
        reqs, toks = [], []
        for c in plan.prefill:
            apply(c.req, c.table_from, c.table_pages)
            tok = forward_row(c.req, c.start, c.tokens.tolist())
            if c.last:
                tokens[c.req].append(tok)
                out[c.req].append(tok)
            reqs.append(c.req)
            toks.append(tok)
        offs = plan.decode_table_offsets
        for i, (r, p) in enumerate(zip(plan.decode_reqs.tolist(), plan.decode_positions.tolist())):
            apply(r, int(plan.decode_table_from[i]), plan.decode_table_pages[offs[i]:offs[i + 1]])
            tok = forward_row(r, p, [tokens[r][p]])
            tokens[r].append(tok)
            out[r].append(tok)
            reqs.append(r)
            toks.append(tok)
        waited = [op.id for op in plan.ops if op.before_forward]
        failed = set()
        for ev in ex.poll(require=waited):        # op completions before the forward's
            if isinstance(ev, kvtier.LoadBackDone) and not ev.success:
                failed.add(ev.op)
            sched.on_event(ev)
        for c in plan.prefill:  # a chunk that waited for a failed load read garbage: the
            if c.last and failed.intersection(int(x) for x in c.waits_for):  # scheduler
                tokens[c.req].pop()                # discards its token and recomputes the
                out[c.req].pop()                   # request, so we drop it too
        sched.forward_done(plan.step, np.asarray(reqs, dtype=np.uint64), np.asarray(toks, dtype=np.uint32))
        now += 1
    s = sched.stats()
    print(f"device {s['device_hit_tokens']}, host {s['host_hit_tokens']}, L3 {s['l3_hit_tokens']}, "
          f"computed {s['computed_tokens']} tokens; ops {dict(sorted(ex.stats.ops.items()))}")
    ex.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mover", default="torch", choices=["torch", "dma", "kernel"])
    ap.add_argument("--max-new", type=int, default=6)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    system = rng.integers(1, 128, size=20).tolist()
    turn1 = {r: system + rng.integers(1, 128, size=6).tolist() for r in range(3)}
    store = kvtier.L3Store.embedded(64 << 20)
    out1 = serve(turn1, store, args)
    turn2 = {r + 10: turn1[r] + out1[r] + rng.integers(1, 128, size=4).tolist() for r in range(3)}
    out1.update(serve(turn2, store, args))  # a second engine, empty, on the same L3
    ref = tiny_llama(args.device)
    same = 0
    for r, p in {**turn1, **turn2}.items():
        same += out1[r] == reference(ref, p, args.max_new)
    print(f"{same} of {len(out1)} requests match transformers' generate()")


if __name__ == "__main__":
    main()
