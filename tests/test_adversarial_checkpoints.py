"""Checkpoints that lie: every config value a file can state is refused with one clear error,
or, where it is a valid value, certified soundly (PGD breaks no certificate of the function
the file actually computes)."""

import dataclasses
import json
import math

import pytest
import torch
from click.testing import CliRunner
from helpers import train_tiny
from safetensors.torch import load_file, save_file

from lofast.certification.attack import pgd_l2
from lofast.certification.certificate import Certifier, CertifySettings
from lofast.checkpoint import FORMAT, load_checkpoint, save_checkpoint
from lofast.cli.main import cli
from lofast.errors import CertificationError, CheckpointError
from lofast.models.vit import LipschitzViT


@pytest.fixture(scope="module")
def trained():
    return train_tiny()


def rewrite(path, out, config_changes=None, tensors_changed=None):
    """A copy of checkpoint `path` at `out` whose stored model config has `config_changes`
    applied (values written as JSON, NaN and infinity included) and whose tensors pass through
    `tensors_changed`."""
    tensors = load_file(str(path))
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    config = json.loads(meta["model_config"])
    config.update(config_changes or {})
    meta["model_config"] = json.dumps(config)
    if tensors_changed is not None:
        tensors = tensors_changed(tensors)
    save_file(tensors, str(out), metadata=meta)
    return out


def negate_head(tensors):
    """The head's weight and bias negated: with final_radius = -1 (which flips every token)
    the network computes the same function as before."""
    head = max(int(k.split(".")[1]) for k in tensors)
    return {k: -v if k.startswith(f"stages.{head}.") else v for k, v in tensors.items()}


@pytest.fixture(scope="module")
def saved(trained, tmp_path_factory):
    model, _, _ = trained
    path = tmp_path_factory.mktemp("adv") / "honest.safetensors"
    save_checkpoint(path, model, {"dataset": "synthetic"})
    return path


REFUSED = {
    "negative final radius, head negated": ({"final_radius": -1.0}, negate_head),
    "zero attention radius": ({"attn_radius": 0.0}, None),
    "negative mlp radius": ({"mlp_radius": -0.5}, None),
    "NaN final radius": ({"final_radius": math.nan}, None),
    "infinite cap": ({"value_cap": math.inf}, None),
    "negative embedding cap": ({"embed_cap": -1.0}, None),
    "negative query-key cap": ({"query_key_cap": -1.0}, None),
    "string cap": ({"output_cap": "0.5"}, None),
    "zero heads": ({"heads": 0}, None),
    "zero patch size": ({"patch_size": 0}, None),
    "negative width": ({"width": -32}, None),
    "fractional depth": ({"depth": 1.5}, None),
    "boolean class count": ({"num_classes": True}, None),
    "unknown pooling": ({"pool": "max"}, None),
    "non-boolean position bias": ({"position_bias": "yes"}, None),
    "infinite input centre": ({"input_center": math.inf}, None),
    "a config of 100 GB": ({"width": 2**16, "heads": 2}, None),
    "integer weights": ({}, lambda t: {k: v.to(torch.int32) for k, v in t.items()}),
}


@pytest.mark.parametrize("case", REFUSED)
def test_lying_checkpoint_is_refused(case, saved, tmp_path):
    changes, tensors = REFUSED[case]
    path = rewrite(saved, tmp_path / "lie.safetensors", changes, tensors)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path)
    assert "\n" not in str(error.value)
    result = CliRunner().invoke(cli, ["certify", "--checkpoint", str(path), "--eps", "0.1",
                                      "--n", "2"])
    assert result.exit_code == 1 and "error:" in result.output
    assert "Traceback" not in result.output


DEEP = "[" * 100_000 + "]" * 100_000  # JSON nested past the parser's depth

LYING_METADATA = {
    "classes a number": {"classes": "7"},
    "classes a string": {"classes": json.dumps("abcdefghij")},  # not ten classes a .. j
    "classes numbers": {"classes": "[1, 2]"},
    "classes nested past the parser's depth": {"classes": DEEP},
    "model config nested past the parser's depth": {"model_config": DEEP},
    "dataset a number": {"dataset": "7"},  # was refused as data of an unknown kind
}


@pytest.mark.parametrize("case", LYING_METADATA)
def test_lying_metadata_is_refused_in_one_line(case, saved, tmp_path):
    from safetensors import safe_open

    with safe_open(str(saved), framework="pt") as f:
        meta = {**f.metadata(), **LYING_METADATA[case]}
    path = tmp_path / "lie.safetensors"
    save_file(load_file(str(saved)), str(path), metadata=meta)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path)
    assert "\n" not in str(error.value) and len(str(error.value)) < 300
    for command in (["certify", "--checkpoint", str(path), "--eps", "0.1", "--n", "2"],
                    ["info", str(path)]):
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == 1 and "error:" in result.output, command
        assert "Traceback" not in result.output and len(result.output) < 400, command


# Valid values other than the ones the weights were trained with: the file then computes
# another function, and its certificates must hold for that function.
ACCEPTED = {
    "larger final radius": {"final_radius": 5.0},
    "smaller attention radius": {"attn_radius": 0.3},
    "larger attention radius": {"attn_radius": 3.0},
    "looser caps": {"value_cap": 4.0, "output_cap": 4.0, "embed_cap": 3.0},
    "no query-key cap": {"query_key_cap": None},
    "more heads": {"heads": 4},
    "class-token pooling": {"pool": "cls"},
    "other input centre": {"input_center": 0.0},
}


@pytest.mark.parametrize("case", ACCEPTED)
def test_valid_but_untrained_config_is_certified_soundly(case, saved, trained, tmp_path):
    _, x, y = trained
    model = load_checkpoint(rewrite(saved, tmp_path / "other.safetensors", ACCEPTED[case]))
    certificate = Certifier(model, CertifySettings()).certify(x, y)
    radius = certificate.radius()
    certified = radius > 0
    assert certified.sum() >= 10  # the attack below has something to break
    broken = pgd_l2(model.double(), x[certified].double(), y[certified],
                    0.999 * radius[certified], steps=50, restarts=2)
    assert not broken.any(), f"{int(broken.sum())} certificates broken"


def test_lie_planted_past_validation_is_still_caught(trained):
    """Even a model built around the config check (a negative projection radius set on the
    module) is refused by the certifier, which checks the constants it uses itself, also right
    after certifying the honest model of the same config and weights (whose stage specs the
    certifier keeps for reuse)."""
    model, x, y = trained
    Certifier(model, CertifySettings()).certify(x[:2], y[:2])
    lying = LipschitzViT(dataclasses.replace(model.config))
    lying.load_state_dict(model.state_dict())
    projection = [s for s in lying.stages if type(s).__name__ == "LayerProject"][-1]
    projection.radius = -1.0
    with pytest.raises(CertificationError, match="not positive"):
        Certifier(lying, CertifySettings()).certify(x, y)


def test_sll_with_a_zero_column_is_one_clear_error(trained):
    model, x, y = trained
    broken = LipschitzViT(model.config)
    broken.load_state_dict(model.state_dict())
    sll = next(s for s in broken.stages if type(s).__name__ == "SLL")
    with torch.no_grad():
        sll.weight[:, 0] = 0.0
    with pytest.raises(CertificationError, match="zero column"):
        Certifier(broken, CertifySettings()).certify(x, y)


def test_format_marker_is_required(saved, tmp_path):
    tensors = load_file(str(saved))
    out = tmp_path / "plain.safetensors"
    save_file(tensors, str(out), metadata={"model_config": "{}", "format": FORMAT + "x"})
    with pytest.raises(CheckpointError, match="not a lofast checkpoint"):
        load_checkpoint(out)
