"""Fixtures shared by the CLI-level test modules (a module may define its own of the same name,
as test_cli.py does for a trained checkpoint): a small image folder of four colour classes, an
untrained tiny checkpoint for it, and one data cache outside the folders tests watch."""

import os

import pytest

# torch, lofast and the helpers are imported where a fixture needs them: the controller process
# of `pytest -n N` loads this file but runs no test, and importing torch there (1.3 s of CPU)
# would only compete with the workers starting up.


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n N`: one core per worker process
        import torch

        torch.set_num_threads(1)


# Every test file by its time on one thread, longest first (`--durations=0`, summed per file;
# files not listed go last). `pytest -n N` hands whole files to the workers in collection order
# (``--dist loadfile``, pyproject.toml), each to the first that is free: longest first, so that
# no worker is left with a long file when the others are done, and the short ones last fill
# the gaps evenly.
FILES_LONGEST_FIRST = (
    "test_distributed.py", "test_certify.py", "test_shipped_models.py", "test_gpu_check.py",
    "test_bounds_attention.py", "test_cli.py", "test_bab.py", "test_api.py",
    "test_training_bound.py", "test_adversarial_checkpoints.py", "test_verdicts.py",
    "test_models.py", "test_attention_norms.py", "test_bounds_spectral.py",
    "test_bounds_near_reference.py", "test_hostile_inputs.py", "test_attention_report.py",
    "test_stage_protocol.py", "test_bounds_coordinate_jacobian.py", "test_data.py",
    "test_bounds_deflation.py", "test_crown.py", "test_checkpoint.py", "test_bounds_compose.py")

# Two lanes (``pytest -m unit`` / ``-m integration``). The integration lane runs the product as
# a user does: commands, the API's pipelines, torchrun, the shipped models, files from outside,
# and the GPU slot script (benchmarks/gpu_check.sh) on a CPU.
# Every other file is the unit lane: the maths against dense float64 references and autograd,
# and the soundness references (PGD on certified samples of small trained models).
INTEGRATION_FILES = (
    "test_api.py", "test_cli.py", "test_distributed.py", "test_shipped_models.py",
    "test_hostile_inputs.py", "test_verdicts.py", "test_adversarial_checkpoints.py",
    "test_attention_report.py", "test_gpu_check.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return (FILES_LONGEST_FIRST.index(name) if name in FILES_LONGEST_FIRST
                else len(FILES_LONGEST_FIRST))

    items.sort(key=rank)  # stable: the order within each file and among the rest is kept
    for item in items:
        item.add_marker("integration" if item.path.name in INTEGRATION_FILES else "unit")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """train/ and test/ folders of four classes, 8 and 4 PNG images per class."""
    from helpers import write_image_folder

    root = tmp_path_factory.mktemp("folder")
    write_image_folder(root, 8, 0)
    return root


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """The tiny preset for the four classes of data_dir, untrained (seed 0)."""
    from lofast.checkpoint import save_checkpoint
    from lofast.config import preset
    from lofast.models.vit import create_model

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
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
