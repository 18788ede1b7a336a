"""The end-to-end LoFAST bound with gradients, for certified training (an estimate, see below).

The certifier (``lofast.certify``) propagates an input radius through the stages with sound
float64 bounds. This module propagates it the same way through the stages of a model being
trained, in the working precision and with gradients: the patch embedding multiplies it by
||W||, LayerProject by its local factor, attention applies the LoFAST delta (zeta by a few
power steps warm-started from the previous batch, see ``bounds.estimate``), SLL layers keep it,
mean pooling divides it by sqrt(n). Because zeta is estimated from below, the radius here can
be slightly smaller than the certifier's; it guides learning only.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lofast.bounds.attention import AttentionWeights
from lofast.bounds.compose import ProjectionStep
from lofast.bounds.estimate import attention_sensitivity_estimate, top_singular_value
from lofast.errors import LofastError
from lofast.models.layers import SLL, Attention, LayerProject, NormalizedHead, PatchEmbed, Pool
from lofast.models.vit import LipschitzViT


class TrainingBound:
    """Computes logits and the pooled-feature radius for an image radius, batch by batch.

    Holds the power-iteration vectors of every attention stage between calls (warm starts);
    ``state``/``load_state`` save and restore them with the training state.
    """

    def __init__(self, iterations: int = 2, kappa: float = 0.5, softmax_jacobian: bool = True,
                 generator: torch.Generator | None = None) -> None:
        if iterations < 1:
            raise LofastError("the training bound needs at least one power iteration")
        self.iterations = iterations
        self.kappa = kappa
        self.softmax_jacobian = softmax_jacobian
        self.generator = generator
        self.vectors: dict[int, Tensor] = {}

    def __call__(self, model: LipschitzViT, images: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """images (B, C, H, W) -> logits (B, C') from the ordinary forward pass and the radius
        (B,) float32 of the pooled features over the l2 ball of radius eps around each image."""
        with model.reusing_effective_weights():
            logits, activations = model.forward_with_activations(images)
            return logits, self._radius(model, activations, images.shape[0], eps)

    def _radius(self, model: LipschitzViT, activations: list[Tensor], batch: int,
                eps: float) -> Tensor:
        device = activations[0].device
        # float32 at least (autocast activations may be bfloat16); float64 models stay float64
        dtype = torch.promote_types(activations[0].dtype, torch.float32)
        with torch.autocast(device.type, enabled=False):
            radius = torch.full((batch,), float(eps), device=device, dtype=dtype)
            moving = slice(None)  # the tokens of `act` that a perturbation can reach
            for index, (stage, act) in enumerate(zip(model.stages, activations)):
                radius = self._stage_radius(index, stage, act.to(dtype), radius, moving)
                if isinstance(stage, PatchEmbed):
                    moving = slice(stage.constant_tokens, None)
                elif isinstance(stage, Attention):
                    moving = slice(None)
        return radius

    def _stage_radius(self, index: int, stage: torch.nn.Module, act: Tensor,
                      radius: Tensor, moving: slice) -> Tensor:
        if isinstance(stage, PatchEmbed):
            return radius * top_singular_value(stage.effective_weight())
        if isinstance(stage, LayerProject):
            return ProjectionStep.around(act, stage.radius, moving).delta(radius[:, None])[:, 0]
        if isinstance(stage, Attention):
            weights = AttentionWeights(**stage.head_weights(), residual=True, scale=stage.scale)
            sensitivity, self.vectors[index] = attention_sensitivity_estimate(
                act, weights, kappa=self.kappa, start=self.vectors.get(index),
                iterations=self.iterations, softmax_jacobian=self.softmax_jacobian,
                generator=self.generator)
            return sensitivity.delta(radius[:, None])[:, 0].to(radius.dtype)
        if isinstance(stage, SLL):
            return radius
        if isinstance(stage, Pool):
            return radius / math.sqrt(stage.num_tokens) if stage.kind == "mean" else radius
        if isinstance(stage, NormalizedHead):
            return radius  # the head's pair norms enter the loss, not the radius
        raise LofastError(f"no training bound for stage {type(stage).__name__}")

    def state(self) -> dict[str, Tensor]:
        return {str(k): v.cpu() for k, v in self.vectors.items()}

    def load_state(self, state: dict[str, Tensor], device: torch.device) -> None:
        self.vectors = {int(k): v.to(device) for k, v in state.items()}
