"""kvtier's SGLang plugin (entry point group ``sglang.srt.plugins``, name ``kvtier``): SGLang
calls ``register`` in the launcher and in every scheduler process, and it makes
``--radix-cache-backend kvtier`` select :class:`kvtier.sglang.radix.KvtierRadixCache`."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    """Registers the ``kvtier`` radix-cache backend (once per process; a second call is a no-op)."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from .radix import BACKEND_NAME, kvtier_radix_cache_factory

    if get_radix_cache_factory(BACKEND_NAME) is kvtier_radix_cache_factory:
        return
    register_radix_cache_backend(BACKEND_NAME, kvtier_radix_cache_factory)
    logger.debug("kvtier: registered radix-cache backend %r", BACKEND_NAME)
