"""The sample of test images bundled with lofast, and the class-balanced evaluation order."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from lofast.errors import DataError

BUNDLED_PATH = Path(__file__).parent / "bundled" / "cifar10-test-sample.npz"
PER_CLASS = 50


def class_balanced_order(labels: np.ndarray) -> np.ndarray:
    """Indices sorted by (position within the sample's class, class): the first k of this order
    hold the first images of every class in turn, whatever order the data set has."""
    labels = np.asarray(labels)
    rank = np.empty(len(labels), dtype=np.int64)
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        rank[members] = np.arange(len(members))
    return np.lexsort((labels, rank))


def load_bundled_sample():
    """The first 50 test images of every CIFAR-10 class (CIFAR-10 JPEG q75 copy), 500 in all."""
    from lofast.data import ImageDataset

    if not BUNDLED_PATH.is_file():
        raise DataError(f"bundled sample missing: {BUNDLED_PATH}; pass --data")
    try:
        with np.load(BUNDLED_PATH, allow_pickle=False) as f:
            images, labels, classes = f["images"], f["labels"], tuple(str(c) for c in f["classes"])
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"{BUNDLED_PATH}: corrupt bundled sample ({e})") from None
    return ImageDataset(images=images, labels=labels.astype(np.int64), classes=classes,
                        name="cifar10")


def write_bundled_sample(source: str, per_class: int = PER_CLASS) -> None:
    """Rebuild the bundled sample from a CIFAR-10 copy (python -m lofast.data.sample PATH)."""
    from lofast.data import load_dataset

    test = load_dataset(source, "test", "cifar10").first_per_class(per_class)
    BUNDLED_PATH.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(BUNDLED_PATH, images=test.images, labels=test.labels.astype(np.uint8),
                        classes=np.array(test.classes))


if __name__ == "__main__":
    write_bundled_sample(sys.argv[1])
