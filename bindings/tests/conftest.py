"""Shared fixtures: small scheduler configurations and L3 stores."""

import numpy as np
import pytest

import kvtier


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

collect_ignore = [] if _ilu.find_spec("vllm") else ["vllm_suite"]
