"""The protocol every stage spec follows (``Stage``), and the rules by which the stage walk takes
its norms (``StageRules``). The specs themselves: ``bounds.stages`` and, for attention,
``bounds.attention_spec``; the walk: ``bounds.stages.radius_maps``.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
from torch import Tensor, nn

from lofast.bounds.compose import LipschitzStep, RadiusMap
from lofast.errors import CertificationError


class StageRules(Protocol):
    """How ``radius_maps`` takes the quantities a stage's radius map needs: sound float64 upper
    bounds for a certificate (``certificate.VerifiedNorms``), differentiable estimates for
    certified training (``training.bound.TrainingBound``)."""

    local_projection: bool  # LayerProject's local contraction around the clean tokens (else 1)

    def embedding_norm(self, index: int, weight: Tensor) -> Tensor | float:
        """||weight|| of the patch embedding at stage ``index``: an upper bound for a
        certificate, an estimate with gradients for training."""

    def attention(self, index: int, tokens: Tensor, spec: Stage) -> RadiusMap:
        """The radius map of the attention block at stage ``index`` at clean tokens (B, n, d)."""


class Stage:
    """What every stage spec owns (the one protocol of the stage walk, the certificate's checks,
    ``lofast info`` and the CROWN export):

    - ``radius_map(index, tokens, moving, rules)``: the stage's radius map at its clean input
      (``moving``: the tokens a perturbation of the image can reach there);
    - ``reach(moving)``: the tokens it can reach after the stage (default: the same);
    - ``lipschitz()``: a global Lipschitz constant, an upper bound (None: only local bounds);
    - ``check(index)``: refuse constants whose accounting would not hold (CertificationError);
    - ``plain()``: the same function as a plain module (``bounds.plain``).

    A new stage type is one spec class with these methods, plus the module that builds it.
    """

    def radius_map(self, index: int, tokens: Tensor, moving: slice,
                   rules: StageRules) -> RadiusMap:
        lipschitz = self.lipschitz()
        if lipschitz is None:
            raise CertificationError(f"stage {index}: no bound for {type(self).__name__}")
        return LipschitzStep(lipschitz)

    def reach(self, moving: slice) -> slice:
        return moving

    def lipschitz(self) -> float | None:
        return None

    def check(self, index: int) -> None:
        tensors = [getattr(self, f.name) for f in dataclasses.fields(self)]
        if not all(torch.isfinite(t).all() for t in tensors if isinstance(t, torch.Tensor)):
            raise CertificationError(f"stage {index}: weights contain NaN or infinity")

    def plain(self) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} has no plain form")
