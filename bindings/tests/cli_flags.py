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
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence
from unittest import mock


@dataclass
class Parsed:
    """How one line parsed: argparse's exit status (0: accepted) and what it wrote to stderr."""

    returncode: int
    stderr: str


def _parse_then_exit(self, args=None, namespace=None):
    _, extra = self.parse_known_args(args, namespace)
    if extra:
        self.error("unrecognized arguments: " + " ".join(extra))
    sys.exit(0)


def check_all(argvs: Sequence[Sequence[str]], cwd: Path) -> List[Parsed]:
    """Parses each ``argv`` (script path first, relative to ``cwd``, then its flags) as its
    script would; one result per argv, in order. A script that raises before it parses
    reports 1 with the exception."""
    out = []
    argv0, here = sys.argv, os.getcwd()
    try:
        os.chdir(cwd)
        with mock.patch.object(argparse.ArgumentParser, "parse_args", _parse_then_exit):
            for argv in argvs:
                sys.argv = list(argv)
                err, code = io.StringIO(), 0
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    try:
                        runpy.run_path(argv[0], run_name="__main__")
                    except SystemExit as e:
                        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                        if isinstance(e.code, str):
                            err.write(e.code)
                    except Exception as e:
                        code = 1
                        err.write(f"{type(e).__name__}: {e}")
                out.append(Parsed(code, err.getvalue()))
    finally:
        sys.argv = argv0
        os.chdir(here)
    return out


def check(argv: List[str], cwd: Path) -> Parsed:
    """Parses ``argv`` (script path first, then its flags) as the script would."""
    return check_all([argv], cwd)[0]
