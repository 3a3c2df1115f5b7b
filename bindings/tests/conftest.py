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
