"""bench_vllm_cpu.py's arithmetic, without an engine: the table's medians and paired ratios
(docs/vllm.md's figures come from it) and the profile's attribution of time to parts."""

from __future__ import annotations

import cProfile
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vllm_cpu as bench  # noqa: E402


def run(mode, mib, rep, p50, reused, of=3072):
    return {"host_mib": mib, "mode": mode, "repeat": rep, "ttft_p50": p50, "ttft_p99": p50 * 2, "tok_s": 100.0,
            "reused": reused, "of": of, "load_before": 1.0, "load_after": 2.0}


def rows_of(out: str):
    return {tuple(ln.split()[:2]): ln.split() for ln in out.splitlines()
            if ln.split()[:1] and ln.split()[0].isdigit()}


def test_the_table_pairs_each_repeat_with_vllms_run_of_that_repeat(capsys):
    # kvtier at 2x, 0.5x and 0.5x vLLM's run of the same repeat: the paired median is 0.5,
    # the ratio of the two medians (0.030 / 0.050) would be 0.6.
    runs = [run("vllm", 64, 0, 0.02, 3072), run("spec", 64, 0, 0.04, 3072),
            run("vllm", 64, 1, 0.05, 3072), run("spec", 64, 1, 0.025, 3072),
            run("vllm", 64, 2, 0.06, 3072), run("spec", 64, 2, 0.03, 3072)]
    bench.table({"runs": runs, "kv_blocks": 24, "prefixes": 6, "prefix_tokens": 512, "repeats": 3})
    rows = rows_of(capsys.readouterr().out)
    assert rows[("64", "vllm")][2] == "0.050" and rows[("64", "spec")][2] == "0.030"  # medians
    assert rows[("64", "vllm")][3] == "0.020" and rows[("64", "spec")][3] == "0.025"  # the fastest repeat
    assert rows[("64", "vllm")][8] == "1.00" and rows[("64", "spec")][8] == "0.50"


def test_the_table_says_when_a_mode_reuses_what_vllm_does_not(capsys):
    runs = [run("vllm", 16, 0, 0.09, 0), run("spec", 16, 0, 0.09, 0), run("spec_l3", 16, 0, 0.03, 3072),
            run("spec_l3", 16, 1, 0.03, 2048), run("vllm", 16, 1, 0.09, 0), run("spec", 16, 1, 0.09, 0)]
    bench.table({"runs": runs, "kv_blocks": 24, "prefixes": 6, "prefix_tokens": 512, "repeats": 2})
    rows = rows_of(capsys.readouterr().out)
    assert rows[("16", "spec")][9] == "1.00"  # nothing either way: as many
    assert rows[("16", "spec_l3")][9] == "inf"
    assert rows[("16", "spec_l3")][6] == "2048-3072/3072"  # reuse that differs between repeats is shown


def _module(tmp_path: Path, rel: str, src: str):
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(rel.replace("/", "_")[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_profile_counts_nested_calls_of_a_part_once(tmp_path):
    # An engine step calling kvtier's manager, whose lookup calls its chains (both kvtier's
    # manager part): the part's time is that of the step's calls into it, not their sum with
    # the nested call.
    chains = _module(tmp_path, "kvtier/vllm/chunks.py", "def locate(n):\n    return sum(range(n))\n")
    manager = _module(tmp_path, "kvtier/vllm/manager.py",
                      "def lookup(chains, n):\n    return chains.locate(n) + chains.locate(n)\n")
    core = _module(tmp_path, "vllm/v1/engine/core.py",
                   "def step(manager, chains):\n"
                   "    for _ in range(50):\n"
                   "        manager.lookup(chains, 20000)\n"
                   "    return sum(range(200000))\n")
    def engine():  # a caller inside the profile (vLLM's engine loop)
        return core.step(manager, chains)

    prof = cProfile.Profile()
    prof.enable()
    engine()
    prof.disable()
    out = tmp_path / "p"
    prof.dump_stats(str(out))
    got = bench.attribute(str(out))
    import pstats

    stats = pstats.Stats(str(out)).stats
    (lookup,) = [v for k, v in stats.items() if k[2] == "lookup"]
    (step,) = [v for k, v in stats.items() if k[2] == "step"]
    assert got["kvtier manager"] == lookup[3] > 0  # the lookups' cumulative time, once
    assert got["engine step"] == step[3] > got["kvtier manager"]
    assert got["vLLM manager"] == got["copy"] == 0
    assert got["steps"] == 1


def test_the_manager_times_are_per_request_medians_over_repeats(capsys):
    # Three repeats of one mode: per-run totals 30, 12 and 21 µs; the median total is 21,
    # and each call's figure is its own median (lookup 9, prepare_load 10), the largest first.
    runs = []
    for rep, us in enumerate(({"lookup": 20.0, "prepare_load": 10.0}, {"lookup": 4.0, "prepare_load": 8.0},
                              {"lookup": 9.0, "prepare_load": 12.0})):
        r = run("spec", 64, rep, 0.01, 3072)
        r["manager_us"] = us
        runs.append(r)
    bench.table({"runs": runs, "kv_blocks": 24, "prefixes": 6, "prefix_tokens": 512, "repeats": 3})
    out = capsys.readouterr().out
    section = out.split("offloading manager time per request")[1].splitlines()[1]
    assert section.split()[:3] == ["64", "spec", "21.0"], section
    assert section.split("(")[1] == "prepare_load 10.0, lookup 9.0)", section
