"""kvtier.torch's executor and an L3 backend that registers the pools' memory (Mooncake's
API): what an executor registered is unregistered when it closes, and only that."""

import gc

import torch

import kvtier
from kvtier.engine import MooncakeL3Backend
from kvtier.mooncake_compat import MooncakeDistributedStore
from kvtier.torch import DevicePool, Executor, HostPool, KVLayout, Pinning, TorchEngine
from conftest import HandOp, small_config, tiny_llama

LAYOUT = KVLayout.mha(num_layers=2, kv_heads=2, head_dim=4, page_size=2, dtype=torch.float32)


def mooncake(name):
    st = MooncakeDistributedStore()
    assert st.setup("h", "m", 1 << 24, 0, "tcp", "", f"embedded://{name}") == 0
    return st


def test_engines_one_after_another_on_one_mooncake_backend():
    """Each engine's executor registered its host and staging pools and never unregistered
    them: the store kept registrations of freed memory, and once a new engine's pools were
    allocated where an old one's had been, register_buffer answered -600 (overlap) and the
    engine could not be built (the third of four, here)."""
    backend = MooncakeL3Backend(mooncake("torch-lifetime-engines"))
    cfg = small_config(page_size=4, device_pages=16, host_pages=16, max_context_tokens=64, l3_enabled=True)
    outs = []
    for _ in range(6):
        with TorchEngine(cfg, tiny_llama(0), backend, stop_token_ids=()) as eng:
            eng.submit(1, [3, 4, 5, 6, 7, 8, 9, 10, 11], 2)
            eng.run_to_idle()
            outs.append(eng.generated(1))
        assert backend._registered == []
        del eng
        gc.collect()
    assert all(o == outs[0] for o in outs)


def test_closing_one_executor_leaves_another_ones_registrations():
    backend = MooncakeL3Backend(mooncake("torch-lifetime-two"))
    dev_a, host_a = DevicePool.allocate(LAYOUT, 4), HostPool.allocate(LAYOUT, 4, Pinning.PAGEABLE)
    dev_b, host_b = DevicePool.allocate(LAYOUT, 4), HostPool.allocate(LAYOUT, 4, Pinning.PAGEABLE)
    a = Executor(dev_a, host_a, backend, l3_workers=1)
    with Executor(dev_b, host_b, backend, l3_workers=1) as b:
        a.close()
        assert host_b.data.data_ptr() in backend._registered
        assert host_a.data.data_ptr() not in backend._registered
        host_b.data[1] = 4.0
        b.submit([HandOp(1, "BackUp", "host", None, [1], (), [f"lifetime:{0:064x}:0"])])
        assert [e.success for e in b.drain()] == [True]
    assert backend._registered == []
