"""kvtier's KV events on the wire, read the way vLLM's own subscribers read them.

`kvtier.KvEventPublisher` publishes the scheduler's cache events over ZMQ in vLLM's format.
These tests subscribe with pyzmq and decode every batch with vLLM's own msgspec classes
(`vllm.distributed.kv_events.KVEventBatch`), then check what a router would build from them
against the scheduler's real state: device pages as medium GPU, host pages as CPU, token ids
and block hashes per block, replay from a sequence number, and the snapshot request (-2) a
late subscriber recovers from."""

import time

import msgspec
import numpy as np
import pytest
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

import kvtier
from kvtier.engine import Engine

PS = 4
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
SNAPSHOT = (-2).to_bytes(8, "big", signed=True)
END = (-1).to_bytes(8, "big", signed=True)


def config(**over):
    base = dict(page_size=PS, device_pages=24, host_pages=48, max_batch_size=8, token_budget=64,
                chunked_prefill_size=32, max_context_tokens=64, record_kv_events=True)
    base.update(over)
    return kvtier.SchedulerConfig(**base)


def prompt(seed, n, shared=0):
    """``n`` tokens, the first ``shared`` common to every seed."""
    t = np.arange(n, dtype=np.uint32) + seed * 1000
    t[:shared] = np.arange(shared, dtype=np.uint32)
    return t


class Subscriber:
    """A SUB socket and a DEALER on the replay socket, as a router holds them."""

    def __init__(self, pub):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVTIMEO, 300)
        # A SUB joins asynchronously (ZMQ's slow joiner): wait for its handshake (at most 5 s
        # on a loaded machine), then for the PUB to take the subscription.
        joined = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        joined.setsockopt(zmq.RCVTIMEO, 5000)
        self.sub.connect(pub.endpoint)
        joined.recv_multipart()
        self.sub.disable_monitor()
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.RCVTIMEO, 3000)
        self.replay.connect(pub.replay_endpoint)
        time.sleep(0.2)

    def live(self, last: int):
        """The live stream up to batch `last`: read until it arrives (20 s at most), not until
        a quiet spell (a publisher thread late by that much would truncate the stream)."""
        out = []
        deadline = time.monotonic() + 20
        while not out or out[-1][0] < last:
            try:
                topic, seq, payload = self.sub.recv_multipart()
            except zmq.Again:
                if time.monotonic() > deadline:
                    return out
                continue
            out.append((int.from_bytes(seq, "big", signed=True), DECODER.decode(payload)))
        return out

    def request(self, start: bytes):
        self.replay.send_multipart([b"", start])
        out = []
        while True:
            # vLLM 0.32's replies, as its ZmqEventPublisher sends them: [empty, topic, seq, payload]
            empty, topic, seq, payload = self.replay.recv_multipart()
            assert empty == b""
            if seq == END:
                assert topic == b"" and payload == b""
                return out
            out.append((int.from_bytes(seq, "big", signed=True), DECODER.decode(payload)))

    def close(self):
        self.ctx.destroy(linger=0)


def wire_hash(h: bytes, fmt: str):
    """A kvtier page hash as the publisher sends it: vLLM's default integer (the low 64 bits,
    big-endian) or the whole 32 bytes."""
    return int.from_bytes(h[24:], "big") if fmt == "int" else bytes(h)


def fold(index, batch: KVEventBatch, fmt="int"):
    """What a router's index does with one batch: {medium: {hash: tokens}}."""
    for e in batch.events:
        if isinstance(e, AllBlocksCleared):
            index.clear()
        elif isinstance(e, BlockStored):
            assert len(e.token_ids) == len(e.block_hashes) * e.block_size
            assert e.medium in ("GPU", "CPU")
            for i, h in enumerate(e.block_hashes):
                if fmt == "int":
                    assert isinstance(h, int) and 0 <= h < 1 << 64
                else:
                    assert isinstance(h, bytes) and len(h) == 32
                index.setdefault(e.medium, {})[h] = list(e.token_ids[i * e.block_size:(i + 1) * e.block_size])
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                index.get(e.medium, {}).pop(h, None)
        else:
            raise AssertionError(f"unexpected event {e!r}")
    return index


def truth(s, fmt="int"):
    """The scheduler's own resident state in the same shape."""
    out = {}
    for ev in s.resident_kv_events():
        medium = {"device": "GPU", "host": "CPU"}[ev["tier"]]
        toks = ev["tokens"].tolist()
        for i, h in enumerate(ev["hashes"]):
            out.setdefault(medium, {})[wire_hash(bytes(h), fmt)] = toks[i * PS:(i + 1) * PS]
    return out


def workload(e, pub, s, rounds=6):
    """Prompts sharing prefixes, more than the device holds (so pages move to host and are
    evicted); one batch per round."""
    seqs = []
    rid = 0
    for r in range(rounds):
        for k in range(3):
            rid += 1
            e.submit(rid, prompt(rid, 28 + 4 * k, shared=12), 2)
        e.run_to_idle(start_ms=r * 1000)
        seq = pub.publish_from(s, ts=float(r))
        if seq is not None:
            seqs.append(seq)
    return seqs


@pytest.mark.parametrize("fmt", ["int", "bytes"])
def test_vllm_decodes_every_batch_and_a_router_index_matches_the_cache(fmt):
    s = kvtier.Scheduler(config())
    e = Engine(s)
    with kvtier.KvEventPublisher(block_size=PS, topic="kvtier", block_hashes=fmt) as pub:
        sub = Subscriber(pub)
        try:
            seqs = workload(e, pub, s)
            assert seqs == list(range(len(seqs))) and len(seqs) >= 3
            live = sub.live(seqs[-1])
            assert [q for q, _ in live] == seqs, "every batch, in order, on the live stream"
            index = {}
            for _, b in live:
                assert isinstance(b, KVEventBatch) and b.data_parallel_rank == 0
                fold(index, b, fmt)
            want = truth(s, fmt)
            assert index == want
            assert set(want) == {"GPU", "CPU"}, "the workload should have left pages on both tiers"
            assert pub.resident_blocks == sum(len(v) for v in want.values())
            # replay from the middle gives exactly what the live stream gave from there
            mid = len(seqs) // 2
            assert [(q, b.events) for q, b in sub.request(mid.to_bytes(8, "big"))] == \
                [(q, b.events) for q, b in live[mid:]]
        finally:
            sub.close()


def test_a_late_subscriber_rebuilds_the_index_from_one_snapshot():
    s = kvtier.Scheduler(config())
    e = Engine(s)
    with kvtier.KvEventPublisher(block_size=PS, buffer_steps=2) as pub:
        workload(e, pub, s)
        sub = Subscriber(pub)  # joins after everything was published
        try:
            history = sub.request((0).to_bytes(8, "big"))
            assert history and history[0][0] > 0, "the buffer kept 2 batches: the start is gone"
            (seq, snap), = sub.request(SNAPSHOT)
            assert seq == history[-1][0], "the snapshot is as of the last batch"
            assert isinstance(snap.events[0], AllBlocksCleared)
            assert fold({"GPU": {12345: [0] * PS}}, snap) == truth(s)
        finally:
            sub.close()


def test_the_replay_buffer_keeps_at_most_buffer_bytes():
    s = kvtier.Scheduler(config())
    e = Engine(s)
    with kvtier.KvEventPublisher(block_size=PS, buffer_bytes=1) as pub:
        workload(e, pub, s)
        sub = Subscriber(pub)
        try:
            history = sub.request((0).to_bytes(8, "big"))
            assert len(history) == 1, "only the latest batch fits: it is always kept"
            (seq, _), = sub.request(SNAPSHOT)
            assert seq == history[0][0]
        finally:
            sub.close()


def test_adapters_travel_as_lora_name():
    s = kvtier.Scheduler(config())
    e = Engine(s)
    with kvtier.KvEventPublisher(block_size=PS) as pub:
        sub = Subscriber(pub)
        try:
            e.submit(1, prompt(1, 16), 2, adapter="sql-lora")
            e.submit(2, prompt(2, 16), 2)
            e.run_to_idle()
            seq = pub.publish_from(s, ts=1.0)
            (_, b), = sub.live(seq)
            names = {ev.lora_name for ev in b.events if isinstance(ev, BlockStored)}
            assert names == {"sql-lora", None}
        finally:
            sub.close()


def test_bad_endpoints_and_closed_publishers_are_typed_errors():
    with pytest.raises(kvtier.EventsError):
        kvtier.KvEventPublisher(endpoint="tcp://256.0.0.1:5557")
    with pytest.raises(kvtier.EventsError):
        kvtier.KvEventPublisher(replay_endpoint="no-such-transport://x")
    with pytest.raises(kvtier.EventsError):
        kvtier.KvEventPublisher(buffer_steps=0)
    with pytest.raises(kvtier.EventsError):
        kvtier.KvEventPublisher(buffer_bytes=0)
    # a NUL byte in an address: a typed error (it was the zmq crate's panic)
    with pytest.raises(kvtier.EventsError, match="NUL"):
        kvtier.KvEventPublisher(endpoint="tcp://127.0.0.1:*\0x")
    with pytest.raises(kvtier.EventsError, match="NUL"):
        kvtier.KvEventPublisher(replay_endpoint="tcp://127.0.0.1:*\0")
    with pytest.raises(ValueError, match="block_hashes"):
        kvtier.KvEventPublisher(block_hashes="hex")
    pub = kvtier.KvEventPublisher(replay_endpoint=None)
    assert pub.replay_endpoint is None
    taken = pub.endpoint
    with pytest.raises(kvtier.EventsError):
        kvtier.KvEventPublisher(endpoint=taken)
    pub.close()
    pub.close()
    s = kvtier.Scheduler(config())
    with pytest.raises(kvtier.EventsError):
        pub.publish_from(s, ts=0.0)
    # nothing to publish is not a batch
    with kvtier.KvEventPublisher(block_size=PS) as p2:
        assert p2.publish_from(s, ts=0.0) is None
