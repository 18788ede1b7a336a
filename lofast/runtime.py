"""Where and how much a driver runs: the device a name means, and the batch size a device
takes by default (``pipeline.run_certify``, ``train_pipeline.run_train`` and the benchmarks)."""

from __future__ import annotations

import torch

from lofast.errors import LofastError


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present; asking for CUDA without one is an error, not a fallback."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise LofastError(f"unknown device {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise LofastError(f"device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LofastError(f"device {name!r} requested but no CUDA GPU is available")
    return device


def default_batch_size(device: torch.device) -> int:
    """Samples certified together when no batch size is given: 16 on CPU, where larger batches
    ran slower per sample in benchmarks/bench_certify.py; 1024 on a GPU, where the width-128
    default's whole test set took 7.5 s end to end against 10.0 s at 256 (H200,
    docs/studies/certifier-speed.md)."""
    return 1024 if device.type == "cuda" else 16
