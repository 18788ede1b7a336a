"""Data readers: CIFAR-10 (python batches, release archive, download), SVHN .mat files and
image folders (directory or tar), all returned as an ImageDataset and cached once decoded.

    from lofast.data import load_dataset
    test = load_dataset("../shared/data/cifar10-jpeg.tar.gz", "test", "cifar10")
    x, y = test.first_per_class(10).to_tensors()   # (100, 3, 32, 32) float32, (100,) int64
"""

from lofast.data.cifar import CIFAR10_MD5, CIFAR10_URL, download_cifar10
from lofast.data.dataset import SPLITS, ImageDataset
from lofast.data.loader import DATASETS, load_dataset

__all__ = [
    "CIFAR10_MD5",
    "CIFAR10_URL",
    "DATASETS",
    "SPLITS",
    "ImageDataset",
    "download_cifar10",
    "load_dataset",
]
