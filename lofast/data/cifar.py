"""CIFAR-10 in its official python format: pickled batches, as a folder or the release archive.

The batches are pickles, and unpickling runs whatever callables the file names. They are
therefore read with a restricted unpickler that admits only the few numpy functions an array
needs, so a crafted file cannot execute code.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import logging
import os
import pickle
import urllib.request
from pathlib import Path, PurePosixPath

import numpy as np

from lofast.data._util import ARCHIVE_ERRORS, open_tar_stream, reason
from lofast.data.dataset import ImageDataset
from lofast.errors import DataError
from lofast.files import atomic_write

try:  # numpy >= 2
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy 1.x
    from numpy.core.multiarray import _reconstruct

log = logging.getLogger(__name__)

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR10_DIR = "cifar-10-batches-py"
META_FILE = "batches.meta"
SPLIT_BATCHES = {
    "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
    "test": ("test_batch",),
}
BATCH_FILES = frozenset({META_FILE, *SPLIT_BATCHES["train"], *SPLIT_BATCHES["test"]})

_IMAGE_SHAPE = (3, 32, 32)  # channel-major, as stored in a row of b"data"
_DOWNLOAD_CHUNK = 1 << 20


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """Stands in for `_codecs.encode`: protocol-2 pickles written by Python 3 store every bytes
    object as `_codecs.encode(text, "latin1")`. Other codecs are refused."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"refused _codecs.encode(..., {encoding!r})")
    return text.encode("latin1")


# Everything a CIFAR batch may name: numpy's array reconstruction under its numpy 1 and numpy 2
# module names, and the bytes constructor of Python 3 protocol-2 pickles. Nothing else loads.
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals in `_ALLOWED_GLOBALS`."""

    def __init__(self, file: io.BufferedIOBase, location: str) -> None:
        super().__init__(file, encoding="bytes")  # Python 2 `str` -> bytes, as the files expect
        self._location = location

    def find_class(self, module: str, name: str) -> object:
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise DataError(
                f"{self._location}: refusing to unpickle {module}.{name} "
                "(a CIFAR-10 batch holds only numpy arrays, lists and bytes)"
            ) from None


def unpickle_batch(data: bytes, location: str) -> dict[str, object]:
    """Unpickle one CIFAR batch safely; the dict's keys are returned as str.

    `location` names the file in errors. Raises DataError for a corrupt pickle, a refused global
    or anything but a dict.
    """
    try:
        obj = _RestrictedUnpickler(io.BytesIO(data), location).load()
    except DataError:
        raise
    except Exception as exc:  # a damaged pickle can fail with almost any exception type
        raise DataError(f"{location}: corrupt pickle ({reason(exc)})") from exc
    if not isinstance(obj, dict):
        raise DataError(f"{location}: expected a pickled dict, found {type(obj).__name__}")
    return {k.decode("latin1") if isinstance(k, bytes) else str(k): v for k, v in obj.items()}


def _label_names(meta: dict[str, object], location: str) -> tuple[str, ...]:
    names = meta.get("label_names")
    if not isinstance(names, list) or not names:
        raise DataError(f"{location}: no 'label_names' list")
    return tuple(n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in names)


def _batch_arrays(
    batch: dict[str, object], location: str, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """(images (N, 32, 32, 3) uint8, labels (N,) int64) of one batch, validated."""
    if "data" not in batch or "labels" not in batch:
        raise DataError(f"{location}: not a CIFAR-10 batch (needs keys 'data' and 'labels')")
    data = batch["data"]
    row = int(np.prod(_IMAGE_SHAPE))
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != row:
        shape = getattr(data, "shape", type(data).__name__)
        raise DataError(f"{location}: 'data' must be a uint8 array of shape (N, {row}), "
                        f"found {shape} {getattr(data, 'dtype', '')}".rstrip())
    try:
        labels = np.asarray(batch["labels"], dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise DataError(f"{location}: 'labels' are not integers ({reason(exc)})") from exc
    if labels.shape != (data.shape[0],):
        raise DataError(f"{location}: {labels.size} labels for {data.shape[0]} images")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(f"{location}: labels must lie in [0, {num_classes}), "
                        f"found {labels.min()}..{labels.max()}")
    # Rows are channel-major (3, 32, 32); the data set is channel-last.
    images = data.reshape(-1, *_IMAGE_SHAPE).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), labels


def _assemble(
    files: dict[str, bytes], split: str, origin: str, location_of: dict[str, str]
) -> ImageDataset:
    """Build the split from the raw bytes of its batch files and batches.meta."""
    wanted = (META_FILE, *SPLIT_BATCHES[split])
    missing = [name for name in wanted if name not in files]
    if missing:
        raise DataError(f"{origin}: missing CIFAR-10 file(s) {', '.join(missing)}")
    classes = _label_names(unpickle_batch(files[META_FILE], location_of[META_FILE]),
                           location_of[META_FILE])
    parts = [
        _batch_arrays(unpickle_batch(files[name], location_of[name]), location_of[name],
                      len(classes))
        for name in SPLIT_BATCHES[split]
    ]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    return ImageDataset(images, labels, classes, "cifar10")


def read_cifar_dir(directory: Path, split: str) -> ImageDataset:
    """Read `split` from a cifar-10-batches-py folder (data_batch_1..5 or test_batch, and
    batches.meta); images in batch order."""
    files, locations = {}, {}
    for name in (META_FILE, *SPLIT_BATCHES[split]):
        path = directory / name
        try:
            files[name] = path.read_bytes()
        except FileNotFoundError:
            continue  # reported, with all other missing files, by _assemble
        except OSError as exc:
            raise DataError(f"{path}: cannot read ({reason(exc)})") from exc
        locations[name] = str(path)
    return _assemble(files, split, str(directory), locations)


def read_cifar_tar(archive: Path, split: str) -> ImageDataset:
    """Read `split` straight from cifar-10-python.tar.gz (one pass, nothing extracted)."""
    wanted = {META_FILE, *SPLIT_BATCHES[split]}
    files, locations = {}, {}
    try:
        with open_tar_stream(archive) as tar:
            for member in tar:
                name = PurePosixPath(member.name).name
                if not member.isfile() or name not in wanted:
                    continue
                if name in files:
                    raise DataError(f"{archive}: holds {name} twice")
                files[name] = tar.extractfile(member).read()
                locations[name] = f"{archive}:{member.name}"
    except ARCHIVE_ERRORS as exc:
        raise DataError(f"{archive}: corrupt or truncated archive ({reason(exc)})") from exc
    return _assemble(files, split, str(archive), locations)


def download_cifar10(
    directory: Path,
    url: str | None = None,
    md5: str | None = None,
    timeout: float = 60.0,
) -> Path:
    """Download the CIFAR-10 python archive into `directory` (created if needed) and return its
    path, `directory / "cifar-10-python.tar.gz"`.

    `url` defaults to env LOFAST_CIFAR10_URL, else CIFAR10_URL; `md5` to env LOFAST_CIFAR10_MD5,
    else CIFAR10_MD5. The file is written under a temporary name, checked against `md5`, and
    only then renamed into place, so the final path never holds a partial or wrong file.
    `timeout` (seconds) bounds every network wait. Raises DataError on a network error or a
    checksum mismatch, leaving no file behind.
    """
    url = url or os.environ.get("LOFAST_CIFAR10_URL") or CIFAR10_URL
    md5 = (md5 or os.environ.get("LOFAST_CIFAR10_MD5") or CIFAR10_MD5).lower()
    target = directory / CIFAR10_ARCHIVE
    log.info("downloading %s to %s", url, target)

    def download(tmp: str) -> None:  # raising leaves no file behind (files.atomic_write)
        digest = hashlib.md5(usedforsecurity=False)
        with open(tmp, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as response:
            while chunk := response.read(_DOWNLOAD_CHUNK):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != md5:
            raise DataError(f"{target}: checksum mismatch for {url} "
                            f"(md5 {digest.hexdigest()}, expected {md5})")

    try:
        atomic_write(target, download)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        # OSError covers URLError, HTTPError, timeouts and an unwritable folder; ValueError an
        # unknown URL scheme; HTTPException a connection closed mid-body.
        raise DataError(f"{target}: download from {url} failed ({reason(exc)})") from exc
    return target
