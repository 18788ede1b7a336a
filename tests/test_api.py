"""The public Python API: the same defaults as the CLI, its import cost, models and data given
as objects (the README's example and the API's records against the CLI's, both on the shipped
default, are in test_shipped_models)."""

import subprocess
import sys
from dataclasses import fields

import pytest

import lofast
from lofast.bounds.spectral import Guarantee, SpectralMethod
from lofast.certificate import Certifier, CertifySettings
from lofast.cli.certify_cmd import certify as certify_command
from lofast.config import CERTIFY_DEFAULTS, GUARANTEES
from lofast.errors import CertificationError


def test_import_lofast_and_help_do_not_import_torch():
    code = ("import sys, lofast, lofast.cli.main; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(sorted(lofast.__all__))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert "certify" in result.stdout and "load_model" in result.stdout
    with pytest.raises(AttributeError):
        lofast.no_such_thing  # noqa: B018


def test_library_and_cli_read_one_set_of_defaults():
    settings = CertifySettings()
    for name in ("guarantee", "bound", "kappa", "softmax_jacobian", "local_projection", "seed"):
        assert getattr(settings, name) == getattr(CERTIFY_DEFAULTS, name), name
    assert settings.method.kind == GUARANTEES["exact"] and settings.guarantee == "exact"
    assert Certifier.__init__.__defaults__[0] is None  # Certifier(model) takes CertifySettings()
    options = {p.name: p.default for p in certify_command.params}
    assert options["guarantee"] == CERTIFY_DEFAULTS.guarantee
    assert options["bound"] == CERTIFY_DEFAULTS.bound
    assert float(options["kappa"]) == CERTIFY_DEFAULTS.kappa
    assert options["softmax_jacobian"] == CERTIFY_DEFAULTS.softmax_jacobian
    assert options["seed"] == CERTIFY_DEFAULTS.seed
    assert {f.name for f in fields(CERTIFY_DEFAULTS)} <= {f.name for f in fields(settings)}


def test_one_vocabulary_for_guarantees():
    """The names users choose are the values of Guarantee, and each names the method giving it."""
    assert set(GUARANTEES) == {g.value for g in Guarantee}
    for name, kind in GUARANTEES.items():
        assert SpectralMethod(kind=kind).guarantee == Guarantee(name)
        assert CertifySettings(guarantee=name).method.kind == kind
    assert CertifySettings(method=SpectralMethod(kind="dense")).guarantee == "exact"
    with pytest.raises(CertificationError, match="guarantee"):
        CertifySettings(guarantee="exact", method=SpectralMethod(kind="lanczos"))
    with pytest.raises(CertificationError, match="unknown guarantee"):
        CertifySettings(guarantee="deterministic")


def test_api_takes_models_and_data_sets(one_thread, checkpoint, data_dir):
    model = lofast.load_model(checkpoint)
    data = lofast.load_data(data_dir, dataset="folder")
    from_paths = lofast.certify(checkpoint, data_dir, eps=0.1, n=4, dataset="folder")
    from_objects = lofast.certify(model, data, eps=0.1, n=4,
                                  settings=CertifySettings(guarantee="exact"))
    assert [r.radius for r in from_paths.records] == [r.radius for r in from_objects.records]
    assert from_paths.summary.samples == 4
    assert len(lofast.load_data()) == 500  # the bundled sample
