"""Whether a documented command line's flags are the ones its Python script accepts, without
running it: the script runs under ``runpy`` with ``argparse.ArgumentParser.parse_args``
replaced by a full parse (every value converted, choices checked, unknown flags refused) that
exits before the script does any work. (``--help`` after the flags would exit before argparse
refuses an unknown flag.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import List

_PROBE = """
import argparse, runpy, sys

def parse_args(self, args=None, namespace=None):
    ns, extra = self.parse_known_args(args, namespace)
    if extra:
        self.error("unrecognized arguments: " + " ".join(extra))
    sys.exit(0)

argparse.ArgumentParser.parse_args = parse_args
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def check(argv: List[str], cwd: Path, python: str = sys.executable) -> subprocess.CompletedProcess:
    """Parses ``argv`` (script path first, then its flags) as the script would."""
    return subprocess.run([python, "-c", _PROBE, *argv], cwd=cwd, capture_output=True, text=True, timeout=120)
