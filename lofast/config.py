"""Frozen settings for models, training and certification, with named model presets."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from lofast.errors import LofastError


@dataclass(frozen=True)
class ModelConfig:
    """A Lipschitz ViT: every stage is L-Lipschitz with known L or an exact LoFAST attention block.

    Per block: X <- Proj_attn_radius(X); X <- X + MHA(X); [X <- Proj_mlp_radius(X)]; X <- SLL(X).
    """

    image_size: int = 32
    channels: int = 3
    num_classes: int = 10
    patch_size: int = 16
    width: int = 128
    depth: int = 3
    heads: int = 8
    mlp_ratio: int = 4
    embed_cap: float = 1.0  # spectral cap of the patch embedding (its Lipschitz constant)
    query_key_cap: float | None = 1.0  # caps on Wq and Wk (None: free)
    value_cap: float = 0.5  # cap on Wv (the paper finds caps below 1 essential)
    output_cap: float = 0.5  # cap on Wo
    attn_radius: float = 1.0  # LayerProject radius of the stream entering every attention block
    mlp_radius: float | None = None  # LayerProject before every SLL layer (None: none)
    final_radius: float | None = 1.0  # LayerProject before pooling (None: none)
    pool: str = "mean"  # "mean" over tokens (1/sqrt(n)-Lipschitz) or "cls"
    input_center: float = 0.5  # x - c is an isometry; no std division (it would scale L)
    # A learned (heads, n, n) bias added to every attention block's scores. It does not depend
    # on the input, so it adds nothing to the softmax terms of the bound; zeta is taken around
    # softmax(bias) instead of uniform attention. Collapsed scores still mix tokens spatially.
    position_bias: bool = False

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise LofastError(
                f"patch_size {self.patch_size} does not divide image_size {self.image_size}"
            )
        if self.width % self.heads:
            raise LofastError(f"width {self.width} is not divisible by heads {self.heads}")
        if self.pool not in ("mean", "cls"):
            raise LofastError(f"pool must be 'mean' or 'cls', not {self.pool!r}")
        for name in ("embed_cap", "value_cap", "output_cap", "attn_radius"):
            if not getattr(self, name) > 0:
                raise LofastError(f"{name} must be positive")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_tokens(self) -> int:
        return self.num_patches + 1  # the class token

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise LofastError(f"unknown model config keys: {', '.join(unknown)}")
        return cls(**values)


PRESETS: dict[str, ModelConfig] = {
    # The LoFAST paper's small models (Table 1): width 128, patch 16, depth 3/4/5.
    "paper-d3": ModelConfig(depth=3),
    "paper-d4": ModelConfig(depth=4),
    "paper-d5": ModelConfig(depth=5),
    # The paper's width-384 models (Figure 2).
    "paper-w384": ModelConfig(width=384, depth=3, heads=8),
    # Tiny model for tests and smoke runs.
    "tiny": ModelConfig(patch_size=8, width=32, depth=2, heads=2, mlp_ratio=2),
    # Our choice: smaller patches (17 tokens) keep more spatial detail at the same width.
    "lofast-s": ModelConfig(patch_size=8, width=128, depth=3, heads=8),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The named preset, with any fields replaced."""
    if name not in PRESETS:
        raise LofastError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run (saved with the checkpoint)."""

    epochs: int = 10
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_epochs: float = 1.0
    schedule: str = "cosine"  # "cosine" or "constant" (after warm-up)
    loss: str = "ce"  # "ce", "margin" (Lipschitz margin, Tsuzuku et al. 2018) or "certified"
    margin: float = 0.0  # margin in head-feature units; logit j != y is raised by margin*||w_y - w_j||
    temperature: float = 1.0  # logits are divided by this before cross-entropy
    train_eps: float = 0.0  # certified: image radius whose LoFAST bound raises the logits
    eps_ramp_epochs: float = 0.0  # certified: train_eps grows linearly from 0 over these epochs
    clean_mix: float = 0.0  # certified: weight of the clean cross-entropy in the loss
    power_iterations: int = 2  # certified: power steps per batch for zeta (warm-started)
    softmax_jacobian: bool = True  # certified: train against the certifier's refined bound
    augment: bool = True  # random crop (pad 4) and horizontal flip
    seed: int = 0
    amp: bool = True  # bfloat16 autocast on CUDA only

    def __post_init__(self) -> None:
        if self.loss not in ("ce", "margin", "certified"):
            raise LofastError(f"loss must be 'ce', 'margin' or 'certified', not {self.loss!r}")
        if self.loss == "certified" and not self.train_eps > 0:
            raise LofastError("--loss certified needs a positive --train-eps")
        if not 0.0 <= self.clean_mix <= 1.0:
            raise LofastError("clean mix must lie in [0, 1]")
        if self.eps_ramp_epochs < 0 or self.power_iterations < 1:
            raise LofastError("the eps ramp must be >= 0 epochs and power iterations >= 1")
        if self.schedule not in ("cosine", "constant"):
            raise LofastError(f"schedule must be 'cosine' or 'constant', not {self.schedule!r}")
        if self.epochs < 1 or self.batch_size < 1:
            raise LofastError("epochs and batch size must be at least 1")
        if not self.lr > 0 or not self.temperature > 0:
            raise LofastError("learning rate and temperature must be positive")
