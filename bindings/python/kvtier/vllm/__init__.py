"""kvtier in vLLM: kvtier's L3 as a secondary tier of vLLM's KV offloading
(``KvtierSecondaryTier``), kvtier's eviction policies for vLLM's host cache
(``KvtierFreqDepthPolicy``, ``KvtierLruPolicy``), and kvtier's scheduler as vLLM's offloading
manager (``KvtierOffloadingSpec``); on CPU, where vLLM refuses offloading, every kvtier spec
and ``KvtierCpuOffloadingSpec`` / ``KvtierTieringOffloadingSpec`` (vLLM's own) copy with
kvtier's CPU copy path (cpu_copy.py). See docs/vllm.md.

Why a package: vLLM loads out-of-tree parts by module path (``"module_path": "kvtier.vllm"``
in ``--kv-transfer-config``), so every class it names must be importable from here.
"""

from .chunks import Chain, ChunkChains, chains_of, group_of, page_of
from .cpu_copy import CpuOffloadError
from .keys import l3_key, layout_of, model_identity, namespace_of
from .manager import KvtierOffloadingManager, KvtierOffloadingSpec
from .spec_config import KvtierSpecConfigError
from .policy import KvtierCachePolicy, KvtierFreqDepthPolicy, KvtierLruPolicy
from .specs import KvtierCpuOffloadingSpec, KvtierTieringOffloadingSpec
from .tier import KvtierSecondaryTier, TierCounters, VllmTierConfigError

__all__ = ["Chain", "ChunkChains", "CpuOffloadError", "KvtierCachePolicy", "KvtierCpuOffloadingSpec",
           "KvtierTieringOffloadingSpec", "KvtierFreqDepthPolicy", "KvtierLruPolicy",
           "KvtierOffloadingManager", "KvtierOffloadingSpec", "KvtierSecondaryTier", "KvtierSpecConfigError",
           "TierCounters",
           "VllmTierConfigError", "chains_of", "group_of", "l3_key", "layout_of", "model_identity", "namespace_of", "page_of"]
