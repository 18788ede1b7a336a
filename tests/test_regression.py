"""CI guard: the shipped default checkpoint must keep its certified accuracy on a fixed subset.

An intentional change (a new checkpoint, a tighter bound) updates checkpoints/reference.json in
the same commit, with the reason in the message.
"""

import json

import pytest
import torch

from lofast.certificate import Certifier, CertifySettings
from lofast.checkpoint import SHIPPED_DIR, load_checkpoint
from lofast.data.sample import class_balanced_order, load_bundled_sample

REFERENCE = SHIPPED_DIR / "reference.json"


@pytest.fixture(scope="module")
def reference():
    return json.loads(REFERENCE.read_text())


@pytest.fixture(scope="module")
def certificate(reference):
    torch.manual_seed(0)
    model = load_checkpoint(SHIPPED_DIR / reference["checkpoint"])
    data = load_bundled_sample()
    subset = data.subset(class_balanced_order(data.labels)[: reference["samples"]])
    x, y = subset.to_tensors()
    settings = CertifySettings(bound=reference["bound"], kappa=reference["kappa"],
                               guarantee=reference["guarantee"])
    return Certifier(model, settings).certify(x, y)


def test_clean_accuracy_matches_reference(reference, certificate):
    clean = (certificate.predictions == certificate.labels).double().mean().item()
    assert clean == pytest.approx(reference["clean_accuracy"], abs=1e-9)


def test_certified_accuracy_does_not_drop(reference, certificate):
    eps = sorted(reference["certified_accuracy"], key=float)
    verdicts = certificate.certified(torch.tensor([float(e) for e in eps], dtype=torch.float64))
    for k, key in enumerate(eps):
        measured = verdicts[:, k].double().mean().item()
        assert measured >= reference["certified_accuracy"][key] - 1e-9, (
            f"certified accuracy at eps={key} fell to {measured:.3f} "
            f"(reference {reference['certified_accuracy'][key]:.3f})")


def test_every_shipped_checkpoint_loads_and_is_on_the_model_card():
    card = (SHIPPED_DIR / "README.md").read_text()
    shipped = sorted(SHIPPED_DIR.glob("*.safetensors"))
    assert shipped
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for path in shipped:
        assert f"`{path.name}`" in card, f"{path.name} is not described in checkpoints/README.md"
        with torch.no_grad():
            assert torch.isfinite(load_checkpoint(path)(x)).all(), path.name
