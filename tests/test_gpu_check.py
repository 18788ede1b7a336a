"""benchmarks/gpu_check.sh, the script an accelerator slot runs, run through on a CPU: slots are
short and rare, and one lost to an option that no longer exists or a pass that does not chain
is lost for good. Its paths: the figures alone, a training pass with its certificate, the next
pass resumed from the first's state, and a new stage from a trained model with the default
recipe (whose compiled step needs CUDA: the script goes on without it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

GPU_CHECK = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
                 "dog", "frog", "horse", "ship", "truck")


@pytest.fixture(scope="module")
def cifar_folder(tmp_path_factory):
    """A CIFAR-10 copy in the shared archive's layout (split / class / NNNN.jpg): 4 training and
    2 test images a class."""
    root = tmp_path_factory.mktemp("cifar10-jpeg")
    rng = np.random.default_rng(0)
    for split, count in (("train", 4), ("test", 2)):
        for name in CIFAR_CLASSES:
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i:04d}.jpg")
    return root


def slot(data, out, *state, **env):
    """One pass of the script on the CPU, without the throughput benchmarks: its exit code and
    its log (what it wrote to stderr where it wrote no log)."""
    settings = {"DEVICE": "cpu", "BENCH_BATCHES": "", "COMPILE": "", "LIMIT": "4",
                "OMP_NUM_THREADS": "1", "LOFAST_CACHE_DIR": str(out.parent / "cache"), **env}
    # the script calls python3: this interpreter's, whether or not its environment is active
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    result = subprocess.run(["bash", str(GPU_CHECK), str(data), str(out), *map(str, state)],
                            env={**os.environ, **settings, "PATH": path}, capture_output=True,
                            text=True, timeout=400, check=False)
    log = out / "log.txt"
    return result.returncode, log.read_text() if log.is_file() else result.stderr


def certified_samples(path):
    return json.loads(path.read_text())["samples"]


def test_the_figures_alone(cifar_folder, tmp_path):
    code, log = slot(cifar_folder, tmp_path / "out", PASS_SECONDS="0")
    assert code == 0, log
    assert certified_samples(tmp_path / "out" / "certify_default.json") == 4, log
    assert "== no training" in log and "exit" not in log, log


def test_training_passes_chain_through_the_repository_state(cifar_folder, tmp_path):
    tiny = "--preset tiny --batch-size 8 --no-augment --loss certified --train-eps 0.05"
    first, second, stage = tmp_path / "first", tmp_path / "second", tmp_path / "stage"
    # a pass that trains, certifies what it trained and leaves its state
    code, log = slot(cifar_folder, first, PASS_SECONDS="90", EPOCHS="2", TRAIN_ARGS=tiny)
    assert code == 0, log
    assert (first / "train.safetensors").is_file()
    assert (first / "train.safetensors.state.pt").is_file()
    assert certified_samples(first / "certify_train.json") == 4, log
    # the next pass resumes that state: the epochs come from it, not from EPOCHS
    code, log = slot(cifar_folder, second, first, PASS_SECONDS="90", TRAIN_ARGS=tiny)
    assert code == 0, log
    assert "== 3a. two-epoch probe" not in log and "train: exit" not in log, log
    assert certified_samples(second / "certify_train.json") == 4, log
    # INIT and STATE together are refused before any work
    code, message = slot(cifar_folder, tmp_path / "both", first,
                         INIT=str(first / "train.safetensors"))
    assert code == 2 and message.startswith("INIT starts a new schedule"), message
    assert not (tmp_path / "both").exists()
    # a new stage from the trained model by the default recipe: its compiled step needs CUDA,
    # so the script trains on without --compile
    code, log = slot(cifar_folder, stage, PASS_SECONDS="90", EPOCHS="1",
                     INIT=str(first / "train.safetensors"))
    assert code == 0, log
    assert "training without --compile" in log, log
    assert certified_samples(stage / "certify_train.json") == 4, log


def test_what_a_pass_reads_is_checked_before_any_work(cifar_folder, tmp_path):
    out = tmp_path / "out"
    for arguments, env, message in (
            ((tmp_path / "no-such-data", out), {}, "no data at"),
            ((cifar_folder, out, tmp_path), {}, "no training state in"),
            ((cifar_folder, out), {"INIT": str(tmp_path / "missing.safetensors")},
             "no checkpoint at")):
        code, said = slot(*arguments, **env)
        assert code == 2 and said.startswith(message), said
        assert not out.exists()
