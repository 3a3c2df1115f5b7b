"""Every command line of the project's own binaries in README.md and docs/ is one the binary
accepts, and the quick ones run.

Why: the shell blocks of the docs are how a user reproduces a figure (`l3-bench`,
`l3-chaos`) or runs the simulator (`kvtier sim`). A renamed or removed flag turns such a line
into an error the user meets first. test_docs_snippets.py runs the Python blocks; this runs
the shell ones that name ``kvtier`` (the simulator CLI), ``kvtier-l3``, ``l3-bench`` or
``l3-chaos``:

- every such line is given to the real binary (built by ``cargo test --workspace
  --all-targets --release``, as scripts/test-all does first) with ``--help`` appended: clap
  refuses a flag it does not know (exit 2) before it prints the help;
- ``kvtier sim`` lines that neither sweep nor replay a trace file (a second or less each) run
  for real and must exit 0.

A line whose arguments are placeholders (``a|b``, ``<its kvtier-l3>``) is skipped and
listed, so a reader sees what is not checked.
"""

import os
import pathlib
import shlex
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BIN = pathlib.Path(os.environ.get("KVTIER_BIN_DIR", ROOT / "target" / "release"))
# How a doc line names each binary -> the binary's file name.
NAMES = {
    "target/release/l3-bench": "l3-bench",
    "target/release/l3-chaos": "l3-chaos",
    "target/release/kvtier-l3": "kvtier-l3",
    "kvtier-l3": "kvtier-l3",
    "kvtier": "kvtier",
}
CARGO_SIM = ["cargo", "run", "--release", "-p", "kvtier-sim", "--bin", "kvtier", "--"]


def shell_blocks(text):
    """(first line number, lines) of each ```sh / ```bash / unlabeled block: fences are read
    line by line (a closing fence is never taken for an opening one)."""
    block, lang, first = None, None, 0
    for n, raw in enumerate(text.splitlines(), 1):
        fence = raw.strip()
        if block is None:
            if fence.startswith("```"):
                block, lang, first = [], fence[3:].strip(), n + 1
        elif fence == "```":
            if lang in ("sh", "bash", ""):
                yield first, block
            block = None
        else:
            block.append(raw)


def doc_lines():
    """(where, argv) of each shell line that runs one of the project's binaries."""
    for path in DOCS:
        for first, lines in shell_blocks(path.read_text(encoding="utf-8")):
            logical, start = "", None
            for i, raw in enumerate(lines):
                line = "" if raw.lstrip().startswith("#") else raw.split(" #", 1)[0].rstrip()
                if start is None:
                    start = first + i
                if line.endswith("\\"):
                    logical += line[:-1] + " "
                    continue
                logical += line
                cmd = logical.split(" | ", 1)[0].strip()
                where = f"{path.relative_to(ROOT)}:{start}"
                logical, start = "", None
                try:
                    argv = shlex.split(cmd)
                except ValueError:
                    continue
                if argv[: len(CARGO_SIM)] == CARGO_SIM:
                    argv = ["kvtier", *argv[len(CARGO_SIM):]]
                if argv and argv[0] in NAMES and (argv[0] != "kvtier" or argv[1:2] in (["sim"], ["l3"])):
                    yield where, [NAMES[argv[0]], *argv[1:]]


LINES = list(doc_lines())


def placeholder(argv):
    return any("|" in a or a.startswith("<") or a.endswith(">") for a in argv)


def binary(name):
    b = BIN / name
    if not b.exists():
        pytest.fail(f"{b} missing: build it with `cargo build --release --workspace --bins`")
    return str(b)


def test_the_docs_name_the_binaries():
    # Guards the collector: a broken regex would make the tests below vacuous.
    names = {argv[0] for _, argv in LINES}
    assert {"kvtier", "l3-bench", "l3-chaos"} <= names, names
    assert len(LINES) >= 20


def test_an_unknown_flag_is_refused():
    # Guards the check itself: `--help` must not hide an unknown flag.
    r = subprocess.run([binary("l3-bench"), "--no-such-flag", "--help"], capture_output=True)
    assert r.returncode == 2


@pytest.mark.parametrize("where,argv", LINES, ids=[w for w, _ in LINES])
def test_the_binary_accepts_the_line(where, argv):
    if placeholder(argv):
        pytest.skip(f"placeholder arguments: {argv}")
    r = subprocess.run([binary(argv[0]), *argv[1:], "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{where}: {' '.join(argv)}\n{r.stderr}"


QUICK = [(w, a) for w, a in LINES
         if a[:2] == ["kvtier", "sim"] and "--sweep" not in a and "--trace" not in a and not placeholder(a)]


@pytest.mark.parametrize("where,argv", QUICK, ids=[w for w, _ in QUICK])
def test_quick_simulator_lines_run(where, argv, tmp_path):
    r = subprocess.run([binary("kvtier"), *argv[1:]], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, f"{where}: {' '.join(argv)}\n{r.stderr[-2000:]}"
    assert r.stdout.strip(), f"{where}: printed nothing"
