"""The stages of a network as the bounds see them, and the one walk that turns them into radius maps.

A model describes itself as a list of stage specs (``LipschitzViT.structure``), in forward
order; the activation recorded for stage k is its clean input, (B, n, d) for token stages and
(B, d) after pooling. The specs are the whole contract between models and bounds: the bounds
never reach into modules.

``radius_maps`` walks the specs once, for both of their uses. How a stage's norms are taken is
the caller's ``StageNorms``: sound float64 upper bounds for a certificate (``lofast.certificate``),
or differentiable estimates with warm starts for certified training (``lofast.training_bound``).
A new stage type is one spec class here plus one case in ``radius_maps`` (and in
``stage_lipschitz`` and ``check_stage`` where it has a constant to state or check).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from lofast.bounds.attention_spec import AttentionSpec
from lofast.bounds.compose import LipschitzStep, ProjectionStep, RadiusMap
from lofast.bounds.spectral import matrix_norm_upper
from lofast.bounds.verified import gamma, gram_with_error, verified_gram_norm
from lofast.errors import CertificationError


@dataclass(frozen=True)
class EmbedSpec:
    """Image (B, C, H, W) -> tokens (B, n, d): centring, patches, linear map, position, class token.

    Lipschitz from the image l2 norm to the token Frobenius norm: ||weight|| (centring, patching
    and adding fixed vectors are isometries on differences). The first ``constant_tokens``
    tokens (the class token) do not depend on the image at all.
    """

    weight: Tensor  # (d, C * p * p)
    constant_tokens: int = 1


@dataclass(frozen=True)
class ProjectSpec:
    """LayerProject: each token projected onto the l2 ball of this radius (1-Lipschitz)."""

    radius: float


@dataclass(frozen=True)
class SLLSpec:
    """x -> x - 2 W diag(1/t) relu(W^T x + b) per token; 1-Lipschitz iff diag(t) - W^T W is PSD."""

    weight: Tensor  # (d, k)
    bias: Tensor  # (k,)
    t: Tensor  # (k,)


@dataclass(frozen=True)
class PoolSpec:
    """Tokens (B, n, d) -> features (B, d): mean over tokens (1/sqrt(n)-Lipschitz) or class token."""

    kind: str
    num_tokens: int


@dataclass(frozen=True)
class HeadSpec:
    """Logits z = W h + b; certified for class y if z_y - z_j > ||w_y - w_j|| delta_h for all j."""

    weight: Tensor  # (num_classes, d)
    bias: Tensor  # (num_classes,)


# AttentionSpec (``bounds.attention_spec``): F(X) = H X + sum_l softmax(X A_l X^T / s + C_l) X B_l.
StageSpec = EmbedSpec | ProjectSpec | AttentionSpec | SLLSpec | PoolSpec | HeadSpec


class StageNorms(Protocol):
    """How ``radius_maps`` takes the norms a stage's radius map needs."""

    def embedding_norm(self, index: int, weight: Tensor) -> Tensor | float:
        """||weight|| of the patch embedding at stage ``index``: an upper bound for a
        certificate, an estimate with gradients for training."""

    def attention(self, index: int, tokens: Tensor, spec: AttentionSpec) -> RadiusMap:
        """The radius map of the attention block at stage ``index`` at clean tokens (B, n, d)."""


def radius_maps(structure: Sequence[StageSpec], activations: Sequence[Tensor],
                norms: StageNorms, local_projection: bool = True) -> list[RadiusMap]:
    """One radius map per stage before the head, in order: composed, they bound the change of
    the pooled features over an l2 ball of images (``compose.propagate``).

    structure: the specs, ending with the head; activations: stage k's clean input at
    position k (the head's input included or not). ``local_projection`` uses LayerProject's
    local contraction around the clean tokens (else its global constant 1). The rule for the
    tokens a perturbation can reach lives here alone: the class token of the embedding cannot
    move until attention mixes every token into every other.
    """
    steps: list[RadiusMap] = []
    moving = slice(None)  # the tokens of the activation that a perturbation can reach
    for index, (spec, act) in enumerate(zip(structure[:-1], activations)):
        if isinstance(spec, EmbedSpec):
            steps.append(LipschitzStep(norms.embedding_norm(index, spec.weight)))
            moving = slice(spec.constant_tokens, None)
        elif isinstance(spec, ProjectSpec):
            steps.append(ProjectionStep.around(act, spec.radius, moving) if local_projection
                         else LipschitzStep(1.0))
        elif isinstance(spec, AttentionSpec):
            steps.append(norms.attention(index, act, spec))
            moving = slice(None)
        elif isinstance(spec, SLLSpec):
            steps.append(LipschitzStep(1.0))
        elif isinstance(spec, PoolSpec):
            if act.shape[1] != spec.num_tokens:
                raise CertificationError(f"stage {index}: pooling over {spec.num_tokens} tokens, "
                                         f"the model computes {act.shape[1]}")
            steps.append(LipschitzStep(pool_lipschitz(spec)))
        else:
            raise CertificationError(f"stage {index}: no bound for {type(spec).__name__}")
    return steps


def pool_lipschitz(spec: PoolSpec) -> float:
    """Mean pooling of n tokens is 1/sqrt(n)-Lipschitz (Frobenius to l2); the class token 1."""
    return 1.0 / math.sqrt(spec.num_tokens) if spec.kind == "mean" else 1.0


def stage_lipschitz(spec: StageSpec) -> float | None:
    """Global Lipschitz constant of a stage, an upper bound (None for attention, which has
    none; the head's is its largest ||w_i - w_j||)."""
    if isinstance(spec, EmbedSpec):
        return float(matrix_norm_upper(spec.weight))
    if isinstance(spec, (ProjectSpec, SLLSpec)):
        return 1.0
    if isinstance(spec, PoolSpec):
        return pool_lipschitz(spec)
    if isinstance(spec, HeadSpec):
        w = spec.weight
        return float(torch.cdist(w, w).max())
    return None


def sll_scaled_norm_upper(weight: Tensor, t: Tensor) -> float:
    """A rigorous upper bound on ||W diag(t)^(-1/2)|| for W (d, k) and t > 0 (k,), float64.

    diag(t) - W^T W is positive semidefinite iff this norm is <= 1, which makes an SLL layer
    1-Lipschitz. F = fl(W / fl(sqrt(t))) has entries within a relative gamma_2 of the exact
    ones, so ||W diag(t)^(-1/2) - F|| <= gamma_3 ||F||_F; ||F|| is bounded by the
    Cholesky-verified Gram norm of ``spectral.verified_gram_norm`` (rounding of F^T F included),
    ||F||_F by its float64 sum of squares inflated by gamma_(dk+2).
    """
    scaled = weight.to(torch.float64) / t.to(torch.float64).sqrt()
    gram, error = gram_with_error(scaled[None])
    norm = verified_gram_norm(gram, gram_error=error, symmetric=True, relative_slack=1e-6)[0]
    frobenius = (scaled.square().sum() * (1.0 + gamma(scaled.numel() + 2))).sqrt()
    return float((norm + gamma(3) * frobenius) * (1.0 + 2.0 ** -40))


def check_stage(spec: StageSpec, index: int) -> None:
    """Refuse a stage whose Lipschitz accounting would not hold for the function it computes.

    The model validates its config, but a certificate must not rest on that alone: every
    constant the bounds use is checked here on the spec the forward pass was built from.
    """
    tensors = [value for value in vars(spec).values() if isinstance(value, torch.Tensor)]
    if not all(torch.isfinite(t).all() for t in tensors):
        raise CertificationError(f"stage {index}: weights contain NaN or infinity")
    if isinstance(spec, ProjectSpec) and not spec.radius > 0:
        raise CertificationError(f"stage {index}: projection radius {spec.radius} is not positive")
    if isinstance(spec, PoolSpec) and spec.kind not in ("mean", "cls"):
        raise CertificationError(f"stage {index}: unknown pooling {spec.kind!r}")
    if isinstance(spec, AttentionSpec) and not (spec.residual and spec.scale > 0):
        raise CertificationError(f"stage {index}: attention must be residual with scale > 0")
    if isinstance(spec, SLLSpec):
        if not (spec.t > 0).all():
            raise CertificationError(f"stage {index}: SLL layer has a zero column "
                                     "(its rescaling divides by zero)")
        bound = sll_scaled_norm_upper(spec.weight, spec.t)
        if not bound <= 1.0:
            raise CertificationError(f"stage {index}: SLL layer is not provably 1-Lipschitz "
                                     f"(||W diag(t)^-1/2|| may be up to {bound:.12g} > 1)")
