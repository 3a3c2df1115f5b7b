"""bindings/bench/vllm_tier.py runs (small sizes) and prints one row per path, bytes checked
inside (a failed job or different bytes raise)."""

import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "vllm_tier.py"
# The bench scripts run in this interpreter (cli_flags.run_script): each fresh one re-imported
# vLLM and torch (~30 s on a loaded 2-core machine).
sys.path.insert(0, str(BENCH.parents[1] / "tests"))
from cli_flags import check_all, run_script  # noqa: E402


def test_the_benchmark_runs_and_reports_every_path():
    r = run_script(BENCH, "--chunks", "2", "--repeat", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert [ln.split(" | ")[0][2:] for ln in rows] == [
        "memcpy (np.copyto)", "kvtier embedded", "kvtier, kvtier-l3 server on loopback", "vLLM fs tier (page cache)"]


COST = BENCH.parent / "vllm_manager_cost.py"


def test_the_manager_cost_benchmark_times_every_manager_through_vllms_connector():
    r = run_script(COST, "--requests", "24", "--repeats", "1", "--chunks", "64")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert [row[0] for row in rows] == [
        "vLLM CPUOffloadingSpec (lru)", "kvtier KvtierOffloadingSpec (lru)",
        "kvtier KvtierOffloadingSpec (freq-depth)", "kvtier KvtierOffloadingSpec (lru) + kvtier_l3",
        "vLLM TieringOffloadingSpec (lru) + KvtierSecondaryTier",
        "vLLM TieringOffloadingSpec (lru) + vLLM's example tier (no bytes)"]
    assert head[:4] == ["manager", "us / request", "/ vLLM's", "host hit rate"]
    # Every manager was called (lookups and stores at least) and vLLM's is the reference.
    for row in rows:
        cells = dict(zip(head, row))
        assert float(cells["us / request"]) > 0
        assert float(cells["lookup"]) > 0 and float(cells["prepare_store"]) > 0, cells
    assert rows[0][2] == "1.00"


def test_the_reuse_workload_serves_every_chunk_from_host_with_the_reference_row():
    """``--workload reuse``: the timed round is all host hits (vLLM's and kvtier's managers
    alike), and the reference row (kvtier walking the chain per lookup) is there."""
    r = run_script(COST, "--workload", "reuse", "--requests", "4", "--prompt-chunks", "6", "--repeats", "1",
                   "--chunks", "64")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {row[0]: dict(zip(head, row)) for row in
            ([c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:])}
    assert "kvtier KvtierOffloadingSpec (lru), a walk per lookup (before)" in rows
    for name in ("vLLM CPUOffloadingSpec (lru)", "kvtier KvtierOffloadingSpec (lru)",
                 "kvtier KvtierOffloadingSpec (lru), a walk per lookup (before)"):
        # 6 whole chunks of 6 * 32 + 5 tokens: every whole block loaded from host
        assert float(rows[name]["host hit rate"]) == 1.0, rows[name]


def test_the_docs_bench_command_lines_are_the_scripts_flags():
    """Every ``.venv-vllm/bin/python bindings/bench/...`` line of docs/vllm.md and docs/vllm/
    names a script and flags that script accepts (cli_flags.py: parsed, not run)."""
    import shlex

    root = BENCH.parents[2]
    pages = [root / "docs" / "vllm.md", *sorted((root / "docs" / "vllm").glob("*.md"))]
    lines = [ln for page in pages for ln in page.read_text().splitlines()
             if ln.startswith(".venv-vllm/bin/python bindings/bench/")]
    assert len(lines) >= 3
    bad_line = ["bindings/bench/vllm_manager_cost.py", "--no-such-flag"]
    *results, bad = check_all([shlex.split(ln)[1:] for ln in lines] + [bad_line], root)
    for ln, r in zip(lines, results):
        assert r.returncode == 0, (ln, r.stderr[-2000:])
    assert bad.returncode != 0 and "unrecognized" in bad.stderr, "the check refuses an unknown flag"
