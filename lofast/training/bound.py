"""The end-to-end LoFAST bound with gradients, for certified training (an estimate, see below).

The certifier (``lofast.certification.certificate``) propagates an input radius through the
stages with sound float64 bounds. This module propagates it the same way through the stages of a
model being trained, by the same walk (``bounds.stages.radius_maps``) over the model's
differentiable stage specs, in the working precision and with gradients: the patch embedding
multiplies it by ||W||, LayerProject by its local factor, attention applies the LoFAST delta
(zeta by a few power steps warm-started from the previous batch, see ``bounds.estimate``), SLL
layers keep it, mean pooling divides it by sqrt(n). Because zeta is estimated from below, the
radius here can be slightly smaller than the certifier's; it guides learning only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lofast.bounds.attention_spec import AttentionSpec
from lofast.bounds.compose import RadiusMap, propagate
from lofast.bounds.estimate import attention_sensitivity_estimates, top_singular_value
from lofast.bounds.stages import radius_maps
from lofast.errors import LofastError
from lofast.models.vit import LipschitzViT


class TrainingBound:
    """Computes logits and the pooled-feature radius for an image radius, batch by batch.

    The stages are walked by ``bounds.stages.radius_maps``, the certifier's walk, with this
    object as the ``StageRules``: the embedding norm by repeated squaring of its Gram matrix
    (no solver), attention from ``attention_sensitivity_estimates``, made for every block before
    the walk (the recorded activations are every block's clean tokens), so that blocks of one
    shape share each kernel launch (an accelerator's step waits on launches). It holds, for every
    attention stage, the final power-iteration vectors of the first WARM_STARTS samples of the
    last call, and starts the next call's samples from them in turn; ``state``/``load_state``
    save and restore them with the training state.
    """

    # A sample's warm start comes from another image anyway (the batch changes every step): 16
    # vectors start one power step as well as one per sample of the previous batch (both reach
    # 0.82 of the converged zeta in the worst sample of a batch, random starts 0.80;
    # benchmarks/warm_starts.py), and keep the training state small (one per sample of a batch
    # of 1024 at width 256: 214 MB)
    WARM_STARTS = 16
    local_projection = True  # the certifier's default
    stack: bool | None = None  # blocks of one shape stacked (``attention_sensitivity_estimates``)

    def __init__(self, iterations: int = 2, kappa: float = 0.5, softmax_jacobian: bool = True,
                 generator: torch.Generator | None = None) -> None:
        if iterations < 1:
            raise LofastError("the training bound needs at least one power iteration")
        self.iterations = iterations
        self.kappa = kappa
        self.softmax_jacobian = softmax_jacobian
        self.generator = generator
        self.vectors: dict[int, Tensor] = {}
        self.sensitivities: dict[int, RadiusMap] = {}  # per call: every block's, by stage index

    def __call__(self, model: LipschitzViT, images: Tensor,
                 eps: float | Tensor) -> tuple[Tensor, Tensor]:
        """images (B, C, H, W) -> logits (B, C') from the ordinary forward pass and the radius
        (B,) of the pooled features over the l2 ball of radius eps around each image, float32
        at least (float64 for a float64 model)."""
        with model.reusing_effective_weights():
            logits, activations = model.forward_with_activations(images)
            # float32 at least (autocast activations may be bfloat16); float64 models stay float64
            dtype = torch.promote_types(activations[0].dtype, torch.float32)
            with torch.autocast(images.device.type, enabled=False):
                structure = model.structure(differentiable=True)
                tokens = [act.to(dtype) for act in activations]
                self.sensitivities = self._attention_estimates(
                    {k: spec for k, spec in enumerate(structure) if isinstance(spec, AttentionSpec)},
                    dict(enumerate(tokens)))
                try:
                    steps = radius_maps(structure, tokens, self)
                finally:
                    self.sensitivities = {}
                # eps may be a tensor (1,) on the device (a compiled step: a float would be
                # a constant of its graph, compiled anew at every step of the radius ramp)
                radius = (eps.to(dtype).repeat(images.shape[0], 1) if isinstance(eps, Tensor)
                          else torch.full((images.shape[0], 1), float(eps),
                                          device=images.device, dtype=dtype))
                return logits, propagate(steps, radius)[:, 0].to(dtype)

    def embedding_norm(self, index: int, weight: Tensor) -> Tensor:
        return top_singular_value(weight)

    def _attention_estimates(self, blocks: dict[int, AttentionSpec],
                             tokens: dict[int, Tensor]) -> dict[int, RadiusMap]:
        """The sensitivity of every block (by stage index) at its clean tokens, all blocks
        estimated together; keeps each block's first WARM_STARTS final vectors."""
        starts = []
        for index in blocks:
            start, batch = self.vectors.get(index), tokens[index].shape[0]
            if start is not None:  # the kept vectors in turn, one per sample
                start = start.repeat(-(-batch // start.shape[0]), 1, 1, 1)[:batch]
            starts.append(start)
        estimates = attention_sensitivity_estimates(
            [tokens[k] for k in blocks], list(blocks.values()), starts=starts,
            kappa=self.kappa, iterations=self.iterations,
            softmax_jacobian=self.softmax_jacobian, generator=self.generator, stack=self.stack)
        sensitivities = {}
        for index, (sensitivity, vectors) in zip(blocks, estimates):
            self.vectors[index] = vectors[:self.WARM_STARTS].clone()  # not a view of the batch's
            sensitivities[index] = sensitivity
        return sensitivities

    def attention(self, index: int, tokens: Tensor, spec: AttentionSpec) -> RadiusMap:
        """The block's sensitivity: made before the walk at these same tokens by ``__call__``,
        or here for this block alone when another caller walks the stages."""
        sensitivity = self.sensitivities.pop(index, None)
        if sensitivity is None:
            sensitivity = self._attention_estimates({index: spec}, {index: tokens})[index]
        return sensitivity

    def state(self) -> dict[str, Tensor]:
        return {str(k): v.cpu() for k, v in self.vectors.items()}

    def load_state(self, state: dict[str, Tensor], device: torch.device) -> None:
        self.vectors = {int(k): v.to(device) for k, v in state.items()}
