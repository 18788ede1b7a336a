"""The settings of a training run."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lofast.config.base import Loss, Schedule, _check_int, _check_positive, _is_real
from lofast.errors import LofastError


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run (saved with the checkpoint)."""

    epochs: int = 10
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_epochs: float = 1.0
    schedule: Schedule = Schedule.COSINE  # after warm-up
    loss: Loss = Loss.CE
    margin: float = 0.0  # margin in head-feature units; logit j != y is raised by margin*||w_y - w_j||
    temperature: float = 1.0  # logits are divided by this before cross-entropy
    train_eps: float = 0.0  # certified: image radius whose LoFAST bound raises the logits
    eps_ramp_epochs: float = 0.0  # certified: train_eps grows linearly from 0 over these epochs
    clean_mix: float = 0.0  # certified: weight of the clean cross-entropy in the loss
    power_iterations: int = 2  # certified: power steps per batch for zeta (warm-started)
    softmax_jacobian: bool = True  # certified: train against the certifier's refined bound
    # attention reward: a hinge penalty ablation_weight * max(0, ablation_margin - (CE of the
    # model with every P_l(X) replaced by its batch mean - CE of the model)), in nats; 0: off
    ablation_margin: float = 0.0
    ablation_weight: float = 1.0
    augment: bool = True  # random crop (pad 4) and horizontal flip
    seed: int = 0
    amp: bool = True  # bfloat16 autocast on CUDA only

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss", Loss.parse("loss", self.loss))
        object.__setattr__(self, "schedule", Schedule.parse("schedule", self.schedule))
        for name in ("epochs", "batch_size", "power_iterations"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("seed", self.seed, minimum=0)
        if self.seed >= 2**63:
            raise LofastError(f"seed must be below 2**63, not {self.seed}")
        for name in ("lr", "temperature"):
            _check_positive(name, getattr(self, name))
        for name in ("weight_decay", "warmup_epochs", "margin", "train_eps", "eps_ramp_epochs",
                     "ablation_margin", "ablation_weight"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or value < 0:
                raise LofastError(f"{name} must be a finite number >= 0, not {value!r}")
        if self.loss is Loss.CERTIFIED and not self.train_eps > 0:
            raise LofastError("--loss certified needs a positive --train-eps")
        if not _is_real(self.clean_mix) or not 0.0 <= self.clean_mix <= 1.0:
            raise LofastError("clean mix must lie in [0, 1]")
