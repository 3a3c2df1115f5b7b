"""What a model's checkpoint *is*, for the L3 namespaces of engine integrations.

Why: an engine names its model by a path or a hub id (vLLM's ``model``, SGLang's
``model_path``), and the L3 namespace (docs/page-keys.md) was derived from that name. But a
name is not the weights: a new fine-tune pushed to the same hub id, a checkpoint replaced in
place at the same path, or a ``--hf-overrides`` that changes RoPE all keep the name while
every page's K and V change. A second engine (or the same one restarted) on a shared
``kvtier-l3`` then loaded the first one's pages as its own and generated wrong tokens, with
no error. :func:`checkpoint_fingerprint` names the checkpoint by its content instead: the
SHA-256 of its ``config.json`` and of every weight file, with their names and sizes. Two copies
of one checkpoint (two hosts, two cache directories, a hub cache and a plain copy) get the same
fingerprint, so engines serving one model still share their pages; a checkpoint whose weights
differ in any byte gets another (until 2026-12-06 it read 16 ranges of 4 KiB per file, and
weights differing only outside them, e.g. a few re-trained embedding rows, shared a namespace).

How: the directory is the name when it is one, else the snapshot the Hugging Face cache holds
for the name and revision (resolved offline; nothing is downloaded). A file's SHA-256 costs
nothing when the hub cache holds it: the cache names each Git LFS file (every weight file) by
its SHA-256. A file of a plain directory is read whole once (about 1 s per GB per core, the
files in parallel) and its digest kept on disk (:func:`digest_cache_dir`), keyed by the file's
path, size, mtime, ctime and inode, so a restarted engine does not read it again; a file
replaced in place is read again. The fingerprint is 16 hex digits of SHA-256 over those
digests; ``""`` when no directory is found (a remote loader, an uncached hub id): then the
engine's namespace is its name alone, as before, and the integrations log it and take an
operator's ``model_version``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Optional

__all__ = ["WEIGHT_SUFFIXES", "checkpoint_dir", "checkpoint_fingerprint", "digest_cache_dir", "engine_identity",
           "namespace_model", "overrides_digest"]

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
"""Files of a checkpoint directory that hold weights."""

READ_BYTES = 8 << 20
"""Bytes read at a time when a file is hashed."""

MAX_CACHED_DIGESTS = 4096
"""Files whose digests the on-disk cache keeps (the latest written)."""

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


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


def digest_cache_dir() -> str:
    """Where local files' digests are kept: ``$KVTIER_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/kvtier``, else ``~/.cache/kvtier``."""
    own = os.environ.get("KVTIER_CACHE_DIR")
    if own:
        return own
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvtier")


def _cache_file() -> str:
    return os.path.join(digest_cache_dir(), "checkpoint-sha256.json")


def _stamp(st: os.stat_result) -> list:
    """What says a file is unchanged since its digest was taken (ctime cannot be set back)."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _load_cache() -> Dict[str, list]:
    """The on-disk digests, ``{path: [*stamp, sha256]}``; empty when missing or unreadable
    (a cache: never an error)."""
    try:
        with open(_cache_file()) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def _save_cache(new: Dict[str, list]) -> None:
    """Adds ``new`` to the on-disk digests (re-read first: engines on one host write it
    concurrently, and a lost race only costs a later read), atomically; errors ignored."""
    if not new:
        return
    try:
        os.makedirs(digest_cache_dir(), exist_ok=True)
        merged = {**_load_cache(), **new}
        keep = dict(list(merged.items())[-MAX_CACHED_DIGESTS:])
        fd, tmp = tempfile.mkstemp(dir=digest_cache_dir(), prefix=".checkpoint-sha256.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(keep, f)
            os.replace(tmp, _cache_file())
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def _file_sha256(path: str) -> str:
    """The SHA-256 of the file's bytes (hashlib releases the GIL: files hash in parallel)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _hub_blob_digest(path: str) -> Optional[str]:
    """The SHA-256 the Hugging Face cache names ``path``'s blob by: snapshot entries are
    symlinks into ``blobs/``, named by the SHA-256 of the content for Git LFS files. None for
    anything else (a Git blob id of a small file is a SHA-1 of a header and the content)."""
    if not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    name = os.path.basename(target)
    if os.path.basename(os.path.dirname(target)) != "blobs" or not _SHA256_HEX.fullmatch(name):
        return None
    return name


def _digests(root: str, files: tuple) -> list:
    """Each file's SHA-256, cheapest source first: the hub cache's blob name, the on-disk
    cache, reading the file (in parallel)."""
    cached = _load_cache()
    out: list = [None] * len(files)
    todo = []
    for i, (name, _, stamp) in enumerate(files):
        path = os.path.join(root, name)
        out[i] = _hub_blob_digest(path)
        if out[i] is None:
            real = os.path.realpath(path)
            hit = cached.get(real)
            if isinstance(hit, list) and hit[:-1] == list(stamp) and isinstance(hit[-1], str):
                out[i] = hit[-1]
            else:
                todo.append((i, path, real, stamp))
    if todo:
        workers = max(1, min(len(todo), os.cpu_count() or 1, 8))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-sha256") as pool:
            done = list(pool.map(lambda t: _file_sha256(t[1]), todo))
        for (i, _, _, _), digest in zip(todo, done):
            out[i] = digest
        _save_cache({real: [*stamp, digest] for (_, _, real, stamp), digest in zip(todo, done)})
    return out


@functools.lru_cache(maxsize=64)
def _fingerprint_of_dir(root: str, files: tuple) -> str:
    """``files``: (name, size, stamp) in name order. The stamp (mtime, ctime, inode, device)
    keys only the caches (a file replaced in place is read again); the fingerprint is of names,
    sizes and content, so copies on two hosts agree."""
    h = hashlib.sha256(b"kvtier-checkpoint-v2")
    for (name, size, _), digest in zip(files, _digests(root, files)):
        h.update(len(name).to_bytes(8, "little") + name.encode() + size.to_bytes(8, "little"))
        h.update(bytes.fromhex(digest))
    return h.hexdigest()[:16]


def checkpoint_fingerprint(model: str, revision: Optional[str] = None) -> str:
    """16 hex digits naming the content of ``model``'s checkpoint (module doc): its
    ``config.json`` and every weight file's name, size and SHA-256, in name order.
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
                files.append((n, st.st_size, tuple(_stamp(st))))
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
                    quantization: Any = None, version: str = "", settings: str = "") -> str:
    """What an engine's pages depend on beyond the model's name: the checkpoint's
    :func:`checkpoint_fingerprint`, the operator's ``version`` and, when the engine's own
    config was read (``engine_config``), its config ``overrides``, ``quantization``,
    ``revision`` and ``settings`` (the engine's other settings that change every page: the
    dtype it computes in, LongRoPE's factors; the integration says which). ``""`` when none
    is known (then the namespace is the name alone, as before, and a warning says so)."""
    fp = checkpoint_fingerprint(model, revision)
    if not fp and not version:
        logger.warning("kvtier: no checkpoint directory found for model %r: its L3 namespace is its name; "
                       "set model_version when the weights under that name change", model)
    parts = [fp, version]
    if engine_config:
        parts += [overrides_digest(overrides), str(quantization or ""), str(revision or "")]
        if settings:
            parts.append(hashlib.sha256(settings.encode()).hexdigest()[:16])
    return "" if not any(parts) else ".".join(parts)


def namespace_model(model: str, identity: str) -> str:
    """The namespace's model field (docs/page-keys.md): the name, then ``#`` and the identity
    when there is one."""
    return f"{model}#{identity}" if identity else model
