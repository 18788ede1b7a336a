"""SVHN in its official cropped-digits format: train_32x32.mat and test_32x32.mat.

Each file holds X, uint8 of shape (32, 32, 3, N) (height, width, channel, sample), and y, of
shape (N, 1), with labels 1..10 where 10 stands for the digit 0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lofast.data.dataset import ImageDataset
from lofast.data.matv5 import read_mat_arrays
from lofast.errors import DataError

SVHN_CLASSES = tuple(str(d) for d in range(10))


def svhn_file_name(split: str) -> str:
    """The official file name of `split`, e.g. "test_32x32.mat"."""
    return f"{split}_32x32.mat"


def read_svhn(path: Path) -> ImageDataset:
    """Read one SVHN .mat file: images (N, 32, 32, 3) in file order, labels 0..9 (10 -> 0)."""
    arrays = read_mat_arrays(path, {"X", "y"})
    missing = [name for name in ("X", "y") if name not in arrays]
    if missing:
        raise DataError(f"{path}: no variable {' or '.join(missing)} (not an SVHN file)")
    x, y = arrays["X"], arrays["y"]
    if x.ndim != 4 or x.shape[2] != 3:
        raise DataError(f"{path}: X must have shape (H, W, 3, N), found {x.shape}")
    if x.dtype != np.uint8:
        if x.size and not np.all(np.isin(x, np.arange(256))):
            raise DataError(f"{path}: X holds values other than integers 0..255")
        x = x.astype(np.uint8)
    if y.size != x.shape[3] or y.ndim > 2 or (y.ndim == 2 and 1 not in y.shape):
        raise DataError(f"{path}: y must hold one label per image ({x.shape[3]}), "
                        f"found shape {y.shape}")
    labels = y.reshape(-1)
    # 0 is accepted too (some re-exports store digit 0 as 0); it means the same class as 10.
    if labels.size and not np.all(np.isin(labels, np.arange(11))):
        raise DataError(f"{path}: labels must be integers in 1..10, "
                        f"found {labels.min():g}..{labels.max():g}")
    labels = labels.astype(np.int64) % 10
    images = np.ascontiguousarray(x.transpose(3, 0, 1, 2))
    return ImageDataset(images, labels, SVHN_CLASSES, "svhn")
