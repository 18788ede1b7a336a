"""The public Python API: the README's example, the same results and defaults as the CLI."""

import json
import re
import subprocess
import sys
from dataclasses import asdict, fields
from pathlib import Path

import pytest
from click.testing import CliRunner

import lofast
from lofast.bounds.spectral import Guarantee, SpectralMethod
from lofast.certificate import Certifier, CertifySettings
from lofast.cli.certify_cmd import certify as certify_command
from lofast.cli.main import cli
from lofast.config import CERTIFY_DEFAULTS, GUARANTEES
from lofast.errors import CertificationError

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


def test_api_gives_the_cli_records(one_thread, tmp_path):
    """lofast.certify with no settings is `lofast certify` with no options, sample by sample."""
    out = tmp_path / "run.jsonl"
    result = CliRunner().invoke(cli, ["certify", "--eps", "0.05", "--eps", "36/255", "--n", "6",
                                      "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    cli_records = [json.loads(line) for line in out.read_text().splitlines()]
    run = lofast.certify(eps=[36 / 255, 0.05], n=6)
    assert len(run.records) == len(cli_records) == 6
    for mine, theirs in zip(run.records, cli_records):
        mine = asdict(mine)
        for key in ("seconds",):
            mine.pop(key), theirs.pop(key)
        assert mine == theirs
    summary = json.loads(result.stdout)
    assert run.summary.certified_accuracy == summary["certified_accuracy"]
    assert run.summary.guarantee == summary["guarantee"]


def test_api_takes_models_and_data_sets(one_thread, checkpoint, data_dir):
    model = lofast.load_model(checkpoint)
    data = lofast.load_data(data_dir, dataset="folder")
    from_paths = lofast.certify(checkpoint, data_dir, eps=0.1, n=4, dataset="folder")
    from_objects = lofast.certify(model, data, eps=0.1, n=4,
                                  settings=CertifySettings(guarantee="exact"))
    assert [r.radius for r in from_paths.records] == [r.radius for r in from_objects.records]
    assert from_paths.summary.samples == 4
    assert len(lofast.load_data()) == 500  # the bundled sample
