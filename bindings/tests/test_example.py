"""The multi-turn example runs and reports hits on every tier."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "multi_turn.py"


@pytest.mark.parametrize("backend", ["embedded", "remote", "compat"])
def test_multi_turn_example(backend):
    p = subprocess.run([sys.executable, str(EXAMPLE), "--backend", backend],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    m = re.search(r"per-tier hits: device (\d+) .*host (\d+) .*L3 (\d+) .*computed (\d+)", p.stdout)
    assert m, p.stdout
    device, host, l3, computed = map(int, m.groups())
    assert device > 0 and host > 0 and l3 > 0 and computed > 0, p.stdout
    probes = [int(n) for n in re.findall(r"(\d+) lease-free L3 probes", p.stdout)]
    reads = [int(n) for n in re.findall(r"(\d+) lease-taking reads", p.stdout)]
    assert len(probes) == 2 and all(n > 0 for n in probes), p.stdout
    assert sum(reads) > 0 and all(r <= q for r, q in zip(reads, probes)), p.stdout


def test_torch_engine_example():
    """examples/torch_engine.py: a HF Llama on kvtier's pools; the second, empty engine reads
    the shared prefixes from L3, and every request matches transformers' generate()."""
    ex = EXAMPLE.parent / "torch_engine.py"
    p = subprocess.run([sys.executable, str(ex)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    l3 = [int(n) for n in re.findall(r"L3 (\d+), computed", p.stdout)]
    assert len(l3) == 2 and l3[0] == 0 and l3[1] > 0, p.stdout
    m = re.search(r"(\d+) of (\d+) requests match", p.stdout)
    assert m and m.group(1) == m.group(2) == "6", p.stdout


def test_torch_engine_example_reference_counts_every_token():
    """The example's reference check (issue 21 item 6): a token equal to ``pad_token_id`` (0)
    inside a prompt is attended to, as in a plain greedy loop over full forwards."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("torch_engine_example", EXAMPLE.parent / "torch_engine.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    ref = ex.tiny_llama("cpu")
    prompt = [5, 0, 17, 0, 0, 42, 9, 0, 3, 77, 0, 1]
    ids = torch.tensor([prompt])
    want = []
    with torch.no_grad():
        for _ in range(5):
            tok = int(ref(ids).logits[0, -1].argmax())
            want.append(tok)
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    assert ex.reference(ref, prompt, 5) == want
