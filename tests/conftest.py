"""Fixtures shared by the CLI-level test modules (a module may define its own of the same name,
as test_cli.py does for a trained checkpoint): a small image folder of four colour classes, an
untrained tiny checkpoint for it, and one data cache outside the folders tests watch."""

import os

import pytest
import torch
from helpers import write_image_folder

from lofast.checkpoint import save_checkpoint
from lofast.config import preset
from lofast.models.vit import create_model

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n N`: one core per worker process
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """train/ and test/ folders of four classes, 8 and 4 PNG images per class."""
    root = tmp_path_factory.mktemp("folder")
    write_image_folder(root, 8, 0)
    return root


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """The tiny preset for the four classes of data_dir, untrained (seed 0)."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny.safetensors"
    save_checkpoint(path, create_model(preset("tiny", num_classes=4), seed=0),
                    {"dataset": "folder", "classes": [f"class{c}" for c in range(4)]})
    return path


@pytest.fixture
def shared_cache(tmp_path_factory, monkeypatch):
    """Decoded data cached once per session, outside every test's own folders."""
    monkeypatch.setenv("LOFAST_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module: many tiny operations run faster without OpenMP
    synchronisation, and results compared with torchrun's one-thread processes sum alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
