"""Per-request cache isolation from Python: cache_salt, adapter and extra_keys on submit.

The reference executor's oracle hashes each request's pages in its own scope, so reading
another scope's KV fails the run, and the hit counters show no sharing across scopes.
"""

import numpy as np
import pytest

import kvtier
from kvtier.engine import Engine, KvtierL3Backend

from conftest import prompt, small_config


def _hits(s):
    st = s.stats()
    return st["device_hit_pages"] + st["host_hit_pages"] + st["l3_hit_pages"]


def _second_hits(first_scope, second_scope):
    s = kvtier.Scheduler(small_config(l3_enabled=True, prefetch_threshold=1, prefetch_stop="wait_complete"))
    e = Engine(s, KvtierL3Backend(kvtier.L3Store.embedded(1 << 22)))
    p = prompt(1, 41)
    e.submit(1, p, 2, **first_scope)
    e.run_to_idle()
    assert _hits(s) == 0
    e.submit(2, p, 2, **second_scope)
    e.run_to_idle()
    s.check()
    return _hits(s)


@pytest.mark.parametrize(
    "a, b",
    [
        ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}),
        ({}, {"cache_salt": "tenant-a"}),
        ({"adapter": "lora-1"}, {"adapter": "lora-2"}),
        ({"adapter": "lora-1"}, {}),
    ],
)
def test_different_scopes_share_nothing(a, b):
    assert _second_hits(a, b) == 0


@pytest.mark.parametrize("scope", [{}, {"cache_salt": "t"}, {"adapter": "x", "cache_salt": "t"}])
def test_the_same_scope_shares_every_page(scope):
    assert _second_hits(scope, dict(scope)) == 10  # (41 - 1) // 4 usable pages


def test_an_image_span_separates_pages_from_its_first_page_on():
    img = lambda d: {"extra_keys": [(10, 14, d)]}  # noqa: E731  page 2 of 4-token pages
    assert _second_hits(img(b"\x01" * 32), img(b"\x02" * 32)) == 2
    assert _second_hits(img("sha256:abc"), img("sha256:abc")) == 10


def test_scoped_hashes_and_keys():
    s = kvtier.Scheduler(small_config())
    p = prompt(3, 16)
    plain = kvtier.page_hashes(p, 4)
    salted = kvtier.page_hashes(p, 4, cache_salt="t")
    assert plain.shape == salted.shape == (4, 32)
    assert not (plain == salted).all(axis=1).any()
    img = kvtier.page_hashes(p, 4, extra_keys=[(8, 9, b"img")])
    assert (img[:2] == plain[:2]).all() and not (img[2:] == plain[2:]).all(axis=1).any()
    assert s.l3_keys(p) != s.l3_keys(p, cache_salt="t")
    assert s.l3_keys(p, adapter="a") == s.l3_keys(p, adapter="a")


def test_kv_events_carry_the_scope():
    s = kvtier.Scheduler(small_config(record_kv_events=True))
    e = Engine(s)
    e.submit(1, prompt(1, 21), 2, cache_salt="tenant-7", adapter="lora")
    e.submit(2, prompt(2, 21), 2)
    e.run_to_idle()
    evs = [ev for ev in s.drain_kv_events() if ev["type"] == "stored"]
    scopes = {(ev["cache_salt"], ev["adapter"]) for ev in evs}
    assert scopes == {("tenant-7", "lora"), (None, None)}


@pytest.mark.parametrize(
    "extra, err",
    [
        ([(5, 5, b"x")], kvtier.InvalidRequestError),
        ([(0, 99, b"x")], kvtier.InvalidRequestError),
        ([(0, 4)], TypeError),
        ([(0, 4, 3.5)], TypeError),
        ([(-1, 4, b"x")], TypeError),
        (5, TypeError),
    ],
)
def test_bad_extra_keys_raise_and_change_nothing(extra, err):
    s = kvtier.Scheduler(small_config())
    with pytest.raises(err):
        s.submit(1, prompt(1, 41), 2, extra_keys=extra)
    assert s.live_requests() == 0
    s.submit(1, prompt(1, 41), 2)  # the id was not taken


def test_tenant_quotas_configure_and_validate():
    s = kvtier.Scheduler(small_config(tenant_quota_device_pages=8, tenant_quota_host_pages=16))
    assert (s.config()["tenant_quota_device_pages"], s.config()["tenant_quota_host_pages"]) == (8, 16)
    assert kvtier.Scheduler(small_config()).config()["tenant_quota_device_pages"] is None
    with pytest.raises(OverflowError):
        kvtier.Scheduler(small_config(tenant_quota_host_pages=-1))
    with pytest.raises(TypeError):
        kvtier.Scheduler(small_config(tenant_quota_device_pages="many"))
