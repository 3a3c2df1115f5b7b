"""kvtier in vLLM: kvtier's L3 as a secondary tier of vLLM's KV offloading
(``KvtierSecondaryTier``) and kvtier's eviction
policies for vLLM's host cache (``KvtierFreqDepthPolicy``, ``KvtierLruPolicy``). See docs/vllm.md.

Why a package: vLLM loads out-of-tree parts by module path (``"module_path": "kvtier.vllm"``
in ``--kv-transfer-config``), so every class it names must be importable from here.
"""

from .keys import l3_key, layout_of, namespace_of
from .policy import KvtierCachePolicy, KvtierFreqDepthPolicy, KvtierLruPolicy
from .tier import KvtierSecondaryTier, TierCounters, VllmTierConfigError

__all__ = ["KvtierCachePolicy", "KvtierFreqDepthPolicy", "KvtierLruPolicy", "KvtierSecondaryTier", "TierCounters", "VllmTierConfigError", "l3_key", "layout_of", "namespace_of"]
