"""Typed errors of ``kvtier.torch``.

Why a family of its own: an engine choosing a mover at start-up wants to catch "this mover
cannot run here" (no CUDA, no cuda-python, CUDA older than 12.8, no Triton) and fall back, and
must be able to tell that apart from a pool whose layout does not fit the scheduler (a
configuration bug to fix, not to fall back from).
"""

from __future__ import annotations

from .. import KvtierError

__all__ = [
    "KvtierTorchError",
    "MoverUnavailableError",
    "PoolLayoutError",
    "ExecutorError",
    "CopyError",
    "UnsupportedModelError",
    "NamespaceError",
]


class KvtierTorchError(KvtierError):
    """Base class of the errors ``kvtier.torch`` raises."""


class MoverUnavailableError(KvtierTorchError):
    """The requested page mover cannot run on this machine (the message says what is missing)."""


class PoolLayoutError(KvtierTorchError, ValueError):
    """A pool's tensors do not have the shape, dtype, device or memory layout required."""


class ExecutorError(KvtierTorchError):
    """An op the executor cannot run (unknown tier, a page outside the pool, a closed executor)."""


class CopyError(KvtierTorchError):
    """The CUDA runtime refused a copy a mover issued (the message carries its error code); the
    op it belonged to completes as failed."""


class UnsupportedModelError(KvtierTorchError, ValueError):
    """The model uses an attention feature the paged glue does not serve (the message names
    it): refused, never served wrong. docs/torch.md lists what is refused."""


class NamespaceError(KvtierTorchError, ValueError):
    """An engine on an L3 store without an L3 namespace: another model's pages on the same
    store would be read as this model's KV."""
