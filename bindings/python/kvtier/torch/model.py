"""Model glue: a Hugging Face decoder whose KV lives only in kvtier's device pool.

Why an attention function and not a cache class: transformers lets a model call any
attention function registered in its ``AttentionInterface``, with the layer, the rotated
query/key/value of the new tokens and whatever keyword arguments the caller passed to the
model. Registering :func:`paged_attention` and setting ``config._attn_implementation`` to
it is all a Llama (and every model with the same attention signature) needs: the function
scatters the new tokens' K/V into the pages the plan assigned, gathers the row's whole
context from its page table and attends over it. No transformers cache holds KV, so every
token the model sees came through kvtier's pages (a wrong page shows up as a wrong token).

This path favours being obviously correct over speed (one row per model call, a gather per
layer): it is what the tests and the example run on CPU. A production engine keeps its own
paged attention kernel and calls ``Executor.wait_for_layer(l)`` before layer l reads KV,
as :func:`paged_attention` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from .pools import Attention, DevicePool, KVLayout

__all__ = ["ATTENTION_NAME", "PagedRow", "layout_of", "paged_attention", "use_paged_attention", "run_row"]

ATTENTION_NAME = "kvtier_paged"


@dataclass
class PagedRow:
    """One row of a forward: the new tokens start at ``start``; ``pages`` is the row's page
    table (device page ids, as a long tensor on the pool's device)."""

    pool: DevicePool
    pages: torch.Tensor
    start: int
    wait_for_layer: Optional[Callable[[int], None]] = None


def layout_of(config: Any, page_size: int, dtype: Optional[torch.dtype] = None) -> KVLayout:
    """The KV layout of a Llama-style config (``num_key_value_heads``, ``head_dim``)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVLayout.mha(config.num_hidden_layers, kv_heads, head_dim, page_size, dtype or config.dtype)


def _slots(row: PagedRow, lo: int, hi: int) -> torch.Tensor:
    ps = row.pool.layout.page_size
    pos = torch.arange(lo, hi, device=row.pages.device)
    return row.pages[pos // ps] * ps + pos % ps


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
    row = kvtier_row
    layer = module.layer_idx
    if row.wait_for_layer is not None:
        row.wait_for_layer(layer)
    pool = row.pool
    if pool.layout.attention != Attention.MHA:
        raise ValueError("paged_attention handles K/V (MHA/GQA) pools")
    _, kv_heads, t, head_dim = key.shape
    k_flat = pool.k(layer).view(-1, kv_heads, head_dim)
    v_flat = pool.v(layer).view(-1, kv_heads, head_dim)
    end = row.start + t
    new = _slots(row, row.start, end)
    k_flat.index_copy_(0, new, key[0].transpose(0, 1).to(k_flat.dtype))
    v_flat.index_copy_(0, new, value[0].transpose(0, 1).to(v_flat.dtype))
    ctx = _slots(row, 0, end)
    k = k_flat.index_select(0, ctx).transpose(0, 1).unsqueeze(0).to(query.dtype)
    v = v_flat.index_select(0, ctx).transpose(0, 1).unsqueeze(0).to(query.dtype)
    groups = query.shape[1] // kv_heads
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    q_pos = torch.arange(row.start, end, device=query.device)
    mask = torch.arange(end, device=query.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def use_paged_attention(model: Any) -> None:
    """Registers :func:`paged_attention` and switches ``model`` to it."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    model.config._attn_implementation = ATTENTION_NAME
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and cfg is not model.config and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = ATTENTION_NAME


@torch.inference_mode()
def run_row(model: Any, row: PagedRow, tokens: Sequence[int]) -> torch.Tensor:
    """Runs ``tokens`` (positions ``row.start..``) through ``model`` over paged KV; returns the
    logits of the last token (float32, on the model's device)."""
    dev = row.pages.device
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=dev)[None]
    pos = torch.arange(row.start, row.start + ids.shape[1], device=dev)[None]
    out = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1, kvtier_row=row)
    return out.logits[0, -1].float()
