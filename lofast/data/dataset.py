"""The in-memory image data set that every reader returns."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from lofast.config import SPLITS  # noqa: F401 - re-exported by lofast.data


@dataclass(frozen=True, eq=False, repr=False)
class ImageDataset:
    """Decoded images with integer labels, in a fixed, reproducible order.

    images: (N, H, W, 3) uint8 RGB.
    labels: (N,) int64, each in [0, len(classes)).
    classes: class names; label i names classes[i].
    name: the data set it came from ("cifar10", "svhn", "folder").

    Equality is identity (``eq=False``): comparing arrays element-wise has no single truth value.
    The repr summarises instead of printing the arrays.
    """

    images: np.ndarray
    labels: np.ndarray
    classes: tuple[str, ...]
    name: str

    def __post_init__(self) -> None:
        # Readers validate their input and raise DataError naming the file; reaching these checks
        # means a programming error, hence ValueError.
        images, labels = self.images, self.labels
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] != 3:
            raise ValueError(
                f"images must be (N, H, W, 3) uint8, got {images.shape} {images.dtype}"
            )
        if labels.dtype != np.int64 or labels.shape != (images.shape[0],):
            raise ValueError(
                f"labels must be ({images.shape[0]},) int64, got {labels.shape} {labels.dtype}"
            )
        if labels.size and (labels.min() < 0 or labels.max() >= len(self.classes)):
            raise ValueError(f"labels must lie in [0, {len(self.classes)})")

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.images.shape[1:]))
        return (f"ImageDataset(name={self.name!r}, n={len(self)}, images={shape}, "
                f"classes={len(self.classes)})")

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def subset(self, indices: slice | list[int] | np.ndarray) -> ImageDataset:
        """The samples at `indices` (a slice, a list or an array of positions or a boolean mask),
        in that order, with the same classes and name."""
        if not isinstance(indices, slice):
            indices = np.asarray(indices)
            if indices.size == 0:
                indices = indices.astype(np.int64)  # np.asarray([]) is float, not an index
        return ImageDataset(self.images[indices], self.labels[indices], self.classes, self.name)

    def first_per_class(self, k: int) -> ImageDataset:
        """The first `k` samples (by position) of every class, ordered by (class, position).

        A class with fewer than `k` samples contributes all of them. Deterministic: it depends only
        on the order of the data set, which the readers fix.
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        picked = [np.flatnonzero(self.labels == c)[:k] for c in range(len(self.classes))]
        return self.subset(np.concatenate(picked) if picked else np.zeros(0, np.int64))

    def digest(self) -> str:
        """SHA-256 (hex) of the images, labels and class names: equal digests, equal data."""
        digest = hashlib.sha256()
        digest.update(np.ascontiguousarray(self.images).tobytes())
        digest.update(np.ascontiguousarray(self.labels).tobytes())
        digest.update("\0".join(self.classes).encode("utf-8"))
        return digest.hexdigest()

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, labels): float32 (N, 3, H, W) in [0, 1] and int64 (N,), both new memory."""
        # ascontiguousarray: torch.from_numpy refuses the negative strides a reversed slice makes.
        images = torch.from_numpy(np.ascontiguousarray(self.images))
        x = images.permute(0, 3, 1, 2).contiguous().to(torch.float32).div_(255.0)
        y = torch.from_numpy(self.labels.copy())  # copy: new memory, and no negative strides
        return x, y
