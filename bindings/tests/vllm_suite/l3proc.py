"""A real ``kvtier-l3`` server process on 127.0.0.1 for the bindings' tests (killable, and
restartable on the same port): kvtier.vllm's import it from this folder, the others through
``conftest.L3Process``."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
from typing import Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[3]


def l3_binary() -> str:
    """``$KVTIER_L3_BIN``, else the workspace's release build (built here if missing)."""
    env = os.environ.get("KVTIER_L3_BIN")
    if env:
        return env
    path = ROOT / "target" / "release" / "kvtier-l3"
    if not path.exists():
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "kvtier-l3", "--bin", "kvtier-l3"],
                       cwd=ROOT, check=True)
    return str(path)


class L3Process:
    """``kvtier-l3 --listen ADDR`` with a token (from ``KVTIER_L3_TOKEN``, as an operator
    would pass it), DRAM only; ``extra``: more flags (``--kv-events …``)."""

    def __init__(self, token: Optional[str] = None, segment_bytes: int = 64 << 20, addr: str = "127.0.0.1:0",
                 extra: Sequence[str] = ()):
        self.token, self.segment_bytes, self.extra = token, segment_bytes, list(extra)
        env = dict(os.environ)
        env.pop("KVTIER_L3_TOKEN", None)
        if token:
            env["KVTIER_L3_TOKEN"] = token
        self.proc = subprocess.Popen(
            [l3_binary(), "--listen", addr, "--segment-bytes", str(segment_bytes), *self.extra],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        line = self.proc.stdout.readline().strip() if self.proc.stdout else ""
        if not line.startswith("LISTENING "):
            self.proc.kill()
            raise RuntimeError(f"kvtier-l3 did not start: {line!r}")
        self.addr = line.split(" ", 1)[1]

    def kill(self) -> None:
        """SIGKILL: the server dies mid-run, as a crashed node would."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def restart(self) -> "L3Process":
        """A new, empty server on the same address."""
        self.kill()
        return L3Process(self.token, self.segment_bytes, self.addr, self.extra)
