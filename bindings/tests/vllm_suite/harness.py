"""A vLLM engine on CPU for kvtier.vllm's tests: the real ``Scheduler``, ``Request``s with
vLLM's block hasher, the real ``OffloadingConnector`` (scheduler side and worker side) with
``TieringOffloadingSpec``; only the GPU DMA is stood in for.

Why: kvtier's tier and policy run in vLLM's scheduler process, so everything they touch is
real here. The one thing a CPU box cannot run is vLLM's ``CPUOffloadingWorker`` (CUDA DMA);
``FakeDma`` replaces just that object inside the real ``OffloadingConnectorWorker`` (as the
spec's worker, which the connector worker's own setup gets over the "GPU": vLLM 0.34 then
hands it each transfer's GPU blocks as addresses in that buffer): it
copies real bytes between a "GPU" buffer (one row per GPU block, all layers) and vLLM's
host chunk slots in /dev/shm, with the sub-block arithmetic of vLLM's worker, and reports
jobs through ``get_finished`` as that worker does. A GPU block's content is a pure function
of (token ids, position, model tag, rank) so every test can say what bytes a block must hold.

Tensor parallelism (``tp``): vLLM's scheduler with ``tensor_parallel_size=tp`` (it counts
``world_size`` completions of every offloading job), one ``OffloadingConnectorWorker`` per
rank (its own rank in its ``OffloadingConfig``, its own "GPU" holding that rank's KV heads,
its own shard of every host slot: bytes ``[rank * shard, (rank + 1) * shard)`` of each row,
as vLLM's ``SharedOffloadRegion`` lays them out), each given its own copy of the step's
connector metadata, and their outputs merged by vLLM's ``KVOutputAggregator``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (  # noqa: E402
    OffloadingConnectorWorker,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    OffloadingWorker,
    TransferResult,
    make_offload_key,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BLOCK = 16  # tokens per GPU block
HEADS, HEAD_DIM, LAYERS = 2, 16, 2
_MODEL_DIRS: Dict[str, str] = {}


def model_dir(root: str, name: str = "tiny-llama", layers: int = LAYERS, heads: int = HEADS,
              head_dim: int = HEAD_DIM) -> str:
    """A hand-written Llama config.json (no weights, no tokenizer: vLLM's ModelConfig only
    reads the config with skip_tokenizer_init)."""
    path = os.path.join(root, f"{name}-{layers}-{heads}-{head_dim}")
    if path not in _MODEL_DIRS:
        os.makedirs(path, exist_ok=True)
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": heads * head_dim * 4,
            "intermediate_size": 64, "num_attention_heads": heads * 4, "num_key_value_heads": heads,
            "num_hidden_layers": layers, "vocab_size": 1000, "max_position_embeddings": 4096,
            "torch_dtype": "float16", "rms_norm_eps": 1e-5,
        }
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
        _MODEL_DIRS[path] = path
    return path


def kv_transfer_config(tiers: Sequence[dict], *, cpu_bytes: int = 1 << 22, bpc: int = 2,
                       policy: str = "lru", policy_module: Optional[str] = None, engine_id: Optional[str] = None,
                       **extra) -> KVTransferConfig:
    ex = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes, "block_size": BLOCK * bpc,
          "eviction_policy": policy, "secondary_tiers": list(tiers), "tier_poll_interval_s": 0, **extra}
    if policy_module:
        ex["cache_policy_module_path"] = policy_module
    return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=ex,
                            engine_id=engine_id or f"kvtier-test-{uuid.uuid4().hex[:12]}")


class FakeDma(OffloadingWorker):
    """vLLM's GPU<->host DMA worker, on CPU: real byte copies between ``gpu`` (rows = GPU
    blocks) and the host chunk slots, reported through ``get_finished`` like vLLM's."""

    def __init__(self, gpu: np.ndarray, host: memoryview, bpc: int):
        self.gpu = gpu
        self.host = np.asarray(host).view(np.uint8)  # (chunks, chunk_bytes), /dev/shm
        self.bpc = bpc
        self.page = gpu.shape[1]
        self.done: List[TransferResult] = []
        self.loads = self.stores = 0
        self.loaded_blocks = 0  # GPU blocks written by loads (host hits the forward used)
        self.hold_loads = False  # True: loads' bytes land, their reports wait for release()
        self.hold_stores = False  # the same for stores
        self.held: List[TransferResult] = []

    def _pairs(self, gpu_spec, cpu_ids):
        """The GPU blocks of a job and the host sub-blocks they go to or come from. vLLM
        0.34 passes the GPU side as ``DevicePointers`` (one address per block, resolved from
        the KV caches the worker was built with: rows of ``gpu`` here), earlier lines as a
        ``GPULoadStoreSpec`` of block ids."""
        if hasattr(gpu_spec, "ptrs"):
            assert (np.asarray(gpu_spec.sizes) == self.page).all(), "one pointer per whole GPU block"
            offsets = np.asarray(gpu_spec.ptrs, dtype=np.uint64) - np.uint64(self.gpu.ctypes.data)
            blocks = (offsets // np.uint64(self.page)).astype(np.int64)
            assert (offsets % np.uint64(self.page) == 0).all() and (blocks < len(self.gpu)).all()
        else:
            blocks = np.asarray(gpu_spec.block_ids, dtype=np.int64)
        skip = int(gpu_spec.block_indices[0]) % self.bpc if len(gpu_spec.block_indices) else 0
        subs = (np.asarray(cpu_ids, dtype=np.int64)[:, None] * self.bpc + np.arange(self.bpc)).reshape(-1)
        subs = subs[skip: skip + len(blocks)]
        return blocks, subs

    def _host_page(self, sub: int) -> np.ndarray:
        c, s = divmod(int(sub), self.bpc)
        return self.host[c, s * self.page:(s + 1) * self.page]

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        blocks, subs = self._pairs(src_spec, dst_spec.block_ids)
        for b, s in zip(blocks, subs):
            self._host_page(s)[:] = self.gpu[b]
        self.stores += 1
        (self.held if self.hold_stores else self.done).append(
            TransferResult(job_id=job_id, success=True, transfer_size=len(blocks) * self.page, transfer_time=0.0))
        return True

    def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool:
        blocks, subs = self._pairs(dst_spec, src_spec.block_ids)
        for b, s in zip(blocks, subs):
            self.gpu[b] = self._host_page(s)
        self.loads += 1
        self.loaded_blocks += len(blocks)
        (self.held if self.hold_loads else self.done).append(
            TransferResult(job_id=job_id, success=True, transfer_size=len(blocks) * self.page, transfer_time=0.0))
        return True

    def release(self) -> None:
        """Reports the held jobs (with the next ``get_finished``)."""
        self.hold_loads = self.hold_stores = False
        self.done.extend(self.held)
        self.held = []

    def get_finished(self):
        out, self.done = self.done, []
        return out

    def wait(self, job_ids) -> None:
        return None


def _req_index(req_ids) -> dict:
    """``ModelRunnerOutput``'s request index, a field up to vLLM 0.33 (0.34 dropped it)."""
    if "req_id_to_index" not in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        return {}
    return {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}}


def block_bytes(tokens: Sequence[int], index: int, tag: str, page: int) -> np.ndarray:
    """What the model computes for GPU block ``index`` of a prompt: a pure function of the
    tokens up to and including the block (and the model tag), so a block loaded from the
    wrong prefix or model is recognised."""
    h = hashlib.sha256(tag.encode() + np.asarray(tokens[: (index + 1) * BLOCK], dtype=np.int64).tobytes())
    seed = int.from_bytes(h.digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, page, dtype=np.uint8)


@dataclass
class Finished:
    req_id: str
    external_tokens: int  # tokens vLLM loaded from the offloading connector (host or L3)
    gpu_ok: bool  # every block the request's forward read held the bytes it must


@dataclass
class Rank:
    """One tensor-parallel worker: its "GPU", its DMA over its shard of the host slots, vLLM's
    worker-side connector, and the prefix bytes each request's forward read on this rank."""

    index: int
    gpu: np.ndarray
    dma: OffloadingWorker  # FakeDma, or Engine.spec_worker's
    worker: OffloadingConnectorWorker
    tag: str
    read: Dict[str, bytes] = field(default_factory=dict)


@dataclass
class Engine:
    """One vLLM engine (scheduler + offloading connector, both sides) on CPU."""

    root: str
    tiers: Sequence[dict]
    model: str = "tiny-llama"
    layers: int = LAYERS
    heads: int = HEADS
    head_dim: int = HEAD_DIM
    dtype: str = "float16"
    tag: Optional[str] = None  # the KV content's identity (defaults to model+layers+dtype)
    num_gpu_blocks: int = 256
    cpu_bytes: int = 1 << 22
    bpc: int = 2
    policy: str = "lru"
    policy_module: Optional[str] = None
    max_num_seqs: int = 8
    tp: int = 1  # tensor-parallel ranks (each holds heads // tp KV heads)
    content: bool = True  # False: no block bytes written or checked (fast replays)
    kv_events: bool = False  # vLLM's KV cache events on (published batches kept in .published)
    extra: dict = field(default_factory=dict)
    kv_config: Optional[KVTransferConfig] = None  # as parsed from a command line (else built from the fields)
    # The spec's worker, spec_worker(kv caches, rank's spec), instead of FakeDma (kvtier's CPU copy
    # worker: test_vllm_cpu_copy.py); the "GPU" is one KV tensor, a row per block, all layers.
    spec_worker: Optional[Callable[[CanonicalKVCaches, Any], OffloadingWorker]] = None
    finished: Dict[str, Finished] = field(default_factory=dict)
    _ok: Dict[str, bool] = field(default_factory=dict)

    def __post_init__(self):
        init_none_hash(sha256_cbor)
        if self.kv_config is not None:
            self.bpc = int(self.kv_config.kv_connector_extra_config.get("block_size", BLOCK)) // BLOCK
        mc = ModelConfig(model=model_dir(self.root, self.model, self.layers, self.heads, self.head_dim), skip_tokenizer_init=True,
                         dtype=self.dtype, max_model_len=4096)
        self.vllm_config = VllmConfig(
            model_config=mc,
            scheduler_config=SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=8192,
                                             max_model_len=4096, is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=BLOCK, prefix_caching_hash_algo="sha256_cbor",
                                     enable_prefix_caching=True),
            device_config=DeviceConfig("cpu"),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tp),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=self.kv_events, publisher="null"),
            kv_transfer_config=self.kv_config or kv_transfer_config(
                self.tiers, cpu_bytes=self.cpu_bytes, bpc=self.bpc, policy=self.policy,
                policy_module=self.policy_module, **self.extra),
        )
        self.vllm_config.cache_config.num_gpu_blocks = self.num_gpu_blocks
        dt = getattr(torch, self.dtype)
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=self.heads // self.tp, head_size=self.head_dim,
                                 dtype=dt)
        layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(self.layers)]
        self.kv_cache_config = KVCacheConfig(num_blocks=self.num_gpu_blocks, kv_cache_tensors=[],
                                             kv_cache_groups=[KVCacheGroupSpec(layer_names, spec)])
        # vLLM's engine builds its workers before its scheduler: a spec whose scheduler side
        # maps the workers' /dev/shm region (kvtier's with kvtier_l3) finds it made, as there.
        self._worker_region = None
        ex = self.vllm_config.kv_transfer_config.kv_connector_extra_config
        if ex.get("spec_name") == "KvtierOffloadingSpec" and ex.get("kvtier_l3") is not None:
            from kvtier.vllm.shm import worker_region

            first = OffloadingSpecFactory.create_spec(build_offloading_config(self.vllm_config, self.kv_cache_config))
            if first.num_chunks:
                self._worker_region = worker_region(first)
        self.sched = Scheduler(self.vllm_config, self.kv_cache_config, StructuredOutputManager(self.vllm_config),
                               block_size=BLOCK, log_stats=True)
        self.connector = self.sched.connector
        self.published: List = []  # KV event batches vLLM's scheduler published
        publish = self.sched.kv_event_publisher.publish
        self.sched.kv_event_publisher.publish = lambda batch: (self.published.append(batch), publish(batch))[1]
        self.cs = self.connector.connector_scheduler
        self.manager = self.cs.manager
        self.page = spec.page_size_bytes * self.layers
        ocfg = build_offloading_config(self.vllm_config, self.kv_cache_config)
        wspec = OffloadingSpecFactory.create_spec(ocfg)
        # The host slots: vLLM's /dev/shm region under tiering (the scheduler maps it too);
        # under a plain CPUOffloadingSpec (kvtier's manager) only the workers hold them.
        if hasattr(self.manager, "primary_tier"):
            host = np.asarray(self.manager.primary_tier.get_kv_memoryview())
        elif getattr(self.manager, "host_view", None) is not None:
            host = np.asarray(self.manager.host_view)  # kvtier's manager with L3 maps the region too
        else:
            host = np.zeros((wspec.num_chunks, max(wspec.kv_bytes_per_chunk, 1)), dtype=np.uint8)
        shard = self.page * self.bpc
        self.ranks: List[Rank] = []
        for r in range(self.tp):
            # The worker side as OffloadingConnector builds it in rank r's GPU worker process.
            rcfg = dataclasses.replace(ocfg, parallel=dataclasses.replace(ocfg.parallel, rank=r))
            rspec = OffloadingSpecFactory.create_spec(rcfg)
            worker = OffloadingConnectorWorker(rspec, self.vllm_config, self.kv_cache_config)
            gpu = np.zeros((self.num_gpu_blocks, self.page), dtype=np.uint8)
            view = host if self.tp == 1 else host.view(np.uint8)[:, r * shard:(r + 1) * shard]
            # vLLM's own worker setup over the "GPU" (one KV tensor, a row per block, all
            # layers), with the spec's worker stood in by FakeDma.
            kv = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(torch.from_numpy(gpu).view(torch.int8), self.page)],
                                   group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=self.page)]])
            if self.spec_worker is None:
                dma = FakeDma(gpu, view, self.bpc)
                rspec.get_worker = lambda _kv, dma=dma: dma
            else:
                rspec.get_worker = lambda kv_, spec=rspec: self.spec_worker(kv_, spec)
            worker._init_worker(kv)  # noqa: SLF001
            self.ranks.append(Rank(r, gpu, worker.worker, worker, ""))
        self.aggregator = KVOutputAggregator.from_connector(self.connector, self.vllm_config.parallel_config.world_size)
        self.hasher = get_request_block_hasher(BLOCK, sha256_cbor)
        self.tag = self.tag or f"{self.model}/{self.layers}/{self.dtype}"
        for rk in self.ranks:
            rk.tag = self.tag if rk.index == 0 else f"{self.tag}/rank{rk.index}"
        self.prompts: Dict[str, List[int]] = {}
        self.loaded: Dict[str, int] = {}
        self.preemptions: Dict[str, int] = {}  # times vLLM preempted each request
        self.stats_payloads: List[dict] = []  # the connector stats vLLM's scheduler reported

    @property
    def tier(self):
        return self.manager.secondary_tiers[0]

    @property
    def gpu(self) -> np.ndarray:
        return self.ranks[0].gpu

    @property
    def dma(self) -> FakeDma:
        return self.ranks[0].dma

    @property
    def worker(self) -> OffloadingConnectorWorker:
        return self.ranks[0].worker

    @property
    def read(self) -> Dict[str, bytes]:
        return self.ranks[0].read

    def add(self, req_id: str, tokens: Sequence[int], max_tokens: int = 2, cache_salt: Optional[str] = None,
            kv_params: Optional[dict] = None):
        """Adds a request; ``kv_params``: its ``kv_transfer_params`` (as a client's extra_args)."""
        extra = None if kv_params is None else {"kv_transfer_params": kv_params}
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        r = Request(req_id, list(tokens), sp, pooling_params=None, block_hasher=self.hasher, cache_salt=cache_salt)
        self.prompts[req_id] = list(tokens)
        self.sched.add_request(r)

    def step(self) -> bool:
        """One engine step; whether it scheduled any tokens."""
        so = self.sched.schedule()
        for rid, r in self.sched.requests.items():
            self.preemptions[rid] = r.num_preemptions
        meta = so.kv_connector_metadata
        outs = []
        for rk in self.ranks:
            # Every rank's worker gets its own copy of the metadata, as over vLLM's RPC.
            m = meta if self.tp == 1 else copy.deepcopy(meta)
            rk.worker.handle_preemptions(m)
            rk.worker.start_kv_transfers(m)
            sampled: Dict[str, List[int]] = {}
            # The "forward": every scheduled token's block is read (checked) or computed (written).
            for req_id, n in so.num_scheduled_tokens.items():
                req = self.sched.requests[req_id]
                start = req.num_computed_tokens - n  # schedule() already advanced it
                self._forward(rk, req, start, n)
                if start + n >= req.num_prompt_tokens:
                    sampled[req_id] = [7]
            rk.worker.prepare_store_kv(m)
            _, recving = rk.worker.get_finished(set(so.finished_req_ids))
            outs.append(ModelRunnerOutput(
                req_ids=list(so.num_scheduled_tokens),
                sampled_token_ids=[sampled.get(r, []) for r in so.num_scheduled_tokens],
                kv_connector_output=KVConnectorOutput(finished_recving=recving or None,
                                                      kv_connector_worker_meta=rk.worker.build_connector_worker_meta()),
                **_req_index(so.num_scheduled_tokens),
            ))
        out = self.aggregator.aggregate(outs)
        eco = self.sched.update_from_output(so, out)
        for outs in eco.values():
            if outs.scheduler_stats is not None and outs.scheduler_stats.kv_connector_stats:
                self.stats_payloads.append(outs.scheduler_stats.kv_connector_stats)
            for o in outs.outputs:
                if o.finish_reason is not None and o.request_id not in self.finished:
                    self.finished[o.request_id] = Finished(o.request_id, self.loaded.get(o.request_id, 0),
                                                           self._ok.pop(o.request_id, True))
        return bool(so.num_scheduled_tokens)

    def _forward(self, rk: Rank, req, start: int, n: int) -> None:
        """Checks the prefix blocks rank ``rk``'s forward reads (those computed before
        ``start``) and writes the blocks it computes; records how many tokens came from
        outside."""
        rid = req.request_id
        if not self.content:
            self.loaded.setdefault(rid, start)
            return
        tokens = self.prompts[rid]
        blocks = self.sched.kv_cache_manager.get_block_ids(rid)[0]
        if rid not in rk.read:
            self.loaded.setdefault(rid, start)
            ok = all(np.array_equal(rk.gpu[blocks[i]], block_bytes(tokens, i, rk.tag, self.page))
                     for i in range(start // BLOCK))
            self._ok[rid] = self._ok.get(rid, True) and ok
            rk.read[rid] = b"".join(rk.gpu[blocks[i]].tobytes() for i in range(start // BLOCK))
        full_end = min(start + n, len(tokens)) // BLOCK
        for i in range(start // BLOCK, full_end):
            rk.gpu[blocks[i]] = block_bytes(tokens, i, rk.tag, self.page)

    def tier_keys_of(self, tokens: Sequence[int], cache_salt: Optional[str] = None) -> List[bytes]:
        """vLLM's offload keys of the full chunks of a prompt (the block hash of each chunk's
        last block, group 0), computed by vLLM's own hasher."""
        r = Request("keys", list(tokens), SamplingParams(max_tokens=1), pooling_params=None,
                    block_hasher=self.hasher, cache_salt=cache_salt)
        return [make_offload_key(h, 0) for h in r.block_hashes[self.bpc - 1::self.bpc]]

    def gpu_bytes_of(self, req_id: str, tokens: Sequence[int]) -> bytes:
        """The bytes a request's forward found in its prefix blocks (those not computed by it)."""
        return self.read[req_id]

    def run(self, timeout_s: float = 120.0) -> None:
        """Steps until every request finished and the tiers are idle. A step that scheduled
        nothing (requests waiting on a lookup probe or a load) is followed by a 1 ms pause,
        as an idle engine loop would wait, so kvtier's and vLLM's background threads run."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not (self.sched.has_requests() or self.manager.has_pending_work()):
                return
            if not self.step():
                time.sleep(0.001)
        raise AssertionError(f"engine did not go idle in {timeout_s} s")

    def reset_gpu_cache(self) -> None:
        self.sched.reset_prefix_cache()

    def close(self) -> None:
        for rk in self.ranks:
            if isinstance(rk.dma, FakeDma):
                rk.dma.host = np.zeros((0, 0), dtype=np.uint8)  # our views of /dev/shm, so vLLM can unmap it
            else:
                rk.dma.shutdown()
        self.sched.shutdown()
        if self._worker_region is not None:
            self._worker_region.cleanup()
