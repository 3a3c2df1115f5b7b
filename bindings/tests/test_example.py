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
    requeried = [int(n) for n in re.findall(r"(\d+) re-queried", p.stdout)]
    reused = [int(n) for n in re.findall(r"(\d+) prefetches reused", p.stdout)]
    assert requeried == [0, 0] and sum(reused) > 0, p.stdout  # every prefetch reused its query
