"""Checkpoints as safetensors files: raw weights plus the model config and provenance in metadata.

safetensors never executes code on load; writes go to a temporary file that replaces the
target only when complete, so an interrupt never leaves a half-written checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, safe_open, save_file

from lofast import __version__
from lofast.config import ModelConfig, json_or_text
from lofast.errors import CheckpointError, LofastError
from lofast.files import atomic_write, check_readable
from lofast.models.vit import LipschitzViT

FORMAT = "lofast-checkpoint-1"


def save_checkpoint(path: str | os.PathLike, model: LipschitzViT,
                    metadata: dict[str, Any] | None = None) -> None:
    """Write the model's weights and config; metadata values are stored as JSON strings."""
    meta = {key: json.dumps(value) for key, value in (metadata or {}).items()}
    meta.update(format=FORMAT, model_config=model.config.to_json(), lofast_version=__version__)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    atomic_write(Path(path), lambda tmp: save_file(tensors, tmp, metadata=meta))


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint read once: the model (eval mode), its metadata (JSON values decoded,
    'model_config' as a dict) and the SHA-256 of the file's bytes (hex), all from the same
    bytes, and the file they were read from."""

    model: LipschitzViT
    metadata: dict[str, Any]
    sha256: str
    path: Path


def read_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu",
                    shipped: tuple[str, str] | None = None) -> Checkpoint:
    """The checkpoint at ``path``, its file read once; with ``shipped`` = (name, registered
    SHA-256) of a shipped model, a file whose bytes differ is refused. CheckpointError for a
    missing, corrupt or mismatched file (weights that do not fit the stored config)."""
    path = Path(path)
    check_readable(path, "checkpoint", CheckpointError)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    digest = hashlib.sha256(data).hexdigest()
    if shipped is not None and digest != shipped[1]:
        raise CheckpointError(f"{path} is not the shipped {shipped[0]} (its SHA-256 differs "
                              "from the registry's)")
    metadata = _decoded(path, _header_metadata(path, data))
    try:
        tensors = load(data)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt checkpoint ({e})") from None
    return Checkpoint(_model(path, metadata, tensors).to(device).eval(), metadata, digest,
                      path)


def _header_metadata(path: Path, data: bytes) -> dict[str, str]:
    """The string metadata of a safetensors file's bytes: an 8-byte little-endian header
    length, then that many bytes of JSON whose "__metadata__" holds it."""
    size = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    header = None
    if 0 < size <= len(data) - 8:
        try:
            header = json.loads(data[8:8 + size].decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            header = None
    raw = (header.get("__metadata__") or {}) if isinstance(header, dict) else None
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                            for k, v in raw.items()):
        raise CheckpointError(f"{path}: not a readable safetensors checkpoint (no valid header)")
    return raw


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's metadata with JSON values decoded; 'model_config' as a dict. Reads the
    header alone (``read_checkpoint`` reads the whole file once for model and metadata)."""
    path = Path(path)
    check_readable(path, "checkpoint", CheckpointError)
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors checkpoint ({e})") from None
    return _decoded(path, raw)


def _decoded(path: Path, raw: dict[str, str]) -> dict[str, Any]:
    """Metadata strings -> values (JSON where they parse); refused without lofast's format."""
    if raw.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a lofast checkpoint (no '{FORMAT}' metadata)")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        out[key] = json_or_text(value)
    classes = out.get("classes")  # what data labels are checked against: a list of names
    if classes is not None and not (isinstance(classes, list)
                                    and all(isinstance(name, str) for name in classes)):
        raise CheckpointError(f"{path}: invalid classes in metadata (a list of class names, "
                              f"not {type(classes).__name__})")
    dataset = out.get("dataset")  # the name of the data it was trained on
    if dataset is not None and not isinstance(dataset, str):
        raise CheckpointError(f"{path}: invalid dataset in metadata (a name, not "
                              f"{type(dataset).__name__})")
    return out


def weights_digest(model: LipschitzViT) -> str:
    """SHA-256 (hex) of a model's config and every tensor of its state (name, dtype, shape and
    bytes): what names a model given in memory, as a file's digest names a checkpoint, so that
    records of one model are never taken for another's."""
    digest = hashlib.sha256(model.config.to_json().encode())
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())  # 0-d too
    return digest.hexdigest()


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu") -> LipschitzViT:
    """A ready model in eval mode that maps images in [0,1] to logits (``read_checkpoint``'s).

    Raises CheckpointError for a missing, corrupt or mismatched file (weights that do not fit
    the stored config).
    """
    return read_checkpoint(path, device).model


def _model(path: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> LipschitzViT:
    """The model of a checkpoint's config and weights, each weight checked against it."""
    try:
        config = ModelConfig.from_dict(meta["model_config"])
    except (KeyError, TypeError, LofastError) as e:
        raise CheckpointError(f"{path}: invalid model config in metadata ({e})") from None
    model = LipschitzViT(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match the config "
            f"(missing: {', '.join(missing[:3]) or '-'}; "
            f"unexpected: {', '.join(unexpected[:3]) or '-'})"
        )
    for key, value in tensors.items():
        if value.shape != expected[key].shape:
            raise CheckpointError(
                f"{path}: weight {key} has shape {tuple(value.shape)}, "
                f"the config needs {tuple(expected[key].shape)}"
            )
        if not value.is_floating_point():
            raise CheckpointError(f"{path}: weight {key} has dtype {value.dtype}; lofast "
                                  "weights are floating point")
        if not torch.isfinite(value).all():
            raise CheckpointError(f"{path}: weight {key} contains NaN or infinity")
    model.load_state_dict(tensors)
    return model


def check_data_fits(model: LipschitzViT, metadata: dict[str, Any], data: Any,
                    classes_unchecked: bool = False) -> None:
    """Refuse a data set (an ImageDataset) whose image shape the model was not built for, or
    whose class names differ from those the checkpoint was trained on (a renamed or missing
    class folder shifts every label, and every verdict with it). A checkpoint whose metadata
    names no classes is refused too, unless ``classes_unchecked``: its labels could mean
    anything. ``metadata`` empty: a model given in memory, whose classes are the caller's."""
    config = model.config
    expected = (config.image_size, config.image_size, config.channels)
    if data.images.shape[1:] != expected:
        raise LofastError(f"data images have shape {data.images.shape[1:]}, the model expects "
                          f"{expected} (H, W, C)")
    trained_on = metadata.get("classes")
    if metadata and trained_on is None and not classes_unchecked:
        raise LofastError("the checkpoint names no classes, so the data's labels cannot be "
                          f"checked against its own ({', '.join(data.classes)}); pass "
                          "--classes-unchecked to take them as they are")
    if trained_on is not None and list(trained_on) != list(data.classes):
        raise LofastError(f"the data's classes {list(data.classes)} differ from those the "
                          f"checkpoint was trained on {list(trained_on)}")


def _shipped_dir() -> Path:
    """Where the shipped checkpoints are: inside the installed package (a wheel, or `pip
    install .`, carries a copy of the repository's checkpoints/), else checkpoints/ beside the
    package in the repository (an editable install)."""
    package = Path(__file__).resolve().parent
    installed = package / "checkpoints"
    return installed if installed.is_dir() else package.parent / "checkpoints"


SHIPPED_DIR = _shipped_dir()
# the shipped models: name -> file, SHA-256, summary, figures (full test set) and regression
# reference (``reference_subset``); the default
REGISTRY = "registry.json"


def read_registry() -> dict[str, Any]:
    """The registry of shipped models (``checkpoints/registry.json``)."""
    path = SHIPPED_DIR / REGISTRY
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read the registry of shipped models {path}: {e}") from None


def list_models() -> list[str]:
    """The names of the shipped models, the default first."""
    registry = read_registry()
    return sorted(registry["models"], key=lambda name: (name != registry["default"], name))


def shipped_path(name: str) -> Path:
    """The file of the shipped model ``name``, checked against its registered SHA-256 (a
    replaced or damaged file is refused, not certified)."""
    models = read_registry()["models"]
    if name not in models:
        raise CheckpointError(f"no shipped model {name!r}; the shipped models are "
                              f"{', '.join(list_models())}")
    path = SHIPPED_DIR / models[name]["file"]
    check_readable(path, "checkpoint", CheckpointError)
    if file_digest(path) != models[name]["sha256"]:
        raise CheckpointError(f"{path} is not the shipped {name} (its SHA-256 differs from the "
                              "registry's)")
    return path


def _resolve(name_or_path: str | os.PathLike | None) -> tuple[Path, tuple[str, str] | None]:
    """(file, (name, registered SHA-256) of a shipped model or None) for a path, the name of a
    shipped model (an existing file of that name is the path), or None (the default)."""
    registry = read_registry()
    name = registry["default"] if name_or_path is None else name_or_path
    if isinstance(name, str) and name in registry["models"] and not Path(name).exists():
        entry = registry["models"][name]
        return SHIPPED_DIR / entry["file"], (name, entry["sha256"])
    return Path(name_or_path), None


def _no_default(error: CheckpointError) -> CheckpointError:
    return CheckpointError(f"no --checkpoint given and no usable shipped default: {error}")


def checkpoint_path(name_or_path: str | os.PathLike | None) -> Path:
    """A checkpoint by path, or by the name of a shipped model (its file checked against the
    registered SHA-256); the default when None."""
    if name_or_path is None:
        return default_checkpoint_path()
    path, shipped = _resolve(name_or_path)
    return shipped_path(shipped[0]) if shipped else path


def open_checkpoint(name_or_path: str | os.PathLike | None,
                    device: str | torch.device = "cpu") -> Checkpoint:
    """``read_checkpoint`` of a path, or of a shipped model by name (its registered SHA-256
    checked on the same bytes); the shipped default when None."""
    path, shipped = _resolve(name_or_path)
    try:
        return read_checkpoint(path, device, shipped)
    except CheckpointError as e:
        if name_or_path is None:
            raise _no_default(e) from None
        if shipped is None and not path.exists() and len(path.parts) == 1:  # a name mistyped?
            raise CheckpointError(f"{e} (no such file, and no shipped model of that name: "
                                  f"{', '.join(list_models())})") from None
        raise


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes (hex), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_checkpoint_path() -> Path:
    """The shipped default checkpoint (the registry's default)."""
    try:
        return shipped_path(read_registry()["default"])
    except CheckpointError as e:
        raise _no_default(e) from None
