"""Which models kvtier.torch serves, and the typed refusal of the rest.

Why a list and not "try and see": a model whose attention the paged glue does not implement
(logit softcapping, attention sinks, chunked or linear attention layers, an MLA variant
with an indexer) still runs through it and produces plausible, wrong tokens. So the config is
checked when the model is switched to paged attention, and :func:`paged_attention` refuses
any attention argument it does not know at the first forward, each with an
:class:`UnsupportedModelError` naming the feature. docs/torch.md lists the refusals; each has
a test (``bindings/tests/test_torch_support.py``).

Served: causal decoders with K/V attention (MHA, GQA, MQA, any head_dim, attention bias),
sliding windows (per layer, as the model passes them), and DeepSeek-V2/V3 MLA (latents in a
``KVLayout.mla`` pool).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from .errors import UnsupportedModelError

__all__ = ["IGNORED_KWARGS", "MLA_MODEL_TYPES", "check_model", "expects_window", "mla_dims"]

MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
"""Models whose attention hands (latent, rope key) to ``past_key_values.update``, which
:class:`~kvtier.torch.model.LatentCache` serves."""

IGNORED_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions", "position_embeddings"})
"""Attention arguments that do not change what attention computes over paged KV."""

_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def mla_dims(config: Any) -> Optional[Tuple[int, int]]:
    """``(kv_lora_rank, qk_rope_head_dim)`` of an MLA config, None for K/V attention."""
    rank = getattr(config, "kv_lora_rank", None)
    if rank is None:
        return None
    return int(rank), int(config.qk_rope_head_dim)


def check_model(config: Any) -> None:
    """Raises :class:`UnsupportedModelError` naming the first feature of ``config`` (a
    transformers config) that kvtier.torch does not serve."""
    kind = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{kind}: encoder-decoder models (cross-attention KV) are not served")
    if mla_dims(config) is not None and kind not in MLA_MODEL_TYPES:
        raise UnsupportedModelError(f"{kind}: an MLA variant other than DeepSeek-V2/V3 ({', '.join(MLA_MODEL_TYPES)})")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError(f"{kind}: attention logit softcapping is not served")
    if getattr(config, "attention_chunk_size", None) is not None:
        raise UnsupportedModelError(f"{kind}: chunked attention (attention_chunk_size) is not served")
    other = sorted(set(getattr(config, "layer_types", None) or ()) - _LAYER_TYPES)
    if other:
        raise UnsupportedModelError(f"{kind}: layer types {other} are not served (only {sorted(_LAYER_TYPES)})")


def expects_window(config: Any, layer: int) -> bool:
    """Whether ``config`` declares a sliding window for ``layer`` (``layer_types``, else a
    ``sliding_window`` for every layer). Some models (Qwen2-MoE, PhiMoE) put the window only
    into the attention mask, which paged attention does not read: their windowed layers call
    it without ``sliding_window`` and are refused rather than served without the window."""
    types = getattr(config, "layer_types", None)
    if types:
        return 0 <= layer < len(types) and types[layer] == "sliding_attention"
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True) is not False
