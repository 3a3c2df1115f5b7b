"""An SGLang "engine" on CPU made of SGLang's own scheduler pieces (tests and the benchmark):
its KV pool (``MHATokenToKVPool``), paged allocator, request-to-token pool, a prefix cache
(SGLang's ``RadixCache`` or kvtier's backend), ``Req``, ``PrefillAdder.add_one_req`` for
admission, ``ScheduleBatch.prepare_for_extend`` for allocation and ``release_kv_cache`` for
the final checkpoint, and the per-step ``flush_pending_backups`` hook, in the order SGLang's
scheduler calls them. Only the model is replaced: the "forward" writes each token's KV as a
pure function of (model, salt, tokens up to it), and checks, before writing, that every
prefix row the request reuses (device hit, or loaded from host or L3) holds exactly that
content: a page loaded from the wrong slot, another model's or salt's bytes, or a torn copy
fails the run."""

from __future__ import annotations

import argparse
import time
import types
import warnings
from array import array
from typing import Any, Callable, List, Optional

warnings.filterwarnings("ignore", message=".*support.*currently", category=UserWarning)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import (  # noqa: E402
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
)
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from kvtier.sglang import radix as kr  # noqa: E402

LAYERS, HEADS, DIM = 2, 2, 4
PS = 4  # the tests' page size (tokens)


def kvtier_cache(**cfg):
    """A cache factory for ``Engine``: kvtier's radix backend under ``cfg`` (its config keys;
    ``store``: an L3 store handle, ``model``: the namespace's model name), I/O inline."""
    store = cfg.pop("store", None)
    model = cfg.pop("model", "model-a")
    cfg.setdefault("io_threads", 0)
    conf = kr.RadixBackendConfig.from_dict(cfg)
    return lambda params: kr.KvtierRadixCache(params, conf, model=model, store=store)


def prompts(seed, n, length, vocab=50_000):
    """``n`` random prompts of ``length`` tokens (token ids from 1)."""
    g = np.random.default_rng(seed)
    return [g.integers(1, vocab, length).tolist() for _ in range(n)]


_PUBLISHED = {}


def publish_server_args(args: Optional[List[str]] = None, page_size: int = 4) -> ServerArgs:
    """SGLang's scheduler pieces read the process's ServerArgs: publish parsed ones (CPU)."""
    words = list(args or ["--model-path", "dummy", "--device", "cpu"]) + ["--page-size", str(page_size)]
    key = tuple(words)
    if key not in _PUBLISHED:
        p = argparse.ArgumentParser()
        ServerArgs.add_cli_args(p)
        _PUBLISHED[key] = ServerArgs.from_cli_args(p.parse_args(words))
    get_context().set_server_args(_PUBLISHED[key])
    return _PUBLISHED[key]


def oracle(model: str, salt: Optional[str], tokens) -> torch.Tensor:
    """The KV value of every position of ``tokens`` (one float per token; exact in float32)."""
    v = hash((model, salt or "")) % 1_000_003
    out = []
    for t in tokens:
        v = (v * 1_000_033 + int(t) + 1) % 1_000_003
        out.append(float(v))
    return torch.tensor(out, dtype=torch.float32)


class Mismatch(AssertionError):
    pass


class Engine:
    """One SGLang scheduler's cache side (module doc). ``cache`` builds the prefix cache from
    SGLang's ``CacheInitParams``; ``device_tokens`` sizes the device KV pool."""

    def __init__(self, cache: Callable[[CacheInitParams], Any], *, page_size: int = 4, device_tokens: int = 64,
                 model: str = "model-a", max_reqs: int = 8, max_context: int = 512,
                 shape: tuple = (LAYERS, HEADS, DIM), mla: bool = False):
        publish_server_args(page_size=page_size)
        self.ps, self.model = page_size, model
        self.layers, self.heads, self.dim = shape
        if mla:  # DeepSeek-style latent KV: one buffer per layer (kv_lora_rank + rope dims)
            self.kv = MLATokenToKVPool(device_tokens, page_size, torch.float32, self.heads * self.dim - 4, 4,
                                       self.layers, "cpu", False)
            self.bufs = list(self.kv.kv_buffer)
        else:
            self.kv = MHATokenToKVPool(device_tokens, page_size, torch.float32, self.heads, self.dim,
                                       self.layers, "cpu", False)
            self.bufs = list(self.kv.k_buffer) + list(self.kv.v_buffer)
        self.alloc = PagedTokenToKVPoolAllocator(device_tokens, page_size, torch.float32, "cpu", self.kv, False)
        self.r2t = ReqToTokenPool(max_reqs, max_context, "cpu", False)
        self.params = CacheInitParams(disable=False, req_to_token_pool=self.r2t,
                                      token_to_kv_pool_allocator=self.alloc, page_size=page_size)
        self.cache = cache(self.params)
        self.mc = types.SimpleNamespace(is_encoder_decoder=False, vocab_size=1 << 20, hf_eos_token_id=None,
                                        is_multimodal=False)
        self.n = 0
        self.steps = 0
        self.prefix_hits: List[int] = []
        self.step_seconds: List[float] = []
        self.checked_rows = 0
        self.adder_hits = {"device": 0, "host": 0, "storage": 0}
        self.computed_tokens = 0

    def request(self, tokens, *, salt: Optional[str] = None, max_new: int = 1) -> Req:
        self.n += 1
        r = Req(f"{self.model}-r{self.n}", "", array("q", tokens), SamplingParams(max_new_tokens=max_new),
                cache_salt=salt)
        return r

    def _forward(self, batch: ScheduleBatch) -> None:
        loc = batch.out_cache_loc
        off = 0
        for r in batch.reqs:
            toks = r.full_untruncated_fill_ids
            want = oracle(self.model, r.cache_salt, toks[: r.extend_end])
            row = self.r2t.req_to_token[r.kv.req_pool_idx, : r.prefix_len].to(torch.int64)
            for i, b in enumerate(self.bufs):
                got = b[row].reshape(len(row), b[0].numel())
                exp = (want[: r.prefix_len] + i * 0.25)[:, None].expand_as(got)
                if not torch.equal(got, exp):
                    bad = (got != exp).any(dim=1).nonzero().flatten().tolist()
                    raise Mismatch(f"{r.rid}: prefix rows {bad[:8]} of buffer {i} hold wrong KV")
            self.checked_rows += len(row)
            n = r.extend_end - r.prefix_len
            dst = loc[off: off + n].to(torch.int64)
            for i, b in enumerate(self.bufs):
                b[dst] = (want[r.prefix_len:] + i * 0.25).reshape(n, *([1] * (b.dim() - 1))).expand(n, *b.shape[1:])
            off += n

    def step(self, waiting: List[Req]) -> List[Req]:
        """One scheduler step: admit what fits (SGLang's admission loop), prefill it, finish it
        (``release_kv_cache`` with checkpoint), then the per-step hook. Returns the admitted."""
        t0 = time.perf_counter()
        adder = PrefillAdder(self.ps, self.cache, self.alloc, None, 1.0, 1 << 20, None)
        for req in list(waiting):
            req.init_next_round_input(self.cache)
            res = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
            if res != AddReqResult.CONTINUE:
                break
        admitted = list(adder.can_run_list)
        forward = 0.0
        self.adder_hits["device"] += adder.log_device_hit_tokens
        self.adder_hits["host"] += adder.log_host_hit_tokens
        self.adder_hits["storage"] += adder.log_storage_hit_tokens
        if admitted:
            batch = ScheduleBatch.init_new(admitted, self.r2t, self.alloc, self.cache, self.mc, False,
                                           SpeculativeAlgorithm.NONE)
            batch.prepare_for_extend()
            t1 = time.perf_counter()
            self._forward(batch)
            forward = time.perf_counter() - t1
            for r in admitted:
                self.prefix_hits.append(r.prefix_len)
                self.computed_tokens += r.extend_end - r.prefix_len
                waiting.remove(r)
                r.output_ids.append(7)
                r.finished_reason = FINISH_LENGTH(length=1)
                release_kv_cache(r, self.cache, checkpoint=True)
        self.cache.flush_pending_backups()
        self.steps += 1
        # The scheduler's cache side only: the oracle "forward" (the model's stand-in) is not counted.
        self.step_seconds.append(time.perf_counter() - t0 - forward)
        return admitted

    def run(self, reqs: List[Req], max_steps: int = 1000) -> List[Req]:
        waiting = list(reqs)
        for _ in range(max_steps):
            if not waiting:
                return reqs
            self.step(waiting)
        raise AssertionError(f"{len(waiting)} requests never admitted")

    def check_pools(self) -> None:
        """Nothing leaked: every device slot is free or held by the tree."""
        assert self.alloc.available_size() + self.cache.evictable_size() + self.cache.protected_size() == \
            self.alloc.size, (self.alloc.available_size(), self.cache.evictable_size(), self.cache.protected_size())
        assert self.cache.protected_size() == 0, "a lock outlived its request"


def sglang_radix(params: CacheInitParams) -> RadixCache:
    return RadixCache(params)
