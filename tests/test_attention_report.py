"""The attention report and the attention ablation: planted dead and live attention, the ablated
model against a dense float64 reference, and the two commands that show them."""

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

from lofast.bounds.attention import attention_probabilities
from lofast.bounds.attention_spec import AttentionSpec
from lofast.bounds.spectral import SpectralMethod
from lofast.certification.attention_report import ablate_attention, attention_report, mean_attention
from lofast.certification.certificate import Certifier, CertifySettings
from lofast.checkpoint import save_checkpoint
from lofast.cli.main import cli
from lofast.config import preset
from lofast.errors import CertificationError
from lofast.models.layers import Attention
from lofast.models.vit import create_model

EXACT = CertifySettings(method=SpectralMethod(kind="verified"))  # `lofast certify`'s default


def images(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 32, 32, generator=g), torch.randint(0, 4, (n,), generator=g)


def attention_stages(model):
    return [s for s in model.stages if isinstance(s, Attention)]


def dead_model(position_bias):
    """Tiny (17 tokens), Wq = 0: P_l(X) = softmax(C_l) for every image, C_l planted far from 0
    when the model has biases."""
    model = create_model(dataclasses.replace(preset("tiny"), num_classes=4,
                                             position_bias=position_bias), seed=0)
    with torch.no_grad():
        for stage in attention_stages(model):
            stage.weights["query"].zero_()
            if position_bias:
                stage.position_bias.normal_(0.0, 2.0)
    return model.eval()


def live_model():
    """Tiny with uncapped Wq, Wk scaled 8x: scores up to 16, attention depends on the image."""
    model = create_model(dataclasses.replace(preset("tiny"), num_classes=4,
                                             query_key_cap=None), seed=0)
    with torch.no_grad():
        for stage in attention_stages(model):
            stage.weights["query"].mul_(8.0)
            stage.weights["key"].mul_(8.0)
    return model.eval()


@pytest.mark.parametrize("position_bias", [False, True])
def test_dead_attention_reports_nothing_to_ablate(position_bias):
    x, y = images(24, 0)
    report = attention_report(dead_model(position_bias), x, y, eps=[0.02, 0.1],
                              settings=EXACT, batch_size=8)
    assert report.samples == 24 and len(report.heads) == 2 * 2  # depth 2, 2 heads
    assert all(h.score_norm == 0.0 and h.score_norm_over_scale == 0.0 for h in report.heads)
    # P_l(X) is the same matrix for every image; only the rounding of its mean remains
    assert report.max_tv < 1e-12
    assert report.attention_ablation_drop == 0.0 and report.changed_predictions == 0.0
    assert report.ablated_clean_accuracy == report.clean_accuracy
    assert report.certified_ablation_drop == {"0.02": 0.0, "0.1": 0.0}
    assert report.ablated_certified_accuracy == report.certified_accuracy
    assert sum(report.certified_accuracy.values()) > 0  # the comparison is not vacuous


def test_live_attention_changes_predictions():
    x, y = images(48, 1)
    report = attention_report(live_model(), x, y, batch_size=16)
    assert report.max_score_norm > 10.0 and report.max_tv > 0.1
    assert all(h.tv_mean > 1e-3 and h.tv_max >= h.tv_mean for h in report.heads)
    assert report.changed_predictions > 0
    assert report.attention_ablation_drop == pytest.approx(
        100.0 * (report.clean_accuracy - report.ablated_clean_accuracy))
    out = report.to_dict()
    assert json.loads(json.dumps(out)) == out  # plain JSON values
    assert out["max_tv"] == report.max_tv and len(out["heads"]) == 4


def test_score_norms_are_upper_bounds():
    model = live_model()
    report = attention_report(model, *images(4, 2))
    for stage, rows in zip(attention_stages(model), (report.heads[:2], report.heads[2:])):
        w = stage.head_weights()
        exact = torch.linalg.matrix_norm(
            w["query"].double() @ w["key"].double().mT, ord=2)
        for row in rows:
            assert exact[row.head] <= row.score_norm <= exact[row.head] * (1 + 1e-6)
            assert row.score_norm_over_scale == pytest.approx(row.score_norm / stage.scale)


def test_mean_is_taken_on_the_real_models_activations():
    model = live_model().double()
    x, _ = images(10, 3)
    means = mean_attention(model, x, batch_size=3)
    with torch.no_grad():
        _, activations = model.forward_with_activations(x.double())
        for i, spec in enumerate(model.structure()):
            if isinstance(spec, AttentionSpec):
                probs = attention_probabilities(activations[i], spec)
                torch.testing.assert_close(means[i], probs.mean(dim=0), rtol=0, atol=1e-14)
                torch.testing.assert_close(means[i].sum(dim=-1),
                                           torch.ones_like(means[i][..., 0]))


def test_total_variation_against_a_direct_computation():
    model = live_model()
    x, y = images(5, 9)
    report = attention_report(model, x, y, batch_size=2)
    means = mean_attention(model, x)
    model64 = model.double()
    with torch.no_grad():
        _, activations = model64.forward_with_activations(x.double())
    rows = iter(report.heads)
    for i, spec in enumerate(model64.structure()):
        if isinstance(spec, AttentionSpec):
            probs = attention_probabilities(activations[i], spec)
            for head in range(probs.shape[1]):
                tv = [0.5 * sum(abs(float(p) - float(q)) for p, q in zip(row, mean_row))
                      for sample in probs[:, head] for row, mean_row in zip(sample, means[i][head])]
                row = next(rows)
                assert (row.stage, row.head) == (i, head)
                assert row.tv_mean == pytest.approx(sum(tv) / len(tv), rel=1e-12)
                assert row.tv_max == pytest.approx(max(tv), rel=1e-12)


def reference_with_fixed_attention(model, means, x):
    """The model's stages in float64, every attention block X + sum_l Pbar_l X Wv_l Wo_l."""
    with torch.no_grad():
        for i, stage in enumerate(model.stages):
            if isinstance(stage, Attention):
                w = stage.head_weights()
                heads = [means[i][l] @ x @ w["value"][l] @ w["output"][l]
                         for l in range(stage.heads)]
                x = x + sum(heads)
            else:
                x = stage(x)
    return x


def similarity_model():
    """Tiny with Wq = Wk = I and every ||A_l|| fixed at 32 (no query or key weights)."""
    return create_model(dataclasses.replace(preset("tiny"), num_classes=4, query_key="identity",
                                            score_norm=32.0), seed=0).eval()


@pytest.mark.parametrize("make", [live_model, similarity_model])
def test_ablated_forward_equals_fixed_attention_reference(make):
    model = make().double()
    x, _ = images(12, 4)
    x = x.double()
    means = mean_attention(model, x)
    ablated = ablate_attention(model, means)
    assert ablated.config.position_bias and not model.config.position_bias
    with torch.no_grad():
        expected = reference_with_fixed_attention(model, means, x)
        torch.testing.assert_close(ablated(x), expected, rtol=0, atol=1e-12)
        for i, stage in enumerate(ablated.stages):  # softmax(log Pbar) = Pbar
            if isinstance(stage, Attention):
                torch.testing.assert_close(stage.position_bias.softmax(dim=-1), means[i],
                                           rtol=0, atol=1e-15)
        # the ablation differs from the real model: the test above is not vacuous
        assert (ablated(x) - model(x)).abs().max() > 1e-3
        # training's ablation (LipschitzViT.forward with fixed attention, the batch's mean on
        # the model's own activations) is the same model
        batch_means = model.batch_mean_attention(x)
        assert sorted(batch_means) == sorted(means)
        for i in means:
            torch.testing.assert_close(batch_means[i], means[i], rtol=0, atol=1e-15)
        torch.testing.assert_close(model(x, fixed_attention=batch_means), expected,
                                   rtol=0, atol=1e-12)


def test_ablation_leaves_model_and_random_stream_alone():
    model = live_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    means = mean_attention(model, images(4, 5)[0])
    torch.manual_seed(7)
    ablate_attention(model, means)
    drawn = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(drawn, torch.rand(3))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_ablated_model_certifies_with_the_unchanged_certifier():
    """The ablation of a live model is a normal biased model: the certifier bounds it, and since
    its scores vanish, every block's score terms are 0."""
    model = live_model()
    x, y = images(6, 6)
    ablated = ablate_attention(model, mean_attention(model, x))
    certificate = Certifier(ablated, EXACT).certify(x, y)
    for step in certificate.steps:
        if hasattr(step, "score_weight_norm"):
            assert torch.all(step.score_weight_norm == 0)
            assert torch.all(step.score_sensitivity == 0)
    assert torch.isfinite(certificate.radius()).all()


def test_given_verdicts_are_used_as_the_real_models():
    model = dead_model(True)
    x, y = images(12, 7)
    eps = [0.05]
    verdicts = Certifier(model, EXACT).certify(x, y).certified(torch.tensor(eps))
    given = attention_report(model, x, y, eps=eps, settings=EXACT, certified=verdicts)
    computed = attention_report(model, x, y, eps=eps, settings=EXACT)
    assert given.certified_accuracy == computed.certified_accuracy
    planted = attention_report(model, x, y, eps=eps, settings=EXACT,
                               certified=torch.zeros_like(verdicts))
    assert planted.certified_accuracy == {"0.05": 0.0}


def test_bad_inputs_are_refused():
    model = dead_model(False)
    x, y = images(4, 8)
    with pytest.raises(CertificationError, match=r"\[0, 1\]"):
        attention_report(model, x * 2, y)
    with pytest.raises(CertificationError, match="labels"):
        attention_report(model, x, y[:3])
    with pytest.raises(CertificationError, match="N >= 1"):
        attention_report(model, x[:0], y[:0])


# The commands


@pytest.fixture(scope="module")
def folder(data_dir):
    """Four colour classes, four test images each (32 x 32): conftest's data_dir."""
    return data_dir


@pytest.fixture(scope="module")
def dead_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "dead.safetensors"
    save_checkpoint(path, dead_model(True), metadata={
        "dataset": "folder", "classes": [f"class{c}" for c in range(4)]})
    return path


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LOFAST_CACHE_DIR", str(tmp_path / "cache"))


def test_info_with_data_shows_heads_and_ablation(dead_checkpoint, folder):
    result = CliRunner().invoke(cli, ["info", str(dead_checkpoint), "--data", str(folder),
                                      "--eps", "0.05", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "attention on 16 samples" in result.output and "TV mean" in result.output
    assert "attention ablation" in result.output and "certified @ eps=0.05" in result.output
    plain = CliRunner().invoke(cli, ["info", str(dead_checkpoint)])  # as before: no data
    assert plain.exit_code == 0 and "TV mean" not in plain.output


@pytest.mark.parametrize("args, message", [
    (["--sample", "--data", "DATA"], "not both"),
    (["--eps", "0.05"], "need --data or --sample"),
    (["--n", "4"], "need --data or --sample"),
])
def test_info_option_errors_are_one_line(dead_checkpoint, folder, args, message):
    args = [str(folder) if a == "DATA" else a for a in args]
    result = CliRunner().invoke(cli, ["info", str(dead_checkpoint), *args])
    assert result.exit_code == 1 and message in result.output
    assert "Traceback" not in result.output


def test_certify_attention_report_json(dead_checkpoint, folder):
    result = CliRunner().invoke(cli, [
        "certify", "--checkpoint", str(dead_checkpoint), "--data", str(folder), "--eps", "0.05",
        "--eps", "36/255", "--n", "12", "--device", "cpu", "--attention-report", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    attention = summary["attention"]
    assert attention["samples"] == summary["samples"] == 12
    assert attention["clean_accuracy"] == summary["clean_accuracy"]
    assert attention["certified_accuracy"] == summary["certified_accuracy"]
    assert attention["attention_ablation_drop"] == 0.0
    assert attention["certified_ablation_drop"] == {"0.05": 0.0, "0.1411764705882353": 0.0}
    assert attention["max_score_norm"] == 0.0 and len(attention["heads"]) == 4
    table = CliRunner().invoke(cli, [
        "certify", "--checkpoint", str(dead_checkpoint), "--data", str(folder), "--eps", "0.05",
        "--n", "4", "--device", "cpu", "--attention-report"])
    assert table.exit_code == 0, table.output
    assert "attention_ablation_drop" in table.output
    without = CliRunner().invoke(cli, [
        "certify", "--checkpoint", str(dead_checkpoint), "--data", str(folder), "--eps", "0.05",
        "--n", "4", "--device", "cpu", "--json"])
    assert "attention" not in json.loads(without.stdout)
