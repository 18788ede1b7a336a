"""The `lofast` command through click's CliRunner: train, resume, info, certify, bad inputs."""

import dataclasses
import json
import os
import signal

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import assert_one_clear_error, record_lines, write_image_folder
from PIL import Image

from lofast.certification.pipeline import RunProgress
from lofast.checkpoint import load_checkpoint, read_metadata
from lofast.cli.certify_cmd import EXIT_UNMET
from lofast.cli.main import cli


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder")
    write_image_folder(root, 24, 0)
    return root


@pytest.fixture(scope="module")
def checkpoint(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny.safetensors"
    result = CliRunner().invoke(cli, [
        "train", "--dataset", "folder", "--data", str(data_dir), "--preset", "tiny",
        "--epochs", "3", "--batch-size", "16", "--lr", "3e-3", "--temperature", "0.25",
        "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LOFAST_CACHE_DIR", str(tmp_path / "cache"))


def test_train_writes_checkpoint_with_metadata(checkpoint):
    meta = read_metadata(checkpoint)
    assert meta["dataset"] == "folder" and meta["epochs"] == 3
    assert meta["model_config"]["num_classes"] == 4
    assert meta["clean_accuracy"] > 0.5  # colours are easy: well above the 25 % of chance
    assert len(meta["history"]) == 3
    assert checkpoint.with_name(checkpoint.name + ".state.pt").is_file()


def test_resume_continues_from_saved_state(data_dir, tmp_path):
    out = tmp_path / "r.safetensors"
    args = ["train", "--dataset", "folder", "--data", str(data_dir), "--preset", "tiny",
            "--batch-size", "16", "--device", "cpu", "--out", str(out)]
    runner = CliRunner()
    assert runner.invoke(cli, args + ["--epochs", "2"]).exit_code == 0
    # an interrupted 2-epoch run: the state says 2 epochs of a 2-epoch plan; a 3-epoch plan
    # is a different run and must be refused rather than silently mixed
    result = runner.invoke(cli, args + ["--epochs", "3", "--resume"])
    assert result.exit_code == 1 and "differ" in result.output
    state = out.with_name(out.name + ".state.pt")
    full = runner.invoke(cli, args + ["--epochs", "2", "--resume"])
    assert full.exit_code == 0, full.output
    assert "epoch 1/2" not in full.output  # nothing was redone
    assert read_metadata(out)["epochs"] == 2 and state.is_file()


def test_resume_reads_a_state_written_before_a_setting_existed(data_dir, tmp_path):
    """A state whose saved settings lack ones added since (logit_annealing, the model's
    normalized_head) resumes when the run keeps their defaults, and is refused when it asks
    for another value."""
    import json

    import torch

    out = tmp_path / "old.safetensors"
    args = ["train", "--dataset", "folder", "--data", str(data_dir), "--preset", "tiny",
            "--batch-size", "16", "--device", "cpu", "--epochs", "2", "--out", str(out)]
    runner = CliRunner()
    assert runner.invoke(cli, args[:-4] + ["--epochs", "1", "--out", str(out)]).exit_code == 0
    state_path = out.with_name(out.name + ".state.pt")
    state = torch.load(state_path, weights_only=False)
    state["train_config"]["epochs"] = 2  # as if stopped after epoch 1 of a 2-epoch run
    del state["train_config"]["logit_annealing"]
    model_config = json.loads(state["plan"]["model_config"])
    del model_config["normalized_head"]
    state["plan"]["model_config"] = json.dumps(model_config, sort_keys=True)
    torch.save(state, state_path)
    refused = runner.invoke(cli, args + ["--resume", "--logit-annealing", "2"])
    assert refused.exit_code == 1 and "differ" in refused.output
    plain_head = runner.invoke(cli, args + ["--resume", "--model-option", "normalized_head=false"])
    assert plain_head.exit_code == 1 and "model_config" in plain_head.output
    for garbled in ("{not json", '{"no_such_field": 1}', "[]",  # one clear line each
                    "[" * 100_000 + "]" * 100_000):  # nested past the JSON parser's depth
        torch.save({**state, "plan": {**state["plan"], "model_config": garbled}}, state_path)
        refused = runner.invoke(cli, args + ["--resume"])
        assert refused.exit_code == 1 and "model_config" in refused.output, refused.output
    torch.save(state, state_path)
    resumed = runner.invoke(cli, args + ["--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert "epoch 1/2" not in resumed.output and "epoch 2/2" in resumed.output


TRAIN_ARGS = ["train", "--dataset", "folder", "--preset", "tiny", "--batch-size", "16",
              "--device", "cpu", "--epochs", "2", "--no-augment"]


@pytest.mark.parametrize("loss", [
    [], ["--loss", "certified", "--train-eps", "0.1", "--eps-ramp-epochs", "1"]])
def test_resume_after_an_immediate_interrupt_matches_uninterrupted_run(data_dir, tmp_path,
                                                                       monkeypatch, loss):
    """A KeyboardInterrupt raised where the program is (a second Ctrl-C, or one outside the
    main thread) right after the first epoch's state was saved: exit 130, no checkpoint, and
    --resume ends with the uninterrupted run's weights."""
    import lofast.training.loop as train_module

    args = TRAIN_ARGS + ["--data", str(data_dir), *loss]
    runner = CliRunner()
    straight = tmp_path / "a.safetensors"
    assert runner.invoke(cli, args + ["--out", str(straight)]).exit_code == 0

    original = train_module.save_training_state
    calls = {"n": 0}

    def save_then_interrupt(*a, **k):
        original(*a, **k)
        calls["n"] += 1
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "save_training_state", save_then_interrupt)
    resumed = tmp_path / "b.safetensors"
    result = runner.invoke(cli, args + ["--out", str(resumed)])
    assert result.exit_code == 130 and calls["n"] == 1 and not resumed.exists()
    assert "interrupted" in result.output and "Traceback" not in result.output
    monkeypatch.setattr(train_module, "save_training_state", original)
    result = runner.invoke(cli, args + ["--out", str(resumed), "--resume"])
    assert result.exit_code == 0, result.output
    from safetensors.torch import load_file

    a, b = load_file(str(straight)), load_file(str(resumed))
    assert all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)


def signal_at_step(monkeypatch, signum: int, step: int, times: int = 1) -> dict:
    """Make the training loop's step number ``step`` (1-based, counted over the run) send
    ``signum`` to this process ``times`` times as the step ends; returns the step count."""
    import lofast.training.loop as train_module

    original = train_module.training_step
    calls = {"n": 0}

    def step_then_signal(*a, **k):
        result = original(*a, **k)
        calls["n"] += 1
        if calls["n"] == step:
            for _ in range(times):
                os.kill(os.getpid(), signum)
        return result

    monkeypatch.setattr(train_module, "training_step", step_then_signal)
    return calls


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_training_at_the_next_step_with_its_state_saved(data_dir, tmp_path,
                                                                        monkeypatch, signum,
                                                                        code):
    """Ctrl-C or SIGTERM in the middle of an epoch (step 3 of 6, certified loss): the step
    finishes, the state and the weights so far are saved there, the command exits 130 / 143
    with one line, the handlers in place before are back, and --resume ends with the very
    weights of an uninterrupted run."""
    from safetensors.torch import load_file

    args = TRAIN_ARGS + ["--data", str(data_dir), "--loss", "certified", "--train-eps", "0.1"]
    runner = CliRunner()
    straight = tmp_path / "a.safetensors"
    assert runner.invoke(cli, args + ["--out", str(straight)]).exit_code == 0
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    calls = signal_at_step(monkeypatch, signum, 3)
    cut = tmp_path / "b.safetensors"
    result = runner.invoke(cli, args + ["--out", str(cut)])
    name = signal.Signals(signum).name
    assert result.exit_code == code, result.output
    assert calls["n"] == 3 and "Traceback" not in result.output
    assert f"interrupted ({name}) after epoch 1, step 3/6: state saved in" in result.output
    assert {s: signal.getsignal(s) for s in before} == before
    meta = read_metadata(cut)
    assert meta["stopped"] == f"{name} after epoch 1, step 3/6" and meta["epochs"] == 0
    monkeypatch.undo()
    result = runner.invoke(cli, args + ["--out", str(cut), "--resume"])
    assert result.exit_code == 0, result.output
    assert "stopped" not in read_metadata(cut)
    a, b = load_file(str(straight)), load_file(str(cut))
    assert all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)


def test_a_second_signal_stops_training_at_once(data_dir, tmp_path, monkeypatch):
    """Two Ctrl-C in one step: the second raises where the program is (Python's own handler,
    put back by the first), so nothing of the unfinished epoch is saved: exit 130, no
    checkpoint, no state."""
    args = TRAIN_ARGS + ["--data", str(data_dir)]
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        calls = signal_at_step(monkeypatch, signal.SIGINT, 3, times=2)
        out = tmp_path / "b.safetensors"
        result = CliRunner().invoke(cli, args + ["--out", str(out)])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.exit_code == 130 and calls["n"] == 3, result.output
    assert "interrupted: finished work is saved" in result.output
    assert not out.exists() and not out.with_name(out.name + ".state.pt").exists()


def test_diverging_run_stops_before_saving_its_weights(data_dir, tmp_path, monkeypatch):
    import torch

    import lofast.training.loop as train_module
    import lofast.training.objective as objective_module

    original = objective_module.training_loss
    calls = {"n": 0}

    def nan_in_epoch_two(*a, **k):  # 96 images in batches of 16: 6 steps per epoch
        calls["n"] += 1
        loss = original(*a, **k)
        return loss * float("nan") if calls["n"] == 9 else loss

    monkeypatch.setattr(objective_module, "training_loss", nan_in_epoch_two)
    out = tmp_path / "d.safetensors"
    result = CliRunner().invoke(cli, [
        "train", "--dataset", "folder", "--data", str(data_dir), "--preset", "tiny",
        "--batch-size", "16", "--device", "cpu", "--epochs", "3", "--out", str(out)])
    assert result.exit_code == 1 and "diverged at epoch 2" in result.output
    assert "Traceback" not in result.output and not out.exists()
    state = train_module.load_training_state(out.with_name(out.name + ".state.pt"))
    assert state["epoch"] == 1
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_init_starts_from_the_checkpoint(checkpoint, data_dir, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "init.safetensors"
    args = ["train", "--dataset", "folder", "--data", str(data_dir), "--init", str(checkpoint),
            "--epochs", "1", "--batch-size", "16", "--device", "cpu", "--out", str(out)]
    result = CliRunner().invoke(cli, args + ["--lr", "1e-9"])  # Adam moves a weight <= lr a step
    assert result.exit_code == 0, result.output
    start, after = load_file(str(checkpoint)), load_file(str(out))
    assert all(np.allclose(start[k].numpy(), after[k].numpy(), rtol=0, atol=1e-7) for k in start)
    meta = read_metadata(out)
    assert meta["model_config"] == read_metadata(checkpoint)["model_config"]
    assert meta["train_options"]["preset"] is None and len(meta["init_checkpoint_sha256"]) == 64
    moved = CliRunner().invoke(cli, args + ["--lr", "3e-3", "--out", str(tmp_path / "m.st")])
    assert moved.exit_code == 0, moved.output
    assert not all(np.array_equal(start[k].numpy(), v.numpy())
                   for k, v in load_file(str(tmp_path / "m.st")).items())


def test_init_adds_position_biases(checkpoint, data_dir, tmp_path):
    """--model-option position_bias=true with --init: the checkpoint's function with zero biases,
    which then train."""
    from safetensors.torch import load_file

    out = tmp_path / "biased.safetensors"
    result = CliRunner().invoke(cli, [
        "train", "--dataset", "folder", "--data", str(data_dir), "--init", str(checkpoint),
        "--model-option", "position_bias=true", "--epochs", "1", "--batch-size", "16",
        "--lr", "3e-3", "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 0, result.output
    model = load_checkpoint(out)
    assert model.config.position_bias
    start, after = load_file(str(checkpoint)), load_file(str(out))
    biases = sorted(set(after) - set(start))
    assert biases and all(k.endswith(".position_bias") for k in biases)
    assert all(after[k].abs().max() > 0 for k in biases)  # they trained from zero
    shown = CliRunner().invoke(cli, ["info", str(out)])
    assert shown.exit_code == 0 and "softmax(C_l) - U" in shown.output
    certified = CliRunner().invoke(cli, ["certify", "--checkpoint", str(out), "--data",
                                         str(data_dir), "--eps", "0.05", "--n", "8",
                                         "--device", "cpu", "--json"])
    assert certified.exit_code == 0, certified.output
    assert json.loads(certified.stdout)["samples"] == 8


def train_from(checkpoint, data, tmp_path, *extra):
    out = tmp_path / "o.safetensors"
    result = CliRunner().invoke(cli, ["train", "--dataset", "folder", "--data", str(data),
                                      "--init", str(checkpoint), *extra, "--epochs", "1",
                                      "--device", "cpu", "--out", str(out)])
    assert "Traceback" not in result.output and not out.exists()
    return result


@pytest.mark.parametrize("extra", [["--preset", "tiny"], ["--model-option", "depth=2"],
                                   ["--model-option", "position_bias=true",
                                    "--model-option", "heads=1"]])
def test_init_refuses_an_architecture_of_its_own(checkpoint, data_dir, tmp_path, extra):
    result = train_from(checkpoint, data_dir, tmp_path, *extra)
    assert result.exit_code == 1 and "--preset" in result.output


def test_init_refuses_a_missing_checkpoint(data_dir, tmp_path):
    result = train_from(tmp_path / "missing.safetensors", data_dir, tmp_path)
    assert result.exit_code == 1 and "missing.safetensors" in result.output


def test_init_refuses_a_checkpoint_for_other_classes(checkpoint, tmp_path):
    data = tmp_path / "ten"  # a 10-class data set against a 4-class checkpoint
    for split in ("train", "test"):
        for c in range(10):
            (data / split / f"c{c}").mkdir(parents=True)
            Image.new("RGB", (32, 32)).save(data / split / f"c{c}" / "0.png")
    result = train_from(checkpoint, data, tmp_path)
    assert result.exit_code == 1 and "built for" in result.output


def test_certified_training_short_run(data_dir, tmp_path):
    out = tmp_path / "cert.safetensors"
    result = CliRunner().invoke(cli, [
        "train", "--dataset", "folder", "--data", str(data_dir), "--preset", "tiny",
        "--epochs", "2", "--batch-size", "16", "--lr", "3e-3", "--loss", "certified",
        "--train-eps", "0.05", "--eps-ramp-epochs", "1", "--clean-mix", "0.2",
        "--temperature", "0.25", "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 0, result.output
    meta = read_metadata(out)
    assert meta["train_options"]["loss"] == "certified"
    assert meta["train_options"]["train_eps"] == 0.05
    assert meta["clean_accuracy"] > 0.5  # still learns the easy colours
    certified = CliRunner().invoke(cli, [
        "certify", "--checkpoint", str(out), "--data", str(data_dir), "--dataset", "folder",
        "--eps", "0.05", "--json"])
    assert certified.exit_code == 0, certified.output
    assert json.loads(certified.stdout)["samples"] == 48


def test_certified_training_needs_a_radius(data_dir, tmp_path):
    result = CliRunner().invoke(cli, [
        "train", "--dataset", "folder", "--data", str(data_dir), "--preset", "tiny",
        "--loss", "certified", "--device", "cpu", "--out", str(tmp_path / "x.safetensors")])
    assert result.exit_code == 1
    assert "--train-eps" in result.output and "Traceback" not in result.output


def test_info(checkpoint):
    result = CliRunner().invoke(cli, ["info", str(checkpoint)])
    assert result.exit_code == 0, result.output
    assert "Attention" in result.output and "local (LoFAST)" in result.output
    assert "SLL" in result.output


def test_certify_summary_jsonl_and_resume(checkpoint, data_dir, tmp_path):
    out = tmp_path / "r.jsonl"
    base = ["certify", "--checkpoint", str(checkpoint), "--data", str(data_dir),
            "--eps", "0.02", "--eps", "0.1", "--device", "cpu"]
    runner = CliRunner()
    result = runner.invoke(cli, base + ["--n", "10", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    records = record_lines(out)
    assert summary["samples"] == len(records) == 10
    for key in ("0.02", "0.1"):
        share = sum(r["verdicts"][key] for r in records) / 10
        assert summary["certified_accuracy"][key] == pytest.approx(share)
    assert summary["clean_accuracy"] == pytest.approx(
        sum(r["label"] == r["prediction"] for r in records) / 10)
    assert summary["guarantee"].startswith("exact")  # the default, --guarantee exact
    # resume to 16 samples: the first 10 are kept, 6 are added
    result = runner.invoke(cli, base + ["--n", "16", "--out", str(out), "--resume", "--json"])
    assert result.exit_code == 0, result.output
    lines = record_lines(out)
    assert len(lines) == 16 and lines[:10] == records
    assert json.loads(result.stdout)["samples"] == 16


class StopAfter(RunProgress):
    """A run interrupted (Ctrl-C) once ``count`` samples have their records."""

    def __init__(self, count: int) -> None:
        self.count = count

    def samples(self, done: int, total: int, ms_per_sample: float | None) -> None:
        if done >= self.count:
            raise KeyboardInterrupt


def test_report_requires_a_finished_run(checkpoint, data_dir, tmp_path):
    """A record file whose run was interrupted is summarised as unfinished, and a requirement
    on it fails however its figures look (a CI job that killed certify on a timeout and then
    judged the file passed on the first few samples); resumed to the end it passes. A resumed
    run that adds samples to a finished file is unfinished until it ends too."""
    import lofast

    out = tmp_path / "r.jsonl"
    base = ["--checkpoint", str(checkpoint), "--data", str(data_dir), "--eps", "0.02",
            "--device", "cpu", "--batch-size", "4", "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        lofast.certify(checkpoint, data_dir, eps=0.02, n=12, device="cpu", batch_size=4,
                       out=out, progress=StopAfter(4))
    assert len(record_lines(out)) == 4
    runner = CliRunner()
    result = runner.invoke(cli, ["report", str(out), "--require", "0.02=0"])
    assert result.exit_code == EXIT_UNMET
    assert "the run did not finish" in result.output and "--resume" in result.output
    shown = runner.invoke(cli, ["report", str(out), "--json"])
    assert shown.exit_code == 0 and json.loads(shown.stdout)[str(out)]["finished"] is False
    assert "did not finish" in shown.stderr
    resumed = runner.invoke(cli, ["certify", *base, "--n", "12", "--resume", "--json"])
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(out.read_text().splitlines()[-1]) == {"finished": {"samples": 12}}
    result = runner.invoke(cli, ["report", str(out), "--require", "0.02=0"])
    assert result.exit_code == 0, result.output
    assert "did not finish" not in result.output
    finished = out.read_text()  # resumed again with nothing left to do: unchanged
    assert runner.invoke(cli, ["certify", *base, "--n", "12", "--resume"]).exit_code == 0
    assert out.read_text() == finished
    # more samples on a finished file: the first mark stays inside, the run is open again
    with pytest.raises(KeyboardInterrupt):
        lofast.certify(checkpoint, data_dir, eps=0.02, n=20, device="cpu", batch_size=4,
                       out=out, resume=True, progress=StopAfter(16))
    assert runner.invoke(cli, ["report", str(out), "--require", "0.02=0"]).exit_code == EXIT_UNMET
    assert runner.invoke(cli, ["certify", *base, "--n", "20", "--resume"]).exit_code == 0
    assert len(record_lines(out)) == 20
    assert runner.invoke(cli, ["report", str(out), "--require", "0.02=0"]).exit_code == 0


def test_no_certified_accuracy_gate_passes_on_estimates(checkpoint, data_dir, tmp_path):
    """Radii under the estimate guarantee (power iteration) are no certificates: a requirement
    or an allowed drop on certified accuracy fails on such a run, as run or as baseline, however
    its figures look; one on clean accuracy alone is judged as usual, and the same gates pass
    on the same model's exact run."""
    runner = CliRunner()
    runs = {}
    for guarantee in ("estimate", "exact"):
        runs[guarantee] = tmp_path / f"{guarantee}.jsonl"
        made = runner.invoke(cli, ["certify", "--checkpoint", str(checkpoint), "--data",
                                   str(data_dir), "--eps", "0.02", "--n", "8", "--device", "cpu",
                                   "--guarantee", guarantee, "--out", str(runs[guarantee]),
                                   "--require", "0.02=0"])
        assert made.exit_code == (EXIT_UNMET if guarantee == "estimate" else 0), made.output
    estimate, exact = str(runs["estimate"]), str(runs["exact"])
    gate = runner.invoke(cli, ["report", estimate, "--require", "0.02=0"])
    assert gate.exit_code == EXIT_UNMET and "NOT certificates" in gate.output
    assert "estimate: NOT a certificate" in gate.output  # the table says so too
    assert runner.invoke(cli, ["report", estimate, "--require", "clean=0"]).exit_code == 0
    assert runner.invoke(cli, ["report", exact, "--require", "0.02=0"]).exit_code == 0
    for run, baseline, side in ((estimate, exact, "run"), (exact, estimate, "baseline")):
        drop = runner.invoke(cli, ["report", run, "--baseline", baseline,
                                   "--max-drop", "0.02=100"])
        assert drop.exit_code == EXIT_UNMET and f"the {side}'s radii are estimates" in drop.output
    assert runner.invoke(cli, ["report", exact, "--baseline", exact,
                               "--max-drop", "0.02=0"]).exit_code == 0


def test_a_merge_is_finished_where_its_parts_are(checkpoint, data_dir, tmp_path):
    """Shards merge as finished (their counts are checked complete); whole runs merge as
    finished only where each part is, unknown where one does not say."""
    import lofast
    from lofast.certification.records import SavedRun, merge_saved_runs

    parts = [tmp_path / f"part{i}.jsonl" for i in range(2)]
    for i, part in enumerate(parts):
        lofast.certify(checkpoint, data_dir, eps=0.02, n=6, device="cpu", out=part,
                       shard=f"{i}/2")
    shown = CliRunner().invoke(cli, ["report", "--merge", *map(str, parts), "--json"])
    assert shown.exit_code == 0, shown.output
    assert next(iter(json.loads(shown.stdout).values()))["finished"] is True
    records = lofast.certify(checkpoint, data_dir, eps=0.02, n=4, device="cpu").records
    for marks, merged in (((True, True), True), ((True, False), False), ((True, None), None)):
        saved = [SavedRun(records[:2], marks[0]), SavedRun(records[2:], marks[1])]
        assert merge_saved_runs(saved).finished is merged


def test_record_files_without_the_finished_mark(checkpoint, data_dir, tmp_path):
    """A file of schema 2 (an earlier lofast: no finished mark) is read and judged as before,
    and resumed in its own schema without a mark; a mark that claims more samples than the
    file holds is refused; a torn mark is an unfinished run."""
    out = tmp_path / "r.jsonl"
    base = ["certify", "--checkpoint", str(checkpoint), "--data", str(data_dir), "--eps", "0.02",
            "--device", "cpu", "--out", str(out)]
    runner = CliRunner()
    assert runner.invoke(cli, base + ["--n", "4"]).exit_code == 0
    header, session, *records, mark = out.read_text().splitlines()
    assert json.loads(mark) == {"finished": {"samples": 4}} and "session" in json.loads(session)
    old = json.loads(header) | {"schema": 2}
    out.write_text("\n".join([json.dumps(old), *records]) + "\n")
    shown = runner.invoke(cli, ["report", str(out), "--json", "--require", "0.02=0"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)[str(out)]["finished"] is None
    assert runner.invoke(cli, base + ["--n", "6", "--resume"]).exit_code == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 7 and json.loads(lines[0])["schema"] == 2
    assert all("finished" not in json.loads(line) for line in lines)
    claimed = tmp_path / "claimed.jsonl"
    claimed.write_text("\n".join([header, *records, '{"finished": {"samples": 5}}']) + "\n")
    result = runner.invoke(cli, ["report", str(claimed)])
    assert result.exit_code == 1 and "finished run's mark without its records" in result.output
    # a mark torn by an interrupt while it was written: unfinished, and resumed to the end
    torn = tmp_path / "torn.jsonl"
    torn.write_text("\n".join([header, *records]) + '\n{"finished": {"sam')
    result = runner.invoke(cli, ["report", str(torn), "--require", "0.02=0"])
    assert result.exit_code == EXIT_UNMET and "did not finish" in result.output
    resumed = [*base[:-2], "--out", str(torn), "--n", "4", "--resume"]
    assert runner.invoke(cli, resumed).exit_code == 0
    assert torn.read_text().splitlines()[-1] == '{"finished": {"samples": 4}}'
    # a record cut off after a finished mark (a resumed run stopped mid-write): unfinished
    cut = torn.read_text() + records[0][:40]
    torn.write_text(cut)
    result = runner.invoke(cli, ["report", str(torn), "--require", "0.02=0"])
    assert result.exit_code == EXIT_UNMET and "did not finish" in result.output


def test_a_saved_run_says_where_it_ran_and_what_its_proofs_took(checkpoint, data_dir, tmp_path):
    """Each session of a run (the first, each resume that certifies samples) writes its device
    and proof seconds; `lofast report` shows the device, the proofs summed over the sessions
    and a total time that includes them; a file of schema 3 says neither (and is resumed
    without session lines); a torn session line is an unfinished run, a broken one refused."""
    out = tmp_path / "r.jsonl"
    base = ["certify", "--checkpoint", str(checkpoint), "--data", str(data_dir), "--eps", "0.02",
            "--device", "cpu", "--out", str(out), "--json"]
    runner = CliRunner()
    first = runner.invoke(cli, [*base, "--n", "4"])
    second = runner.invoke(cli, [*base, "--n", "6", "--resume"])
    assert first.exit_code == second.exit_code == 0, first.output + second.output
    live = [json.loads(result.stdout) for result in (first, second)]
    again = runner.invoke(cli, [*base, "--n", "6", "--resume"])  # nothing left: no session
    assert again.exit_code == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    sessions = [line["session"] for line in lines if "session" in line]
    assert [s["proof_seconds"] for s in sessions] == [run["proof_seconds"] for run in live]
    assert {s["device"] for s in sessions} == {live[0]["device"]}
    assert live[0]["device"].startswith("cpu (") and "thread" in live[0]["device"]
    shown = runner.invoke(cli, ["report", str(out), "--json"])
    assert shown.exit_code == 0, shown.output
    summary = json.loads(shown.stdout)[str(out)]
    proofs = sum(run["proof_seconds"] for run in live)
    assert summary["device"] == live[0]["device"]
    assert summary["proof_seconds"] == pytest.approx(proofs, rel=1e-12)
    samples = sum(record["seconds"] for record in record_lines(out))
    assert summary["total_seconds"] == pytest.approx(samples + proofs, rel=1e-12)
    table = runner.invoke(cli, ["report", str(out)])
    assert "per-model proofs" in table.output and "cpu (" in table.output
    # schema 3: no sessions; summarised without them, resumed without adding any
    old = tmp_path / "old.jsonl"
    header = json.loads(out.read_text().splitlines()[0]) | {"schema": 3}
    kept = [line for line in out.read_text().splitlines()[1:] if '"session"' not in line]
    old.write_text("\n".join([json.dumps(header), *kept[:5]]) + "\n")  # 4 records, a mark, 1
    summary = json.loads(runner.invoke(cli, ["report", str(old), "--json"]).stdout)[str(old)]
    assert (summary["device"], summary["proof_seconds"]) == ("-", None)
    assert summary["total_seconds"] == pytest.approx(
        sum(record["seconds"] for record in record_lines(old)), rel=1e-12)
    resumed = [*base[:-3], "--out", str(old), "--n", "6", "--resume"]
    assert runner.invoke(cli, resumed).exit_code == 0
    assert '"session"' not in old.read_text() and len(record_lines(old)) == 6
    # a session line torn by an interrupt: the run did not finish; a session after the
    # finished mark (a resume stopped before its first batch) reopens the run
    text = out.read_text()
    for tail in ('{"session": {"dev', json.dumps({"session": sessions[0]}) + "\n"):
        out.write_text(text + tail)
        result = runner.invoke(cli, ["report", str(out), "--require", "0.02=0"])
        assert result.exit_code == EXIT_UNMET and "did not finish" in result.output
    for broken in ({"device": "cpu", "proof_seconds": -1.0}, {"device": "", "proof_seconds": 1},
                   {"device": "cpu"}, {"device": "cpu", "proof_seconds": 1, "more": 2},
                   {"device": 3, "proof_seconds": 1}, {"device": "cpu", "proof_seconds": True}):
        out.write_text(text + json.dumps({"session": broken}) + "\n")
        assert_one_clear_error(runner.invoke(cli, ["report", str(out)]), "session line")
    out.write_text(text + '{"session": {"device": "cpu", "proof_seconds": NaN}}\n')
    assert_one_clear_error(runner.invoke(cli, ["report", str(out)]), "session line")
    # in a file of schema 3 a session line is no line of ours
    old.write_text(old.read_text() + json.dumps({"session": sessions[0]}) + "\n")
    assert_one_clear_error(runner.invoke(cli, ["report", str(old)]), "not a lofast record")


def test_merged_parts_keep_their_sessions(checkpoint, data_dir, tmp_path):
    """`lofast report --merge` of shards: every part's device once, the proofs of all."""
    import lofast
    from lofast.certification.records import Session, load_run, merge_saved_runs

    parts = [tmp_path / f"part{i}.jsonl" for i in range(2)]
    runs = [lofast.certify(checkpoint, data_dir, eps=0.02, n=6, device="cpu", out=part,
                           shard=f"{i}/2") for i, part in enumerate(parts)]
    shown = CliRunner().invoke(cli, ["report", "--merge", *map(str, parts), "--json"])
    assert shown.exit_code == 0, shown.output
    summary = next(iter(json.loads(shown.stdout).values()))
    assert summary["device"] == runs[0].summary.device
    assert summary["proof_seconds"] == pytest.approx(
        sum(run.summary.proof_seconds for run in runs), rel=1e-12)
    saved = [load_run(part) for part in parts]
    other = dataclasses.replace(saved[1], sessions=(Session("cuda:0 (GPU)", 2.0),))
    merged = merge_saved_runs([saved[0], other])
    assert merged.sessions == (*saved[0].sessions, Session("cuda:0 (GPU)", 2.0))


@pytest.mark.parametrize("change, named", [
    (["--no-softmax-jacobian"], "bound lofast + softmax Jacobian (now lofast)"),
    (["--kappa", "1"], "kappa 0.5 (now 1.0)"),
    (["--split", "train"], "data"),
    (["--guarantee", "probabilistic"], "guarantee exact (now probabilistic)"),
])
def test_certify_resume_refuses_other_settings(checkpoint, data_dir, tmp_path, change, named):
    out = tmp_path / "r.jsonl"
    base = ["certify", "--checkpoint", str(checkpoint), "--data", str(data_dir), "--eps", "0.05",
            "--n", "4", "--device", "cpu", "--out", str(out)]
    runner = CliRunner()
    assert runner.invoke(cli, base).exit_code == 0
    before = out.read_text()
    result = runner.invoke(cli, base + ["--resume"] + change)
    assert result.exit_code == 1
    assert "other settings" in result.output and named in result.output
    assert "Traceback" not in result.output
    assert out.read_text() == before  # nothing lost or appended


def test_certify_reads_data_by_its_path_for_a_model_trained_in_memory(data_dir, tmp_path):
    """A checkpoint trained on an ImageDataset made in memory names that data ("synthetic"),
    not a kind read from paths: certify takes the kind the path shows (it was refused as
    "unknown dataset 'synthetic'", naming the data path); --dataset still overrides it."""
    from lofast.checkpoint import save_checkpoint
    from lofast.config import preset
    from lofast.models.vit import create_model

    path = tmp_path / "memory.safetensors"
    save_checkpoint(path, create_model(preset("tiny", num_classes=4), seed=0),
                    {"dataset": "synthetic", "classes": [f"class{c}" for c in range(4)]})
    base = ["certify", "--checkpoint", str(path), "--data", str(data_dir), "--eps", "0.1",
            "--n", "4", "--device", "cpu", "--json"]
    result = CliRunner().invoke(cli, base)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["samples"] == 4
    result = CliRunner().invoke(cli, [*base, "--dataset", "cifar10"])
    assert result.exit_code == 1 and "Traceback" not in result.output


def test_certify_resume_refuses_other_checkpoint(checkpoint, data_dir, tmp_path):
    out = tmp_path / "r.jsonl"
    other = tmp_path / "other.safetensors"
    other.write_bytes(checkpoint.read_bytes())
    base = ["certify", "--data", str(data_dir), "--eps", "0.05", "--n", "4", "--device", "cpu",
            "--out", str(out)]
    runner = CliRunner()
    assert runner.invoke(cli, base + ["--checkpoint", str(checkpoint)]).exit_code == 0
    # a byte-identical copy is the same model: resuming from it is allowed
    assert runner.invoke(cli, base + ["--checkpoint", str(other), "--resume"]).exit_code == 0
    other.write_bytes(checkpoint.read_bytes() + b" ")
    result = runner.invoke(cli, base + ["--checkpoint", str(other), "--resume"])
    assert result.exit_code == 1 and "checkpoint" in result.output


def test_certify_softmax_jacobian_switch(checkpoint, data_dir):
    base = ["certify", "--checkpoint", str(checkpoint), "--data", str(data_dir), "--eps", "0.05",
            "--eps", "0.2", "--n", "8", "--device", "cpu", "--json"]
    summaries = {}
    for flag in ("--softmax-jacobian", "--no-softmax-jacobian"):
        result = CliRunner().invoke(cli, base + [flag])
        assert result.exit_code == 0, result.output
        summaries[flag] = json.loads(result.stdout)
    assert summaries["--softmax-jacobian"]["bound"] == "lofast + softmax Jacobian"
    assert summaries["--no-softmax-jacobian"]["bound"] == "lofast"
    for key in ("0.05", "0.2"):  # the refinement never certifies less
        assert (summaries["--softmax-jacobian"]["certified_accuracy"][key]
                >= summaries["--no-softmax-jacobian"]["certified_accuracy"][key])


def test_certify_table_output(checkpoint, data_dir):
    result = CliRunner().invoke(cli, ["certify", "--checkpoint", str(checkpoint), "--data",
                                      str(data_dir), "--eps", "0.05", "--n", "8",
                                      "--guarantee", "estimate"])
    assert result.exit_code == 0, result.output
    assert "certified accuracy @ eps=0.05" in result.output
    assert "NOT a certificate" in result.output or "estimate" in result.output


def test_progress_lines_where_no_bar_is_drawn(checkpoint, data_dir, tmp_path, monkeypatch):
    # CliRunner's stderr is not a terminal, like a log file: rich draws no bar there
    from lofast.cli import progress

    train = ["train", "--dataset", "folder", "--data", str(data_dir), "--init", str(checkpoint),
             "--epochs", "1", "--batch-size", "16", "--device", "cpu",
             "--out", str(tmp_path / "p.safetensors")]
    certify = ["certify", "--checkpoint", str(checkpoint), "--data", str(data_dir),
               "--eps", "0.05", "--n", "8", "--batch-size", "4"]
    quiet = CliRunner().invoke(cli, certify)  # the first line waits PLAIN_PROGRESS_SECONDS
    assert quiet.exit_code == 0 and "samples," not in quiet.output
    monkeypatch.setattr(progress, "PLAIN_PROGRESS_SECONDS", 0.0)
    trained = CliRunner().invoke(cli, train)
    assert trained.exit_code == 0, trained.output
    assert "epoch 1/1, step 1/6: loss" in trained.output  # 96 images in batches of 16
    assert "epoch 1/1, step 6/6: loss" in trained.output
    certified = CliRunner().invoke(cli, certify)
    assert certified.exit_code == 0, certified.output
    assert "certified 4/8 samples," in certified.output
    assert "certified 8/8 samples," in certified.output


@pytest.mark.parametrize("eps", ["0", "-0.1", "abc", "nan", "1/0", "0/255", "-36/255", "1/2/3"])
def test_certify_rejects_bad_eps(checkpoint, data_dir, eps):
    result = CliRunner().invoke(cli, ["certify", "--checkpoint", str(checkpoint), "--data",
                                      str(data_dir), "--eps", eps])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "Invalid value for '--eps': eps " in result.output


@pytest.mark.parametrize("option, value", [("--fallback-timeout", "0"), ("--shard", "3/2"),
                                           ("--require", "0.05=200")])
def test_a_bad_option_value_is_named_as_written(option, value):
    result = CliRunner().invoke(cli, ["certify", "--eps", "0.05", option, value])
    assert result.exit_code == 2
    assert f"Invalid value for '{option}': " in result.output
    assert "_" not in result.output.splitlines()[-1]  # fallback-timeout, not fallback_timeout


def test_certify_accepts_eps_as_a_fraction(checkpoint, data_dir):
    base = ["certify", "--checkpoint", str(checkpoint), "--data", str(data_dir), "--n", "4",
            "--device", "cpu", "--json", "--eps"]
    runner = CliRunner()
    fraction = runner.invoke(cli, base + ["36/255"])
    decimal = runner.invoke(cli, base + [repr(36 / 255)])
    assert fraction.exit_code == 0 and decimal.exit_code == 0, fraction.output
    assert (json.loads(fraction.stdout)["certified_accuracy"]
            == json.loads(decimal.stdout)["certified_accuracy"])
    assert list(json.loads(fraction.stdout)["certified_accuracy"]) == ["0.1411764705882353"]


def test_certify_bad_files(checkpoint, data_dir, tmp_path):
    runner = CliRunner()
    missing = runner.invoke(cli, ["certify", "--checkpoint", str(tmp_path / "no.safetensors"),
                                  "--data", str(data_dir), "--eps", "0.1"])
    assert missing.exit_code == 1 and "not found" in missing.output
    corrupt = tmp_path / "c.safetensors"
    corrupt.write_bytes(checkpoint.read_bytes()[:100])
    result = runner.invoke(cli, ["certify", "--checkpoint", str(corrupt), "--data",
                                 str(data_dir), "--eps", "0.1"])
    assert result.exit_code == 1 and "error" in result.output
    assert "Traceback" not in result.output


def test_certify_wrong_image_shape(checkpoint, tmp_path):
    root = tmp_path / "small"
    for split in ("train", "test"):
        folder = root / split / "a"
        folder.mkdir(parents=True)
        Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(folder / "0.png")
    result = CliRunner().invoke(cli, ["certify", "--checkpoint", str(checkpoint), "--data",
                                      str(root), "--eps", "0.1"])
    assert result.exit_code == 1 and "shape" in result.output


def test_train_bad_inputs(tmp_path):
    runner = CliRunner()
    result = runner.invoke(cli, ["train", "--data", str(tmp_path / "none"), "--out",
                                 str(tmp_path / "o.safetensors")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    result = runner.invoke(cli, ["train", "--data", str(tmp_path), "--device", "cuda",
                                 "--out", str(tmp_path / "o.safetensors")])
    assert result.exit_code == 1 and ("GPU" in result.output or "error" in result.output)


@pytest.mark.parametrize("fallback", ["crown", "alpha-crown", "beta-crown"])
def test_fallback_without_auto_lirpa_is_one_clear_line(checkpoint, data_dir, monkeypatch,
                                                       fallback):
    import lofast.crown

    monkeypatch.setattr(lofast.crown, "crown_available", lambda: False)
    result = CliRunner().invoke(cli, ["certify", "--checkpoint", str(checkpoint), "--data",
                                      str(data_dir), "--eps", "0.1", "--fallback", fallback])
    assert result.exit_code == 1 and "auto_LiRPA" in result.output
    assert "pip install" in result.output and "Traceback" not in result.output


def test_time_limit_stops_mid_epoch_and_resume_is_bit_identical(data_dir, tmp_path):
    """A run cut by --time-limit after every single step (12 calls for 2 epochs of 6 steps)
    ends with the very weights of an uninterrupted run: certified loss, augmentation."""
    from safetensors.torch import load_file

    args = ["train", "--dataset", "folder", "--data", str(data_dir), "--preset", "tiny",
            "--batch-size", "16", "--device", "cpu", "--epochs", "2", "--loss", "certified",
            "--train-eps", "0.1"]
    runner = CliRunner()
    straight = tmp_path / "a.safetensors"
    assert runner.invoke(cli, args + ["--out", str(straight)]).exit_code == 0
    cut = tmp_path / "b.safetensors"
    calls, result = 0, None
    while result is None or result.exit_code == 75:
        resume = ["--resume"] if calls else []
        result = runner.invoke(cli, args + ["--out", str(cut), "--time-limit", "1e-6", *resume])
        calls += 1
        assert calls <= 13, result.output
        if result.exit_code == 75:  # the weights so far are a checkpoint too, marked as such
            meta = read_metadata(cut)
            finished = int(calls >= 6)  # the sixth call ends the first epoch
            assert meta["stopped"].startswith(f"time limit after epoch {finished + 1}, step ") \
                or (calls == 6 and meta["stopped"] == "time limit after epoch 1 of 2")
            assert meta["epochs"] == finished and len(meta["history"]) == finished
            assert load_checkpoint(cut).config == load_checkpoint(straight).config
    assert result.exit_code == 0, result.output
    assert "stopped" not in read_metadata(cut)
    assert calls == 12  # one step per call: the state was saved inside the epochs
    a, b = load_file(str(straight)), load_file(str(cut))
    assert all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)
    assert read_metadata(cut)["history"][-1]["train_loss"] == \
        read_metadata(straight)["history"][-1]["train_loss"]


def test_compiled_training_step_trains_the_same_model(data_dir):
    """``train(compile_mode="cudagraphs")`` (``lofast train --compile`` on a GPU; on a CPU the
    traced graph runs without capture): certified training with the radius ramp, whose eps
    changes every step, reaches the eager run's weights and history with one graph; the CLI
    refuses the option without a CUDA device, in one line. (An epoch's smaller last batch
    would be a second graph of its own shape, ``dynamic=False``: 14 s more of tracing here.)"""
    import torch
    from torch._dynamo.utils import counters

    from lofast.config import TrainConfig, preset
    from lofast.data import load_dataset
    from lofast.models.vit import create_model
    from lofast.training.loop import train

    counters.clear()
    train_set, test_set = (load_dataset(data_dir, split, "folder") for split in ("train", "test"))
    config = TrainConfig(epochs=2, batch_size=24, lr=3e-3, loss="certified", train_eps=0.1,
                         eps_ramp_epochs=1.5, power_iterations=1, augment=False)
    models, histories = [], []
    for mode in (None, "cudagraphs"):
        # one block: quick to trace; position biases: as the GPU recipe (no read-back of them)
        model = create_model(preset("tiny", num_classes=4, depth=1, position_bias=True), seed=0)
        histories.append(train(model, train_set.images, train_set.labels, test_set.images,
                               test_set.labels, config, torch.device("cpu"), compile_mode=mode))
        models.append(model)
    # one graph for the eight steps (four batches of 24 an epoch): the radius ramp's eps is an
    # input, not a constant, and the first step (random power-iteration starts) ran eagerly
    assert counters["stats"]["unique_graphs"] == 1 and counters["frames"]["ok"] == 1
    eager, compiled = (m.state_dict() for m in models)
    assert all(torch.allclose(eager[k], compiled[k], rtol=1e-4, atol=1e-6) for k in eager)
    for a, b in zip(*histories):
        assert abs(a.train_loss - b.train_loss) < 1e-4 and a.test_accuracy == b.test_accuracy
    result = CliRunner().invoke(cli, ["train", "--dataset", "folder", "--data", str(data_dir),
                                      "--preset", "tiny", "--device", "cpu", "--compile",
                                      "--out", "unused.safetensors"])
    assert result.exit_code == 1 and "needs a CUDA device" in result.output
    assert "Traceback" not in result.output


def test_a_failing_compiled_step_is_one_clear_error(data_dir, monkeypatch):
    """A compilation or capture that fails (on an H200, cuSOLVER inside a CUDA graph did) stops
    training with one line that names the cause and the way on, not a traceback."""
    import torch

    from lofast.config import TrainConfig, preset
    from lofast.data import load_dataset
    from lofast.errors import LofastError
    from lofast.models.vit import create_model
    from lofast.training.loop import train

    def compile_that_fails_in_capture(module, **options):
        def run(*args):
            raise RuntimeError("CUDA error: operation failed due to a previous error during "
                               "capture\nmore detail")
        return run

    monkeypatch.setattr(torch, "compile", compile_that_fails_in_capture)
    train_set = load_dataset(data_dir, "train", "folder")
    config = TrainConfig(epochs=1, batch_size=16, loss="certified", train_eps=0.1,
                         power_iterations=1, augment=False)
    model = create_model(preset("tiny", num_classes=4, depth=1), seed=0)
    with pytest.raises(LofastError, match=r"compiled training step failed \(RuntimeError: CUDA "
                                          r"error: operation failed .*capture\); train without"):
        train(model, train_set.images, train_set.labels, train_set.images[:4],
              train_set.labels[:4], config, torch.device("cpu"), compile_mode="cudagraphs")


def test_running_out_of_memory_is_one_line(checkpoint, data_dir, tmp_path, monkeypatch):
    """The allocator's error anywhere in a command (training, a report, an attack) is one line
    that says what to do, exit code 1, no traceback; a certify run that runs out of memory
    for a lone sample says so; any other exception still propagates (a bug, not the user's)."""
    import torch

    from lofast.certification import certificate, pipeline
    from lofast.training import pipeline as training

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB (GPU 0)")

    runner = CliRunner()
    monkeypatch.setattr(training, "run_train", out_of_memory)
    result = runner.invoke(cli, ["train", "--data", str(data_dir), "--dataset", "folder",
                                 "--out", str(tmp_path / "m.safetensors")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert "out of memory (CUDA out of memory. Tried to allocate 9.00 GiB (GPU 0)); a " \
           "smaller --batch-size" in " ".join(result.output.split())
    monkeypatch.setattr(certificate.Certifier, "certify", out_of_memory)
    result = runner.invoke(cli, ["certify", "--checkpoint", str(checkpoint), "--data",
                                 str(data_dir), "--eps", "0.1", "--batch-size", "2"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert "certifying a single sample" in " ".join(result.output.split())
    monkeypatch.setattr(pipeline, "run_certify", lambda *a: 1 / 0)
    result = runner.invoke(cli, ["certify", "--checkpoint", str(checkpoint), "--data",
                                 str(data_dir), "--eps", "0.1"])
    assert isinstance(result.exception, ZeroDivisionError)


def test_cpu_amp_autocasts_the_model_on_a_cpu_only_when_asked(data_dir, tmp_path):
    """`--cpu-amp` runs the model's forward and backward in bfloat16 on a CPU (its weights end
    elsewhere than float32's, the certified loss still trains); `--amp` alone keeps a CPU in
    float32 (the same weights as `--no-amp`); `--no-amp --cpu-amp` is one clear line."""
    import torch
    from safetensors.torch import load_file

    from lofast.config import TrainConfig
    from lofast.training.loop import autocast_enabled

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not autocast_enabled(TrainConfig(), cpu) and autocast_enabled(TrainConfig(), cuda)
    assert autocast_enabled(TrainConfig(cpu_amp=True), cpu)
    assert not autocast_enabled(TrainConfig(amp=False), cuda)
    args = TRAIN_ARGS + ["--data", str(data_dir), "--epochs", "1", "--loss", "certified",
                         "--train-eps", "0.1"]
    runner = CliRunner()
    weights = {}
    for name, extra in (("float32", ["--no-amp"]), ("amp", []), ("cpu_amp", ["--cpu-amp"])):
        out = tmp_path / f"{name}.safetensors"
        result = runner.invoke(cli, args + extra + ["--out", str(out)])
        assert result.exit_code == 0, result.output
        weights[name] = load_file(str(out))
    same = [torch.equal(weights["float32"][k], weights["amp"][k]) for k in weights["float32"]]
    assert all(same)
    moved = [not torch.equal(weights["float32"][k], weights["cpu_amp"][k])
             for k in weights["float32"]]
    assert any(moved)
    assert all(torch.isfinite(w).all() for w in weights["cpu_amp"].values())
    result = runner.invoke(cli, args + ["--no-amp", "--cpu-amp", "--out",
                                        str(tmp_path / "x.safetensors")])
    assert result.exit_code == 1 and "--cpu-amp" in result.output
    assert "Traceback" not in result.output
