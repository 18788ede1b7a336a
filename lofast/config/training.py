"""The settings of a training run: how it trains (``TrainConfig``, saved with the checkpoint)
and what it reads and writes (``TrainRun``)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from lofast.config.base import (
    DATASETS,
    MAX_BATCH_SIZE,
    MAX_SEED,
    Loss,
    Schedule,
    _is_real,
    check_flags,
    check_int,
    check_positive,
    plain_number,
    plain_option,
)
from lofast.config.certify import _optional_path, parse_radius
from lofast.config.model import INIT_OPTIONS, PRESETS
from lofast.errors import ConfigError


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
    # logit annealing (Lai et al., ICML 2025, BRONet): each sample's cross-entropy CE weighted
    # by (1 - exp(-CE))^gamma, so that samples already past their margin weigh less; 0: off
    logit_annealing: float = 0.0
    power_iterations: int = 2  # certified: power steps per batch for zeta (warm-started)
    softmax_jacobian: bool = True  # certified: train against the certifier's refined bound
    # attention reward: a hinge penalty ablation_weight * max(0, ablation_margin - (CE of the
    # model with every P_l(X) replaced by its batch mean - CE of the model)), in nats; 0: off
    ablation_margin: float = 0.0
    ablation_weight: float = 1.0
    augment: bool = True  # random crop (pad 4) and horizontal flip
    seed: int = 0
    amp: bool = True  # bfloat16 autocast on CUDA (training.loop.autocast_enabled)
    # with amp, bfloat16 autocast on a CPU too: fast where it computes bfloat16 natively
    # (AVX512-BF16, AMX), slower elsewhere
    cpu_amp: bool = False

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)  # frozen: normalised once, here
        set_("loss", Loss.parse("loss", self.loss, ConfigError))
        set_("schedule", Schedule.parse("schedule", self.schedule, ConfigError))
        for name in ("epochs", "power_iterations"):
            set_(name, check_int(name, getattr(self, name), 1, error=ConfigError))
        # the command line's ranges: a batch past MAX_BATCH_SIZE is a typo that would ask for
        # the whole training set's certified-loss activations at once
        set_("batch_size", check_int("batch_size", self.batch_size, 1, MAX_BATCH_SIZE,
                                     ConfigError))
        set_("seed", check_int("seed", self.seed, 0, MAX_SEED, ConfigError))
        for name in ("lr", "temperature"):
            set_(name, check_positive(name, getattr(self, name), ConfigError))
        for name in ("weight_decay", "warmup_epochs", "margin", "train_eps", "eps_ramp_epochs",
                     "ablation_margin", "ablation_weight", "logit_annealing"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, not {value!r}")
            set_(name, plain_number(value))
        if self.loss is Loss.CERTIFIED and not self.train_eps > 0:
            raise ConfigError("--loss certified needs a positive --train-eps")
        if not _is_real(self.clean_mix) or not 0.0 <= self.clean_mix <= 1.0:
            raise ConfigError("clean mix must lie in [0, 1]")
        set_("clean_mix", plain_number(self.clean_mix))
        check_flags(self, ("softmax_jacobian", "augment", "amp", "cpu_amp"), ConfigError)
        if self.cpu_amp and not self.amp:
            raise ConfigError("--cpu-amp autocasts as --amp does, on a CPU too: it cannot go "
                              "with --no-amp")


DEFAULT_PRESET = "paper-d3"  # the architecture of a run given neither a preset nor --init


@dataclass(frozen=True)
class TrainRun:
    """What a training run reads and writes beside its ``TrainConfig``, as ``lofast train`` and
    ``lofast.train`` take it; checked here, once, for both (``training.pipeline.run_train`` runs
    it).

    data: the data set (a path); out: the checkpoint to write (its resumable state beside it,
    ``OUT.state.pt``); dataset: its kind; preset and model_options: the architecture (None
    with init); init: a checkpoint to start from, whose architecture is kept (model_options may
    then only add what ``INIT_OPTIONS`` allows); limit: the first N training images
    of the class-balanced order; time_limit: seconds, after which the run stops at a step with
    its state saved (``errors.TimeLimitReached``); compile: CUDA graphs (one CUDA device).
    """

    data: Any
    out: Any
    dataset: str = "cifar10"
    download: bool = False
    preset: str | None = None  # DEFAULT_PRESET without init
    model_options: Any = None
    init: Any = None
    device: str = "auto"
    compile: bool = False
    limit: int | None = None
    resume: bool = False
    time_limit: float | None = None
    overwrite: bool = False

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        for name in ("data", "out"):
            if getattr(self, name) is None:
                raise ConfigError(f"a training run needs {name}")
            set_(name, _optional_path(name, getattr(self, name)))
        set_("init", _optional_path("init", self.init))
        if self.dataset not in DATASETS:
            raise ConfigError(f"dataset must be one of {', '.join(DATASETS)}, not "
                              f"{self.dataset!r}")
        if self.init is not None and (self.preset is not None
                                      or not set(self.model_options or {}) <= set(INIT_OPTIONS)):
            raise ConfigError("--init takes the architecture from the checkpoint; drop --preset "
                              "and --model-option (only " + ", ".join(INIT_OPTIONS)
                              + " may be added)")
        if self.init is None and self.preset is None:
            set_("preset", DEFAULT_PRESET)
        if self.init is None and self.preset not in PRESETS:
            raise ConfigError(f"unknown preset {self.preset!r}; choose from "
                              f"{', '.join(PRESETS)}")
        options = dict(self.model_options or {})
        if not all(isinstance(k, str) for k in options):
            raise ConfigError("model options are named by strings")
        set_("model_options", {k: plain_option(k, v, ConfigError) for k, v in options.items()})
        if self.limit is not None:
            set_("limit", check_int("limit", self.limit, 1, error=ConfigError))
        if self.time_limit is not None:
            set_("time_limit", parse_radius(self.time_limit, "time_limit"))
        check_flags(self, ("download", "compile", "resume", "overwrite"), ConfigError)
        if not isinstance(self.device, str) or not self.device:
            raise ConfigError(f"device must be a name such as 'cpu' or 'cuda', not "
                              f"{self.device!r}")
