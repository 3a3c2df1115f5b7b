"""Every Python code block of README.md and docs/ runs, as a new user would paste it.

Why: a snippet in the docs is the first thing a new user runs; one that raises (a default
configuration that does not validate, a renamed method) costs them the first five minutes.
Each ```python block runs in a fresh namespace from the repository root; a block that needs
something the docs define earlier must define it itself.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)


def python_blocks():
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for i, m in enumerate(FENCE.finditer(text)):
            line = text[: m.start()].count("\n") + 1
            yield pytest.param(m.group(1), id=f"{path.relative_to(ROOT)}:{line}")


BLOCKS = list(python_blocks())


def test_the_docs_have_python_snippets():
    # Guards the collector itself: a broken regex would make the test below vacuous.
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("code", BLOCKS)
def test_snippet_runs(code, monkeypatch):
    monkeypatch.chdir(ROOT)
    exec(compile(code, "<snippet>", "exec"), {"__name__": "__snippet__"})


def test_first_run_defaults_are_valid():
    import kvtier

    kvtier.Scheduler()
    kvtier.Scheduler(kvtier.SchedulerConfig())
    kvtier.SchedulerConfig().validate()
    kvtier.Scheduler(kvtier.SchedulerConfig(page_size=64, l3_enabled=True))
