"""kvtier.vllm's tests run in their own venv (.venv-vllm: vLLM 0.34.0 pins transformers
< 5.23, the main venv has 5.23); scripts/test-all runs them as a separate pytest call."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def engines(tmp_path):
    """``make(tiers, **kw)``: a harness engine (harness.py) in the test's directory; every
    engine made is closed when the test ends."""
    from harness import Engine

    made = []

    def make(tiers, **kw):
        e = Engine(str(tmp_path), tiers, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
