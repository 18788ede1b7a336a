"""Switch attention on in a trained checkpoint without retraining, for benchmarks.

Certified training collapses the scores X A_l X^T, so the shipped models have nearly fixed
attention and certify cheaply. To measure what input-dependent attention costs the certifier,
and to attack its certificates where attention is strong, ``with_live_attention`` replaces every
block's Wq and Wk so that every head's A_l = Wq_l Wk_l^T has ||A_l|| / s = strength (s =
sqrt(d / h), the score divisor). By default Wq, Wk are c Q_1, c Q_2 with Q_1, Q_2 seeded random
orthogonal (d x d) matrices: every head's Wq_l, Wk_l then has orthonormal columns times c and
A_l has all its nonzero singular values equal to c^2. With ``spread`` r > 1, each head's
Wq_l is Q_l D O_l instead (Q_l its dh orthonormal columns of Q_1, D diagonal with values spaced
geometrically from 1 down to 1 / sqrt(r), O_l a random orthogonal dh x dh matrix), likewise
Wk_l from Q_2: the singular values of A_l = Q_l D O_l O'_l^T D Q'_l^T, those of D O_l O'_l^T D,
then differ by a ratio up to r, along directions not aligned with the heads' coordinates; each
head's columns are then rescaled to the target ||A_l||. The caps on Wq, Wk are lifted; every
other weight and the position biases are kept.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from lofast.models.layers import Attention
from lofast.models.vit import LipschitzViT


def with_live_attention(model: LipschitzViT, strength: float, seed: int = 0,
                        spread: float = 1.0) -> LipschitzViT:
    """A copy of ``model`` (float32, eval mode) whose blocks have ||A_l|| / s = strength, with
    Wq, Wk of equal singular values (spread 1) or singular values spread by the ratio
    ``spread`` (module docstring)."""
    if not (math.isfinite(strength) and strength >= 0):
        raise ValueError(f"attention strength must be finite and >= 0, got {strength}")
    if not (math.isfinite(spread) and spread >= 1):
        raise ValueError(f"singular value spread must be finite and >= 1, got {spread}")
    live = LipschitzViT(dataclasses.replace(model.config, query_key_cap=None))
    live.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)

    def orthogonal(d: int) -> torch.Tensor:
        return torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64)).Q

    with torch.no_grad():
        for stage in live.stages:
            if not isinstance(stage, Attention):
                continue
            if "query" not in stage.weights:
                raise ValueError("with_live_attention needs learned query and key weights "
                                 "(this model has query_key=identity)")
            d = stage.weights["query"].shape[0]
            heads, dh = stage.heads, stage.head_dim
            drawn = {}
            for name in ("query", "key"):
                weight = orthogonal(d)
                if spread > 1:
                    values = spread ** (-0.5 * torch.arange(dh, dtype=torch.float64) / (dh - 1))
                    weight = weight * values.repeat(heads) @ torch.block_diag(
                        *(orthogonal(dh) for _ in range(heads)))
                drawn[name] = weight
            query = drawn["query"].reshape(d, heads, dh).permute(1, 0, 2)  # (h, d, dh)
            key = drawn["key"].reshape(d, heads, dh).permute(1, 0, 2)
            norms = torch.linalg.matrix_norm(query @ key.mT, ord=2)  # (h,) ||A_l||
            factor = (strength * stage.scale / norms).sqrt()  # per head, on both Wq_l and Wk_l
            columns = factor.repeat_interleave(dh)
            for name in ("query", "key"):
                stage.weights[name].copy_(drawn[name] * columns)
    return live.eval()


def score_spectra(model: LipschitzViT) -> list[dict[str, float]]:
    """Per attention block, what its heads' A_l = Wq_l Wk_l^T are, measured from the effective
    weights in float64: the range of ||A_l|| / s over heads and the largest ratio of A_l's top
    to its dh-th singular value (1 for orthonormal columns)."""
    rows = []
    with torch.no_grad():
        for stage in model.stages:
            if isinstance(stage, Attention):
                weights = stage.head_weights()
                scores = (weights["query"].double() @ weights["key"].double().mT)
                values = torch.linalg.svdvals(scores)[..., : weights["query"].shape[-1]]
                strength = values[:, 0] / stage.scale
                rows.append({"strength_min": strength.min().item(),
                             "strength_max": strength.max().item(),
                             "spread_max": (values[:, 0] / values[:, -1]).max().item()})
    return rows
