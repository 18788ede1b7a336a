"""CI guard: every checkpoint in checkpoints/reference.json keeps its figures on a fixed subset.

For each listed checkpoint: clean accuracy must match exactly, no certified accuracy may drop,
and where an ``attention_ablation_drop`` is recorded (a checkpoint whose attention does work),
replacing every block's attention by its mean over the subset must still cost at least that
many points of clean accuracy, so that an accidental attention collapse fails CI. An
intentional change (a new checkpoint, a tighter bound) updates checkpoints/reference.json in
the same commit, with the reason in the message.
"""

import json

import pytest
import torch

from lofast.attention_report import attention_report
from lofast.certificate import Certifier, CertifySettings
from lofast.checkpoint import SHIPPED_DIR, load_checkpoint
from lofast.data.sample import class_balanced_order, load_bundled_sample

REFERENCE = json.loads((SHIPPED_DIR / "reference.json").read_text())
CHECKPOINTS = sorted(REFERENCE["checkpoints"])


@pytest.fixture(scope="module")
def subset():
    data = load_bundled_sample()
    return data.subset(class_balanced_order(data.labels)[: REFERENCE["samples"]]).to_tensors()


@pytest.fixture(scope="module", params=CHECKPOINTS)
def case(request, subset):
    """(checkpoint name, its reference figures, the model, its certificate on the subset)."""
    name = request.param
    torch.manual_seed(0)
    model = load_checkpoint(SHIPPED_DIR / name)
    settings = CertifySettings(bound=REFERENCE["bound"], kappa=REFERENCE["kappa"],
                               guarantee=REFERENCE["guarantee"])
    x, y = subset
    return name, REFERENCE["checkpoints"][name], model, Certifier(model, settings).certify(x, y)


def test_clean_accuracy_matches_reference(case):
    _, expected, _, certificate = case
    clean = (certificate.predictions == certificate.labels).double().mean().item()
    assert clean == pytest.approx(expected["clean_accuracy"], abs=1e-9)


def test_certified_accuracy_does_not_drop(case):
    name, expected, _, certificate = case
    eps = sorted(expected["certified_accuracy"], key=float)
    verdicts = certificate.certified(torch.tensor([float(e) for e in eps], dtype=torch.float64))
    for k, key in enumerate(eps):
        measured = verdicts[:, k].double().mean().item()
        assert measured >= expected["certified_accuracy"][key] - 1e-9, (
            f"{name}: certified accuracy at eps={key} fell to {measured:.3f} "
            f"(reference {expected['certified_accuracy'][key]:.3f})")


def test_attention_still_does_its_work(case, subset):
    name, expected, model, _ = case
    if "attention_ablation_drop" not in expected:
        pytest.skip(f"{name}: no attention ablation on record (its attention does no work)")
    report = attention_report(model, *subset)
    assert report.attention_ablation_drop >= expected["attention_ablation_drop"] - 1e-9, (
        f"{name}: replacing attention by its mean now costs {report.attention_ablation_drop:.1f} "
        f"points (reference {expected['attention_ablation_drop']:.1f}): attention collapsed")


def test_every_shipped_checkpoint_loads_and_is_on_the_model_card():
    card = (SHIPPED_DIR / "README.md").read_text()
    shipped = sorted(SHIPPED_DIR.glob("*.safetensors"))
    assert shipped
    assert set(CHECKPOINTS) <= {path.name for path in shipped}
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for path in shipped:
        assert f"`{path.name}`" in card, f"{path.name} is not described in checkpoints/README.md"
        with torch.no_grad():
            assert torch.isfinite(load_checkpoint(path)(x)).all(), path.name
