"""load_dataset: find out what a path holds, read the split through the cache, validate it."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from lofast.config import DATASETS
from lofast.data._util import ARCHIVE_ERRORS, is_tar_name, open_tar_stream, reason
from lofast.data.cache import cached
from lofast.data.cifar import (
    BATCH_FILES,
    CIFAR10_ARCHIVE,
    CIFAR10_DIR,
    download_cifar10,
    read_cifar_dir,
    read_cifar_tar,
)
from lofast.data.dataset import SPLITS, ImageDataset
from lofast.data.imagefolder import (
    find_folder_root,
    is_image_name,
    read_folder_dir,
    read_folder_tar,
)
from lofast.data.svhn import read_svhn, svhn_file_name
from lofast.errors import DataError
from lofast.files import check_readable

# What each layout is read with, and which `dataset` values it can serve.
_READERS: dict[str, Callable[[Path, str], ImageDataset]] = {
    "cifar-dir": read_cifar_dir,
    "cifar-tar": read_cifar_tar,
    "svhn-mat": lambda path, split: read_svhn(path),
    "folder-dir": read_folder_dir,
    "folder-tar": read_folder_tar,
}
_FAMILY = {"cifar-dir": "cifar10", "cifar-tar": "cifar10", "svhn-mat": "svhn",
           "folder-dir": "folder", "folder-tar": "folder"}
_SERVES = {"cifar10": {"cifar10", "folder"}, "svhn": {"svhn"}, "folder": {"folder"}}
CIFAR10_IMAGE_SIZE = (32, 32)  # (H, W)


@dataclass(frozen=True)
class _Source:
    kind: str  # a key of _READERS
    path: Path  # the file or folder the reader opens

    def inputs(self) -> list[Path]:
        """What the reader's result depends on (for the cache): the file itself, or only the
        relevant parts of a folder, which may hold much else."""
        if self.kind == "cifar-dir":
            return [self.path / name for name in sorted(BATCH_FILES)]
        if self.kind == "folder-dir":
            return [self.path / split for split in SPLITS]
        return [self.path]


def _tar_kind(archive: Path) -> str:
    """"cifar-tar" or "folder-tar", from the first member that tells them apart."""
    try:
        with open_tar_stream(archive) as tar:
            for member in tar:
                name = PurePosixPath(member.name).name
                if member.isfile() and name in BATCH_FILES:
                    return "cifar-tar"
                if member.isfile() and is_image_name(name):
                    return "folder-tar"
    except ARCHIVE_ERRORS as exc:
        raise DataError(f"{archive}: corrupt or truncated archive ({reason(exc)})") from exc
    raise DataError(f"{archive}: archive holds neither CIFAR-10 batches nor .jpg/.png images")


def _file_source(path: Path, split: str) -> _Source:
    """What a data file given directly is: an SVHN .mat, or a tar of CIFAR batches or images."""
    name = path.name.lower()
    if name.endswith(".mat"):
        other = SPLITS[1 - SPLITS.index(split)]
        if name == svhn_file_name(other):
            raise DataError(f"{path}: is the SVHN '{other}' split, but split '{split}' was asked")
        return _Source("svhn-mat", path)
    if is_tar_name(name):
        return _Source(_tar_kind(path), path)
    raise DataError(f"{path}: unknown data file (expected a .mat, .tar, .tar.gz or .tgz)")


def _dir_source(directory: Path, split: str, family: str) -> _Source | None:
    """Where `directory` holds data of `family`, or None if it holds none."""
    if family == "cifar10":
        if (directory / CIFAR10_DIR).is_dir():
            return _Source("cifar-dir", directory / CIFAR10_DIR)
        if any((directory / name).is_file() for name in BATCH_FILES):
            return _Source("cifar-dir", directory)
        if (directory / CIFAR10_ARCHIVE).is_file():
            return _Source("cifar-tar", directory / CIFAR10_ARCHIVE)
    elif family == "svhn":
        if any((directory / svhn_file_name(s)).is_file() for s in SPLITS):
            mat = directory / svhn_file_name(split)
            if not mat.is_file():
                raise DataError(f"{directory}: no {mat.name} for split '{split}'")
            return _Source("svhn-mat", mat)
    else:
        root = find_folder_root(directory)
        if root is not None:
            return _Source("folder-dir", root)
    return None


def _locate(path: Path, split: str, dataset: str | None) -> _Source | None:
    """The source of `split` at `path` that can serve `dataset`; None for a folder without one.

    With dataset=None every layout is tried, CIFAR-10 batches first, then SVHN, then images.
    """
    if path.is_file():
        source = _file_source(path, split)
        family = _FAMILY[source.kind]
        if dataset is not None and family not in _SERVES[dataset]:
            raise DataError(f"{path}: holds {family} data, not {dataset}")
        return source
    if not path.is_dir():
        what = "is not a regular file or folder" if path.exists() else "does not exist"
        raise DataError(f"{path}: {what}")
    families = ("cifar10", "svhn", "folder") if dataset is None else \
        [f for f in ("cifar10", "svhn", "folder") if f in _SERVES[dataset]]
    try:
        for family in families:
            source = _dir_source(path, split, family)
            if source is not None:
                return source
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({reason(exc)})") from exc
    return None


def _check_cifar10(dataset: ImageDataset, where: Path) -> None:
    if len(dataset.classes) != 10:
        raise DataError(f"{where}: CIFAR-10 needs 10 classes, found {len(dataset.classes)} "
                        f"({', '.join(dataset.classes)})")
    if dataset.images.shape[1:] != (*CIFAR10_IMAGE_SIZE, 3):
        h, w = dataset.images.shape[1:3]
        raise DataError(f"{where}: CIFAR-10 images are 32x32 RGB, found {h}x{w}")


def load_dataset(
    path: str | os.PathLike,
    split: str,
    dataset: str | None = None,
    download: bool = False,
    cache_dir: str | os.PathLike | None = None,
) -> ImageDataset:
    """Load the `split` ("train" or "test") of the data set at `path`.

    `path` may be:
      - CIFAR-10 in the official python format: the cifar-10-batches-py folder, a folder
        containing it, or cifar-10-python.tar.gz (or a folder containing that);
      - SVHN: train_32x32.mat / test_32x32.mat, or a folder containing them;
      - an image folder <root>/<split>/<class>/*.jpg|*.jpeg|*.png, as a folder or a
        .tar/.tar.gz/.tgz archive, the root possibly one folder down.
    `dataset` ("cifar10", "svhn", "folder") says which to expect; None detects it. "cifar10"
    accepts an image folder too, and checks for 10 classes of 32x32 RGB images.
    `download=True` fetches the CIFAR-10 archive into the folder `path` when it holds no data.
    Decoded arrays are cached in `cache_dir` (default $LOFAST_CACHE_DIR or ~/.cache/lofast).

    Returns the split in a fixed order: file order for CIFAR-10 batches and SVHN, (class name,
    file name) for image folders. `name` is `dataset`, or the detected kind when None.
    Raises DataError, with one line naming the file, for any missing, corrupt or invalid input.
    """
    try:
        path = Path(path).expanduser().resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        raise DataError(f"{path}: cannot resolve path ({reason(exc)})") from exc
    if path.exists() and not path.is_dir():  # a FIFO would make the read wait forever
        check_readable(path, "data file", DataError)
    if split not in SPLITS:
        raise DataError(f"{path}: unknown split {split!r} (expected 'train' or 'test')")
    if dataset is not None and dataset not in DATASETS:
        raise DataError(f"{path}: unknown dataset {dataset!r} (expected one of "
                        f"{', '.join(DATASETS)})")

    can_download = download and dataset in (None, "cifar10")
    source = _locate(path, split, dataset) if path.exists() or not can_download else None
    if source is None and can_download:
        source = _Source("cifar-tar", download_cifar10(path))
    if source is None:
        expected = {
            None: "CIFAR-10 batches or archive, SVHN .mat files or <split>/<class>/ images",
            "cifar10": f"{CIFAR10_DIR}/, {CIFAR10_ARCHIVE} or <split>/<class>/ images; "
                       "download=True fetches the archive",
            "svhn": "train_32x32.mat or test_32x32.mat",
            "folder": "<split>/<class>/ image folders",
        }[dataset]
        if download:
            expected += "; download=True only fetches CIFAR-10"
        raise DataError(f"{path}: no data found (expected {expected})")

    reader = _READERS[source.kind]
    if dataset == "cifar10" and _FAMILY[source.kind] == "folder":  # refused at a first 224x224
        reader = functools.partial(reader, size=CIFAR10_IMAGE_SIZE)
    result = cached(lambda: reader(source.path, split), source.path, source.kind, split,
                    source.inputs(),
                    Path(cache_dir).expanduser() if cache_dir is not None else None)
    result = replace(result, name=dataset or _FAMILY[source.kind])
    if result.name == "cifar10":
        _check_cifar10(result, source.path)
    return result
