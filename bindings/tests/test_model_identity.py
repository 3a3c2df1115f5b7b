"""``kvtier.model_identity`` and ``kvtier.vllm.model_identity``: what names a checkpoint in the
engines' L3 namespaces. The bug they fix (wrong tokens from another fine-tune's pages under the
same model name) is tested with real engines in vllm_engine/test_vllm_engine_model_identity.py;
here the fingerprint's own promises: equal for copies of one checkpoint (two hosts share L3),
different when any weight byte, the config or a file's size changes, read again when a file is
replaced in place, found in the Hugging Face cache for a hub id, whose blob names are the
files' digests (nothing read), and a local file's digest kept across processes."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.model_identity as mi
from kvtier.model_identity import checkpoint_dir, checkpoint_fingerprint, overrides_digest

BIG = 16 * 4096 * 4  # past what kvtier once read whole (it sampled 16 ranges of 4 KiB)


@pytest.fixture(autouse=True)
def _own_digest_cache(tmp_path_factory, monkeypatch):
    """Each test its own on-disk digest cache (never the user's), and the in-process one empty."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path_factory.mktemp("kvtier-cache")))
    mi._fingerprint_of_dir.cache_clear()
    yield
    mi._fingerprint_of_dir.cache_clear()


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
def test_one_flipped_byte_anywhere_changes_it(tmp_path_factory, pos, bit):
    """Any edit of the weights is another model (a few re-trained rows of the embeddings, a
    fine-tune of the last layers: every page past them differs). Until 2026-12-06 the
    fingerprint read 16 ranges of 4 KiB per file, and an edit outside them shared a namespace:
    wrong KV from the other checkpoint's pages, no error."""
    d = str(tmp_path_factory.mktemp("flip"))
    w = bytearray(_weights(3))
    a = _ckpt(os.path.join(d, "a"), bytes(w))
    w[pos] ^= 1 << bit
    b = _ckpt(os.path.join(d, "b"), bytes(w))
    assert checkpoint_fingerprint(a) != checkpoint_fingerprint(b)


def test_an_edit_outside_the_old_sample_changes_it(tmp_path):
    """The tester's case: one row in the middle of a shard, between two of the old samples."""
    w = bytearray(_weights(5))
    a = checkpoint_fingerprint(_ckpt(tmp_path / "a", bytes(w)))
    w[BIG // 30: BIG // 30 + 64] = bytes(64)
    assert checkpoint_fingerprint(_ckpt(tmp_path / "b", bytes(w))) != a


def _hub(cache, repo, files):
    """A Hugging Face cache holding ``files`` ({name: bytes}) for ``repo`` as the hub client
    lays it out: snapshot entries are relative symlinks to ``blobs/<name>``, the name the
    SHA-256 of the content for files stored with Git LFS (weights) and Git's own blob id (a
    SHA-1 of a header and the content) for small files (config.json)."""
    import hashlib

    base = cache / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / ("cd" * 20)
    (base / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        if name.endswith(".json"):
            digest = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        else:
            digest = hashlib.sha256(data).hexdigest()
        (base / "blobs" / digest).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", digest), snap / name)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text("cd" * 20)
    return snap


def test_the_hub_cache_and_a_local_copy_agree_and_the_blob_names_are_not_read_again(tmp_path, monkeypatch):
    """A hub cache names each large file by its SHA-256: that is its digest, nothing is read
    (a 400 GB checkpoint costs the engine's start nothing). A plain copy of the same files
    (another host's local directory) is hashed and gets the same fingerprint, so the two
    engines share their pages."""
    from huggingface_hub import constants

    files = {"config.json": b'{"model_type": "llama"}', "model-00000.safetensors": _weights(6),
             "model-00001.safetensors": _weights(7)}
    cache = tmp_path / "hub"
    _hub(cache, "org/model", files)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    local = tmp_path / "local"
    local.mkdir()
    for n, data in files.items():
        (local / n).write_bytes(data)
    hashed = []
    real = mi._file_sha256
    monkeypatch.setattr(mi, "_file_sha256", lambda path: hashed.append(os.path.basename(path)) or real(path))
    assert checkpoint_fingerprint("org/model") == checkpoint_fingerprint(str(local)) != ""
    # the hub's config.json (a Git blob id, not a SHA-256) is read; its LFS weights are not
    assert sorted(hashed) == sorted([*files, "config.json"]), hashed


def test_a_local_files_digest_is_kept_across_processes_until_the_file_changes(tmp_path, monkeypatch):
    """Hashing a large local checkpoint costs seconds per GB: the digest is kept on disk
    (``KVTIER_CACHE_DIR``) keyed by the file's size, mtime, ctime and inode, so a restarted
    engine does not read it again; a file replaced in place is read again."""
    a = _ckpt(tmp_path / "m", _weights(8))
    first = checkpoint_fingerprint(a)
    mi._fingerprint_of_dir.cache_clear()  # as a new process
    hashed = []
    real = mi._file_sha256
    monkeypatch.setattr(mi, "_file_sha256", lambda path: hashed.append(os.path.basename(path)) or real(path))
    assert checkpoint_fingerprint(a) == first and hashed == []
    w = bytearray(_weights(8))
    w[-1] ^= 1
    new = os.path.join(a, "new.tmp")
    with open(new, "wb") as f:
        f.write(bytes(w))
    os.replace(new, os.path.join(a, "model-00000.safetensors"))
    assert checkpoint_fingerprint(a) != first and hashed == ["model-00000.safetensors"]


def test_a_corrupt_digest_cache_is_ignored(tmp_path, monkeypatch):
    a = _ckpt(tmp_path / "m", _weights(9))
    first = checkpoint_fingerprint(a)
    cache = os.environ["KVTIER_CACHE_DIR"]
    for name in os.listdir(cache):
        with open(os.path.join(cache, name), "w") as f:
            f.write("{not json")
    mi._fingerprint_of_dir.cache_clear()
    assert checkpoint_fingerprint(a) == first
    os.chmod(cache, 0o500)  # an unwritable cache: still a fingerprint
    try:
        mi._fingerprint_of_dir.cache_clear()
        assert checkpoint_fingerprint(_ckpt(tmp_path / "n", _weights(9))) == first
    finally:
        os.chmod(cache, 0o700)


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
