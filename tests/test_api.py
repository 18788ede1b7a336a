"""The public Python API: the same defaults as the CLI, its import cost, models and data given
as objects (the README's example and the API's records against the CLI's, both on the shipped
default, are in test_shipped_models)."""

import json
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import numpy
import pytest
import torch

import lofast
from lofast.bounds.spectral import Guarantee, SpectralMethod
from lofast.certification.certificate import Certifier, CertifySettings
from lofast.certification.pipeline import RunProgress
from lofast.cli.certify_cmd import certify as certify_command
from lofast.config import CERTIFY_DEFAULTS, GUARANTEE_CHOICES, GUARANTEES
from lofast.errors import CertificationError, LofastError


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
    assert settings.guarantee == "auto" and settings.method is None  # resolved per model
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
    with pytest.raises(CertificationError, match="not auto"):  # a method fixes the guarantee
        CertifySettings(guarantee="auto", method=SpectralMethod(kind="dense"))
    with pytest.raises(CertificationError, match="jacobian_slack"):  # checked under auto too
        CertifySettings(guarantee="auto", jacobian_slack=-1.0)
    assert set(GUARANTEE_CHOICES) == {"auto", *GUARANTEES}
    options = {p.name: p for p in certify_command.params}
    assert list(options["guarantee"].type.choices) == list(GUARANTEE_CHOICES)


def test_api_takes_models_and_data_sets(one_thread, checkpoint, data_dir):
    model = lofast.load_model(checkpoint)
    data = lofast.load_data(data_dir, dataset="folder")
    from_paths = lofast.certify(checkpoint, data_dir, eps=0.1, n=4, dataset="folder")
    from_objects = lofast.certify(model, data, eps=0.1, n=4,
                                  settings=CertifySettings(guarantee="exact"))
    assert [r.radius for r in from_paths.records] == [r.radius for r in from_objects.records]
    assert from_paths.summary.samples == 4
    assert len(lofast.load_data()) == 500  # the bundled sample


def test_verdicts_only_runs_keep_the_verdicts_and_say_so(one_thread, checkpoint, data_dir):
    """``verdicts_only`` (``lofast certify --verdicts-only``): the verdicts of a full run at
    every eps, radii no larger, and the summary names the mode (a resumed run must match)."""
    from click.testing import CliRunner

    from lofast.cli.main import cli

    eps = [0.05, 0.1]
    full = lofast.certify(checkpoint, data_dir, eps=eps, n=8, dataset="folder")
    fast = lofast.certify(checkpoint, data_dir, eps=eps, n=8, dataset="folder",
                          verdicts_only=True)
    assert fast.summary.certified_accuracy == full.summary.certified_accuracy
    assert ([[c.certified for c in r.results.values()] for r in fast.records]
            == [[c.certified for c in r.results.values()] for r in full.records])
    assert all(f.radius <= t.radius * (1 + 1e-12) for f, t in zip(fast.records, full.records))
    assert fast.summary.bound == (full.summary.bound
                                  + ", radii for the verdicts at eps 0.05, 0.1")
    result = CliRunner().invoke(cli, ["certify", "--checkpoint", str(checkpoint), "--data",
                                      str(data_dir), "--dataset", "folder", "--n", "8",
                                      "--eps", "0.1", "--verdicts-only", "--json"])
    assert result.exit_code == 0, result.output
    assert "verdicts at eps 0.1" in result.output


def _out_of_memory_above(limit, monkeypatch):
    """Certification raising the allocator's error for batches above ``limit`` images (as
    CUDA's caching allocator does for a batch too large); returns the sizes asked for."""
    import torch

    asked, original = [], Certifier._certify

    def certify(self, images, labels, screen=True):
        asked.append(len(images))
        if len(images) > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return original(self, images, labels, screen)

    monkeypatch.setattr(Certifier, "_certify", certify)
    return asked


def test_a_batch_without_memory_is_certified_in_halves(one_thread, checkpoint, data_dir,
                                                       monkeypatch):
    """Out of memory at a batch of 8: the run goes on at 4 (said once), then keeps 4 for the
    rest, and its records equal a run's that fit; a lone sample without memory is one
    LofastError, not a traceback."""
    expected = lofast.certify(checkpoint, data_dir, eps=0.1, n=11, dataset="folder",
                              batch_size=16)
    asked = _out_of_memory_above(4, monkeypatch)
    notes = []

    class Notes(RunProgress):
        def note(self, text):
            notes.append(text)

    got = lofast.certify(checkpoint, data_dir, eps=0.1, n=11, dataset="folder", batch_size=8,
                         progress=Notes())
    # the per-model proofs' pass tries single samples (this untrained model gets them all
    # wrong, so none needs a proof), then the batches
    assert asked[-4:] == [8, 4, 4, 3] and set(asked[:-4]) == {1}, asked
    assert len(notes) == 1 and "at a batch of 8: certifying 4 at a time" in notes[0]
    assert [r.index for r in got.records] == [r.index for r in expected.records]
    assert [r.radius for r in got.records] == [r.radius for r in expected.records]
    monkeypatch.undo()
    _out_of_memory_above(0, monkeypatch)
    with pytest.raises(LofastError, match="out of memory on cpu certifying a single sample"):
        lofast.certify(checkpoint, data_dir, eps=0.1, n=3, dataset="folder", batch_size=2)


def test_the_time_per_sample_leaves_out_the_per_model_proofs(one_thread, monkeypatch):
    """A run makes its once-per-model proofs before the first batch and times them apart: each
    record's seconds are the sample's own, and the summary gives the proofs' seconds."""
    import functools
    import time

    from helpers import train_tiny

    from lofast.bounds.attention_spec import AttentionSpec
    from lofast.data import ImageDataset

    model, x, y = train_tiny(position_bias=True)
    pixels = (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    data = ImageDataset(images=numpy.ascontiguousarray(pixels),
                        labels=y.numpy().astype(numpy.int64),
                        classes=tuple(f"c{i}" for i in range(4)), name="folder")
    original = AttentionSpec.__dict__["weight_norms"].func

    def slow(spec):  # a per-model proof of a second, once per block and certifier
        time.sleep(1.0)
        return original(spec)

    slowed = functools.cached_property(slow)
    slowed.__set_name__(AttentionSpec, "weight_norms")
    monkeypatch.setattr(AttentionSpec, "weight_norms", slowed)
    run = lofast.certify(model, data, eps=0.1, n=6)
    assert sum(r.radius > 0 for r in run.records) >= 3  # samples with bounds: proofs needed
    assert run.summary.proof_seconds >= 1.0
    # in the first batch, the six samples would share at least a second
    assert max(r.seconds for r in run.records) < 0.15, [r.seconds for r in run.records]
    assert run.summary.to_dict()["proof_seconds"] == run.summary.proof_seconds


def test_the_proofs_pass_leaves_the_random_starts_of_the_batches(one_thread, monkeypatch):
    """The records of a run whose proofs are made before the first batch are those of a run
    without that pass, under the probabilistic guarantee too, whose per-sample Lanczos starts
    come from the certifier's one stream."""
    from lofast.certification import pipeline

    settings = CertifySettings(guarantee="probabilistic")
    probe = Certifier(lofast.load_model("lofast-live"), settings)
    x, y = lofast.load_data().subset(list(range(8))).to_tensors()
    before = probe.norms.generator.get_state().clone()
    probe.certify(x, y)
    assert not torch.equal(before, probe.norms.generator.get_state())  # the stream is used
    with monkeypatch.context() as patched:  # the run as it was: proofs in the first batch
        patched.setattr(pipeline, "make_proofs", lambda *arguments: 0.0)
        expected = lofast.certify("lofast-live", eps=[0.02, 0.1], n=8, settings=settings)
    run = lofast.certify("lofast-live", eps=[0.02, 0.1], n=8, settings=settings)
    assert run.summary.proof_seconds > 0 and expected.summary.proof_seconds == 0.0
    assert [(r.index, r.radius, r.results[0.02].bound) for r in run.records] == [
        (r.index, r.radius, r.results[0.02].bound) for r in expected.records]


class _StopsAtOnce(RunProgress):
    def samples(self, done, total, ms_per_sample):
        raise CertificationError("stopped by the progress report")


@pytest.mark.parametrize("stop", ["proofs", "progress"])
def test_a_run_stopped_before_its_first_batch_lets_go_of_its_record_file(
        one_thread, checkpoint, data_dir, tmp_path, monkeypatch, stop):
    # an error while the per-model proofs are made, or raised by the caller's progress report:
    # the record file is closed and unlocked even while the error is kept (as a notebook keeps
    # the last traceback, and with it the run's frames), so the same process can resume it
    out = tmp_path / "r.jsonl"

    def stopped(self, images, labels):
        raise CertificationError("stopped while making the proofs")

    progress = None
    if stop == "proofs":
        monkeypatch.setattr(Certifier, "make_proofs", stopped)
    else:
        progress = _StopsAtOnce()
    with pytest.raises(CertificationError, match="stopped") as kept:
        lofast.certify(checkpoint, data_dir, eps=0.1, n=4, dataset="folder", out=out,
                       progress=progress)
    monkeypatch.undo()
    run = lofast.certify(checkpoint, data_dir, eps=0.1, n=4, dataset="folder", out=out,
                         resume=True)
    assert run.summary.samples == 4 and run.summary.finished
    assert kept.traceback  # held until here


def test_a_run_of_a_model_in_memory_resumes_only_with_its_own_weights(
        one_thread, checkpoint, data_dir, tmp_path):
    """A model given in memory is named in the records by its weights: the same weights resume
    the run, other weights are refused (they would have counted the first model's
    certificates as theirs)."""
    out = tmp_path / "r.jsonl"
    model = lofast.load_model(checkpoint)
    first = lofast.certify(model, data_dir, eps=0.1, n=4, dataset="folder", out=out)
    again = lofast.certify(lofast.load_model(checkpoint), data_dir, eps=0.1, n=4,
                           dataset="folder", out=out, resume=True)
    assert [r.radius for r in again.records] == [r.radius for r in first.records]
    with torch.no_grad():
        model.stages[0].bias.add_(1.0)
    with pytest.raises(LofastError, match="other settings: checkpoint in memory, weights"):
        lofast.certify(model, data_dir, eps=0.1, n=4, dataset="folder", out=out, resume=True)


# Arguments the API must refuse as the command line does, before any work (ConfigError, one of
# lofast.errors): each would otherwise certify the wrong question. A negative eps, in
# particular, counted misclassified samples as certified.
BAD_ARGUMENTS = [
    {"eps": -1.0}, {"eps": [0.05, -1]}, {"eps": 0}, {"eps": float("nan")},
    {"eps": float("inf")}, {"eps": "abc"}, {"eps": "1/0"}, {"eps": True}, {"eps": []},
    {"eps": [0.05, None]}, {"n": -1}, {"n": 0}, {"n": 2.5}, {"n": True}, {"batch_size": -1},
    {"batch_size": 0}, {"batch_size": 2**40}, {"split": "dev"}, {"dataset": "imagenet"},
    {"fallback": "gamma"}, {"fallback_timeout": -1.0}, {"shard": "3/2"}, {"shard": "x"},
    {"resume": True}, {"attack": "yes"}, {"attention_report": 1}, {"device": ""},
    {"settings": "exact"}, {"out": 3.5}, {"eps": torch.tensor(-0.05)},
    {"eps": torch.tensor(True)}, {"eps": numpy.float64(-1)}, {"eps": torch.tensor([0.05, 0.0])},
    {"data": 123}, {"data": b"/tmp"}, {"progress": 5}, {"progress": "bars"},
    {"verdicts_only": "yes"}, {"eps": [0.05, 0.1], "settings": CertifySettings(verdicts_at=0.05)},
]


@pytest.mark.parametrize("arguments", BAD_ARGUMENTS, ids=repr)
def test_api_refuses_bad_arguments_before_any_work(arguments, monkeypatch):
    from lofast.certification import pipeline
    from lofast.errors import ConfigError

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(pipeline, "load_source", never)
    with pytest.raises(ConfigError):
        lofast.certify(**{"eps": 0.05, **arguments})


def test_api_reads_eps_as_the_command_line_does():
    from lofast.config import AttackSettings, CertifyConfig

    assert CertifyConfig(eps="0.05").eps == (0.05,)  # one radius, not four characters
    assert CertifyConfig(eps="36/255").eps == (36 / 255,)
    assert CertifyConfig(eps=[0.1, "0.02", 0.1]).eps == (0.02, 0.1)
    # numbers of numpy and torch, one or several: 0-d ones are one radius, not a sequence
    assert CertifyConfig(eps=torch.tensor(0.25)).eps == (0.25,)
    assert CertifyConfig(eps=numpy.array([0.5, 0.25])).eps == (0.25, 0.5)
    assert CertifyConfig(eps=torch.tensor([0.5, 0.25])).eps == (0.25, 0.5)
    assert CertifyConfig(eps=0.05, attack=True).attack == AttackSettings()
    assert CertifyConfig(eps=0.05, shard="1/3").shard == (1, 3)
    for bad in ({"steps": 0}, {"restarts": 10**6}, {"seed": -1}, {"box": "no"}):
        with pytest.raises(CertificationError.__mro__[1]):  # LofastError
            AttackSettings(**bad)


def test_numpy_numbers_count_as_numbers_and_are_stored_as_python_ones():
    """A count from numpy (np.arange, a shape) is an integer like any other, and a float32 a
    number: the configs keep them as Python ints and floats, which JSON records and
    checkpoint metadata can hold; a numpy bool stays refused, as a Python bool is."""
    from lofast.config import AttackSettings, CertifyConfig, ModelConfig, TrainConfig
    from lofast.errors import ConfigError

    config = CertifyConfig(eps=0.05, limit=numpy.int64(3), batch_size=numpy.uint16(2),
                           attack=AttackSettings(steps=numpy.int32(7), seed=numpy.int64(5)))
    stored = (config.limit, config.batch_size, config.attack.steps, config.attack.seed)
    assert stored == (3, 2, 7, 5) and all(type(v) is int for v in stored)
    model = ModelConfig(width=numpy.int64(32), depth=numpy.int8(2), heads=numpy.int64(4))
    assert json.loads(model.to_json())["width"] == 32
    train = TrainConfig(epochs=numpy.int64(2), batch_size=numpy.int32(8), seed=numpy.int64(1))
    assert (type(train.epochs), type(train.batch_size), type(train.seed)) == (int, int, int)
    assert type(CertifySettings(seed=numpy.int64(3)).seed) is int
    train = TrainConfig(lr=numpy.float32(1e-3), train_eps=numpy.float64(0.1),
                        clean_mix=numpy.float32(0.5), warmup_epochs=numpy.int64(1))
    stored = (train.lr, train.train_eps, train.clean_mix, train.warmup_epochs)
    assert [type(v) for v in stored] == [float, float, float, float] and train.clean_mix == 0.5
    model = ModelConfig(value_cap=numpy.float32(0.5), input_center=numpy.float16(0.5))
    assert json.loads(model.to_json())["value_cap"] == 0.5
    settings = CertifySettings(guarantee="exact", jacobian_slack=numpy.float32(0.5))
    slack = settings.method.jacobian_slack
    assert type(slack) is float and slack == 0.5
    for bad in (numpy.bool_(True), numpy.float64(2.0), numpy.int64(0)):
        with pytest.raises(ConfigError):
            CertifyConfig(eps=0.05, limit=bad)


def test_certifier_refuses_images_and_labels_the_model_was_not_made_for(checkpoint):
    import torch

    certifier = Certifier(lofast.load_model(checkpoint))
    x = torch.rand(2, 3, 32, 32)
    y = torch.tensor([0, 1])
    for images, labels in [(x[:, :2], y), (x[:, :, :16], y), (x[0], y), (x, y.float()),
                           (x, y[:1]), (x, torch.tensor([0, 4])), (x, torch.tensor([-1, 0])),
                           (x, y.bool()), (x.numpy(), y), (x[:0], y[:0])]:
        with pytest.raises(CertificationError):
            certifier.certify(images, labels)
    # uint8 pixels, even a dark image whose values all lie in 0 .. 1 (it would be certified as
    # a [0, 1] image other than the one meant)
    with pytest.raises(CertificationError, match="divide by 255"):
        certifier.certify((x < 0.5).to(torch.uint8), y)
    certificate = certifier.certify(x, y)
    with pytest.raises(CertificationError, match="radii"):
        certificate.certified(torch.tensor([0.05, -1.0], dtype=torch.float64))
    for narrow in (torch.uint8, torch.int8, torch.int16, torch.int32):  # classes all the same
        taken = certifier.certify(x, y.to(narrow))
        assert taken.labels.dtype == torch.int64
        assert torch.equal(taken.margins, certificate.margins)


def test_certifier_refuses_settings_and_weights_it_cannot_trust(checkpoint):
    """Flags that are not booleans (a text "no" reads as true), a negative seed and a model
    given in memory with a non-finite weight: one CertificationError each, before any SVD."""
    for bad in ({"softmax_jacobian": "no"}, {"local_projection": None}, {"seed": -1},
                {"seed": 0.5}):
        with pytest.raises(CertificationError):
            CertifySettings(**bad)
    model = lofast.load_model(checkpoint)
    with torch.no_grad():
        next(model.parameters())[0] = float("nan")
    with pytest.raises(CertificationError, match="NaN or infinity"):
        Certifier(model)
    with pytest.raises(CertificationError, match="NaN or infinity"):
        lofast.certify(model, eps=0.05, n=2)


@pytest.mark.parametrize("arguments, named", [
    ({"model": None}, "takes a LipschitzViT .* not NoneType"),
    ({"model": "tiny.safetensors"}, "takes a LipschitzViT .* not str"),
    ({"settings": {"guarantee": "exact"}}, "settings must be a CertifySettings, not dict"),
    ({"device": "tpu9"}, "unknown device 'tpu9'"),
    ({"device": "cuda:64"}, "device 'cuda:64' requested but"),
    ({"meta": True}, "stages.0.weight has no values")])
def test_certifier_refuses_what_it_is_not_made_for_in_one_line(checkpoint, arguments, named):
    """A Certifier made of the wrong things says so in one CertificationError, not in a
    traceback from deep inside PyTorch."""
    model = lofast.load_model(checkpoint)
    if arguments.pop("meta", False):
        model = model.to("meta")
    with pytest.raises(CertificationError, match=named):
        Certifier(**{"model": model, **arguments})


def test_api_certificates_cannot_be_fooled_by_their_arguments():
    """A property test: random eps lists, n and batch sizes, valid and invalid. Each call is
    refused, or every sample it certifies is correctly classified with a positive margin, has a
    radius at least its eps, and survives PGD at 0.999 x that radius."""
    import copy
    import random

    import numpy as np
    import torch
    from helpers import train_tiny

    from lofast.certification.attack import pgd_l2
    from lofast.data import ImageDataset
    from lofast.errors import ConfigError

    model, x, y = train_tiny()
    pixels = (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    data = ImageDataset(images=np.ascontiguousarray(pixels), labels=y.numpy().astype(np.int64),
                        classes=tuple(f"c{i}" for i in range(4)), name="folder")
    rng = random.Random(0)
    valid = [0.02, 0.05, 0.1, 0.2, "0.1", "1/20", 1e-300]
    invalid = [-0.05, -1, 0, float("nan"), float("inf"), "-1/20", "x"]
    refused = certified = 0
    attacked: dict[int, float] = {}  # sample -> largest certified eps
    for _ in range(20):  # about two draws in five are valid
        eps = rng.sample(valid, rng.choice([0, 1, 2, 2, 3, 3, 3, 3, 3, 3]))
        eps += rng.sample(invalid, rng.choice([0, 0, 0, 1]))
        n = rng.choice([-1, 0, 1, 5, 9, 16, 16, None, 2.5, True, 3, 7])
        batch_size = rng.choice([-1, 0, 1, 4, 7, None, None, 16, 2, 5])
        try:
            run = lofast.certify(model, data, eps=eps, n=n, batch_size=batch_size, device="cpu")
        except ConfigError:
            refused += 1
            continue
        for record in run.records:
            for e, result in record.results.items():
                if result.certified:
                    certified += 1
                    assert record.prediction == record.label and record.margin > 0
                    assert record.radius >= e > 0
                    attacked[record.index] = max(attacked.get(record.index, 0.0), e)
    assert refused >= 3 and certified >= 3, (refused, certified)
    index = sorted(attacked)
    images = torch.from_numpy(pixels[index]).permute(0, 3, 1, 2).double() / 255
    radius = torch.tensor([attacked[i] for i in index], dtype=torch.float64)
    broken = pgd_l2(copy.deepcopy(model).double(), images, y[index], radius * 0.999, steps=50,
                    restarts=2)
    assert not broken.any()


def test_shipped_models_by_name_from_the_registry(tmp_path, monkeypatch):
    """list_models() names the registered models (the default first); load_model and certify
    take a name; a shipped file that is not the registered one (replaced, damaged) is refused."""
    import shutil

    from lofast import checkpoint
    from lofast.errors import CheckpointError

    names = lofast.list_models()
    assert names[0] == "lofast-default" and "lofast-live" in names
    assert lofast.load_model("lofast-live").config.heads == 1
    with pytest.raises(CheckpointError, match="no shipped model"):
        checkpoint.shipped_path("lofast-nothing")
    copy = tmp_path / "checkpoints"
    shutil.copytree(checkpoint.SHIPPED_DIR, copy)
    with open(copy / "lofast-live.safetensors", "r+b") as f:  # one byte of a weight changed
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    monkeypatch.setattr(checkpoint, "SHIPPED_DIR", copy)
    with pytest.raises(CheckpointError, match="not the shipped lofast-live"):
        lofast.load_model("lofast-live")


def test_train_command_reads_its_defaults_from_the_configs():
    """`lofast train`'s options default to TrainConfig's and TrainRun's fields: one set."""
    from dataclasses import MISSING

    import click

    from lofast.cli.train_cmd import train as train_command
    from lofast.config import TrainConfig, TrainRun

    context = click.Context(train_command)
    options = {p.name: p.get_default(context) for p in train_command.params}
    renamed = {"data_path": "data", "init_path": "init", "compile_step": "compile"}
    checked = 0
    for config in (TrainConfig, TrainRun):
        for field in fields(config):
            name = next((k for k, v in renamed.items() if v == field.name), field.name)
            if name not in options or field.default is MISSING or name == "model_options":
                continue
            default = field.default.value if hasattr(field.default, "value") else field.default
            assert options[name] == default, name
            checked += 1
    assert checked >= 25


BAD_TRAIN_SETTINGS = [
    {"logit_annealing": -1.0}, {"logit_annealing": float("nan")}, {"logit_annealing": "2"},
    {"lr": 0}, {"temperature": float("inf")}, {"epochs": 0}, {"seed": -1}, {"loss": "hinge"},
    {"loss": "certified"}, {"clean_mix": 1.5}, {"margin": -0.1}, {"schedule": "step"},
    {"cpu_amp": True, "amp": False}, {"cpu_amp": "yes"}, {"amp": 1}, {"augment": "no"},
    {"batch_size": 2**16 + 1}, {"seed": 2**63}, {"power_iterations": 0},
]


@pytest.mark.parametrize("settings", BAD_TRAIN_SETTINGS, ids=repr)
def test_api_train_refuses_bad_settings_before_any_work(settings, monkeypatch, tmp_path):
    """lofast.train checks its settings by TrainConfig's rules, as `lofast train` does, and
    raises ConfigError before reading data or building a model."""
    import importlib

    def never(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(importlib.import_module("lofast.api"), "run_train", never)
    with pytest.raises(lofast.errors.ConfigError):
        lofast.train(tmp_path / "data", tmp_path / "m.safetensors", **settings)


def test_api_train_refuses_a_progress_without_its_methods_first(tmp_path):
    # before the data is read (there is none here): an AttributeError mid-run otherwise
    for progress in (5, object()):
        with pytest.raises(lofast.errors.ConfigError, match="TrainProgress"):
            lofast.train(tmp_path / "no data", tmp_path / "m.safetensors", progress=progress)
    assert not (tmp_path / "m.safetensors").exists()


def test_api_trains_and_certifies_with_everything_the_command_has(data_dir, tmp_path):
    """lofast.train writes a checkpoint as `lofast train` does (its record included; model
    options given as numpy scalars reach its JSON as Python values), and lofast.certify runs
    the attack with records to a file, resumed."""
    out = tmp_path / "m.safetensors"
    history = lofast.train(data_dir, out, dataset="folder", preset="tiny", epochs=1,
                           batch_size=numpy.int64(16), device="cpu",
                           model_options={"depth": numpy.int64(2), "value_cap": numpy.float32(0.5)})
    assert len(history) == 1 and out.exists()
    from lofast.checkpoint import read_metadata

    meta = read_metadata(out)
    assert meta["classes"] == [f"class{c}" for c in range(4)]
    assert meta["train_options"]["preset"] == "tiny" and meta["epochs"] == 1
    assert meta["train_options"]["model_options"] == {"depth": 2, "value_cap": 0.5}
    with pytest.raises(lofast.errors.ConfigError, match="one value"):
        lofast.train(data_dir, tmp_path / "n.safetensors", dataset="folder", epochs=1,
                     model_options={"depth": numpy.arange(2)})
    with pytest.raises(lofast.errors.ConfigError):
        lofast.train(data_dir, tmp_path / "n.safetensors", dataset="folder", epochs=1,
                     no_such_setting=1)
    records = tmp_path / "r.jsonl"
    first = lofast.certify(out, data_dir, eps=0.1, n=4, dataset="folder", device="cpu",
                           attack=True, out=records)
    again = lofast.certify(out, data_dir, eps=0.1, n=6, dataset="folder", device="cpu",
                           attack=True, out=records, resume=True)
    assert [r.index for r in again.records[:4]] == [r.index for r in first.records]
    assert again.summary.samples == 6 and all(r.attacked for r in again.records)


README = Path(__file__).resolve().parent.parent / "README.md"


def readme_example() -> str:
    """The indented code block of the README's "Python API" section."""
    section = README.read_text().split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^    \S.*(?:\n(?:    .*|[ ]*)$)*", section, flags=re.MULTILINE)
    assert block, "the README's Python API section has no code block"
    return "\n".join(line[4:] for line in block.group(0).splitlines())


def test_readme_example_runs_as_written(one_thread, capsys):
    code = readme_example()
    assert "import lofast" in code
    exec(compile(code, str(README), "exec"), {})  # noqa: S102 - the README example, as written
    assert capsys.readouterr().out.strip(), "the example prints its results"


def test_the_default_batch_size_follows_the_device_and_the_token_count(checkpoint, data_dir,
                                                                      monkeypatch):
    """64 on a CPU up to 65 tokens, 16 above (there a larger batch only adds memory), 1024 on a
    GPU; the pipeline asks with its model's token count."""
    import torch

    from lofast import runtime

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [runtime.default_batch_size(cpu, n) for n in (5, 17, 65, 66, 257)] == [
        64, 64, 64, 16, 16]
    assert runtime.default_batch_size(cuda, 257) == 1024
    asked = []
    original = runtime.default_batch_size

    def recording(device, tokens):
        asked.append((device.type, tokens))
        return original(device, tokens)

    monkeypatch.setattr(runtime, "default_batch_size", recording)
    run = lofast.certify(checkpoint, data_dir, eps=0.1, n=3, dataset="folder")
    assert asked == [("cpu", lofast.load_model(checkpoint).config.num_tokens)]
    assert len(run.records) == 3
