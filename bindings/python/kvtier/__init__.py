"""kvtier: KV-cache tiering for LLM serving engines, from Python.

The engine loop::

    import kvtier
    s = kvtier.Scheduler(kvtier.SchedulerConfig(page_size=64, device_pages=4096, host_pages=8192))
    s.submit(1, prompt_token_ids, max_new_tokens=128)
    while True:
        plan = s.next_execution_plan(now_ms)
        ...  # run plan.ops, then the forward (plan.prefill chunks, plan.decode_* columns)
        s.on_event(kvtier.LoadBackDone(op.id))
        s.forward_done(plan.step, reqs, tokens, stops)

``kvtier.engine`` is a complete reference executor (numpy arrays as KV pools, a pluggable L3
backend); ``kvtier.mooncake_compat.MooncakeDistributedStore`` is a drop-in replacement of
Mooncake's store class backed by kvtier's L3 store.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

from . import _native
from ._native import (  # noqa: F401  (re-exports)
    AgreementError,
    BackUpDone,
    BadCompletionError,
    BufferOverflowError,
    CacheError,
    ClientNotFoundError,
    CompletionOutOfOrderError,
    ConfigError,
    DuplicateCompletionError,
    DuplicateRequestError,
    EpochFencedError,
    EventsError,
    ExecutionPlan,
    FileOpenFailError,
    FileReadFailError,
    FileWriteFailError,
    FoundNeedsAgreementError,
    ForwardDone,
    IllegalClientError,
    IllegalEventError,
    InvalidKeyError,
    InvalidParamsError,
    InvalidRequestError,
    KvEventPublisher,
    KvtierError,
    L3Error,
    L3InternalError,
    L3QueryDone,
    L3Server,
    L3Store,
    LeaseExpiredError,
    LoadBackDone,
    LossNeedsAgreementError,
    NoAvailableHandleError,
    NotInStepError,
    ObjectAlreadyExistsError,
    ObjectHasLeaseError,
    ObjectNotFoundError,
    OffloadManager,
    OffloadManagerError,
    PlannedOp,
    PrefetchDone,
    PrefillChunk,
    ProtocolMismatchError,
    QueryResults,
    RankAgreement,
    ReplicaIsGoneError,
    ReplicaNotReadyError,
    RowCountMismatchError,
    RpcFailError,
    Scheduler,
    SchedulerError,
    SegmentAlreadyExistsError,
    SegmentNotFoundError,
    UnableOffloadError,
    UnableOffloadingError,
    UnavailableError,
    UnavailableInModeError,
    UnknownOpError,
    UnknownRequestError,
    UnknownStepError,
    WriteBackDone,
    WrongCompletionKindError,
    eviction_ranks,
    l3_charge,
    page_hashes,
    parse_l3_key,
)

__version__: str = _native.__version__

_DEFAULTS: Dict[str, Any] = _native.default_config()


def _default(name: str) -> Any:
    v = _DEFAULTS[name]
    if isinstance(v, dict):
        return field(default_factory=lambda: dict(v))
    return field(default=v)


@dataclass
class SchedulerConfig:
    """Scheduler configuration (defaults are the Rust ``SchedulerConfig::default()``).

    Policies are strings: ``prefetch_stop`` in {"best_effort", "wait_complete", "timeout"}
    (with ``prefetch_timeout_base_ms`` and ``prefetch_timeout_per_1k_tokens_ms``),
    ``write_policy`` in {"write_through", "write_through_selective", "write_back"} (with
    ``write_hit_threshold``), ``retraction`` in {"latest_arrival", "fewest_generated",
    "most_pages"}, ``l3_sharing`` in {"per_rank", "replicated"} (with ``l3_leader_rank``: MLA
    models, where one rank probes and backs up for all). ``namespace`` is a dict with keys model, dtype, layout, tenant, adapter
    (it selects the L3 key namespace). ``tenant_quota_device_pages`` / ``tenant_quota_host_pages``
    cap the pages each tenant (each distinct ``cache_salt``) holds per tier, cached or in use
    by its requests; no tenant's allocation evicts a tenant within its quota (None: no cap;
    see docs/scheduler.md). ``eviction`` is ``"lru"`` (default), ``"freq-depth"`` or
    ``"freq-depth:CREDIT_PAGES:MAX_USES:DEBIT_PER_PAGE"`` (see docs/sim.md). ``host_admission`` is ``"on-finish"`` (default: pages computed on
    device get a host copy when their request finishes) or ``"on-device-eviction:AHEAD_PAGES"``
    (demotion: device pages are written to host just before device evicts them).
    ``queue_protection`` is ``"waiting"`` (default: the pages of waiting requests' prompts are
    evicted after every other cached page, until they are admitted) or ``"off"``. ``tp_ranks``
    is the tensor-parallel group's size (1: a single rank; ``rank`` must be below it): above 1
    the scheduler is one rank of several and refuses the direct ``l3_lost`` / ``l3_lost_all``
    (``LossNeedsAgreementError``): losses go through ``RankAgreement.lost`` and
    ``agree_losses``. ``shadow_sample_salt`` picks which 1-in-R sample the ``"shadow"`` eviction
    policy's shadows replay at capacities where they are sampled, and ``shadow_full_size_pages``
    up to which device + host capacity they are exact (default 65,536; above, 1 prefix in
    ⌈capacity / it⌉ is replayed, and the shadows' memory stays within 4 × it pages of
    metadata: docs/sim/shadow.md). ``kv_events_max_bytes`` (64 MiB by default) bounds the events
    ``record_kv_events=True`` keeps between two ``drain_kv_events()``: past it they are dropped
    and the next drain answers ``{"type": "cleared"}`` and every copy held now (a resync).
    ``validate()`` raises ``ConfigError`` naming the field.
    """

    page_size: int = _default("page_size")
    device_pages: int = _default("device_pages")
    host_pages: int = _default("host_pages")
    max_batch_size: int = _default("max_batch_size")
    token_budget: int = _default("token_budget")
    chunked_prefill_size: int = _default("chunked_prefill_size")
    mixed_prefill_decode: bool = _default("mixed_prefill_decode")
    host_enabled: bool = _default("host_enabled")
    l3_enabled: bool = _default("l3_enabled")
    prefetch_threshold: int = _default("prefetch_threshold")
    prefetch_stop: str = _default("prefetch_stop")
    prefetch_timeout_base_ms: int = _default("prefetch_timeout_base_ms")
    prefetch_timeout_per_1k_tokens_ms: int = _default("prefetch_timeout_per_1k_tokens_ms")
    write_policy: str = _default("write_policy")
    write_hit_threshold: int = _default("write_hit_threshold")
    keep_device_after_write_back: bool = _default("keep_device_after_write_back")
    retraction: str = _default("retraction")
    max_context_tokens: int = _default("max_context_tokens")
    namespace: Dict[str, str] = _default("namespace")
    rank: int = _default("rank")
    l3_sharing: str = _default("l3_sharing")
    l3_leader_rank: int = _default("l3_leader_rank")
    record_kv_events: bool = _default("record_kv_events")
    kv_events_max_bytes: int = _default("kv_events_max_bytes")
    tenant_quota_device_pages: Optional[int] = _default("tenant_quota_device_pages")
    tenant_quota_host_pages: Optional[int] = _default("tenant_quota_host_pages")
    eviction: str = _default("eviction")
    host_admission: str = _default("host_admission")
    queue_protection: str = _default("queue_protection")
    tp_ranks: int = _default("tp_ranks")
    shadow_sample_salt: int = _default("shadow_sample_salt")
    shadow_full_size_pages: int = _default("shadow_full_size_pages")

    def validate(self) -> None:
        """Raises ``ConfigError`` (or ``TypeError``) if the configuration is invalid."""
        _native.validate_config(self)

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a plain dict (``SchedulerConfig(**d)`` rebuilds it)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SchedulerConfig":
        """Builds a config from a dict of fields (unknown keys raise ``TypeError``)."""
        return cls(**dict(d))

    def replace(self, **changes: Any) -> "SchedulerConfig":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


OP_KINDS = tuple(_native.op_kinds())
"""Cache op kinds, as ``PlannedOp.kind`` spells them."""

EVENT_TYPES = (L3QueryDone, PrefetchDone, LoadBackDone, WriteBackDone, BackUpDone, ForwardDone)
"""Every completion event class."""

__all__ = [n for n in dir() if not n.startswith("_") and n not in ("annotations", "dataclass", "dataclasses", "field", "Any", "Dict", "Mapping", "Optional")]
