"""The model's config and the named presets."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from typing import Any

from lofast.config.base import (
    MAX_PARAMETERS,
    Pooling,
    Weights,
    _is_real,
    check_flags,
    check_int,
    check_positive,
    plain_dict,
    plain_number,
)
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
    pool: Pooling = Pooling.MEAN
    input_center: float = 0.5  # x - c is an isometry; no std division (it would scale L)
    # A learned (heads, n, n) bias added to every attention block's scores. It does not depend
    # on the input, so it adds nothing to the softmax terms of the bound; zeta is taken around
    # softmax(bias) instead of uniform attention. Collapsed scores still mix tokens spatially.
    position_bias: bool = False
    # Fix every head's ||Wq_l Wk_l^T|| at this value (None: only capped, which lets certified
    # training drive the scores, and with them input-dependent attention, to zero).
    score_norm: float | None = None
    # Wq = Wk = I (identity): each head's scores are the dot products of the tokens'
    # coordinates it owns (no learned direction can make the scores constant)
    query_key: Weights = Weights.LEARNED
    # Fix every head's ||Wv_l Wo_l|| at this value (None: only capped, which lets training switch
    # attention off by shrinking what it mixes in).
    value_norm: float | None = None
    # Wv = value_cap I, Wo = output_cap I (identity): each head mixes the coordinates it owns as
    # they are, so the value path cannot turn away from the directions in which tokens differ
    # (with learned Wv, Wo certified training makes X Wv Wo nearly constant over the tokens).
    value_output: Weights = Weights.LEARNED
    # score_norm, value_norm, query_key and value_output apply to `live_blocks` blocks only
    # (None: all): the last ones, or with live_first the first ones, whose tokens are the
    # projected patches themselves. The others keep learned, capped weights.
    live_blocks: int | None = None
    live_first: bool = False
    # Unit-norm rows in the classifier (last-layer normalisation; False: free rows, the logits'
    # scale learned with them, as the softmax temperature would be).
    normalized_head: bool = True

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)  # frozen: normalised once, here
        # Every value here reaches the forward pass, and the radii reach the Lipschitz
        # accounting: a value read from a file is checked like any other input.
        for name in ("image_size", "channels", "num_classes", "patch_size", "width", "depth",
                     "heads", "mlp_ratio"):
            set_(name, check_int(name, getattr(self, name), 2 if name == "num_classes" else 1))
        for name in ("embed_cap", "value_cap", "output_cap", "attn_radius"):
            set_(name, check_positive(name, getattr(self, name)))
        for name in ("query_key_cap", "mlp_radius", "final_radius", "score_norm", "value_norm"):
            if getattr(self, name) is not None:
                set_(name, check_positive(name, getattr(self, name)))
        if not _is_real(self.input_center) or not math.isfinite(self.input_center):
            raise LofastError(f"input_center must be a finite number, not {self.input_center!r}")
        set_("input_center", plain_number(self.input_center))
        # the names read from a file become their members
        set_("pool", Pooling.parse("pool", self.pool))
        set_("query_key", Weights.parse("query_key", self.query_key))
        set_("value_output", Weights.parse("value_output", self.value_output))
        if self.live_blocks is not None:
            set_("live_blocks", check_int("live_blocks", self.live_blocks, 1))
            if self.live_blocks > self.depth:
                raise LofastError(f"live_blocks {self.live_blocks} exceeds depth {self.depth}")
        check_flags(self, ("position_bias", "live_first", "normalized_head"))
        if self.image_size % self.patch_size:
            raise LofastError(
                f"patch_size {self.patch_size} does not divide image_size {self.image_size}"
            )
        if self.width % self.heads:
            raise LofastError(f"width {self.width} is not divisible by heads {self.heads}")
        if self.parameter_count() > MAX_PARAMETERS:
            raise LofastError(
                f"the model would have {self.parameter_count():,} parameters "
                f"({4 * self.parameter_count() / 2**30:.1f} GiB in float32); "
                f"lofast builds at most {MAX_PARAMETERS:,}"
            )

    def parameter_count(self) -> int:
        """Number of learned values, computed from the config alone (before allocating)."""
        d, n, hidden = self.width, self.num_tokens, self.width * self.mlp_ratio
        embed = d * self.channels * self.patch_size**2 + d + self.num_patches * d + d
        bias = self.heads * n * n if self.position_bias else 0
        block = 4 * d * d + bias + d * hidden + 2 * hidden
        identity = sum((not self.learned_query_key(b)) + (not self.learned_value_output(b))
                       for b in range(self.depth))  # pairs of d x d matrices not learned
        return embed + self.depth * block - identity * 2 * d * d + self.num_classes * (d + 1)

    def is_live(self, block: int) -> bool:
        """Whether score_norm, value_norm, query_key and value_output apply to block (0-based)."""
        if self.live_blocks is None:
            return True
        if self.live_first:
            return block < self.live_blocks
        return block >= self.depth - self.live_blocks

    def learned_query_key(self, block: int) -> bool:
        return self.query_key is Weights.LEARNED or not self.is_live(block)

    def learned_value_output(self, block: int) -> bool:
        return self.value_output is Weights.LEARNED or not self.is_live(block)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_tokens(self) -> int:
        return self.num_patches + 1  # the class token

    def to_json(self) -> str:
        return json.dumps(plain_dict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        if not isinstance(values, dict):
            raise LofastError(f"a model config is a mapping of fields, not {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise LofastError(f"unknown model config keys: {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(known))}")
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
    # The usual ViT cut of a 32 x 32 image, 4 x 4 patches (65 tokens), with position biases:
    # 8,320 coordinates a block, so `lofast certify` takes the probabilistic guarantee there.
    "lofast-p4": ModelConfig(patch_size=4, width=128, depth=6, heads=8, position_bias=True),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The named preset, with any fields replaced."""
    if name not in PRESETS:
        raise LofastError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return ModelConfig.from_dict({**dataclasses.asdict(PRESETS[name]), **overrides})


# Options a trained model can take on (``lofast train --init CKPT --model-option ...``): each
# keeps every weight of the model and adds only zero-initialised ones.
INIT_OPTIONS = {
    "position_bias": "zero position biases (the same function), free to train",
    "score_norm": "every head's ||Wq_l Wk_l^T|| fixed at this value (attention kept alive)",
    "query_key": "'identity': Wq = Wk = I, the learned query and key weights dropped",
    "value_norm": "every head's ||Wv_l Wo_l|| fixed at this value (attention kept alive)",
    "live_blocks": "the three options above only in the last N blocks",
    "normalized_head": "'false': the head's rows freed, from the unit rows (the same function)",
}
