"""The certified-radius search of bounds/compose.py against closed forms and bisection."""

import math

import pytest
import torch

from lofast.bounds.compose import (
    ROUNDING_MARGIN,
    LipschitzStep,
    ProjectionStep,
    certified_radius,
    head_certified,
    propagate,
)


def random_head(batch: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Margins (B, C) (+inf at the label, one row misclassified) and pair norms (B, C)."""
    generator = torch.Generator().manual_seed(seed)
    margins = torch.rand(batch, classes, generator=generator, dtype=torch.float64) * 3 + 1e-3
    margins[:, 0] = math.inf
    margins[-1, 1] = -0.5  # misclassified: radius 0
    margins[0] *= 40.0  # a radius far above the search's first bracket
    pair_norms = torch.rand(batch, classes, generator=generator, dtype=torch.float64) + 0.1
    pair_norms[:, 0] = 0.0
    return margins, pair_norms


def certified_at(steps, margins, pair_norms, eps: torch.Tensor) -> torch.Tensor:
    return head_certified(margins, pair_norms, propagate(steps, eps[:, None]))[:, 0]


@pytest.mark.parametrize("points", [1, 3, 15])
def test_radius_of_lipschitz_steps_is_the_closed_form(points):
    margins, pair_norms = random_head(12, 10, seed=points)
    steps = [LipschitzStep(1.7), LipschitzStep(0.9)]
    radius = certified_radius(steps, margins, pair_norms, points=points)
    exact = (margins / (pair_norms * 1.7 * 0.9 * (1 + ROUNDING_MARGIN))).min(dim=1).values
    exact[-1] = 0.0
    assert radius[-1] == 0.0
    assert torch.allclose(radius, exact, rtol=1e-13, atol=0.0)
    assert certified_at(steps, margins, pair_norms, radius)[:-1].all()


def test_radius_is_certified_and_tight_through_a_nonlinear_step():
    margins, pair_norms = random_head(16, 10, seed=5)
    generator = torch.Generator().manual_seed(6)
    min_norm = 1.5 + 3 * torch.rand(16, generator=generator, dtype=torch.float64)
    steps = [LipschitzStep(1.3), ProjectionStep(min_norm, 1.0), LipschitzStep(2.0)]
    radius = certified_radius(steps, margins, pair_norms)
    correct = radius > 0
    assert correct.sum() == 15
    assert certified_at(steps, margins, pair_norms, radius)[correct].all()
    assert not certified_at(steps, margins, pair_norms, radius * (1 + 1e-12))[correct].any()
    # the same radii as plain bisection to the last bits
    bisected = certified_radius(steps, margins, pair_norms, points=1)
    assert torch.allclose(radius, bisected, rtol=1e-14, atol=0.0)


class Jagged:
    """A map that is not monotone in eps: certified on [0, 1) and on [2, 3) only."""

    def delta(self, eps: torch.Tensor) -> torch.Tensor:
        return torch.where((eps < 1) | ((eps >= 2) & (eps < 3)), eps * 0.0, eps * 1e9)


def test_a_returned_radius_was_itself_certified_even_for_a_non_monotone_map():
    margins = torch.tensor([[math.inf, 1.0]], dtype=torch.float64)
    pair_norms = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    for points in (1, 4, 15):
        radius = certified_radius([Jagged()], margins, pair_norms, points=points)
        assert certified_at([Jagged()], margins, pair_norms, radius).all()


def test_head_never_certifies_a_wrong_or_tied_sample_whatever_the_radius():
    """A misclassified or tied sample fails the head test at every radius, negative and NaN
    included (a negative radius once made every margin exceed its 'needed' value)."""
    margins, pair_norms = random_head(6, 5, seed=3)
    margins[2, 3] = 0.0  # a tie
    radii = torch.tensor([[-1.0, -1e-9, 0.0, 1e-6, float("nan")]], dtype=torch.float64)
    verdicts = head_certified(margins, pair_norms, radii.expand(6, -1))
    assert not verdicts[-1].any() and not verdicts[2].any()
    assert not verdicts[:, [0, 1, 4]].any()  # negative or NaN radii certify nothing
    assert verdicts[0, 2] and verdicts[0, 3]  # a correct sample at radius 0 and nearly 0
