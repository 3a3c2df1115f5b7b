"""What a model's checkpoint *is*, for the L3 namespaces of engine integrations.

Why: an engine names its model by a path or a hub id (vLLM's ``model``, SGLang's
``model_path``), and the L3 namespace (docs/page-keys.md) was derived from that name. But a
name is not the weights: a new fine-tune pushed to the same hub id, a checkpoint replaced in
place at the same path, or a ``--hf-overrides`` that changes RoPE all keep the name while
every page's K and V change. A second engine (or the same one restarted) on a shared
``kvtier-l3`` then loaded the first one's pages as its own and generated wrong tokens, with
no error. :func:`checkpoint_fingerprint` names the checkpoint by its content instead: the
bytes of its ``config.json`` and, for every weight file, its name, size and a fixed sample
of its bytes. Two copies of one checkpoint (two hosts, two cache directories) get the same
fingerprint, so engines serving one model still share their pages; a checkpoint whose weights
differ (a fine-tune changes nearly every byte) gets another.

How: the directory is the name when it is one, else the snapshot the Hugging Face cache holds
for the name and revision (resolved offline; nothing is downloaded). The fingerprint is 16
hex digits of SHA-256; ``""`` when no directory is found (a remote loader, an uncached hub
id): then the engine's namespace is its name alone, as before, and the integrations log it
and take an operator's ``model_version``. It is a sample, not a checksum: weights that differ
only outside the sampled bytes (an edit of a few rows) share a fingerprint; give them
different ``model_version``s.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from typing import Any, Optional

__all__ = ["SAMPLES_PER_FILE", "SAMPLE_BYTES", "WEIGHT_SUFFIXES", "checkpoint_dir", "checkpoint_fingerprint",
           "engine_identity", "namespace_model", "overrides_digest"]

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
"""Files of a checkpoint directory that hold weights."""

SAMPLES_PER_FILE = 16
"""Byte ranges :func:`checkpoint_fingerprint` reads from each weight file, evenly spaced."""

SAMPLE_BYTES = 4096
"""Bytes in each sampled range."""


def checkpoint_dir(model: str, revision: Optional[str] = None) -> Optional[str]:
    """The directory holding ``model``'s checkpoint: the path itself, or the Hugging Face
    cache's snapshot of the hub id at ``revision`` (offline lookup). None if neither."""
    if os.path.isdir(model):
        return os.path.realpath(model)
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 (not a hub id the cache knows: no directory)
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


def _sample_file(h: "hashlib._Hash", path: str, size: int) -> None:
    with open(path, "rb") as f:
        if size <= SAMPLES_PER_FILE * SAMPLE_BYTES:
            h.update(f.read())
            return
        last = size - SAMPLE_BYTES
        for i in range(SAMPLES_PER_FILE):
            f.seek(i * last // (SAMPLES_PER_FILE - 1))
            h.update(f.read(SAMPLE_BYTES))


@functools.lru_cache(maxsize=64)
def _fingerprint_of_dir(root: str, files: tuple) -> str:
    """``files``: (name, size, mtime_ns, inode) in name order. mtime and inode key only this
    cache (a file replaced in place is read again); the fingerprint is of names, sizes and
    content, so copies on two hosts agree."""
    h = hashlib.sha256(b"kvtier-checkpoint-v1")
    for name, size, _, _ in files:
        h.update(len(name).to_bytes(8, "little") + name.encode() + size.to_bytes(8, "little"))
        _sample_file(h, os.path.join(root, name), size)
    return h.hexdigest()[:16]


def checkpoint_fingerprint(model: str, revision: Optional[str] = None) -> str:
    """16 hex digits naming the content of ``model``'s checkpoint (module doc): its
    ``config.json`` and every weight file's name, size and sampled bytes, in name order.
    Only the directory's own files, as the engines' loaders read them (a training run's
    ``checkpoint-*/`` subdirectories are other weights; a walk of a large tree would cost the
    engine's start). ``""`` when no checkpoint directory is found or it holds neither."""
    root = checkpoint_dir(model, revision)
    if root is None:
        return ""
    files = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return ""
    for n in names:
        if n == "config.json" or n.endswith(WEIGHT_SUFFIXES):
            try:
                st = os.stat(os.path.join(root, n))  # follows the hub cache's symlinks to its blobs
            except OSError:
                continue
            if os.path.isfile(os.path.join(root, n)):
                files.append((n, st.st_size, st.st_mtime_ns, st.st_ino))
    if not files:
        return ""
    files.sort()
    try:
        return _fingerprint_of_dir(root, tuple(files))
    except OSError:
        return ""


def overrides_digest(overrides: Any) -> str:
    """16 hex digits of SHA-256 over an engine's config overrides (vLLM's ``hf_overrides``,
    SGLang's ``json_model_override_args``) as sorted JSON; ``""`` when there are none."""
    if not overrides:
        return ""
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except ValueError:
            pass
        if not overrides:
            return ""
    text = json.dumps(overrides, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def engine_identity(model: str, *, engine_config: bool, revision: Optional[str] = None, overrides: Any = None,
                    quantization: Any = None, version: str = "") -> str:
    """What an engine's pages depend on beyond the model's name: the checkpoint's
    :func:`checkpoint_fingerprint`, the operator's ``version`` and, when the engine's own
    config was read (``engine_config``), its config ``overrides``, ``quantization`` and
    ``revision``. ``""`` when none is known (then the namespace is the name alone, as before,
    and a warning says so)."""
    fp = checkpoint_fingerprint(model, revision)
    if not fp and not version:
        logger.warning("kvtier: no checkpoint directory found for model %r: its L3 namespace is its name; "
                       "set model_version when the weights under that name change", model)
    parts = [fp, version]
    if engine_config:
        parts += [overrides_digest(overrides), str(quantization or ""), str(revision or "")]
    return "" if not any(parts) else ".".join(parts)


def namespace_model(model: str, identity: str) -> str:
    """The namespace's model field (docs/page-keys.md): the name, then ``#`` and the identity
    when there is one."""
    return f"{model}#{identity}" if identity else model
