"""A disk cache of decoded data sets, so that slow sources (60,000 JPEGs) are decoded once.

One uncompressed .npz per (source kind, absolute source path, split). Each file records the key
it was built for: the format version, the source and a fingerprint of the size and mtime of
every file read (every file below a folder), so a changed source, or a file from an older
version of this code, is a miss and gets rebuilt. Each file also records the SHA-256 of its
content (images, labels, class names), checked on every load: an entry whose arrays were changed
in place (labels edited, images swapped, the key kept) is rebuilt from the source. Caching is best effort: an unreadable or corrupt
cache file is rebuilt and an unwritable cache folder is skipped, never an error.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from lofast.data.dataset import ImageDataset
from lofast.files import atomic_write

log = logging.getLogger(__name__)

# Bump whenever readers change what they return for the same source.
CACHE_FORMAT_VERSION = 2


def default_cache_dir() -> Path:
    """$LOFAST_CACHE_DIR if set, else ~/.cache/lofast."""
    env = os.environ.get("LOFAST_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lofast"


def _fingerprint(inputs: Sequence[Path]) -> str:
    """A digest of the size and mtime of every input file, and of every file below every input
    folder; a missing input counts as such."""
    digest = hashlib.sha256()

    def add(path: str) -> None:
        st = os.stat(path)
        line = f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n"
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


def _load(path: Path, key: str) -> ImageDataset | None:
    """The data set cached at `path` for `key`, or None if absent, stale or damaged."""
    if not path.is_file():  # absent, or something no cache writes (a FIFO): a miss
        return None
    try:
        with np.load(path, allow_pickle=False) as npz:
            if str(npz["key"]) != key:
                return None
            classes = tuple(str(c) for c in npz["classes"])
            dataset = ImageDataset(npz["images"], npz["labels"], classes, str(npz["name"]))
            if dataset.digest() != str(npz["digest"]):
                log.warning("cache file %s does not match its digest; rebuilding it", path)
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
        with open(tmp, "wb") as out:
            np.savez(out, key=np.array(key), digest=np.array(dataset.digest()),
                     images=dataset.images, labels=dataset.labels,
                     classes=np.array(dataset.classes, dtype=str), name=np.array(dataset.name))

    try:
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
    `build` depends on: a change of size or mtime in any of them invalidates the entry.
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
