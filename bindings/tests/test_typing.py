"""The typed API a type checker sees is the one that runs.

kvtier ships ``py.typed`` and a hand-written ``kvtier/_native.pyi``: a user's mypy or pyright
reads the stub, not the extension. mypy's ``stubtest`` imports the built extension and
compares it with the stub (every name, signature, default, keyword-only or positional
parameter, property or method, ``@final``); mypy then checks kvtier's own Python (kvtier.vllm,
kvtier.sglang, kvtier.torch, mooncake_compat) against that stub, under the config in
bindings/pyproject.toml ([tool.mypy]). By hand, from the repository root:

    .venv/bin/python -m mypy.stubtest --mypy-config-file bindings/pyproject.toml kvtier._native
    .venv/bin/python -m mypy --config-file bindings/pyproject.toml bindings/python/kvtier
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="mypy is not installed (scripts/test-all installs it into .venv)")

BINDINGS = Path(__file__).resolve().parents[1]
CONFIG = BINDINGS / "pyproject.toml"
PACKAGE = BINDINGS / "python" / "kvtier"
STUB = PACKAGE / "_native.pyi"


def _env(mypypath: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    if mypypath is not None:
        env["MYPYPATH"] = str(mypypath)
    return env


def _stubtest(tmp_path: Path, mypypath: Path | None = None) -> subprocess.CompletedProcess:
    # in tmp_path: no .mypy_cache lands in the checkout
    return subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "--mypy-config-file", str(CONFIG), "kvtier._native"],
        cwd=tmp_path, env=_env(mypypath), capture_output=True, text=True, timeout=300,
    )


def _mypy(tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(CONFIG), "--cache-dir", str(tmp_path / "cache"),
         str(PACKAGE)],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300,
    )


def test_the_stubs_are_the_extensions_api(tmp_path):
    r = _stubtest(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success" in r.stdout


def test_a_stub_that_differs_from_the_extension_is_caught(tmp_path):
    # The check above is not vacuous: a copy of the stub that loses one keyword of
    # L3Store.put (and one that gains a name the extension lacks) fails it, naming each.
    shadow = tmp_path / "stubs" / "kvtier"
    shadow.mkdir(parents=True)
    (shadow / "__init__.pyi").write_text("")
    text = STUB.read_text()
    put = "def put(self, key: str, data: _Buffer, *, soft_pin: bool = False, wait_persisted: bool = False)"
    assert put in text
    text = text.replace(put, "def put(self, key: str, data: _Buffer, *, soft_pin: bool = False)")
    text += "\ndef no_such_function() -> None: ...\n"
    (shadow / "_native.pyi").write_text(text)
    r = _stubtest(tmp_path, mypypath=tmp_path / "stubs")
    assert r.returncode != 0
    assert re.search(r'L3Store\.put is inconsistent, stub does not have parameter "wait_persisted"', r.stdout), r.stdout
    assert "kvtier._native.no_such_function is not present at runtime" in r.stdout, r.stdout


def test_kvtiers_python_type_checks_against_the_stubs(tmp_path):
    r = _mypy(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    # every module of the package was checked (the engines' glue included), not skipped
    checked = int(re.search(r"no issues found in (\d+) source files", r.stdout).group(1))
    assert checked == len(list(PACKAGE.rglob("*.py"))) + len(list(PACKAGE.rglob("*.pyi"))), r.stdout
