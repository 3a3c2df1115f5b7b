"""kvtier.vllm's tests run in their own venv (.venv-vllm: vLLM 0.34.0 pins transformers
< 5.23, the main venv has 5.23); scripts/test-all runs them as a separate pytest call."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
