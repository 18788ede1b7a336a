"""Composition of per-stage local bounds through a network, and the head certificate.

Every stage maps an input radius eps (B, E) to an output radius, and every such map is
nondecreasing in eps; so the certified set of radii of a sample is an interval [0, r) and the
radius r follows by a search (``certified_radius``). The stage quantities depend on the clean input only: they are
computed once per sample and reused for any number of eps values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

# Relative inflation of the final feature-space radius: covers float64 rounding in the scalar
# recursion and in the logits (errors of order 1e-15 relative), with a wide safety factor.
ROUNDING_MARGIN = 1e-9


class RadiusMap(Protocol):
    def delta(self, eps: Tensor) -> Tensor:
        """Output radius for input radius eps: (B, E) -> (B, E), nondecreasing in eps."""


@dataclass(frozen=True)
class LipschitzStep:
    """A globally L-Lipschitz stage: eps -> L eps."""

    factor: float

    def delta(self, eps: Tensor) -> Tensor:
        return eps * self.factor


@dataclass(frozen=True)
class ProjectionStep:
    """Local bound of LayerProject (radius R) around clean tokens; min_norm (B,) is the smallest
    norm among the tokens the perturbation can reach (a token that cannot move adds nothing).

    A token at norm r moved by t stays, with the whole segment between, at norm >= r - t. If
    r - t > R that segment lies outside the ball, where the projection z -> R z / ||z|| has
    Jacobian norm R / ||z|| <= R / (r - t); otherwise 1-Lipschitz suffices. The factor grows
    with t and falls with r, so over all tokens (per-token budgets t_i <= eps) the Frobenius
    change is at most eps * c(min_norm, eps) with c(r, t) = R / (r - t) if r - t > R else 1.
    """

    min_norm: Tensor  # (B,)
    radius: float

    def __post_init__(self) -> None:
        if not self.radius > 0:  # the factor R / (r - t) is a contraction bound only for R > 0
            raise ValueError(f"projection radius must be positive, not {self.radius}")

    @classmethod
    def around(cls, tokens: Tensor, radius: float, moving: slice) -> ProjectionStep:
        """The step at clean tokens (B, n, d), of which only tokens[:, moving] can move. Norms
        are computed to ~1e-16 relative; the minimum is shaved by 1e-12 to stay below them."""
        norms = torch.linalg.vector_norm(tokens[:, moving], dim=-1).min(dim=-1).values
        return cls(norms * (1 - 1e-12), radius)

    def delta(self, eps: Tensor) -> Tensor:
        gap = self.min_norm[:, None] - eps
        outside = gap > self.radius
        factor = torch.where(outside, self.radius / torch.where(outside, gap, 1.0), 1.0)
        return eps * factor


def propagate(steps: Sequence[RadiusMap], eps: Tensor) -> Tensor:
    """Radius after all steps, (B, E) -> (B, E)."""
    for step in steps:
        eps = step.delta(eps)
    return eps


def head_certified(margins: Tensor, pair_norms: Tensor, feature_radius: Tensor) -> Tensor:
    """True where z_y - z_j > ||w_y - w_j|| * radius for every j != y (margins already +inf at
    j = y and negative where another class wins) and every such margin is positive: a sample
    the model gets wrong, or ties, is never certified, whatever the radius (a radius below 0,
    or NaN, certifies nothing). Shapes: (B, C), (B, C), (B, E) -> (B, E)."""
    needed = pair_norms[:, None, :] * (feature_radius[..., None] * (1.0 + ROUNDING_MARGIN))
    correct = (margins > 0).all(dim=-1)[:, None] & (feature_radius >= 0)
    return (margins[:, None, :] > needed).all(dim=-1) & correct


def certified_radius(steps: Sequence[RadiusMap], margins: Tensor, pair_norms: Tensor,
                     bits: int = 60, start: float = 1.0, points: int = 63) -> Tensor:
    """Largest eps (B,) at which the head test still passes, (B,); misclassified samples get 0.

    A search on the monotone recursion: the bracket [low, high) is grown by doubling until
    its top is not certified, then each round tests `points` evenly spaced radii inside it in
    one pass of the recursion (eps of shape (B, points)) and keeps the gap between the largest
    certified one and the next, shrinking the bracket (points + 1)-fold, until it is 2^-bits of
    its first width. The returned value is the lower end of the final bracket, a radius that
    was itself tested and certified (or 0): the result is certified even where rounding makes
    the recursion non-monotone at the level of the last bits.
    63 points a round (ten rounds to 2^-60, eleven passes with the first bracket) cost as much
    on a CPU as 15 (sixteen passes), in 31 % fewer operator launches for an accelerator
    (3,636 against 5,291 for a batch of the default), with the same radii to the bit.
    """
    batch = margins.shape[0]
    device, dtype = margins.device, margins.dtype
    correct = (margins > 0).all(dim=1)

    def ok(eps: Tensor) -> Tensor:  # eps (B, E) -> (B, E) certified, and not misclassified
        return head_certified(margins, pair_norms, propagate(steps, eps)) & correct[:, None]

    low = torch.zeros(batch, device=device, dtype=dtype)
    high = torch.full((batch,), start, device=device, dtype=dtype)
    for _ in range(64):  # grow the bracket until the top is not certified
        grow = ok(high[:, None])[:, 0]
        if not grow.any():
            break
        low = torch.where(grow, high, low)
        high = torch.where(grow, high * 2.0, high)
    fractions = torch.arange(1, points + 1, device=device, dtype=dtype) / (points + 1)
    index = torch.arange(points, device=device)
    for _ in range(math.ceil(bits / math.log2(points + 1))):
        grid = low[:, None] + (high - low)[:, None] * fractions  # (B, points), increasing
        last = torch.where(ok(grid), index, -1).amax(dim=1)  # largest certified point, or -1
        below = grid.gather(1, last.clamp(min=0)[:, None])[:, 0]
        above = grid.gather(1, (last + 1).clamp(max=points - 1)[:, None])[:, 0]
        low = torch.where(last >= 0, below, low)
        high = torch.where(last + 1 < points, above, high)
    return torch.where(correct, low, torch.zeros_like(low))
