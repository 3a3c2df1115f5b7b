"""kvtier.torch: run kvtier's plans on real KV in PyTorch tensors.

The part of an engine between the plan and the hardware: KV pools in the layout attention
kernels read (device) and L3 stores (host, page-first, pinned), page movers (``torch``,
``dma``, ``kernel``), an executor that runs each plan's ops on their own lanes (CUDA streams
on GPU, worker threads everywhere), enforces the ordering contracts and reports each
completion only after its bytes landed, and glue that runs a Hugging Face model over the
paged KV. See docs/torch.md.

    from kvtier.torch import DevicePool, HostPool, KVLayout, Executor
    layout = KVLayout.mha(num_layers=32, kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
    ex = Executor(DevicePool.allocate(layout, 4096, "cuda"), HostPool.allocate(layout, 8192),
                  KvtierL3Backend(store), mover="dma")
    ex.submit(plan.ops); ex.terminate(plan.terminate_prefetch)
    ex.wait_before_forward(plan, LoadWait.PER_LAYER)   # then wait_for_layer(l) in layer l
    for ev in ex.poll(): scheduler.on_event(ev)
"""

from __future__ import annotations

from .errors import (
    CopyError,
    ExecutorError,
    KvtierTorchError,
    MoverUnavailableError,
    NamespaceError,
    PoolLayoutError,
    UnsupportedModelError,
)
from .executor import Executor, ExecutorStats, LoadWait, Ordering
from .lanes import Lane, Signal
from .movers import MOVERS, Direction, Mover, TorchMover, make_mover
from .namespace import torch_namespace, weights_fingerprint
from .pools import Attention, DevicePool, HostOrder, HostPool, KVLayout, Pinning

__all__ = [
    "Attention",
    "DevicePool",
    "Direction",
    "Executor",
    "CopyError",
    "ExecutorError",
    "ExecutorStats",
    "HostOrder",
    "HostPool",
    "KVLayout",
    "KvtierTorchError",
    "Lane",
    "LoadWait",
    "MOVERS",
    "Mover",
    "MoverUnavailableError",
    "NamespaceError",
    "Ordering",
    "Pinning",
    "PoolLayoutError",
    "Signal",
    "TorchEngine",
    "TorchMover",
    "UnsupportedModelError",
    "make_mover",
    "torch_namespace",
    "weights_fingerprint",
]


def __getattr__(name: str):
    # The engine pulls in transformers glue lazily: pools, movers and the executor do not need it.
    if name == "TorchEngine":
        from .engine import TorchEngine

        return TorchEngine
    raise AttributeError(name)
