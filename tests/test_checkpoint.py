"""Checkpoints: bit-exact round trip, clear errors for corrupt or mismatched files."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lofast.checkpoint import FORMAT, load_checkpoint, read_metadata, save_checkpoint
from lofast.config import preset
from lofast.errors import CheckpointError
from lofast.models.vit import create_model


@pytest.fixture
def saved(tmp_path):
    model = create_model(preset("tiny"), seed=0)
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, model, {"dataset": "cifar10", "clean_accuracy": 0.5})
    return model, path


def test_round_trip_is_bit_exact(saved):
    model, path = saved
    loaded = load_checkpoint(path)
    for (k, a), (k2, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    assert loaded.config == model.config and not loaded.training
    x = torch.rand(2, 3, 32, 32)
    assert torch.equal(model.eval()(x), loaded(x))
    meta = read_metadata(path)
    assert meta["dataset"] == "cifar10" and meta["clean_accuracy"] == 0.5
    assert meta["model_config"]["width"] == 32


def test_no_temporary_files_left(saved):
    _, path = saved
    assert [p.name for p in path.parent.iterdir()] == ["m.safetensors"]


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "absent.safetensors")


def test_a_mistyped_model_name_lists_the_shipped_ones(tmp_path, monkeypatch):
    """A bare name that is neither a file nor a shipped model is likely a mistyped name: the
    error lists the shipped ones (a path with folders does not)."""
    from lofast.checkpoint import list_models, open_checkpoint

    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="not found: lofast-defualt") as named:
        open_checkpoint("lofast-defualt")
    assert all(name in str(named.value) for name in list_models())
    with pytest.raises(CheckpointError) as path:
        open_checkpoint(tmp_path / "absent.safetensors")
    assert "shipped" not in str(path.value)


def test_truncated_file(saved):
    _, path = saved
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=str(path.name)):
        load_checkpoint(path)


def test_garbage_file(tmp_path):
    path = tmp_path / "g.safetensors"
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


def test_weights_not_matching_config(saved, tmp_path):
    _, path = saved
    tensors = load_file(str(path))
    meta = {"format": FORMAT, "model_config": json.dumps({**read_metadata(path)["model_config"],
                                                           "width": 64})}
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    with pytest.raises(CheckpointError, match="shape|match"):
        load_checkpoint(bad)
    del tensors[next(iter(tensors))]
    save_file(tensors, str(bad), metadata={"format": FORMAT,
                                          "model_config": json.dumps(read_metadata(path)["model_config"])})
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(bad)


def test_not_a_lofast_checkpoint(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({"a": torch.zeros(2)}, str(path))
    with pytest.raises(CheckpointError, match="not a lofast checkpoint"):
        load_checkpoint(path)


def test_nan_weights_rejected(saved, tmp_path):
    _, path = saved
    tensors = load_file(str(path))
    key = next(iter(tensors))
    tensors[key] = torch.full_like(tensors[key], float("nan"))
    raw = {"format": FORMAT, "model_config": json.dumps(read_metadata(path)["model_config"])}
    bad = tmp_path / "nan.safetensors"
    save_file(tensors, str(bad), metadata=raw)
    with pytest.raises(CheckpointError, match="NaN"):
        load_checkpoint(bad)


def test_a_checkpoint_is_read_once_for_model_metadata_and_digest(saved, monkeypatch):
    """``read_checkpoint``: the model, the metadata and the SHA-256 all come from one read of
    the file, and equal what the separate readers give."""
    from pathlib import Path

    from lofast import checkpoint

    model, path = saved
    reads = []
    real = Path.read_bytes

    def counting(self):
        reads.append(self)
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", counting)
    monkeypatch.setattr(checkpoint, "safe_open", None)  # no second reader of the header
    loaded = checkpoint.read_checkpoint(path)
    assert reads == [path]
    monkeypatch.undo()
    assert loaded.sha256 == checkpoint.file_digest(path)
    assert loaded.metadata == read_metadata(path)
    for a, b in zip(model.state_dict().values(), loaded.model.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(CheckpointError, match="is not the shipped m"):
        checkpoint.read_checkpoint(path, shipped=("m", "0" * 64))


@pytest.mark.parametrize("header", [b"\xff" * 8, (10).to_bytes(8, "little") + b"[1, 2]    ",
                                    (30).to_bytes(8, "little")
                                    + b'{"__metadata__": {"format": 1}}'[:30]])
def test_a_bad_safetensors_header_is_one_clear_error(tmp_path, header):
    from lofast.checkpoint import read_checkpoint

    path = tmp_path / "bad.safetensors"
    path.write_bytes(header + b"\0" * 16)
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        read_checkpoint(path)
