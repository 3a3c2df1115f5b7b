"""Where copies run: lanes (a worker thread, plus a CUDA stream on GPU) and the signals that
say when the work issued on them has finished.

Why a thread per lane even on GPU: the ``torch`` mover must wait on the host between its
stages (a gather on the CPU before an upload, a download before a scatter on the CPU), and a
dependency on an L3 read that is still running can only be waited for on the host. Doing that
on the engine's thread would stall the forward pass; doing it on the lane's thread stalls only
that lane, which is what a CUDA stream would do anyway. GPU-ordered movers (``dma``,
``kernel``) never wait on the host for a GPU dependency: they make the lane's stream wait on
the dependency's CUDA event.

A :class:`Signal` is resolved when its work has been *issued*: on CPU the work is then done;
on GPU it carries the CUDA event recorded after the work, and is done when that event is.
``done()`` never blocks (what ``Executor.poll`` asks), ``wait()`` blocks the calling thread,
``wait_on_stream(s)`` makes stream ``s`` wait without blocking anyone.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, List, Optional, Sequence

import torch

__all__ = ["Signal", "Lane", "LaneContext"]


class Signal:
    """Completion of one piece of work on a lane (see the module docs)."""

    __slots__ = ("_issued", "_event", "_error")

    def __init__(self) -> None:
        self._issued = threading.Event()
        self._event: Optional[torch.cuda.Event] = None
        self._error: Optional[BaseException] = None

    @staticmethod
    def done_now() -> "Signal":
        s = Signal()
        s.resolve()
        return s

    def resolve(self, event: Optional["torch.cuda.Event"] = None, error: Optional[BaseException] = None) -> None:
        if self._issued.is_set():
            return
        self._event = event
        self._error = error
        self._issued.set()

    @property
    def resolved(self) -> bool:
        return self._issued.is_set()

    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    def done(self) -> bool:
        """True once the work finished (never blocks)."""
        if not self._issued.is_set():
            return False
        return self._event is None or bool(self._event.query())

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the work finished; False on timeout (before it was issued)."""
        if not self._issued.wait(timeout):
            return False
        if self._event is not None:
            self._event.synchronize()
        return True

    def wait_on_stream(self, stream: "torch.cuda.Stream") -> None:
        """Makes ``stream`` wait for the work (blocks the caller only until it is issued)."""
        self._issued.wait()
        if self._event is not None:
            stream.wait_event(self._event)


class LaneContext:
    """What a task running on a lane uses to mark its progress."""

    def __init__(self, lane: "Lane") -> None:
        self.lane = lane

    @property
    def stream(self) -> Optional["torch.cuda.Stream"]:
        return self.lane.stream

    def mark(self, sig: Signal, error: Optional[BaseException] = None) -> None:
        """Resolves ``sig`` at this point of the lane's work (records an event on GPU)."""
        if self.lane.stream is not None and error is None:
            ev = torch.cuda.Event()
            ev.record(self.lane.stream)
            sig.resolve(ev)
        else:
            sig.resolve(error=error)


Task = Callable[[LaneContext], None]


class Lane:
    """A FIFO of tasks on one worker thread (and one CUDA stream when ``device`` is CUDA).

    ``submit(deps, task, signals)``: the task starts after every dep is done (stream-waited on
    GPU when ``gpu_deps_on_stream``, host-waited otherwise) and must resolve each of its
    signals through ``ctx.mark``; any it left unresolved (an exception) are resolved with the
    error, so nobody waits forever."""

    def __init__(self, name: str, device: torch.device, gpu_deps_on_stream: bool = True) -> None:
        self.name = name
        self.device = device
        self.stream: Optional[torch.cuda.Stream] = (
            torch.cuda.Stream(device=device) if device.type == "cuda" else None
        )
        self.gpu_deps_on_stream = gpu_deps_on_stream
        self._q: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._ctx = LaneContext(self)
        self._thread = threading.Thread(target=self._run, name=f"kvtier-{name}", daemon=True)
        self._thread.start()

    def submit(self, deps: Sequence[Signal], task: Task, signals: Sequence[Signal]) -> None:
        self._q.put((list(deps), task, list(signals)))

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            item = self._q.get()
            if item is None:
                return
            deps, task, signals = item
            try:
                for d in deps:
                    if self.stream is not None and self.gpu_deps_on_stream:
                        d.wait_on_stream(self.stream)
                    else:
                        d.wait()
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        task(self._ctx)
                else:
                    task(self._ctx)
            except BaseException as e:  # noqa: BLE001 - reported through the signals
                for s in signals:
                    s.resolve(error=e)
                continue
            for s in signals:
                if not s.resolved:  # a task that forgot a signal: resolve it at the end
                    self._ctx.mark(s)


def all_done(signals: List[Signal]) -> bool:
    return all(s.done() for s in signals)
