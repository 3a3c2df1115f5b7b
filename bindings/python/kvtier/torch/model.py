"""Model glue: a Hugging Face decoder whose KV lives only in kvtier's device pool.

Why an attention function and not a cache class: transformers lets a model call any
attention function registered in its ``AttentionInterface``, with the layer, the rotated
query/key/value of the new tokens and whatever keyword arguments the caller passed to the
model. Registering :func:`paged_attention` and setting ``config._attn_implementation`` to
it is all a Llama (and every model with the same attention signature) needs: the function
scatters the new tokens' K/V into the pages the plan assigned, gathers the row's whole
context from its page table and attends over it. No transformers cache holds KV, so every
token the model sees came through kvtier's pages (a wrong page shows up as a wrong token).

MLA models (DeepSeek-V2/V3) are the exception: what they cache is not K and V but one
compressed latent and one rope key per token, which only exist inside the attention module,
before ``kv_b_proj`` expands them. transformers hands exactly those to
``past_key_values.update``; :class:`LatentCache` is that cache for one row: it writes the
latents into a ``KVLayout.mla`` pool and returns the row's whole context of latents, which
the module expands and passes on to :func:`paged_attention`.

Every layout is checked where it is used: the K/V (or latent) tensors the model produces
must have the pool's shape, else :class:`PoolLayoutError`; attention features this path does
not implement raise :class:`UnsupportedModelError` (see :mod:`kvtier.torch.support`), never
a silently wrong token. Sliding windows are served: a query attends only to the last
``sliding_window`` positions, and pages wholly before the window are not read.

This path favours being obviously correct over speed (one row per model call, a gather per
layer): it is what the tests and the example run on CPU. A production engine keeps its own
paged attention kernel and calls ``Executor.wait_for_layer(l)`` before layer l reads KV,
as :func:`paged_attention` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn.functional as F

from torch.nn.attention.bias import causal_lower_right

from .errors import PoolLayoutError, UnsupportedModelError
from .pools import Attention, DevicePool, KVLayout
from .support import IGNORED_KWARGS, check_model, expects_window, mla_dims

__all__ = [
    "ATTENTION_NAME",
    "LatentCache",
    "PagedAttention",
    "PagedRow",
    "layout_of",
    "paged_attention",
    "use_paged_attention",
    "run_row",
]

ATTENTION_NAME = "kvtier_paged"


@dataclass
class PagedRow:
    """One row of a forward: the new tokens start at ``start``; ``pages`` is the row's page
    table (device page ids, as a long tensor on the pool's device)."""

    pool: DevicePool
    pages: torch.Tensor
    start: int
    wait_for_layer: Optional[Callable[[int], None]] = None
    latent_layers: Set[int] = field(default_factory=set)
    """MLA: the layers whose latents went through :class:`LatentCache` in this call."""
    slots: Dict[Tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    """The pool slots of positions ``lo..hi``, computed by the first layer that needs them and
    reused by the others (every layer reads the same positions); cleared by :func:`run_row`."""


def layout_of(config: Any, page_size: int, dtype: Optional[torch.dtype] = None) -> KVLayout:
    """The KV layout of a config: ``KVLayout.mla`` (latent ``kv_lora_rank`` +
    ``qk_rope_head_dim``) for DeepSeek-V2/V3-style MLA, else K/V with
    ``num_key_value_heads`` and ``head_dim`` (``hidden_size / heads`` when unset)."""
    dt = dtype or config.dtype
    mla = mla_dims(config)
    if mla is not None:
        return KVLayout.mla(config.num_hidden_layers, mla[0] + mla[1], page_size, dt)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVLayout.mha(config.num_hidden_layers, kv_heads, head_dim, page_size, dt)


def _slots(row: PagedRow, lo: int, hi: int) -> torch.Tensor:
    got = row.slots.get((lo, hi))
    if got is not None:
        return got
    ps = row.pool.layout.page_size
    if hi > row.pages.numel() * ps:
        raise PoolLayoutError(f"positions up to {hi} need {-(-hi // ps)} pages, the row's table has {row.pages.numel()}")
    pos = torch.arange(lo, hi, device=row.pages.device)
    out = row.pages[pos // ps] * ps + pos % ps
    row.slots[(lo, hi)] = out
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as bytes (its last dimension times the element size)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _scatter(flat: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """``flat[slots] = new`` in ``flat``'s dtype, copied as bytes: torch has no CPU
    ``index_copy_`` / ``index_select`` for FP8 (torch 2.14), and an FP8 KV pool failed every
    forward (a TorchEngine with ``kv_dtype=torch.float8_e4m3fn`` could not even be built)."""
    _bytes(flat).index_copy_(0, slots, _bytes(new.to(flat.dtype).contiguous()))


def _gather(flat: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``flat[slots]`` (gathered as bytes, see :func:`_scatter`) converted to ``dtype``."""
    return _bytes(flat).index_select(0, slots).view(flat.dtype).to(dtype)


def _refuse_integer_pool(layout: KVLayout) -> None:
    """The glue casts K/V to the pool's dtype: into an integer pool (int8) that truncates them
    (a quantized cache needs scales this path does not have), wrong tokens with no error."""
    if not layout.dtype.is_floating_point:
        raise PoolLayoutError(f"a KV pool of {layout.dtype}: the model glue serves floating-point KV only "
                              "(an integer cache would hold the K/V truncated)")


def _expect(t: torch.Tensor, shape: Tuple[int, ...], what: str, layout: KVLayout) -> None:
    if tuple(t.shape) != shape:
        raise PoolLayoutError(f"{what}: the model gave {tuple(t.shape)}, the pool's {layout} needs {shape}")


class LatentCache:
    """``past_key_values`` for one MLA row: ``update(kv_nope, k_rot, layer)`` writes the new
    tokens' latents (``[1, 1, t, kv_lora_rank]`` and ``[1, 1, t, qk_rope_head_dim]``, rope
    applied) into the row's pages and returns the row's whole context of both."""

    def __init__(self, row: PagedRow) -> None:
        self.row = row

    def update(self, kv_nope: torch.Tensor, k_rot: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        row = self.row
        layout = row.pool.layout
        if layout.attention != Attention.MLA:
            raise PoolLayoutError(f"the model caches MLA latents, the pool is {layout.attention.value}")
        _refuse_integer_pool(layout)
        t = int(kv_nope.shape[2]) if kv_nope.dim() == 4 else -1
        rank = int(kv_nope.shape[-1])
        latent = layout.chunk_shape[1]
        _expect(kv_nope, (1, 1, t, rank), "MLA latent", layout)
        _expect(k_rot, (1, 1, t, latent - rank), "MLA rope key", layout)
        if row.wait_for_layer is not None:
            row.wait_for_layer(layer_idx)
        flat = row.pool.k(layer_idx).view(-1, latent)
        end = row.start + t
        new = torch.cat([kv_nope[0, 0], k_rot[0, 0]], dim=-1)
        _scatter(flat, _slots(row, row.start, end), new)
        ctx = _gather(flat, _slots(row, 0, end), kv_nope.dtype)
        row.latent_layers.add(layer_idx)
        return ctx[:, :rank].view(1, 1, end, rank), ctx[:, rank:].view(1, 1, end, latent - rank)


def _attend(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: int, start: int,
            window: Optional[int], scaling: Optional[float]) -> torch.Tensor:
    """Causal (and windowed) attention of queries at ``start..`` over keys at ``lo..``.

    Without a window the keys end where the queries end, so the mask is the lower-right
    causal one, which SDPA serves with its fused kernels (no mask tensor); grouped KV heads are
    attended as they are (``enable_gqa``), not repeated. (The first H100 run computed 128 tokens
    over an 8K prefix in 40 ms with an explicit mask and repeated heads: docs/torch.md.)"""
    end = start + query.shape[2]
    if window is None:
        mask: Any = causal_lower_right(query.shape[2], end - lo)
    else:
        q_pos = torch.arange(start, end, device=query.device)[:, None]
        k_pos = torch.arange(lo, end, device=query.device)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling,
                                         enable_gqa=query.shape[1] != k.shape[1])
    return out.transpose(1, 2).contiguous()


def _check_kwargs(kwargs: Any) -> Optional[int]:
    """The sliding window, if any; refuses attention arguments this path does not implement."""
    for name, val in kwargs.items():
        if name == "is_causal":
            if val is False:
                raise UnsupportedModelError("non-causal attention (is_causal=False) is not served")
            continue
        if name in IGNORED_KWARGS or val is None or val is False:
            continue
        if name != "sliding_window":
            raise UnsupportedModelError(f"attention argument {name!r} (e.g. logit softcapping or attention sinks)"
                                        " is not served by kvtier's paged attention")
    window = kwargs.get("sliding_window")
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise UnsupportedModelError(f"sliding_window={window!r} is not a positive token count")
    return window


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    kvtier_row: Optional[PagedRow] = None,
    **kwargs: Any,
):
    """transformers attention over paged KV (batch of one row; see the module docs)."""
    if kvtier_row is None:
        raise ValueError("paged_attention needs kvtier_row=PagedRow(...) passed to the model call")
    if not getattr(module, "is_causal", True):
        raise UnsupportedModelError(f"{type(module).__name__} is not causal attention")
    window = _check_kwargs(kwargs)
    row = kvtier_row
    layer = module.layer_idx
    if window is None and expects_window(getattr(module, "config", None), layer):
        raise UnsupportedModelError(f"layer {layer}: the config declares a sliding window the attention call does not"
                                    " pass (the model keeps it in its mask only)")
    pool = row.pool
    layout = pool.layout
    if query.shape[0] != 1:
        raise PoolLayoutError(f"paged attention runs one row per call, got a batch of {query.shape[0]}")
    t = int(query.shape[2])
    end = row.start + t
    if layout.attention == Attention.MLA:
        # The latents went through LatentCache: key and value are the row's whole context.
        if layer not in row.latent_layers:
            raise PoolLayoutError(f"layer {layer}: an MLA pool, but the model did not pass its latents "
                                  "through past_key_values (not an MLA model?)")
        if key.shape[2] != end or value.shape[2] != end:
            raise PoolLayoutError(f"layer {layer}: {key.shape[2]} context keys for {end} positions")
        return _attend(query, key, value, 0, row.start, window, scaling), None
    _refuse_integer_pool(layout)
    if row.wait_for_layer is not None:
        row.wait_for_layer(layer)
    _, kv_heads, head_dim = layout.chunk_shape
    _expect(key, (1, kv_heads, t, head_dim), f"layer {layer} key", layout)
    _expect(value, (1, kv_heads, t, head_dim), f"layer {layer} value", layout)
    if query.shape[1] % kv_heads:
        raise PoolLayoutError(f"{query.shape[1]} query heads are not a multiple of the pool's {kv_heads} KV heads")
    k_flat = pool.k(layer).view(-1, kv_heads, head_dim)
    v_flat = pool.v(layer).view(-1, kv_heads, head_dim)
    new = _slots(row, row.start, end)
    _scatter(k_flat, new, key[0].transpose(0, 1))
    _scatter(v_flat, new, value[0].transpose(0, 1))
    lo = max(0, row.start - window + 1) if window is not None else 0  # pages before the window: not read
    ctx = _slots(row, lo, end)
    k = _gather(k_flat, ctx, query.dtype).transpose(0, 1).unsqueeze(0)
    v = _gather(v_flat, ctx, query.dtype).transpose(0, 1).unsqueeze(0)
    return _attend(query, k, v, lo, row.start, window, scaling), None


class PagedAttention:
    """What :func:`use_paged_attention` changed, to undo it: ``restore()``, or use it as a
    context manager (``with use_paged_attention(model): ...``)."""

    def __init__(self, model: Any, previous: List[Tuple[Any, Any]]) -> None:
        self.model = model
        self._previous = previous

    def restore(self) -> None:
        """Gives every config its attention implementation back (idempotent)."""
        for cfg, impl in reversed(self._previous):
            cfg._attn_implementation = impl
        self._previous = []

    def __enter__(self) -> "PagedAttention":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def use_paged_attention(model: Any) -> PagedAttention:
    """Checks that kvtier serves ``model`` (else :class:`UnsupportedModelError`), registers
    :func:`paged_attention` and switches ``model`` to it; the handle returned undoes it."""
    from transformers import AttentionInterface

    check_model(model.config)
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    previous: List[Tuple[Any, Any]] = []
    seen: Set[int] = set()
    for cfg in [model.config] + [getattr(m, "config", None) for m in model.modules()]:
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "_attn_implementation"):
            continue
        seen.add(id(cfg))
        previous.append((cfg, cfg._attn_implementation))
        cfg._attn_implementation = ATTENTION_NAME
    return PagedAttention(model, previous)


@torch.inference_mode()
def run_row(model: Any, row: PagedRow, tokens: Sequence[int]) -> torch.Tensor:
    """Runs ``tokens`` (positions ``row.start..``) through ``model`` over paged KV; returns the
    logits of the last token (float32, on the model's device)."""
    dev = row.pages.device
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=dev)[None]
    pos = torch.arange(row.start, row.start + ids.shape[1], device=dev)[None]
    row.latent_layers.clear()
    row.slots.clear()
    cache = LatentCache(row) if row.pool.layout.attention == Attention.MLA else None
    out = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=False, logits_to_keep=1,
                kvtier_row=row)
    return out.logits[0, -1].float()
