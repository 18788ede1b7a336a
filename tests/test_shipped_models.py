"""The shipped checkpoints: the regression guard, the registry's tables, the API's records
against the CLI's and the record schemas. The regression guard certifies each model once (a
module fixture), as its once-per-model proofs take seconds (6 s for the default on one thread);
a Certifier owns its proofs, so every other test here that certifies a shipped model pays them
again, and those use the smallest model. (The README's Python example, on the default, runs in
test_api.py, on the other worker of `pytest -n 2`.)

Regression guard: for each model in checkpoints/registry.json, clean accuracy must match
exactly on its fixed subset, no certified accuracy may drop, and where an
``attention_ablation_drop`` is recorded (a checkpoint whose attention does work), replacing
every block's attention by its mean over the subset must still cost at least that many points
of clean accuracy, so that an accidental attention collapse fails CI. An
intentional change (a new checkpoint, a tighter bound) updates the registry's ``reference`` in
the same commit, with the reason in the message. The README's and the model card's tables are
the registry's ``figures`` (``lofast.model_card``).
"""

import json
import re
from dataclasses import asdict

import pytest
import torch
from click.testing import CliRunner

import lofast
from lofast.certification.attention_report import attention_report
from lofast.certification.certificate import Certifier, CertifySettings
from lofast.certification.records import read_run
from lofast.checkpoint import SHIPPED_DIR, load_checkpoint, read_registry, shipped_path
from lofast.cli.main import cli
from lofast.data.sample import class_balanced_order, load_bundled_sample

REGISTRY = read_registry()
REFERENCE = REGISTRY["reference_subset"]
# the test matrix: every registered model (checkpoints/registry.json)
CHECKPOINTS = lofast.list_models()



@pytest.fixture(scope="module")
def subset():
    data = load_bundled_sample()
    return data.subset(class_balanced_order(data.labels)[: REFERENCE["samples"]]).to_tensors()


@pytest.fixture(scope="module", params=CHECKPOINTS)
def case(request, subset):
    """(checkpoint name, its reference figures, the model, its certificate on the subset)."""
    name = request.param
    torch.manual_seed(0)
    model = load_checkpoint(shipped_path(name))
    settings = CertifySettings(bound=REFERENCE["bound"], kappa=REFERENCE["kappa"],
                               guarantee=REFERENCE["guarantee"])
    x, y = subset
    return name, REGISTRY["models"][name]["reference"], model, Certifier(model,
                                                                         settings).certify(x, y)


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
    assert CHECKPOINTS
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for name in CHECKPOINTS:
        entry = REGISTRY["models"][name]
        assert {"figures", "reference"} <= set(entry), f"{name}: figures and reference each"
        assert f"`{entry['file']}`" in card, f"{name} is not described in checkpoints/README.md"
        with torch.no_grad():
            assert torch.isfinite(load_checkpoint(shipped_path(name))(x)).all(), name


def test_the_tables_of_readme_and_model_card_are_the_registry_figures(tmp_path):
    """The README's and the model card's tables are generated (``python -m lofast.model_card``);
    one edited by hand, or a registry changed without them, fails."""
    from lofast import model_card

    assert model_card.stale_files() == []
    for relative in model_card.TABLES:  # a hand edit of a figure is caught
        copy = tmp_path / relative
        copy.parent.mkdir(parents=True, exist_ok=True)
        text = (model_card.REPOSITORY / relative).read_text()
        figure = re.search(r"\| \**(\d+\.\d\d) %", text)  # the first accuracy of a table
        copy.write_text(text.replace(figure[0], figure[0].replace(figure[1], "99.99"), 1))
    assert model_card.stale_files(tmp_path) == list(model_card.TABLES)


def test_the_table_writer_outside_a_checkout_is_one_clear_error(tmp_path, monkeypatch, capsys):
    from lofast import model_card

    monkeypatch.setattr(model_card, "REPOSITORY", tmp_path)  # as in an installed wheel
    assert model_card.main(["--check"]) == 2
    assert "not a lofast checkout" in capsys.readouterr().err


def test_api_gives_the_cli_records(one_thread, tmp_path):
    """lofast.certify with no settings but the model is `lofast certify` with no options but
    --checkpoint, sample by sample (the smallest shipped model: each call proves its
    once-per-model bounds afresh)."""
    out = tmp_path / "run.jsonl"
    result = CliRunner().invoke(cli, ["certify", "--checkpoint", "paper-d3-margin", "--eps",
                                      "0.05", "--eps", "36/255", "--n", "6", "--out", str(out),
                                      "--json"])
    assert result.exit_code == 0, result.output
    cli_records = [asdict(r) for r in read_run(out)]
    run = lofast.certify("paper-d3-margin", eps=[36 / 255, 0.05], n=6)
    assert len(run.records) == len(cli_records) == 6
    for mine, theirs in zip(run.records, cli_records):
        mine = asdict(mine)
        for key in ("seconds",):
            mine.pop(key), theirs.pop(key)
        assert mine == theirs
    summary = json.loads(result.stdout)
    assert run.summary.to_dict()["certified_accuracy"] == summary["certified_accuracy"]
    assert run.summary.guarantee == summary["guarantee"]


def test_records_survive_a_schema_1_to_4_round_trip(one_thread, tmp_path):
    """A shipped model's records of 100 bundled images (the smallest model: each call proves
    its once-per-model bounds afresh; with an attack's and a fallback's fields on
    some), written as a schema-1 file (no header, run settings in every record), read, written
    as schema 4 and read again: identical field by field; report reads both alike (the new
    file marked finished, the old one without the mark)."""
    from lofast.certification.records import SCHEMA, write_records

    run = lofast.certify("paper-d3-margin", eps=[0.02, 0.05], n=100, device="cpu")
    for r in run.records[:10]:  # the fields of --attack and --fallback, as they are written
        r.adversarial_radius = 0.25
        r.update(0.02, falsified=False)
        r.update(0.05, falsified=False, fallback_seconds=1.5, fallback={
            "method": "crown", "verdict": "unknown", "bound": -0.1, "domains": None,
            "seconds": 1.5})
    old = tmp_path / "schema1.jsonl"
    old.write_text("".join(r.to_json(schema=1) + "\n" for r in run.records))
    first = read_run(old)
    new = tmp_path / "schema4.jsonl"
    write_records(new, first)
    assert json.loads(new.read_text().splitlines()[0])["schema"] == SCHEMA == 4
    second = read_run(new)
    assert [asdict(r) for r in second] == [asdict(r) for r in first] == [asdict(r) for r in
                                                                          run.records]
    shown = [json.loads(CliRunner().invoke(cli, ["report", str(p), "--json"]).stdout)[str(p)]
             for p in (old, new)]
    shown[0].pop("total_seconds"), shown[1].pop("total_seconds")
    assert (shown[0].pop("finished"), shown[1].pop("finished")) == (None, True)
    assert shown[0] == shown[1]
