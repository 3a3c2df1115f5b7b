"""bindings/bench/vllm_tier.py runs (small sizes) and prints one row per path, bytes checked
inside (a failed job or different bytes raise)."""

import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "vllm_tier.py"


def test_the_benchmark_runs_and_reports_every_path():
    r = subprocess.run([sys.executable, str(BENCH), "--chunks", "2", "--repeat", "1"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert [ln.split(" | ")[0][2:] for ln in rows] == [
        "memcpy (np.copyto)", "kvtier embedded", "kvtier, kvtier-l3 server on loopback", "vLLM fs tier (page cache)"]
