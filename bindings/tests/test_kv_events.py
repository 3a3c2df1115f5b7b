"""`kvtier.KvEventPublisher` misused as an engine might by accident: a refused call raises a
typed exception and leaves the scheduler's events where they were (the next good call
publishes them); a publisher inherited by a forked child neither publishes there nor breaks
its parent's."""

import os
import sys
import time

import numpy as np
import pytest

import kvtier
from conftest import small_config
from kvtier.engine import Engine

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")


def recording_scheduler(page_size=4):
    return kvtier.Scheduler(small_config(page_size=page_size, record_kv_events=True))


def serve(s, req, n=40):
    e = Engine(s)
    e.submit(req, np.arange(n, dtype=np.uint32) + 1000 * req, 2)
    e.run_to_idle()


def subscriber(pub):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    joined = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(pub.endpoint)
    joined.recv_multipart()
    time.sleep(0.1)
    return sub


def test_a_forked_child_can_neither_publish_nor_break_the_parents_publisher():
    # Before: the child's publish went to a thread that does not exist in it, its exit (or
    # close) panicked joining that thread, and closing the inherited sockets aborted the
    # parent (ZMQ's "Assertion failed: ok (mailbox.cpp:99)").
    s = recording_scheduler()
    with kvtier.KvEventPublisher(block_size=4) as pub:
        serve(s, 1)
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                try:
                    pub.publish_from(s, 1.0)
                    code = 1
                except kvtier.EventsError as e:
                    code = 0 if "forked" in str(e) else 4
                if s.drain_kv_events() == []:
                    code = 5  # the refused publish drained them
                pub.close()
            except BaseException:
                code = 2
            sys.stdout.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, (
            "1: the child published, 2: it raised otherwise, 4: untyped, 5: events drained")
        sub = subscriber(pub)
        assert pub.publish_from(s, 2.0) == 0, "the parent's first batch"
        _, seq, payload = sub.recv_multipart()
        assert int.from_bytes(seq, "big") == 0
        assert len(msgspec.msgpack.decode(payload)[1]) > 0


def test_a_batch_that_would_misdescribe_its_blocks_is_refused_and_drains_nothing():
    # Before: a scheduler of 4-token pages published through the default publisher
    # (block_size 16) sent BlockStored events of 8 hashes and 32 token ids claiming 16 tokens
    # a block, and a NaN or infinite ts went out as the batch's time; both returned a
    # sequence number.
    s = recording_scheduler(page_size=4)
    serve(s, 1)
    with kvtier.KvEventPublisher() as wrong, kvtier.KvEventPublisher(block_size=4) as pub:
        with pytest.raises(kvtier.ConfigError, match="block_size 16.*page_size 4"):
            wrong.publish_from(s, 1.0)
        for ts in (float("nan"), float("inf"), -float("inf")):
            with pytest.raises(ValueError, match="ts"):
                pub.publish_from(s, ts)
        sub = subscriber(pub)
        assert pub.publish_from(s, 2.0) == 0, "nothing published before"
        _, _, payload = sub.recv_multipart()
        ts, events, _ = msgspec.msgpack.decode(payload)
        assert ts == 2.0
        stored = [ev for ev in events if ev["type"] == "BlockStored"]
        assert stored and all(
            len(ev["token_ids"]) == 4 * len(ev["block_hashes"]) and ev["block_size"] == 4
            for ev in stored
        ), "every event the refused calls left is in the batch, consistently described"
        assert pub.publish_from(s, 3.0) is None, "all drained by the good call"


def test_events_nobody_drained_are_capped_and_published_as_a_resync():
    # Before: record_kv_events=True held every event until a drain, without bound (707 KB
    # after 400 small requests in scheduler/tests/lifecycle.rs, growing with each).
    s = kvtier.Scheduler(small_config(page_size=4, record_kv_events=True, kv_events_max_bytes=2048))
    for req in range(1, 30):
        serve(s, req)
    first = s.drain_kv_events()
    assert first[0] == {"type": "cleared"}
    resident = s.resident_kv_events()
    assert [(e["tier"], e["hashes"].tobytes()) for e in first[1:]] == [
        (e["tier"], e["hashes"].tobytes()) for e in resident]
    for req in range(30, 60):
        serve(s, req)
    with kvtier.KvEventPublisher(block_size=4) as pub:
        sub = subscriber(pub)
        assert pub.publish_from(s, 1.0) == 0
        _, _, payload = sub.recv_multipart()
        _, events, _ = msgspec.msgpack.decode(payload)
        assert events[0]["type"] == "AllBlocksCleared"
        stored = [ev for ev in events[1:] if ev["type"] == "BlockStored"]
        assert len(stored) == len(events) - 1
        assert sum(len(ev["block_hashes"]) for ev in stored) == sum(
            len(e["hashes"]) for e in s.resident_kv_events())
    with pytest.raises(kvtier.ConfigError, match="kv_events_max_bytes"):
        kvtier.Scheduler(small_config(record_kv_events=True, kv_events_max_bytes=0))


def test_resident_blocks_waits_for_the_publisher_thread_without_the_gil():
    # Before: the getter waited for the publisher thread to fold every published batch (here
    # a million blocks) holding the GIL, so every other Python thread of the engine stopped.
    import threading

    s = kvtier.Scheduler(small_config(
        page_size=1, device_pages=250_000, host_pages=0, host_enabled=False, token_budget=250_000,
        chunked_prefill_size=250_000, max_context_tokens=200_000, record_kv_events=True))
    ticks, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.monotonic())

    with kvtier.KvEventPublisher(block_size=1) as pub:
        for req in range(5):
            serve(s, req, n=190_000)
            pub.publish_from(s, float(req))
        t = threading.Thread(target=tick)
        t.start()
        while not ticks:
            time.sleep(0.001)
        start = time.monotonic()
        n = pub.resident_blocks
        end = time.monotonic()
        stop.set()
        t.join()
    assert n > 0
    span = end - start
    assert span > 0.02, f"the fold took {span:.3f} s: too short to tell"
    inside = [x for x in ticks if start + span / 4 < x < end - span / 4]
    assert inside, f"no other thread ran during the {span:.3f} s call"
