"""``kvtier.model_identity`` and ``kvtier.vllm.model_identity``: what names a checkpoint in the
engines' L3 namespaces. The bug they fix (wrong tokens from another fine-tune's pages under the
same model name) is tested with real engines in vllm_engine/test_vllm_engine_model_identity.py;
here the fingerprint's own promises: equal for copies of one checkpoint (two hosts share L3),
different when any sampled weight byte, the config or a file's size changes, read again when a
file is replaced in place, found in the Hugging Face cache for a hub id."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.model_identity import (SAMPLE_BYTES, SAMPLES_PER_FILE, checkpoint_dir, checkpoint_fingerprint,
                                   overrides_digest)

BIG = SAMPLES_PER_FILE * SAMPLE_BYTES * 4  # sampled, not read whole


def _ckpt(path, weights: bytes, config: str = '{"model_type": "llama"}', shards=1):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(config)
    n = len(weights) // shards
    for i in range(shards):
        with open(os.path.join(path, f"model-{i:05d}.safetensors"), "wb") as f:
            f.write(weights[i * n:(i + 1) * n])
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write("{}")
    return str(path)


def _weights(seed: int, n: int = BIG) -> bytes:
    return bytes((i * 31 + seed * 97) % 251 for i in range(n))


def test_copies_of_one_checkpoint_agree_and_other_weights_do_not(tmp_path):
    a = _ckpt(tmp_path / "host-a" / "m", _weights(1), shards=2)
    b = _ckpt(tmp_path / "host-b" / "other-name", _weights(1), shards=2)
    fa = checkpoint_fingerprint(a)
    assert len(fa) == 16 and fa == checkpoint_fingerprint(b), "two copies (two hosts) share their pages"
    assert checkpoint_fingerprint(_ckpt(tmp_path / "c", _weights(2), shards=2)) != fa
    assert checkpoint_fingerprint(_ckpt(tmp_path / "d", _weights(1), config='{"rope_theta": 1e6}', shards=2)) != fa
    # the tokenizer is not the model's KV
    with open(os.path.join(a, "tokenizer.json"), "w") as f:
        f.write('{"x": 1}')
    assert checkpoint_fingerprint(a) == fa


def test_a_file_replaced_in_place_is_read_again(tmp_path):
    """The engine's process computes it once per tier; a checkpoint replaced under the same
    path between two engines in one process (tests, notebooks) must not be served from the
    cache of the first."""
    a = _ckpt(tmp_path / "m", _weights(1))
    before = checkpoint_fingerprint(a)
    new = tmp_path / "new.safetensors"
    new.write_bytes(_weights(5))
    os.replace(new, os.path.join(a, "model-00000.safetensors"))  # same size, a new inode
    assert checkpoint_fingerprint(a) != before


@settings(max_examples=40, deadline=None)
@given(pos=st.integers(0, BIG - 1), bit=st.integers(0, 7))
def test_one_flipped_byte_in_a_sampled_range_changes_it_and_one_outside_does_not(tmp_path_factory, pos, bit):
    d = str(tmp_path_factory.mktemp("flip"))
    w = bytearray(_weights(3))
    a = _ckpt(os.path.join(d, "a"), bytes(w))
    w[pos] ^= 1 << bit
    b = _ckpt(os.path.join(d, "b"), bytes(w))
    last = BIG - SAMPLE_BYTES
    sampled = any(o <= pos < o + SAMPLE_BYTES for o in (i * last // (SAMPLES_PER_FILE - 1)
                                                      for i in range(SAMPLES_PER_FILE)))
    assert (checkpoint_fingerprint(a) != checkpoint_fingerprint(b)) == sampled


def test_a_hub_id_is_found_in_the_cache_and_an_unknown_name_is_empty(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snap = cache / "models--org--model" / "snapshots" / ("ab" * 20)
    _ckpt(snap, _weights(4))
    (cache / "models--org--model" / "refs").mkdir(parents=True)
    (cache / "models--org--model" / "refs" / "main").write_text("ab" * 20)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert checkpoint_dir("org/model") == str(snap)
    assert checkpoint_fingerprint("org/model") == checkpoint_fingerprint(str(snap))
    assert checkpoint_fingerprint("org/unknown") == "" and checkpoint_dir("org/unknown") is None
    assert checkpoint_fingerprint(str(tmp_path / "no-such-dir")) == ""


def test_overrides_digest():
    assert overrides_digest(None) == overrides_digest({}) == overrides_digest("") == overrides_digest("{}") == ""
    a = overrides_digest({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    assert a == overrides_digest('{"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}')
    assert a != overrides_digest({"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}})


def test_only_the_directorys_own_files_count_and_unreadable_ones_do_not_fail(tmp_path):
    """Engines load the directory's own weight files: a training run's ``checkpoint-*/``
    subdirectories are other weights and must not change the namespace (nor be walked: a
    large tree would cost the engine's start). A weight file that cannot be read gives no
    fingerprint (the name alone, with a warning), never an error at engine start."""
    a = _ckpt(tmp_path / "m", _weights(1))
    before = checkpoint_fingerprint(a)
    _ckpt(tmp_path / "m" / "checkpoint-1000", _weights(2))
    assert checkpoint_fingerprint(a) == before
    os.makedirs(os.path.join(a, "dir.safetensors"))  # a directory named like a weight file
    assert checkpoint_fingerprint(a) == before
    w = os.path.join(a, "model-00000.safetensors")
    os.chmod(w, 0)
    try:
        if os.access(w, os.R_OK):  # root reads anything: nothing to check here
            return
        assert checkpoint_fingerprint(a) == ""
    finally:
        os.chmod(w, 0o644)
