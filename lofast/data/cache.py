"""A disk cache of decoded data sets, so that slow sources (60,000 JPEGs) are decoded once.

One uncompressed .npz per (source kind, absolute source path, split). Each file records the key
it was built for: the format version, the source and a fingerprint of the size, mtime and
SHA-256 of every file read (every file below a folder), so a changed source, a cache built from
other data, or a file from an older version of this code, is a miss and gets rebuilt. Each
file also records the SHA-256 of its content (images, labels, class names) and an HMAC of key
and content under a secret kept in the cache folder (``.lofast-cache-secret``, created once,
readable by its owner alone), both checked on every load: an entry whose arrays were changed
(labels edited, images swapped), even with its digests recomputed, is rebuilt from the source.

What it does not protect against: someone who can read the secret, that is who runs as the
owner of the cache folder, can forge an entry; and a secret readable by others, or a folder
others can write, is not trusted (entries are then rebuilt, and nothing is cached). Point
``LOFAST_CACHE_DIR`` at a folder only you can write. Caching is best effort: an unreadable or
corrupt cache file is rebuilt and an unwritable cache folder is skipped, never an error.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from lofast.data.dataset import ImageDataset
from lofast.files import atomic_write

log = logging.getLogger(__name__)

# Bump whenever readers change what they return for the same source.
CACHE_FORMAT_VERSION = 3
SECRET_NAME = ".lofast-cache-secret"


def default_cache_dir() -> Path:
    """$LOFAST_CACHE_DIR if set, else ~/.cache/lofast."""
    env = os.environ.get("LOFAST_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lofast"


def _fingerprint(inputs: Sequence[Path]) -> str:
    """A digest of the size, mtime and SHA-256 of every input file, and of every file below
    every input folder; a missing input counts as such. Hashing reads every byte once (about
    1 s for CIFAR-10's 60,000 JPEGs, 0.05 s for its 20 MB archive), far less than decoding."""
    digest = hashlib.sha256()

    def add(path: str) -> None:
        st = os.stat(path)
        content = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                content.update(block)
        line = f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{content.hexdigest()}\n"
        digest.update(line.encode("utf-8", "surrogateescape"))

    for item in inputs:
        if item.is_file():
            add(str(item))
        elif item.is_dir():
            # followlinks=False: a symlink cycle must not make this walk endless.
            for folder, dirs, files in os.walk(item):
                dirs.sort()
                for name in sorted(files):
                    add(os.path.join(folder, name))
        else:
            digest.update(f"{item}\0absent\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def _secret(folder: Path, create: bool) -> bytes | None:
    """The cache folder's secret: 32 random bytes in a file only its owner can read, in a folder
    only its owner can write (None where that does not hold, or, without create, where there is
    none yet: nothing read from such a folder is trusted)."""
    path = folder / SECRET_NAME
    try:
        mine = os.getuid() if hasattr(os, "getuid") else None
        st = os.stat(folder)
        if mine is not None and (st.st_uid != mine or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
            return None
        if create and not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077 or (
                mine is not None and st.st_uid != mine):
            return None
        value = path.read_bytes()
    except OSError:
        return None
    return value if len(value) == 32 else None


def _seal(secret: bytes, key: str, digest: str) -> str:
    return hmac.new(secret, f"{key}\0{digest}".encode("utf-8", "surrogateescape"),
                    hashlib.sha256).hexdigest()


def _load(path: Path, key: str) -> ImageDataset | None:
    """The data set cached at `path` for `key`, or None if absent, stale, damaged or not sealed
    by this folder's secret."""
    if not path.is_file():  # absent, or something no cache writes (a FIFO): a miss
        return None
    secret = _secret(path.parent, create=False)
    if secret is None:
        return None
    try:
        with np.load(path, allow_pickle=False) as npz:
            if str(npz["key"]) != key:
                return None
            classes = tuple(str(c) for c in npz["classes"])
            dataset = ImageDataset(npz["images"], npz["labels"], classes, str(npz["name"]))
            digest = dataset.digest()
            if digest != str(npz["digest"]) or not hmac.compare_digest(
                    _seal(secret, key, digest), str(npz["seal"])):
                log.warning("cache file %s does not match its digest or seal; rebuilding it",
                            path)
                return None
            return dataset
    except FileNotFoundError:
        return None
    # Any damage (bad zip, missing or malformed array, wrong shapes) just means: rebuild.
    except Exception as exc:  # noqa: BLE001
        log.warning("ignoring unreadable cache file %s (%s)", path, exc)
        return None


def _save(path: Path, key: str, dataset: ImageDataset) -> None:
    """Write the cache file atomically (``files.atomic_write``); skip on any OS error."""

    def write(tmp: str) -> None:
        digest = dataset.digest()
        with open(tmp, "wb") as out:
            np.savez(out, key=np.array(key), digest=np.array(digest),
                     seal=np.array(_seal(secret, key, digest)),
                     images=dataset.images, labels=dataset.labels,
                     classes=np.array(dataset.classes, dtype=str), name=np.array(dataset.name))

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        secret = _secret(path.parent, create=True)
        if secret is None:
            log.info("not caching %s (the folder or its secret is open to others)", path)
            return
        atomic_write(path, write)
    except OSError as exc:
        log.info("not caching %s (%s)", path, exc)


def cached(
    build: Callable[[], ImageDataset],
    source: Path,
    kind: str,
    split: str,
    inputs: Sequence[Path],
    cache_dir: Path | None = None,
) -> ImageDataset:
    """`build()`, or the copy of its result cached for (`kind`, `source`, `split`).

    `source` is the absolute file or folder `build` reads, `kind` names the reader (two readers
    of one path do not share an entry) and `inputs` are the files and folders whose content
    `build` depends on: a change of size, mtime or content in any of them invalidates the
    entry.
    `cache_dir` defaults to default_cache_dir().
    """
    try:
        key = f"v{CACHE_FORMAT_VERSION}|{kind}|{source}|{split}|{_fingerprint(inputs)}"
    except OSError:
        return build()  # the source cannot be examined: let the reader report why
    name = hashlib.sha256(f"{kind}|{source}|{split}".encode("utf-8", "surrogateescape"))
    path = (cache_dir or default_cache_dir()) / f"{kind}-{split}-{name.hexdigest()[:20]}.npz"
    dataset = _load(path, key)
    if dataset is None:
        dataset = build()
        _save(path, key, dataset)
    return dataset
