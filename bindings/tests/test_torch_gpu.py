"""kvtier.torch on a CUDA GPU: the movers (``torch``, ``dma``, ``kernel``) against indexed
copies, the ordering rules with slow copy streams (``torch.cuda._sleep`` on the lane's
stream, so the host never waits), the compute-stream rule, and the model tests of
test_torch_model.py with each mover.

GPU ONLY: this module skips when ``torch.cuda.is_available()`` is false (CI has no GPU); the
GPU session runs it (docs/torch.md, "On a GPU machine"). Nothing else makes it skip: a mover
that cannot run on a CUDA machine fails here, it does not skip."""

import random
import threading

import numpy as np
import pytest
import torch

import kvtier
from kvtier.engine import KvtierL3Backend
from kvtier.torch import (
    DevicePool,
    Direction,
    Executor,
    HostPool,
    KVLayout,
    Ordering,
    Pinning,
    make_mover,
)
from conftest import HandOp, tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU ONLY: needs CUDA")

MOVERS = ["torch", "dma", "kernel"]
LAYOUT = KVLayout.mha(num_layers=4, kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
KEYS = [f"kvtier-gpu:{i:064x}:0" for i in range(8)]
SLOW = int(3e8)  # GPU cycles: ~0.15 to 0.2 s on an H100


def gpu_pools(dev_pages=16, host_pages=16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = DevicePool.allocate(LAYOUT, dev_pages, "cuda")
    for comps in dev.tensors:
        for t in comps:
            t.copy_(torch.randn(t.shape, generator=g, device="cuda").to(t.dtype))
    host = HostPool.allocate(LAYOUT, host_pages, Pinning.PINNED)
    host.data.copy_(torch.randn(host.data.shape).to(host.data.dtype))
    return dev, host


def page_on_host_layout(dev, p):
    return torch.stack([torch.stack([dev.k(l)[p], dev.v(l)[p]]) for l in range(LAYOUT.num_layers)]).cpu()


def slow_stream(direction):
    """Delay hook: the copies of ``direction`` start ~0.2 s late on their own stream."""
    return lambda d, layers: torch.cuda._sleep(SLOW) if d == direction else None


# every mover, and the variants the benchmark compares: dma through the raw driver call and
# through cuda-python's wrapper, the kernel at the first H100 run's 4 warps x 512 words
VARIANTS = {
    "torch": ("torch", {}),
    "dma-raw": ("dma", {"issue": "raw"}),
    "dma-bindings": ("dma", {"issue": "bindings"}),
    "kernel": ("kernel", {}),
    "kernel-4x512": ("kernel", {"num_warps": 4, "block_words": 512}),
}


def variant(name):
    from kvtier.torch.movers.dma import Issue

    mover, kw = VARIANTS[name]
    return make_mover(mover, **{k: (Issue(v) if k == "issue" else v) for k, v in kw.items()})


def test_dma_mover_uses_the_raw_driver_call_on_this_gpu():
    m = make_mover("dma")
    assert m.issue.value == "raw", m.raw_unavailable


@pytest.mark.parametrize("call", ["copy", "copy_layers"])
@pytest.mark.parametrize("stream", ["side", "legacy-default"])
@pytest.mark.parametrize("mover", list(VARIANTS))
@pytest.mark.parametrize("direction", list(Direction))
def test_mover_moves_scattered_pages(mover, direction, stream, call):
    """On a side stream, and on the legacy default stream (where a BackUp of device pages
    runs: an L3 lane thread sets no stream), which cuMemcpyBatchAsync refuses: the dma mover
    failed every such BackUp with cudaErrorInvalidValue on the first H100 run. Through
    ``copy`` and through ``copy_layers`` (a load's layer-by-layer path: every layer issued
    once, in order)."""
    dev, host = gpu_pools()
    m = variant(mover)
    m.check_pools(dev, host)
    dp, hp = np.array([9, 0, 3, 15, 4, 5]), np.array([2, 11, 5, 6, 7, 8])
    want_dev = [[t.clone() for t in c] for c in dev.tensors]
    want_host = host.data.clone()
    for l in range(LAYOUT.num_layers):
        for c in range(2):
            for a, b in zip(dp.tolist(), hp.tolist()):
                if direction == Direction.LOAD:
                    want_dev[l][c][a] = host.data[b, l, c].cuda()
                else:
                    want_host[b, l, c] = dev.tensors[l][c][a].cpu()
    issued = []

    def move():
        if call == "copy":
            m.copy(direction, dev, host, dp, hp, range(LAYOUT.num_layers))
        else:
            m.copy_layers(direction, dev, host, dp, hp, range(LAYOUT.num_layers), issued.append)

    if stream == "side":
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            move()
        s.synchronize()
    else:
        assert torch.cuda.current_stream().cuda_stream == 0
        errors = []

        def run():  # a fresh thread, as the executor's lanes are
            try:
                move()
                torch.cuda.current_stream().synchronize()
            except Exception as e:  # reported below: pytest sees no thread's exception
                errors.append(e)

        t = threading.Thread(target=run)
        t.start()
        t.join()
        assert not errors, errors
    for l in range(LAYOUT.num_layers):
        for c in range(2):
            assert torch.equal(dev.tensors[l][c], want_dev[l][c])
    assert torch.equal(host.data, want_host)
    assert issued == ([] if call == "copy" else list(range(LAYOUT.num_layers)))


@pytest.mark.parametrize("mover", MOVERS)
@pytest.mark.parametrize("ordering", list(Ordering))
def test_backup_waits_for_the_write_back_on_a_slow_stream(mover, ordering):
    dev, host = gpu_pools()
    host.data[5] = 0
    store = kvtier.L3Store.embedded(1 << 26)
    m = make_mover(mover, delay=slow_stream(Direction.STORE))
    with Executor(dev, host, KvtierL3Backend(store), mover=m, ordering=ordering) as ex:
        ex.submit([HandOp(1, "WriteBack", "device", "host", [2], [5])])
        ex.submit([HandOp(2, "BackUp", "host", None, [5], (), KEYS[:1])])
        ex.drain()
    buf = np.zeros(LAYOUT.page_bytes, dtype=np.uint8)
    store.get_into(KEYS[0], buf)
    stored = torch.from_numpy(buf).view(torch.bfloat16).view(host.data.shape[1:])
    if ordering == Ordering.ENFORCED:
        assert torch.equal(stored, page_on_host_layout(dev, 2))
    elif mover != "torch":  # the torch mover waits on the host inside the copy: no race to see
        assert torch.count_nonzero(stored.float()) == 0


@pytest.mark.parametrize("mover", MOVERS)
@pytest.mark.parametrize("ordering", list(Ordering))
def test_released_device_page_is_not_overwritten_under_a_slow_write_back(mover, ordering):
    dev, host = gpu_pools()
    before = page_on_host_layout(dev, 3)
    new = host.data[6].clone()
    m = make_mover(mover, delay=slow_stream(Direction.STORE))
    with Executor(dev, host, mover=m, ordering=ordering) as ex:
        ex.submit([HandOp(1, "WriteBack", "device", "host", [3], [1])])
        ex.submit([HandOp(2, "LoadBack", "host", "device", [6], [3])])
        ex.drain()
    if ordering == Ordering.ENFORCED:
        assert torch.equal(host.data[1], before)
    elif mover != "torch":
        assert torch.equal(host.data[1], new)


@pytest.mark.parametrize("mover", MOVERS)
@pytest.mark.parametrize("ordering", list(Ordering))
def test_write_back_waits_for_the_forward_that_wrote_the_page(mover, ordering):
    """The compute stream writes a page late (slow kernel, then the write); a write-back
    submitted after it must copy what the forward wrote."""
    dev, host = gpu_pools()
    with Executor(dev, host, mover=make_mover(mover), ordering=ordering) as ex:
        torch.cuda._sleep(SLOW)  # the "forward" on the current stream
        for l in range(LAYOUT.num_layers):
            dev.k(l)[7].fill_(3.0)
            dev.v(l)[7].fill_(3.0)
        ex.submit([HandOp(1, "WriteBack", "device", "host", [7], [0])])
        ex.drain()
    if ordering == Ordering.ENFORCED:
        assert (host.data[0].float() == 3.0).all()
    elif mover != "torch":
        assert not (host.data[0].float() == 3.0).all()


@pytest.mark.parametrize("mover", MOVERS)
def test_model_through_every_tier_matches_generate_on_gpu(mover):
    from test_torch_model import multi_turn_through_every_tier

    multi_turn_through_every_tier(tiny_llama(seed=3, device="cuda"), "cuda", mover)


@pytest.mark.parametrize("mover", MOVERS)
def test_model_with_slow_streams_and_terminated_prefetches_on_gpu(mover):
    from test_torch_model import random_delays

    rng = random.Random(9)
    m = make_mover(mover, delay=lambda d, layers: torch.cuda._sleep(rng.randrange(0, 2 * 10**7)))
    random_delays(tiny_llama(seed=3, device="cuda"), "cuda", m, rng)


@pytest.mark.parametrize("mover", MOVERS)
def test_mla_through_every_tier_on_gpu(mover):
    from test_torch_mla import DIMS, mla_through_every_tier

    for dims in DIMS:
        mla_through_every_tier(dims, "cuda", mover)


@pytest.mark.parametrize("mover", MOVERS)
def test_demotion_with_l3_on_gpu(mover):
    from test_torch_engine_l3 import demotion_with_l3

    demotion_with_l3("cuda", mover)


def test_weights_fingerprint_does_not_depend_on_the_device():
    """The L3 namespace's weights fingerprint (docs/torch.md) is the same for one set of weights
    on CPU, on the GPU, and split between them (gathered per device, hashed in parameter
    order); it costs milliseconds on the GPU too."""
    import time

    from kvtier.torch import weights_fingerprint

    cpu = tiny_llama(seed=3)
    gpu = tiny_llama(seed=3, device="cuda")
    assert weights_fingerprint(gpu) == weights_fingerprint(cpu)
    gpu.model.embed_tokens.to("cpu")  # a model split over host and device
    assert weights_fingerprint(gpu) == weights_fingerprint(cpu)
    assert weights_fingerprint(tiny_llama(seed=4, device="cuda")) != weights_fingerprint(cpu)
    from transformers import LlamaConfig, LlamaForCausalLM

    big = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                       num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4)).cuda()
    weights_fingerprint(big)
    t0 = time.perf_counter()
    weights_fingerprint(big)
    print(f"weights_fingerprint on {torch.cuda.get_device_name()}: {(time.perf_counter() - t0) * 1e3:.2f} ms")
