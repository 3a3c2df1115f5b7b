"""Short names for kvtier's vLLM parts, registered through the ``vllm.general_plugins``
entry point (bindings/pyproject.toml).

Why: with the names registered a config says ``"type": "kvtier"`` and
``"eviction_policy": "kvtier-freq-depth"`` instead of class names plus module paths (which
keep working). vLLM runs general plugins in every process and possibly several times per
process, and its ``register_*`` raise on a second registration, so ``register`` checks
first and is idempotent.
"""

from __future__ import annotations

TIER_NAME = "kvtier"
POLICY_NAMES = {"kvtier-freq-depth": "KvtierFreqDepthPolicy", "kvtier-lru": "KvtierLruPolicy"}


def register() -> None:
    """Registers ``kvtier`` (secondary tier) and ``kvtier-freq-depth`` / ``kvtier-lru``
    (host-cache policies) with vLLM's factories; a no-op when already registered."""
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    if TIER_NAME not in SecondaryTierFactory._registry:
        SecondaryTierFactory.register_tier(TIER_NAME, "kvtier.vllm.tier", "KvtierSecondaryTier")
    for name, cls in POLICY_NAMES.items():
        if name not in CachePolicyFactory._registry:
            CachePolicyFactory.register_cache_policy(name, "kvtier.vllm.policy", cls)
