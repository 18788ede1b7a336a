"""Switch attention on in a trained checkpoint without retraining, for benchmarks.

Certified training collapses the scores X A_l X^T, so the shipped models have nearly fixed
attention and certify cheaply. To measure what input-dependent attention costs the certifier,
``with_live_attention`` replaces every block's Wq and Wk by c Q_1, c Q_2 with Q_1, Q_2 seeded
random orthogonal (d x d) matrices: every head's Wq_l, Wk_l then has orthonormal columns times
c, A_l = Wq_l Wk_l^T has all its nonzero singular values equal to c^2, and c = sqrt(k s) gives
||A_l|| / s = k (s = sqrt(d / h), the score divisor). The caps on Wq, Wk are lifted (k > 1 / s
needs c > 1); every other weight and the position biases are kept.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from lofast.models.layers import Attention
from lofast.models.vit import LipschitzViT


def with_live_attention(model: LipschitzViT, strength: float, seed: int = 0) -> LipschitzViT:
    """A copy of ``model`` (float32, eval mode) whose blocks have ||A_l|| / s = strength."""
    if not (math.isfinite(strength) and strength >= 0):
        raise ValueError(f"attention strength must be finite and >= 0, got {strength}")
    live = LipschitzViT(dataclasses.replace(model.config, query_key_cap=None))
    live.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for stage in live.stages:
            if not isinstance(stage, Attention):
                continue
            scale = math.sqrt(strength * stage.scale)
            for name in ("query", "key"):
                weight = stage.weights[name]
                draw = torch.randn(weight.shape, generator=generator, dtype=torch.float64)
                weight.copy_(scale * torch.linalg.qr(draw).Q)
    return live.eval()
