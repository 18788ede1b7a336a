"""The stages of a network as the bounds see them, and the one walk that turns them into radius maps.

A model describes itself as a list of stage specs (``LipschitzViT.structure``), in forward
order; the activation recorded for stage k is its clean input, (B, n, d) for token stages and
(B, d) after pooling. The specs are the whole contract between models and bounds: the bounds
never reach into modules.

``radius_maps`` walks the specs once, for both of their uses. How a stage's norms are taken is
the caller's ``StageRules``: sound float64 upper bounds for a certificate
(``lofast.certification.certificate``), or differentiable estimates with warm starts for
certified training (``lofast.training.bound``).
Every spec follows ``bounds.stage.Stage``: its radius map, the tokens it lets a perturbation
reach, its Lipschitz constant, its checks and its plain form are its own methods, so a new
stage type is one spec class (and the module that builds it), with no table to extend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lofast.bounds.attention_spec import AttentionSpec
from lofast.bounds.compose import LipschitzStep, ProjectionStep, RadiusMap
from lofast.bounds.plain import PlainEmbed, PlainHead, PlainPool, PlainProject, PlainSLL
from lofast.bounds.spectral import matrix_norm_upper
from lofast.bounds.stage import Stage, StageRules
from lofast.bounds.verified import gamma, gram_with_error, verified_gram_norm
from lofast.errors import CertificationError


@dataclass(frozen=True)
class EmbedSpec(Stage):
    """Image (B, C, H, W) -> tokens (B, n, d): centring, patches, linear map, position, class token.

    Lipschitz from the image l2 norm to the token Frobenius norm: ||weight|| (centring, patching
    and adding fixed vectors are isometries on differences). The first ``constant_tokens``
    tokens (the class token) do not depend on the image at all.
    """

    weight: Tensor  # (d, C * p * p)
    bias: Tensor  # (d,)
    position: Tensor  # (n_patches, d)
    class_token: Tensor  # (d,)
    center: float
    patch_size: int
    constant_tokens: int = 1

    def radius_map(self, index: int, tokens: Tensor, moving: slice,
                   rules: StageRules) -> RadiusMap:
        return LipschitzStep(rules.embedding_norm(index, self.weight))

    def reach(self, moving: slice) -> slice:
        return slice(self.constant_tokens, None)  # the class token cannot move

    def lipschitz(self) -> float:
        return float(matrix_norm_upper(self.weight))

    def plain(self) -> nn.Module:
        return PlainEmbed(self.weight, self.bias, self.position, self.class_token, self.center,
                          self.patch_size)


@dataclass(frozen=True)
class ProjectSpec(Stage):
    """LayerProject: each token projected onto the l2 ball of this radius (1-Lipschitz)."""

    radius: float

    def radius_map(self, index: int, tokens: Tensor, moving: slice,
                   rules: StageRules) -> RadiusMap:
        return (ProjectionStep.around(tokens, self.radius, moving) if rules.local_projection
                else LipschitzStep(1.0))

    def lipschitz(self) -> float:
        return 1.0

    def check(self, index: int) -> None:
        if not self.radius > 0:
            raise CertificationError(f"stage {index}: projection radius {self.radius} is not "
                                     "positive")

    def plain(self) -> nn.Module:
        return PlainProject(self.radius)


@dataclass(frozen=True)
class SLLSpec(Stage):
    """x -> x - 2 W diag(1/t) relu(W^T x + b) per token; 1-Lipschitz iff diag(t) - W^T W is PSD."""

    weight: Tensor  # (d, k)
    bias: Tensor  # (k,)
    t: Tensor  # (k,)

    def lipschitz(self) -> float:
        return 1.0

    def check(self, index: int) -> None:
        super().check(index)
        if not (self.t > 0).all():
            raise CertificationError(f"stage {index}: SLL layer has a zero column "
                                     "(its rescaling divides by zero)")
        bound = sll_scaled_norm_upper(self.weight, self.t)
        if not bound <= 1.0:
            raise CertificationError(f"stage {index}: SLL layer is not provably 1-Lipschitz "
                                     f"(||W diag(t)^-1/2|| may be up to {bound:.12g} > 1)")

    def plain(self) -> nn.Module:
        return PlainSLL(self.weight, self.bias, self.t)


@dataclass(frozen=True)
class PoolSpec(Stage):
    """Tokens (B, n, d) -> features (B, d): mean over tokens (1/sqrt(n)-Lipschitz, Frobenius to
    l2) or class token (1-Lipschitz)."""

    kind: str
    num_tokens: int

    def radius_map(self, index: int, tokens: Tensor, moving: slice,
                   rules: StageRules) -> RadiusMap:
        if tokens.shape[1] != self.num_tokens:
            raise CertificationError(f"stage {index}: pooling over {self.num_tokens} tokens, "
                                     f"the model computes {tokens.shape[1]}")
        return LipschitzStep(self.lipschitz())

    def lipschitz(self) -> float:
        return 1.0 / math.sqrt(self.num_tokens) if self.kind == "mean" else 1.0

    def check(self, index: int) -> None:
        if self.kind not in ("mean", "cls"):
            raise CertificationError(f"stage {index}: unknown pooling {self.kind!r}")

    def plain(self) -> nn.Module:
        return PlainPool(self.kind)


@dataclass(frozen=True)
class HeadSpec(Stage):
    """Logits z = W h + b; certified for class y if z_y - z_j > ||w_y - w_j|| delta_h for all j."""

    weight: Tensor  # (num_classes, d)
    bias: Tensor  # (num_classes,)

    def pair_norms(self, labels: Tensor) -> Tensor:
        """||w_y - w_j|| (B, C) for labels y (B,): what the head multiplies a feature radius
        by before comparing it with the margin z_y - z_j."""
        return torch.linalg.vector_norm(self.weight[labels][:, None, :] - self.weight[None],
                                        dim=-1)

    def lipschitz(self) -> float:
        """The largest ||w_i - w_j||: no margin moves faster."""
        return float(torch.cdist(self.weight, self.weight).max())

    def plain(self) -> nn.Module:
        return PlainHead(self.weight, self.bias)


# AttentionSpec (``bounds.attention_spec``): F(X) = H X + sum_l softmax(X A_l X^T / s + C_l) X B_l.
StageSpec = EmbedSpec | ProjectSpec | AttentionSpec | SLLSpec | PoolSpec | HeadSpec


def radius_maps(structure: Sequence[Stage], activations: Sequence[Tensor],
                rules: StageRules) -> list[RadiusMap]:
    """One radius map per stage before the head, in order: composed, they bound the change of
    the pooled features over an l2 ball of images (``compose.propagate``). The only stage walk.

    structure: the specs, ending with the head; activations: stage k's clean input at
    position k (the head's input included or not). Each stage states which tokens a
    perturbation can reach after it (``Stage.reach``): the class token of the embedding cannot
    move until attention mixes every token into every other.
    """
    steps: list[RadiusMap] = []
    moving = slice(None)  # the tokens of the activation that a perturbation can reach
    for index, (spec, act) in enumerate(zip(structure[:-1], activations)):
        steps.append(spec.radius_map(index, act, moving, rules))
        moving = spec.reach(moving)
    return steps


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
