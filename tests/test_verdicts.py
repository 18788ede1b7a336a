"""Three verdicts (certified / falsified / unknown) and reports of saved runs."""

import copy
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import record_lines, train_tiny
from PIL import Image

from lofast.certification.attack import pgd_attack
from lofast.certification.pipeline import run_attack
from lofast.checkpoint import load_checkpoint
from lofast.cli.main import cli

pytestmark = pytest.mark.usefixtures("shared_cache")


@pytest.fixture(scope="module")
def trained():
    return train_tiny()


def test_falsifier_finds_a_planted_counterexample(trained):
    """Walk from an image of one predicted class towards one of another, stop just before the
    decision boundary: a counterexample lies within a known distance, and PGD must find it."""
    model, x, y = trained
    model = copy.deepcopy(model).double()
    x = x.double()
    predicted = model(x).argmax(dim=1)
    a = int(torch.nonzero(predicted == y)[0])
    b = int(torch.nonzero(predicted != predicted[a])[0])
    low, high = 0.0, 1.0  # fraction of the way from x[a] to x[b]: low keeps a's class
    for _ in range(50):
        mid = (low + high) / 2
        same = model((x[a] + mid * (x[b] - x[a]))[None]).argmax() == predicted[a]
        low, high = (mid, high) if same else (low, mid)
    start = x[a] + low * (x[b] - x[a])
    beyond = x[a] + high * (x[b] - x[a])
    eps = 2.0 * float((beyond - start).norm()) + 1e-6
    label = predicted[a:a + 1]
    result = pgd_attack(model, start[None], label, eps, steps=50, restarts=1)
    assert bool(result.found[0])
    assert float(result.norm[0]) <= eps * (1 + 1e-9)
    adversarial = start + result.perturbation[0]
    assert adversarial.min() >= 0 and adversarial.max() <= 1  # in the pixel box
    assert int(model(adversarial[None]).argmax()) == int(result.adversarial_class[0]) != label


def test_nothing_is_found_where_nothing_exists(trained):
    model, x, y = trained
    model = copy.deepcopy(model).double()
    result = pgd_attack(model, x[:8].double(), y[:8], 1e-6, steps=10, restarts=1)
    correct = model(x[:8].double()).argmax(dim=1) == y[:8]
    assert not result.found[correct].any()
    assert torch.equal(result.adversarial_class[~result.found],
                       torch.full_like(result.adversarial_class[~result.found], -1))


def test_restarts_run_side_by_side_and_the_first_to_find_wins(trained):
    """Restarts are batched, not sequential, yet each image keeps what the first restart that
    found a perturbation found: where the clean start (restart 0) succeeds, three restarts
    return exactly its perturbation; more restarts find a superset; every perturbation lies in
    the ball and the box and changes the prediction."""
    model, x, y = trained
    model = copy.deepcopy(model).double()
    x = x[:32].double()
    y = model(x).argmax(dim=1)  # the prediction as the label: a budget that half breaks
    eps = torch.linspace(1.0, 10.0, len(x), dtype=torch.float64)
    one = pgd_attack(model, x, y, eps, steps=8, restarts=1)
    three = pgd_attack(model, x, y, eps, steps=8, restarts=3)
    assert one.found.any() and not one.found.all()
    assert (three.found >= one.found).all() and (three.found > one.found).any()
    assert torch.equal(three.perturbation[one.found], one.perturbation[one.found])
    assert (three.norm <= eps * (1 + 1e-9)).all()
    adversarial = x + three.perturbation
    assert adversarial.min() >= 0 and adversarial.max() <= 1
    assert torch.equal(model(adversarial).argmax(dim=1)[three.found],
                       three.adversarial_class[three.found])
    assert (three.adversarial_class[three.found] != y[three.found]).all()


def test_the_attack_runs_on_the_runs_device(trained, monkeypatch):
    """The attack's float64 copy lives on the device the run certifies on (a GPU run attacks on
    the GPU, not on the host's cores): here an explicit CPU device object stands in for the
    resolved device, and every float64 copy the run makes is made there."""
    import lofast
    from lofast import runtime
    from lofast.config import AttackSettings
    from lofast.data import ImageDataset
    from lofast.models.vit import LipschitzViT

    model, x, y = trained
    run_device = torch.device("cpu", 0)
    monkeypatch.setattr(runtime, "resolve_device", lambda name: run_device)
    copies = []
    original = LipschitzViT.frozen
    monkeypatch.setattr(LipschitzViT, "frozen",
                        lambda self, device, dtype=torch.float64:
                        copies.append(device) or original(self, device, dtype))
    pixels = (x[:4] * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    data = ImageDataset(images=np.ascontiguousarray(pixels), labels=y[:4].numpy(),
                        classes=("a", "b", "c", "d"), name="folder")
    lofast.certify(model, data, eps=[0.05], attack=AttackSettings(steps=3, restarts=1))
    # every copy of the run (the certifier's, the attack's and its search twin) on the run's device
    assert len(copies) >= 3 and all(isinstance(d, torch.device) and d == run_device
                                    for d in copies), copies


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs a GPU"))])
def test_both_attacks_take_host_labels_of_any_integer_type(trained, device):
    """Labels built on the host (as the pipeline's from its records) and of a narrower integer
    type than int64 attack images on the run's device alike, with the same verdicts as int64
    labels beside them (a GPU run of `certify --attack` once failed on the host labels)."""
    from lofast.certification.attack import minimum_norm_attack

    model, x, y = trained
    model = copy.deepcopy(model).double().to(device)
    images = x[:6].double().to(device)
    narrow = y[:6].to(torch.int32)  # on the host
    reference = y[:6].to(device)
    for attack in (lambda labels: pgd_attack(model, images, labels, 0.5, steps=5, restarts=1),
                   lambda labels: minimum_norm_attack(model, images, labels, steps=5)):
        got, expected = attack(narrow), attack(reference)
        assert torch.equal(got.found, expected.found)
        assert torch.equal(got.adversarial_class, expected.adversarial_class)

def test_attack_takes_the_exact_caps_once(trained, monkeypatch):
    """A ViT under attack computes its exact caps (an SVD each) once for the whole attack, not
    in each of its forward passes, and nothing stays held afterwards."""
    from lofast.models import layers

    model, x, y = trained
    model = copy.deepcopy(model).double()
    capped = sum(len(s.capped_weights()) for s in model.stages if hasattr(s, "capped_weights"))
    exact_norms = []
    original = layers.spectral_norm
    monkeypatch.setattr(layers, "spectral_norm", lambda w, exact=False: (
        exact_norms.append(exact), original(w, exact))[1])
    pgd_attack(model, x[:4].double(), y[:4], 0.5, steps=6, restarts=2)
    assert exact_norms.count(True) == capped > 0
    assert all(getattr(s, "held", None) is None for s in model.stages)


def certify(checkpoint, data_dir, out, *extra):
    result = CliRunner().invoke(cli, [
        "certify", "--checkpoint", str(checkpoint), "--data", str(data_dir), "--device", "cpu",
        "--eps", "0.02", "--eps", "0.5", "--n", "16", "--json", "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_attack_gives_three_verdicts(checkpoint, data_dir, tmp_path):
    saved = tmp_path / "adversarial"
    summary = certify(checkpoint, data_dir, tmp_path / "r.jsonl", "--attack", "--attack-steps",
                      "20", "--attack-restarts", "1", "--save-adversarial", str(saved))
    records = record_lines(tmp_path / "r.jsonl")
    model = load_checkpoint(checkpoint).double()
    for key in ("0.02", "0.5"):
        certified = summary["certified_accuracy"][key]
        assert certified + summary["falsified"][key] + summary["unknown"][key] == \
            pytest.approx(1.0)
        for r in records:
            assert not (r["verdicts"][key] and r["falsified"][key])
            if r["prediction"] != r["label"]:  # its own counterexample
                assert r["falsified"][key] and r["counterexamples"][key]["norm"] == 0
            if r["falsified"][key]:
                found = r["counterexamples"][key]
                assert found["norm"] <= float(key)
                with np.load(found["file"]) as npz:
                    image = torch.from_numpy(npz["image"])[None]
                assert int(model(image).argmax()) == found["class"] != r["label"]
    assert summary["falsified"]["0.5"] >= summary["falsified"]["0.02"] > 0
    assert len(list(saved.glob("*.npz"))) == sum(len(r["counterexamples"]) for r in records)
    # how far each certificate is from the nearest counterexample found
    for r in records:
        adversarial = r["adversarial_radius"]
        assert adversarial is not None  # the untrained tiny model: every sample breaks
        assert (adversarial == 0) == (r["prediction"] != r["label"])
        certified_to = max([r["radius"]] + [float(k) for k, v in r["verdicts"].items() if v])
        assert adversarial > certified_to or adversarial == certified_to == 0
        for key in ("0.02", "0.5"):  # falsified exactly where a counterexample lies within eps
            assert r["falsified"][key] == (adversarial <= float(key))
    for key, share in summary["not_falsified"].items():
        assert share == pytest.approx(1 - summary["falsified"][key])


def test_tightness_of_the_certificates_is_reported(trained, tmp_path):
    """With an attack, the API's summary and ``lofast report`` give the median certified /
    adversarial radius over the correctly classified samples (in (0, 1]: no certificate
    reaches past a counterexample) and the not-falsified share beside the certified one."""
    import lofast
    from lofast.config import AttackSettings
    from lofast.data import ImageDataset

    model, x, y = trained
    pixels = (x[:12] * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    data = ImageDataset(images=np.ascontiguousarray(pixels), labels=y[:12].numpy(),
                        classes=("a", "b", "c", "d"), name="folder")
    out = tmp_path / "run.jsonl"
    run = lofast.certify(model, data, eps=[0.05, 1.0], attack=AttackSettings(steps=30,
                         restarts=1), out=out, device="cpu")
    summary = run.summary
    ratios = [r.certified_radius / r.adversarial_radius for r in run.records
              if r.prediction == r.label]
    assert len(ratios) >= 8 and all(0 < q < 1 for q in ratios)
    assert summary.median_radius_ratio == pytest.approx(float(np.median(ratios)))
    for e in (0.05, 1.0):
        assert (summary.certified_accuracy[e] <= summary.not_falsified[e]
                == pytest.approx(1 - summary.falsified[e]))
    shown = json.loads(CliRunner().invoke(cli, ["report", str(out), "--json"]).stdout)[str(out)]
    assert shown["median_radius_ratio"] == summary.median_radius_ratio
    assert shown["median_adversarial_radius"] == summary.median_adversarial_radius


def test_minimum_norm_attack_finds_a_planted_counterexample(trained):
    """Images just before the decision boundary on the segment towards an image of another
    class: the attack's adversarial radius is at most the planted distance (it may find a
    nearer one), its counterexample changes the prediction in float64 and lies in the box."""
    from lofast.certification.attack import minimum_norm_attack

    model, x, y = trained
    model = copy.deepcopy(model).double()
    x = x.double()
    predicted = model(x).argmax(dim=1)
    starts, distances, labels = [], [], []
    for a in torch.nonzero(predicted == y)[:6, 0].tolist():
        b = int(torch.nonzero(predicted != predicted[a])[0])
        low, high = 0.0, 1.0
        for _ in range(40):
            mid = (low + high) / 2
            same = model((x[a] + mid * (x[b] - x[a]))[None]).argmax() == predicted[a]
            low, high = (mid, high) if same else (low, mid)
        start = x[a] + (low - 0.02) * (x[b] - x[a])  # 2 % of the segment before the boundary
        starts.append(start)
        distances.append(float((x[a] + high * (x[b] - x[a]) - start).norm()))
        labels.append(int(predicted[a]))
    result = minimum_norm_attack(model, torch.stack(starts), torch.tensor(labels), steps=30)
    assert result.found.all()
    assert (result.norm <= torch.tensor(distances, dtype=torch.float64) * (1 + 1e-6)).all()
    adversarial = torch.stack(starts) + result.perturbation
    assert adversarial.min() >= 0 and adversarial.max() <= 1
    assert (model(adversarial).argmax(dim=1) == result.adversarial_class).all()
    assert (result.adversarial_class != torch.tensor(labels)).all()
    assert torch.allclose(result.norm, result.perturbation.flatten(1).norm(dim=1))


def test_a_certificate_beyond_a_counterexample_stops_the_run(trained):
    """The attack's end-to-end check: a record claiming a radius beyond a counterexample the
    attack finds is reported as unsound, not written."""
    from lofast.certification.certificate import Certifier
    from lofast.certification.pipeline import _batch_records
    from lofast.config import AttackSettings
    from lofast.errors import CertificationError

    model, x, y = trained
    records, _ = _batch_records(Certifier(model), x[:4], y[:4], range(4), [0.05], {})
    certified = next(r for r in records if r.radius > 0)
    certified.radius *= 100  # a certificate no sound bound gives
    with pytest.raises(CertificationError, match="unsound"):
        run_attack(model.frozen("cpu"), model.frozen("cpu", torch.float32), x[:4], records, [0.05],
                   AttackSettings(steps=20, restarts=1))


def test_save_adversarial_needs_attack(checkpoint, data_dir, tmp_path):
    result = CliRunner().invoke(cli, ["certify", "--checkpoint", str(checkpoint), "--data",
                                      str(data_dir), "--eps", "0.1", "--save-adversarial",
                                      str(tmp_path / "a")])
    assert result.exit_code == 1 and "--attack" in result.output


def test_report_summarises_compares_and_plots_saved_runs(checkpoint, data_dir, tmp_path):
    lofast_run = certify(checkpoint, data_dir, tmp_path / "lofast.jsonl", "--attack",
                         "--attack-steps", "10", "--attack-restarts", "1")
    naive_run = certify(checkpoint, data_dir, tmp_path / "naive.jsonl", "--bound", "naive")
    runner = CliRunner()
    plot = tmp_path / "curve.png"
    shown = runner.invoke(cli, ["report", str(tmp_path / "lofast.jsonl"),
                                str(tmp_path / "naive.jsonl"), "--plot", str(plot)])
    assert shown.exit_code == 0, shown.output
    assert "lofast.jsonl" in shown.output and "naive.jsonl" in shown.output
    assert "not falsified @" in shown.output
    with Image.open(plot) as image:
        image.verify()
    with Image.open(plot) as image:
        assert image.format == "PNG" and image.size == (800, 500)
        assert len(set(np.asarray(image.convert("L")).ravel().tolist())) > 10  # not blank
    as_json = json.loads(runner.invoke(cli, ["report", str(tmp_path / "lofast.jsonl"),
                                             str(tmp_path / "naive.jsonl"), "--json"]).stdout)
    saved = as_json[str(tmp_path / "lofast.jsonl")]
    for key in ("clean_accuracy", "certified_accuracy", "falsified", "unknown", "mean_radius"):
        assert saved[key] == lofast_run[key]
    assert as_json[str(tmp_path / "naive.jsonl")]["certified_accuracy"] == \
        naive_run["certified_accuracy"]


@pytest.mark.parametrize("text, eps, percent", [
    ("36/255=42", 36 / 255, 42), ("clean=50%", None, 50), (" 0.05 = 48.5 ", 0.05, 48.5),
    ("CLEAN=0", None, 0), ("0.1=100", 0.1, 100)])
def test_a_requirement_reads_eps_and_an_exact_percentage(text, eps, percent):
    from fractions import Fraction

    from lofast.config import parse_requirement

    requirement = parse_requirement(text)
    assert requirement.eps == eps and requirement.percent == Fraction(str(percent))


@pytest.mark.parametrize("text, named", [
    ("0.05", "not EPS=PERCENT"), ("=42", "not EPS=PERCENT"), ("0.05=", "not EPS=PERCENT"),
    ("0.05=101", "0 .. 100"), ("0.05=-1", "0 .. 100"), ("0.05=nan", "0 .. 100"),
    ("0.05=inf", "0 .. 100"), ("-0.05=10", "positive"), ("0=10", "positive"),
    ("clean=abc", "not a percentage"), ("0.05=4=5", "not a percentage")])
def test_a_bad_requirement_is_refused(text, named):
    from lofast.config import parse_requirement
    from lofast.errors import ConfigError

    with pytest.raises(ConfigError, match=named):
        parse_requirement(text)


def test_requirements_compare_counts_of_samples_exactly():
    """42.3 % of 1,000 samples needs 423 of them, and 29 % of 100 is met by 29 (0.29 * 100 is
    28.999999999999996 in floating point: a comparison of floats fails it); a third of three
    samples meets 33.33 % and misses 33.34 %; a run of no samples meets nothing."""
    from lofast.certification.report import Summary
    from lofast.config import parse_requirement
    from lofast.errors import ConfigError

    def summary(samples, certified, clean):
        return Summary(samples=samples, clean_accuracy=clean, certified_accuracy={0.05: certified},
                       certified_by={}, median_radius=0.0, mean_radius=0.0,
                       mean_ms_per_sample=0.0, total_seconds=0.0, guarantee="exact",
                       bound="lofast", kappa=0.5, device="cpu")

    def unmet(run, *texts):
        lines = run.unmet([parse_requirement(t) for t in texts])
        assert run.unmet(texts) == lines  # the texts themselves, as the Python API takes them
        return lines

    run = summary(1000, 423 / 1000, 500 / 1000)
    assert unmet(run, "0.05=42.3", "clean=50", "0.05=0") == []
    assert unmet(run, "0.05=42.31", "clean=50.1") == [
        "requirement 0.05=42.31 not met: certified accuracy 42.30 % (423 of 1000 samples)",
        "requirement clean=50.1 not met: clean accuracy 50.00 % (500 of 1000 samples)"]
    assert unmet(summary(100, 29 / 100, 57 / 100), "0.05=29", "clean=57") == []
    third = summary(3, 1 / 3, 1 / 3)
    assert unmet(third, "0.05=33.33") == [] and len(unmet(third, "0.05=33.34")) == 1
    empty = summary(0, float("nan"), float("nan"))
    assert len(unmet(empty, "0.05=0", "clean=0")) == 2
    with pytest.raises(ConfigError, match="certifies at eps 0.05, not 0.1"):
        unmet(run, "0.1=10")
    for bad in ("0.05=200", "-0.05=10", "0.05"):  # the Python API's texts, refused as the CLI's
        with pytest.raises(ConfigError):
            run.unmet([bad])


def test_require_sets_the_exit_code_of_certify_and_report(checkpoint, data_dir, tmp_path):
    """A run at its own certified share exits 0; one sample more is exit code 3 with one line
    per requirement missed, the summary and every record still written; a requirement at an eps
    the run does not certify is refused before any work; report applies them to saved runs."""
    runner = CliRunner()
    out = tmp_path / "r.jsonl"
    summary = certify(checkpoint, data_dir, out)
    certified = round(summary["certified_accuracy"]["0.02"] * 16)
    assert certified < 16
    met, missed = f"0.02={100 * certified / 16}", f"0.02={100 * (certified + 1) / 16}"
    base = ["certify", "--checkpoint", str(checkpoint), "--data", str(data_dir), "--device",
            "cpu", "--eps", "0.02", "--eps", "0.5", "--n", "16", "--json"]
    passed = runner.invoke(cli, base + ["--require", met, "--require", "clean=0"])
    assert passed.exit_code == 0, passed.output
    failed_out = tmp_path / "failed.jsonl"
    failed = runner.invoke(cli, base + ["--require", missed, "--out", str(failed_out)])
    assert failed.exit_code == 3
    assert json.loads(failed.stdout)["certified_accuracy"] == summary["certified_accuracy"]
    assert failed.stderr.strip() == (f"requirement {missed} not met: certified accuracy "
                                     f"{100 * certified / 16:.2f} % ({certified} of 16 samples)")
    assert len(record_lines(failed_out)) == 16
    elsewhere = tmp_path / "elsewhere.jsonl"
    refused = runner.invoke(cli, base + ["--require", "0.1=10", "--out", str(elsewhere)])
    assert refused.exit_code == 1 and "certifies at eps 0.02, 0.5, not 0.1" in refused.output
    assert not elsewhere.exists()
    assert runner.invoke(cli, ["report", str(out), "--require", met]).exit_code == 0
    both = runner.invoke(cli, ["report", str(out), str(failed_out), "--require", missed])
    assert both.exit_code == 3
    assert [line.split(":")[0] for line in both.stderr.splitlines()] == ["r.jsonl", "failed.jsonl"]
    parts = [tmp_path / f"part{i}.jsonl" for i in range(2)]
    for i, part in enumerate(parts):
        assert runner.invoke(cli, base + ["--shard", f"{i}/2", "--out", str(part)]).exit_code == 0
    merge = ["report", "--merge", *map(str, parts), "--require"]
    assert runner.invoke(cli, merge + [met]).exit_code == 0
    merged = runner.invoke(cli, merge + [missed])
    assert merged.exit_code == 3 and merged.stderr.startswith(f"requirement {missed} not met")


def test_report_refuses_a_foreign_file(tmp_path):
    notes = tmp_path / "notes.jsonl"
    notes.write_text("hello\n")
    result = CliRunner().invoke(cli, ["report", str(notes)])
    assert result.exit_code == 1 and "not a lofast record" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("change, named", [
    ({"prediction": 3}, "margin's sign"),  # another class predicted with a positive margin
    ({"margin": 0.0}, "not classified correctly"),  # a tie is never certified
    ({"margin": -0.01}, "margin's sign"),  # the label wins with a negative margin
    ({"prediction": 3, "margin": -0.01, "radius": 0.0, "verdicts": {"0.05": False},
      "verifiers": {"0.05": None}, "certified_radius": 0.0}, None),  # a misclassified sample
    ({"prediction": 3, "margin": -0.01, "radius": 0.0, "verdicts": {"0.05": True},
      "verifiers": {"0.05": "crown"}, "certified_radius": 0.05}, "not classified correctly"),
    ({"falsified": {"0.05": True}}, "counterexample within"),  # certified and broken at 0.05
    ({"radius": 0.04, "verdicts": {"0.05": False}, "verifiers": {"0.05": None},
      "certified_radius": 0.04, "falsified": {"0.05": True}}, None),  # broken beyond 0.04
    ({"prediction": -1}, "not a lofast record"),
])
def test_report_refuses_a_record_that_contradicts_itself(tmp_path, change, named):
    """A record file is read back by `lofast report` (and its --require gate) and by --resume:
    one that certifies a sample it calls misclassified, or holds a counterexample inside its
    certified radius, would be counted as it stands, so it is refused in one line naming the
    contradiction; the consistent variants read."""
    from lofast.certification.records import EpsResult, SampleRecord, header_line

    record = SampleRecord(index=0, label=1, prediction=1, margin=0.2, radius=0.08,
                          results={0.05: EpsResult(certified=True, verifier="lofast", bound=0.01)})
    line = {**json.loads(record.to_json())}
    for key, value in change.items():
        line[key] = {**line[key], **value} if isinstance(value, dict) and key in line else value
    path = tmp_path / "run.jsonl"
    path.write_text(header_line([0.05], {}) + json.dumps(line) + "\n")
    result = CliRunner().invoke(cli, ["report", str(path)])
    if named is None:
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 1 and f"{path}:2: not a lofast record" in result.output
    assert named in result.output and "Traceback" not in result.output


def test_large_attacks_run_in_parts(trained, monkeypatch):
    """restarts x samples above MAX_ATTACK_IMAGES is attacked in parts of that size: the same
    shapes, every perturbation in the ball and the box, found ones checked; memory no longer
    grows with --attack-restarts x --batch-size."""
    from lofast.certification import attack

    model, x, y = trained
    model = copy.deepcopy(model).double()
    x = x[:12].double()
    y = model(x).argmax(dim=1)
    eps = torch.linspace(1.0, 10.0, 12, dtype=torch.float64)
    monkeypatch.setattr(attack, "MAX_ATTACK_IMAGES", 6)  # parts of two samples x 3 restarts
    result = pgd_attack(model, x, y, eps, steps=8, restarts=3)
    assert result.perturbation.shape == x.shape and result.found.any()
    assert (result.norm <= eps * (1 + 1e-9)).all()
    adversarial = x + result.perturbation
    assert adversarial.min() >= 0 and adversarial.max() <= 1
    assert (model(adversarial).argmax(dim=1)[result.found] != y[result.found]).all()
    nearest = attack.minimum_norm_attack(model, x, y, steps=10)
    assert nearest.norm.shape == (12,) and nearest.found.all()


def test_a_float32_search_finds_what_float64_finds_and_is_checked_in_float64(trained):
    """The attacks' float32 search twin (``run_attack``'s): every counterexample it keeps
    changes the float64 model's prediction, lies in the box and, for PGD, within eps in float64
    (no tolerance); it finds the same samples as the float64 search, the minimum-norm radii
    within 2 % of each other, and where it costs no robustness, the minimum-norm radius is where
    the float64 model's prediction changes on the ray (refined in float64)."""
    from lofast.certification.attack import minimum_norm_attack

    model, x, y = trained
    exact, search = model.frozen("cpu"), model.frozen("cpu", torch.float32)
    x, y = x[:16].double(), y[:16]
    near_fast = minimum_norm_attack(exact, x, y, steps=30, search=search)
    near_slow = minimum_norm_attack(exact, x, y, steps=30)
    assert torch.equal(near_fast.found, near_slow.found) and near_fast.found.any()
    both = near_fast.found & (near_slow.norm > 0)
    assert torch.allclose(near_fast.norm[both], near_slow.norm[both], rtol=0.02)
    at = x + near_fast.perturbation
    assert at.min() >= 0 and at.max() <= 1
    assert (exact(at).argmax(dim=1)[near_fast.found] != y[near_fast.found]).all()

    eps = float(near_slow.norm[both].median())  # about half the samples within reach
    fast = pgd_attack(exact, x, y, eps, steps=20, restarts=2, search=search)
    slow = pgd_attack(exact, x, y, eps, steps=20, restarts=2)
    assert fast.perturbation.dtype == torch.float64 and fast.found.any()
    assert torch.equal(fast.found, slow.found)
    assert (fast.norm <= eps).all()
    adversarial = x + fast.perturbation
    assert adversarial.min() >= 0 and adversarial.max() <= 1
    predicted = exact(adversarial).argmax(dim=1)
    assert (predicted[fast.found] != y[fast.found]).all()
    assert torch.equal(predicted[fast.found], fast.adversarial_class[fast.found])
    # one step of 2.5 eps outside the box: every perturbation on the float32 ball's surface,
    # some a rounding outside eps in float64 until brought back into the ball there
    edge = pgd_attack(exact, x, y, eps, steps=1, restarts=1, search=search, box=False)
    assert edge.found.any() and (edge.norm <= eps).all()


def test_a_search_twin_that_lies_finds_nothing_the_model_does_not_do(trained):
    """A search twin that misclassifies everything (a logit offset the model does not have)
    reports a counterexample at every image; the check on the model keeps none of them for the
    images the model classifies correctly."""
    from lofast.certification.attack import minimum_norm_attack

    model, x, y = trained
    exact = model.frozen("cpu")
    x = x[:8].double()
    correct = exact(x).argmax(dim=1) == y[:8]
    assert correct.any()

    class Liar(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.twin = model.frozen("cpu", torch.float32)

        def forward(self, images):
            logits = self.twin(images)
            offset = torch.zeros_like(logits)
            offset[:, 0] = offset[:, 1] = 1e3  # class 0 or 1 always wins: never both labels
            return logits + offset * torch.arange(1, logits.shape[1] + 1)

    liar = Liar()
    for result in (pgd_attack(exact, x, y[:8], 1e-6, steps=3, restarts=1, search=liar),
                   minimum_norm_attack(exact, x, y[:8], steps=3, search=liar)):
        assert not result.found[correct].any()
        assert (result.adversarial_class[correct] == -1).all()


@pytest.fixture(scope="module")
def baseline_runs(trained, tmp_path_factory):
    """Saved runs of the trained tiny model on 48 of its test images at eps 0.8 and 1.1 (its radii lie at 0.9-1.3): the
    baseline (LoFAST's bound), a run with the naive bound (certifies less), and a run with the
    naive bound on the first 40 of those images only."""
    import lofast
    from lofast.certification.certificate import CertifySettings
    from lofast.data import ImageDataset

    model, x, y = trained
    pixels = (x[:48] * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    data = ImageDataset(images=np.ascontiguousarray(pixels), labels=y[:48].numpy(),
                        classes=("a", "b", "c", "d"), name="folder")
    folder = tmp_path_factory.mktemp("baseline")
    paths = {name: folder / f"{name}.jsonl" for name in ("baseline", "naive", "fewer")}
    for name, n, bound in (("baseline", 48, "lofast"), ("naive", 48, "naive"),
                           ("fewer", 40, "naive")):
        lofast.certify(model, data, eps=[0.8, 1.1], n=n, device="cpu",
                       settings=CertifySettings(bound=bound), out=paths[name])
    return paths


def test_a_run_is_compared_with_its_baseline_sample_by_sample(baseline_runs):
    """report --baseline: accuracy of each run on the samples both hold, the change in points
    and the samples each eps lost and gained, by index, as the records say; --max-drop passes at
    the drop itself and fails one sample below it (exit code 3, one line), on exact counts."""
    from fractions import Fraction

    base = {r["index"]: r for r in record_lines(baseline_runs["baseline"])}
    runner = CliRunner()
    for name in ("naive", "fewer"):
        ours = {r["index"]: r for r in record_lines(baseline_runs[name])}
        common = sorted(ours.keys() & base.keys())
        result = runner.invoke(cli, ["report", str(baseline_runs[name]), "--json", "--baseline",
                                     str(baseline_runs["baseline"])])
        assert result.exit_code == 0, result.output
        shown = json.loads(result.stdout)
        assert list(shown["runs"]) == [str(baseline_runs[name])]
        compared = shown["against_baseline"][str(baseline_runs[name])]
        assert compared["samples"] == len(common) and compared["run_only"] == 0
        assert compared["baseline_only"] == 48 - len(common)
        for key in ("0.8", "1.1"):
            lost = [i for i in common if base[i]["verdicts"][key] and not ours[i]["verdicts"][key]]
            gained = [i for i in common if ours[i]["verdicts"][key] and not base[i]["verdicts"][key]]
            assert compared["lost"][key] == lost and compared["gained"][key] == gained
            counts = [sum(side[i]["verdicts"][key] for i in common) for side in (base, ours)]
            assert compared["certified"][key] == counts
            assert compared["change_points"][key] == pytest.approx(
                100 * (counts[1] - counts[0]) / len(common))
    naive = json.loads(runner.invoke(cli, ["report", str(baseline_runs["naive"]), "--json",
                                           "--baseline", str(baseline_runs["baseline"])]
                                     ).stdout)["against_baseline"][str(baseline_runs["naive"])]
    lost = len(naive["lost"]["0.8"]) - len(naive["gained"]["0.8"])
    assert lost > 0  # the naive bound certifies less: the comparison has something to show
    drop = Fraction(100 * lost, 48)
    command = ["report", str(baseline_runs["naive"]), "--baseline", str(baseline_runs["baseline"])]
    table = runner.invoke(cli, command)
    assert table.exit_code == 0 and "against the baseline baseline.jsonl" in table.output
    assert "certified @ eps=0.8" in table.output and "samples lost / gained" in table.output
    assert runner.invoke(cli, command + ["--max-drop", f"0.8={float(drop) + 1e-9}",
                                         "--max-drop", "clean=0"]).exit_code == 0
    short = float(Fraction(100 * (lost - 1), 48)) + 0.01  # one sample short of the drop
    failed = runner.invoke(cli, command + ["--max-drop", f"0.8={short:.4f}"])
    assert failed.exit_code == 3, failed.output
    assert failed.stderr.strip().startswith(f"allowed drop 0.8={short:.4f} exceeded: certified "
                                            f"accuracy fell by {float(drop):.2f} points")


def test_allowed_drops_compare_counts_exactly():
    """A third of three samples lost is 33.33... points: an allowance of 33.33 is exceeded and
    one of 33.34 is not; gaining never exceeds an allowance; the clean accuracy has its own."""
    from lofast.certification.report import Comparison
    from lofast.errors import ConfigError

    def compared(baseline, run, clean=(3, 3)):
        return Comparison(samples=3, run_only=0, baseline_only=0, eps=[0.05], clean=clean,
                          certified={0.05: (baseline, run)}, lost={0.05: []},
                          gained={0.05: []}, median_radius=(0.0, 0.0))

    assert compared(3, 2).exceeded(["0.05=33.34"]) == []
    assert len(compared(3, 2).exceeded(["0.05=33.33"])) == 1
    assert compared(1, 3).exceeded(["0.05=0"]) == []
    assert len(compared(3, 3, clean=(3, 2)).exceeded(["clean=0", "0.05=0"])) == 1
    with pytest.raises(ConfigError, match="both certify at eps 0.05, not 0.1"):
        compared(3, 3).exceeded(["0.1=1"])
    unfinished = Comparison(**{**compared(3, 3).__dict__, "finished": (True, False)})
    assert unfinished.exceeded(["0.05=0"])[0].startswith("the run did not finish")
    for bad, named in (("0.05", "not EPS=POINTS"), ("0.05=101", "0 .. 100"),
                       ("0.05=-1", "0 .. 100"), ("clean=x", "not a number of points")):
        with pytest.raises(ConfigError, match=named):
            compared(3, 3).exceeded([bad])


def test_a_baseline_of_other_samples_is_refused_in_one_line(baseline_runs, checkpoint,
                                                            data_dir, tmp_path):
    """Another data set (its indices name other images), no sample in common, an eps the two do
    not share: one line and exit code 1; --max-drop without --baseline: a usage error."""
    runner = CliRunner()
    other = tmp_path / "other.jsonl"
    certify(checkpoint, data_dir, other)
    naive, base = str(baseline_runs["naive"]), str(baseline_runs["baseline"])
    for command, named in (
            ([str(other), "--baseline", base], "certified on other data"),
            ([naive, "--baseline", base, "--max-drop", "0.5=1"], "both certify at eps 0.8, 1.1"),
    ):
        result = runner.invoke(cli, ["report", *command])
        assert result.exit_code == 1 and named in result.output, result.output
        assert "Traceback" not in result.output and len(result.output.splitlines()) == 1
    parts = [tmp_path / f"part{i}.jsonl" for i in range(2)]
    for i, part in enumerate(parts):
        certify(checkpoint, data_dir, part, "--shard", f"{i}/2")
    result = runner.invoke(cli, ["report", str(parts[0]), "--baseline", str(parts[1])])
    assert result.exit_code == 1 and "no sample in common" in result.output
    result = runner.invoke(cli, ["report", naive, "--max-drop", "0.8=1"])
    assert result.exit_code == 2 and "--max-drop needs --baseline" in result.output
