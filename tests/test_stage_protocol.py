"""A new stage type is one spec class (and the module that builds it): a stage defined here,
unknown to lofast, is certified by the certifier, walked by the training bound and exported
for CROWN with no table or chain in lofast to extend."""

import copy
import dataclasses

import pytest
import torch
from helpers import train_tiny
from torch import Tensor, nn

from lofast.bounds.stage import Stage
from lofast.certification.attack import pgd_l2
from lofast.certification.certificate import Certifier
from lofast.crown.export import export_plain
from lofast.errors import CertificationError
from lofast.training.bound import TrainingBound


@dataclasses.dataclass(frozen=True)
class ScaleSpec(Stage):
    """x -> c x on every token: |c|-Lipschitz; refused for c = 0 (no model wants it)."""

    factor: float

    def lipschitz(self) -> float:
        return abs(self.factor)

    def check(self, index: int) -> None:
        if self.factor == 0:
            raise CertificationError(f"stage {index}: a zero scale")

    def plain(self) -> nn.Module:
        return Scale(self.factor)  # the module is plain already


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return x * self.factor

    def spec(self, differentiable: bool = False) -> ScaleSpec:
        return ScaleSpec(self.factor)


@pytest.fixture(scope="module")
def scaled():
    """The trained tiny model with a token scaling by 0.9 after its first projection."""
    model, x, y = train_tiny()
    model = copy.deepcopy(model)
    model.stages.insert(2, Scale(0.9))
    return model, x[:16], y[:16]


def test_the_certifier_takes_a_new_stage_soundly(scaled):
    model, x, y = scaled
    certificate = Certifier(model).certify(x, y)
    radius = certificate.radius()
    certified = radius > 0
    assert certified.sum() >= 5
    model64 = copy.deepcopy(model).double()
    assert not pgd_l2(model64, x[certified].double(), y[certified], radius[certified] * 0.999,
                      steps=30, restarts=2).any()
    model.stages[2].factor = 0.0  # its own check refuses it
    with pytest.raises(CertificationError, match="zero scale"):
        Certifier(model)
    model.stages[2].factor = 0.9


def test_the_training_bound_and_the_export_take_a_new_stage(scaled):
    model, x, y = scaled
    _, radius = TrainingBound(iterations=50)(model, x, 0.05)
    reference = Certifier(model).certify(x, y).feature_radius(torch.tensor([0.05]))[:, 0]
    assert torch.allclose(radius.double(), reference, rtol=0.02)  # an estimate, in float32
    plain = export_plain(model.double())
    assert isinstance(plain[2], Scale)
    with torch.no_grad():
        assert torch.allclose(plain(x.double()), model(x.double()), atol=1e-12)
