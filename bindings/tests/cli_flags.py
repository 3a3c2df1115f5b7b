"""Whether a documented command line's flags are the ones its Python script accepts, without
running it: the script runs under ``runpy`` with ``argparse.ArgumentParser.parse_args``
replaced by a full parse (every value converted, choices checked, unknown flags refused) that
exits before the script does any work. (``--help`` after the flags would exit before argparse
refuses an unknown flag.)

The lines are parsed in the calling interpreter, one after the other: the benchmark scripts
import vLLM and torch before they parse (~30 s in a fresh interpreter on a loaded 2-core
machine), which a test process has usually done already; a subprocess per line paid that
import once per line."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import runpy
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence
from unittest import mock


@dataclass
class Ran:
    """How a script ran: its exit status (an uncaught exception is 1), stdout and stderr."""

    returncode: int
    stdout: str
    stderr: str


def run_script(script, *args: str) -> Ran:
    """Runs ``python SCRIPT ARGS`` in this interpreter (runpy, ``__main__``), its output
    captured: the scripts import vLLM and torch first, which a test process has done already.
    ``sys.argv`` is restored after."""
    out, err = io.StringIO(), io.StringIO()
    argv, code = sys.argv, 0
    sys.argv = [str(script), *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(script), run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    err.write(e.code)
            except Exception:
                err.write(traceback.format_exc())
                code = 1
    finally:
        sys.argv = argv
    return Ran(code, out.getvalue(), err.getvalue())


def _parse_then_exit(self, args=None, namespace=None):
    _, extra = self.parse_known_args(args, namespace)
    if extra:
        self.error("unrecognized arguments: " + " ".join(extra))
    sys.exit(0)


def check_all(argvs: Sequence[Sequence[str]], cwd: Path) -> List[Ran]:
    """Parses each ``argv`` (script path first, relative to ``cwd``, then its flags) as its
    script would; one result per argv, in order. A script that raises before it parses
    reports 1 with the exception."""
    here = os.getcwd()
    try:
        os.chdir(cwd)
        with mock.patch.object(argparse.ArgumentParser, "parse_args", _parse_then_exit):
            return [run_script(argv[0], *argv[1:]) for argv in argvs]
    finally:
        os.chdir(here)


def check(argv: List[str], cwd: Path) -> Ran:
    """Parses ``argv`` (script path first, then its flags) as the script would."""
    return check_all([argv], cwd)[0]
