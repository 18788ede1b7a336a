"""Inputs a careless or hostile user gives: every one ends in one `error:` line and a non-zero
exit, never a traceback, and leaves every file as it was; results are never lost or mixed."""

import errno
import hashlib
import json
import math
import os

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import assert_one_clear_error, record_lines

from lofast.certification.records import RecordWriter
from lofast.cli.main import cli

pytestmark = pytest.mark.usefixtures("shared_cache")


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def snapshot(folder):
    """Path -> SHA-256 of every regular file below folder (and the names of the others)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "not a file" for p in sorted(folder.rglob("*"))}


def certify_args(checkpoint, data_dir, *extra):
    return ["certify", "--checkpoint", checkpoint, "--data", data_dir, "--eps", "0.1",
            "--device", "cpu", *extra]


def train_args(data_dir, out, *extra):
    return ["train", "--dataset", "folder", "--data", data_dir, "--preset", "tiny",
            "--epochs", "1", "--batch-size", "16", "--device", "cpu", "--out", out, *extra]


# name -> (arguments, with {ckpt}, {data}, {work} replaced, and a text the error must contain)
BAD_INPUTS = {
    "device meta": (["certify", "--checkpoint", "{ckpt}", "--data", "{data}", "--eps", "0.1",
                     "--device", "meta"], "not supported"),
    "seed 2**70": (["certify", "--checkpoint", "{ckpt}", "--data", "{data}", "--eps", "0.1",
                    "--seed", str(2**70)], "seed"),
    "out under a regular file": (["certify", "--checkpoint", "{ckpt}", "--data", "{data}",
                                  "--eps", "0.1", "--out", "{work}/notes.txt/r.jsonl"],
                                 "cannot write"),
    "resume a text file": (["certify", "--checkpoint", "{ckpt}", "--data", "{data}", "--eps",
                            "0.1", "--out", "{work}/notes.txt", "--resume"], "not a lofast record"),
    "resume a binary file": (["certify", "--checkpoint", "{ckpt}", "--data", "{data}", "--eps",
                              "0.1", "--out", "{work}/binary.jsonl", "--resume"],
                             "not a lofast record"),
    "resume a record of the wrong type": (["certify", "--checkpoint", "{ckpt}", "--data",
                                           "{data}", "--eps", "0.1", "--out",
                                           "{work}/typed.jsonl", "--resume"], "not a lofast record"),
    "directory as checkpoint": (["certify", "--checkpoint", "{work}", "--eps", "0.1"],
                                "directory"),
    "train lr inf": (["train", "--data", "{data}", "--lr", "inf", "--out", "{work}/m.safetensors"],
                     "lr"),
    "train warm-up nan": (["train", "--data", "{data}", "--warmup-epochs", "nan", "--out",
                           "{work}/m.safetensors"], "warmup_epochs"),
    "train weight decay -1": (["train", "--data", "{data}", "--weight-decay", "-1", "--out",
                               "{work}/m.safetensors"], "weight_decay"),
    "train seed 2**70": (["train", "--data", "{data}", "--seed", str(2**70), "--out",
                          "{work}/m.safetensors"], "seed"),
    "train device meta": (["train", "--data", "{data}", "--device", "meta", "--out",
                           "{work}/m.safetensors"], "not supported"),
    "train unknown model option": (["train", "--dataset", "folder", "--data", "{data}",
                                    "--preset", "tiny", "--model-option", "bogus=1", "--out",
                                    "{work}/m.safetensors"], "bogus"),
    "train negative radius": (["train", "--dataset", "folder", "--data", "{data}", "--preset",
                               "tiny", "--model-option", "final_radius=-1", "--out",
                               "{work}/m.safetensors"], "final_radius"),
    "train zero heads": (["train", "--dataset", "folder", "--data", "{data}", "--preset", "tiny",
                          "--model-option", "heads=0", "--out", "{work}/m.safetensors"], "heads"),
    "train model option nested past the parser's depth": (
        ["train", "--dataset", "folder", "--data", "{data}", "--preset", "tiny", "--model-option",
         "width=" + "[" * 100_000 + "]" * 100_000, "--out", "{work}/m.safetensors"], "width"),
    "train string cap": (["train", "--dataset", "folder", "--data", "{data}", "--preset", "tiny",
                          "--model-option", "value_cap=big", "--out", "{work}/m.safetensors"],
                         "value_cap"),
    "train out under a regular file": (["train", "--dataset", "folder", "--data", "{data}",
                                        "--preset", "tiny", "--out",
                                        "{work}/notes.txt/m.safetensors"], "cannot write"),
    "train over an existing file": (["train", "--dataset", "folder", "--data", "{data}",
                                     "--preset", "tiny", "--out", "{work}/notes.txt"],
                                    "--overwrite"),
    "train resume a binary state": (["train", "--dataset", "folder", "--data", "{data}",
                                     "--preset", "tiny", "--epochs", "1", "--out",
                                     "{work}/garbled.safetensors", "--resume"], "unreadable"),
    # second round: reads that could never end or wait forever, plots over inputs, records
    # with values no run writes, small gaps
    "report /dev/zero": (["report", "/dev/zero"], "character device"),
    "report a FIFO": (["report", "{work}/fifo.jsonl"], "FIFO"),
    "resume /dev/full": (["certify", "--checkpoint", "{ckpt}", "--data", "{data}", "--eps",
                          "0.1", "--out", "/dev/full", "--resume"], "character device"),
    "checkpoint a device": (["certify", "--checkpoint", "/dev/null", "--eps", "0.1"],
                            "character device"),
    "plot over a run": (["report", "{work}/run.jsonl", "--plot", "{work}/run.jsonl"],
                        "one of the runs"),
    "plot of an unknown kind": (["report", "{work}/run.jsonl", "--plot", "{work}/curve.xyz"],
                                "must end in"),
    "plot over a FIFO": (["report", "{work}/run.jsonl", "--plot", "{work}/fifo.png"],
                         "not a regular file"),
    "plot to /dev/full": (["report", "{work}/run.jsonl", "--plot", "/dev/full"], "must end in"),
    "record with a NaN radius": (["report", "{work}/nan.jsonl"], "nan.jsonl:1: not a lofast"),
    "record with eps key abc": (["report", "{work}/abc.jsonl"], "abc.jsonl:1: not a lofast"),
    "record without verdicts": (["report", "{work}/empty.jsonl"], "empty.jsonl:1: not a"),
    "record with a numeric verifier": (["report", "{work}/verifier.jsonl"],
                                       "verifier.jsonl:1: not a lofast"),
    "record of 100,000 nested brackets": (["report", "{work}/nested.jsonl"],
                                          "nested.jsonl:1: not a lofast"),
    "baseline a FIFO": (["report", "{work}/run.jsonl", "--baseline", "{work}/fifo.jsonl"],
                        "FIFO"),
    "baseline /dev/zero": (["report", "{work}/run.jsonl", "--baseline", "/dev/zero"],
                           "character device"),
    "baseline with a NaN radius": (["report", "{work}/run.jsonl", "--baseline",
                                    "{work}/nan.jsonl"], "nan.jsonl:1: not a lofast"),
    "max drop nan": (["report", "{work}/run.jsonl", "--baseline", "{work}/run.jsonl",
                      "--max-drop", "0.1=nan"], "0 .. 100"),
    "train time limit nan": (["train", "--data", "{data}", "--time-limit", "nan", "--out",
                              "{work}/m.safetensors"], "time-limit"),
    "a million attack restarts": (["certify", "--checkpoint", "{ckpt}", "--data", "{data}",
                                   "--eps", "0.1", "--attack", "--attack-restarts", "1000000"],
                                  "attack-restarts"),
    "Jacobian slack nan": (["certify", "--checkpoint", "{ckpt}", "--data", "{data}", "--eps",
                            "0.1", "--jacobian-slack", "nan"], "jacobian_slack"),
    "Jacobian slack 2": (["certify", "--checkpoint", "{ckpt}", "--data", "{data}", "--eps",
                          "0.1", "--jacobian-slack", "2"], "jacobian_slack"),
    # third round: click's own checks quoted a hostile value whole (up to the OS's limit)
    "a batch size of 200,000 digits": (["certify", "--batch-size", "9" * 200_000 + "x"],
                                       "characters left out"),
    "an eps of 200,000 digits": (["certify", "--eps", "9" * 200_000 + "x"],
                                 "characters left out"),
    "a guarantee of 200,000 letters": (["certify", "--guarantee", "a" * 200_000],
                                       "characters left out"),
    "an option name with a terminal escape": (["certify", "--\x1b[31mred"], r"\x1b[31mred"),
}

# A valid record, and the values that hostile files put in its place.
RECORD = {"index": 0, "label": 0, "prediction": 0, "margin": 1.0, "radius": 0.1,
          "verdicts": {"0.1": True}, "bounds": {"0.1": 0.5}, "verifiers": {"0.1": "lofast"},
          "reasons": {}, "rule": "pairwise-head", "seconds": 0.0, "fallback_seconds": {},
          "run": {}}
HOSTILE_RECORDS = {
    "run.jsonl": json.dumps(RECORD),
    "nan.jsonl": json.dumps(RECORD).replace('"radius": 0.1', '"radius": NaN'),
    "abc.jsonl": json.dumps({**RECORD, "verdicts": {"abc": True}, "bounds": {},
                             "verifiers": {}}),
    "empty.jsonl": json.dumps({**RECORD, "verdicts": {}, "bounds": {}, "verifiers": {}}),
    "verifier.jsonl": json.dumps({**RECORD, "verifiers": {"0.1": 7}}),
    "nested.jsonl": "[" * 100_000 + "]" * 100_000,
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_clear_error_and_changes_nothing(case, checkpoint, data_dir, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("my notes, not records\n")
    (work / "binary.jsonl").write_bytes(bytes(range(256)))
    record = {"index": "zero", "label": 0, "prediction": 0, "margin": 1.0, "radius": 0.1,
              "verdicts": {"0.1": True}, "bounds": {"0.1": 0.0}, "verifiers": {"0.1": "lofast"},
              "reasons": {}, "rule": "pairwise-head", "seconds": 0.0, "fallback_seconds": {},
              "run": {}}
    (work / "typed.jsonl").write_text(json.dumps(record) + "\n")
    (work / "garbled.safetensors.state.pt").write_bytes(b"\x80\x04garbage")
    for name, line in HOSTILE_RECORDS.items():
        (work / name).write_text(line + "\n")
    os.mkfifo(work / "fifo.jsonl")  # reading it would wait for a writer forever
    os.mkfifo(work / "fifo.png")
    before = snapshot(work)
    args, needle = BAD_INPUTS[case]
    args = [a.format(ckpt=checkpoint, data=data_dir, work=work) for a in args]
    result = invoke(*args)
    assert_one_clear_error(result, needle)
    assert "epoch 1/" not in result.output  # refused before any training
    assert snapshot(work) == before


def test_second_writer_of_one_record_file_is_refused(checkpoint, data_dir, tmp_path):
    out = tmp_path / "r.jsonl"
    from lofast.certification.records import eps_key

    holder = RecordWriter(out, False, [0.1], {"run": eps_key(0.1)})  # another run, still going
    try:
        result = invoke(*certify_args(checkpoint, data_dir, "--out", out, "--resume"))
        assert_one_clear_error(result, "another lofast process")
    finally:
        holder.close()
    result = invoke(*certify_args(checkpoint, data_dir, "--out", tmp_path / "s.jsonl", "--n", "4"))
    assert result.exit_code == 0, result.output


def test_full_disk_keeps_finished_records(checkpoint, data_dir, tmp_path, monkeypatch):
    import lofast.certification.records

    out = tmp_path / "r.jsonl"
    calls = {"n": 0}
    real_fsync = os.fsync

    def fsync_then_fill(fd):  # the header, the session's line and a batch written, then full
        calls["n"] += 1
        if calls["n"] == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(lofast.certification.records.os, "fsync", fsync_then_fill)
    result = invoke(*certify_args(checkpoint, data_dir, "--out", out, "--batch-size", "2",
                                  "--n", "6"))
    assert_one_clear_error(result, "No space left")
    monkeypatch.setattr(lofast.certification.records.os, "fsync", real_fsync)
    result = invoke(*certify_args(checkpoint, data_dir, "--out", out, "--batch-size", "2",
                                  "--n", "6", "--resume", "--json"))
    assert result.exit_code == 0, result.output
    assert "resuming: 2 samples" in result.output or "resuming: 4 samples" in result.output
    assert json.loads(result.stdout)["samples"] == 6


def test_resume_counts_only_the_requested_samples(checkpoint, data_dir, tmp_path):
    out = tmp_path / "r.jsonl"
    assert invoke(*certify_args(checkpoint, data_dir, "--out", out, "--n", "8")).exit_code == 0
    result = invoke(*certify_args(checkpoint, data_dir, "--out", out, "--n", "2", "--resume",
                                  "--json"))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["samples"] == 2
    assert len(record_lines(out)) == 8  # the other records stay in the file


def test_distinct_eps_never_share_a_key(checkpoint, data_dir, tmp_path):
    out = tmp_path / "r.jsonl"
    args = ["certify", "--checkpoint", checkpoint, "--data", data_dir, "--n", "2", "--device",
            "cpu", "--out", out, "--eps"]
    assert invoke(*args, "36/255").exit_code == 0
    result = invoke(*args, "0.141176", "--resume")
    assert_one_clear_error(result, "same --eps")


def test_renamed_class_folder_is_refused(checkpoint, data_dir, tmp_path):
    import shutil

    renamed = tmp_path / "renamed"
    shutil.copytree(data_dir, renamed)
    for split in ("train", "test"):
        (renamed / split / "class0").rename(renamed / split / "zebra")
    result = invoke(*certify_args(checkpoint, renamed))
    assert_one_clear_error(result, "'zebra'", "'class0'")


def test_tampered_cache_is_rebuilt(data_dir, tmp_path):
    from lofast.data import load_dataset

    cache = tmp_path / "cache"
    honest = load_dataset(data_dir, "test", "folder", cache_dir=cache)
    (entry,) = cache.glob("*.npz")
    with np.load(entry) as npz:
        arrays = dict(npz)
    arrays["labels"] = np.zeros_like(arrays["labels"])  # every label 0, the key kept
    np.savez(entry, **arrays)
    again = load_dataset(data_dir, "test", "folder", cache_dir=cache)
    assert np.array_equal(again.labels, honest.labels) and again.labels.any()
    # the same, with the content digest recomputed for the tampered arrays: the seal (an HMAC
    # under the folder's secret) no longer matches
    from lofast.data import ImageDataset

    with np.load(entry) as npz:
        arrays = dict(npz)
    arrays["labels"] = np.zeros_like(arrays["labels"])
    forged = ImageDataset(arrays["images"], arrays["labels"],
                          tuple(str(c) for c in arrays["classes"]), str(arrays["name"]))
    arrays["digest"] = np.array(forged.digest())
    np.savez(entry, **arrays)
    again = load_dataset(data_dir, "test", "folder", cache_dir=cache)
    assert np.array_equal(again.labels, honest.labels)
    # a cache folder that others may write is not trusted: nothing is cached there
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    load_dataset(data_dir, "test", "folder", cache_dir=shared)
    assert not list(shared.glob("*.npz"))


def test_train_refuses_to_overwrite_unless_asked(data_dir, tmp_path):
    out = tmp_path / "m.safetensors"
    out.write_text("someone else's file")
    assert_one_clear_error(invoke(*train_args(data_dir, out)), "--overwrite")
    assert out.read_text() == "someone else's file"
    result = invoke(*train_args(data_dir, out, "--overwrite"))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("change, named", [
    (["--limit", "8"], "in data, limit"),
    (["--model-option", "depth=1"], "in model_config"),
    (["--preset", "paper-d3"], "in model_config"),
])
def test_train_resume_refuses_another_plan(data_dir, tmp_path, change, named):
    out = tmp_path / "m.safetensors"
    args = train_args(data_dir, out, "--epochs", "2")
    assert invoke(*args).exit_code == 0
    args = [a for a in args if a != "tiny"] if "--preset" in change else args
    if "--preset" in change:
        args.remove("--preset")
    result = invoke(*args, *change, "--resume")
    assert_one_clear_error(result, named)


def test_weights_gone_non_finite_mid_epoch_are_one_clear_error(data_dir, tmp_path,
                                                               monkeypatch):
    """A step that leaves non-finite weights between two loss checks (here a position bias,
    which the training bound does not read back): the next steps' losses are non-finite, and
    that is divergence, reported as such at the next check, not a traceback."""
    import torch

    import lofast.training.loop as train_module

    original = train_module.training_step
    calls = {"n": 0}

    def poison_bias(objective, *a, **k):  # 32 images in batches of 16: 2 steps per epoch
        calls["n"] += 1
        result = original(objective, *a, **k)
        if calls["n"] == 3:  # the first step of epoch 2
            with torch.no_grad():
                bias = next(p for n, p in objective.named_parameters()
                            if n.endswith("position_bias"))
                bias.fill_(float("nan"))
        return result

    monkeypatch.setattr(train_module, "training_step", poison_bias)
    out = tmp_path / "m.safetensors"
    result = invoke(*train_args(data_dir, out, "--epochs", "3", "--limit", "32", "--loss",
                                "certified", "--train-eps", "0.05", "--model-option",
                                "position_bias=true"))
    assert_one_clear_error(result, "diverged at epoch 2 (non-finite loss)")
    assert not out.exists()


def test_non_finite_weights_stop_training_and_keep_the_last_good_state(data_dir, tmp_path,
                                                                       monkeypatch):
    import torch

    import lofast.training.loop as train_module

    original = train_module.training_step
    calls = {"n": 0}

    def poison_in_epoch_two(model, *a, **k):  # 32 images in batches of 16: 2 steps per epoch
        calls["n"] += 1
        result = original(model, *a, **k)
        if calls["n"] == 4:  # after the last step of epoch 2
            with torch.no_grad():
                next(model.parameters()).fill_(float("inf"))
        return result

    monkeypatch.setattr(train_module, "training_step", poison_in_epoch_two)
    out = tmp_path / "m.safetensors"
    result = invoke(*train_args(data_dir, out, "--epochs", "3", "--limit", "32"))
    assert_one_clear_error(result, "non-finite weights in epoch 2")
    assert not out.exists()
    state = train_module.load_training_state(out.with_name(out.name + ".state.pt"))
    assert state["epoch"] == 1
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_a_2_gb_file_without_line_breaks_is_refused_without_reading_it(tmp_path):
    """A sparse 2 GB file of zeros as records: refused at its first MiB, not read whole."""
    import time

    sparse = tmp_path / "sparse.jsonl"
    with open(sparse, "wb") as f:
        f.truncate(2**31)
    started = time.perf_counter()
    assert_one_clear_error(invoke("report", sparse), "longer than")
    assert_one_clear_error(invoke("report", sparse, "--merge"), "longer than")
    assert time.perf_counter() - started < 5


def test_a_bound_that_overflows_certifies_nothing_and_every_record_is_written(data_dir,
                                                                                tmp_path):
    """Scores of norm 1e150 make every feature bound infinite: no sample is certified, each
    record says why (the overflow, or a misclassification, for which no bound is computed),
    and the file is valid JSON (not a ValueError when it is written)."""
    import torch

    from lofast.checkpoint import save_checkpoint
    from lofast.config import preset
    from lofast.models.vit import create_model

    model = create_model(preset("tiny", num_classes=4, score_norm=1e150), seed=0)
    with torch.no_grad():  # class 0 wins everywhere: its four images are bounded
        model.stages[-1].bias[0] = 10.0
    checkpoint = tmp_path / "huge.safetensors"
    save_checkpoint(checkpoint, model, {"dataset": "folder",
                                        "classes": [f"class{c}" for c in range(4)]})
    out = tmp_path / "r.jsonl"
    result = invoke(*certify_args(checkpoint, data_dir, "--out", out, "--json"))
    assert result.exit_code == 0, result.output
    records = record_lines(out)
    assert len(records) == 16
    for r in records:  # a misclassified sample gets no bound at all
        assert r["verdicts"] == {"0.1": False} and r["bounds"] == {"0.1": None}
        assert r["reasons"] == {"0.1": "bound overflow" if r["prediction"] == r["label"]
                                else "misclassified"} and r["radius"] == 0
    assert sum(r["prediction"] == r["label"] for r in records) == 4  # their bounds overflowed
    assert invoke("report", out).exit_code == 0


def test_a_full_disk_at_the_training_state_is_one_line_and_keeps_the_last_state(
        data_dir, tmp_path, monkeypatch):
    """torch reports a full disk as RuntimeError: the command gives one line, and the state
    file written before is left as it was."""
    import torch

    out = tmp_path / "m.safetensors"
    assert invoke(*train_args(data_dir, out)).exit_code == 0
    state = out.with_name(out.name + ".state.pt")
    before = state.read_bytes()
    real_save = torch.save

    def full(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)  # a part is written, then the disk is full
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64")

    monkeypatch.setattr(torch, "save", full)
    result = invoke(*train_args(data_dir, out, "--overwrite"))
    assert_one_clear_error(result, "write failed", "unchanged")
    assert state.read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp"))


def test_interrupts_name_resume_only_where_a_command_has_it(monkeypatch, tmp_path):
    import lofast.certification.records

    path = tmp_path / "run.jsonl"
    path.write_text(HOSTILE_RECORDS["run.jsonl"] + "\n")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(lofast.certification.records, "load_run", interrupted)
    result = invoke("report", path)
    assert result.exit_code == 130 and "interrupted" in result.output
    assert "--resume" not in result.output


def test_a_head_with_a_zero_row_is_certified():
    """A class whose head row is all zeros scores its bias alone; the model stays finite and
    certifiable (it was refused as 'NaN or infinity')."""
    import torch

    from lofast.certification.certificate import Certifier
    from lofast.config import preset
    from lofast.models.vit import create_model

    model = create_model(preset("tiny", num_classes=4), seed=0)
    with torch.no_grad():
        model.stages[-1].weight[2].zero_()
    x = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    certificate = Certifier(model).certify(x, torch.tensor([0, 1, 2, 3]))
    assert torch.isfinite(certificate.margins[certificate.margins < math.inf]).all()


def test_a_checkpoint_that_names_no_classes_needs_classes_unchecked(data_dir, tmp_path):
    """Without class names in its metadata, a checkpoint's labels could mean anything (a
    renamed class folder gave 7.5 % clean accuracy, silently): refused unless asked."""
    from lofast.checkpoint import save_checkpoint
    from lofast.config import preset
    from lofast.models.vit import create_model

    checkpoint = tmp_path / "nameless.safetensors"
    save_checkpoint(checkpoint, create_model(preset("tiny", num_classes=4), seed=0),
                    {"dataset": "folder"})
    assert_one_clear_error(invoke(*certify_args(checkpoint, data_dir, "--n", "2")),
                           "--classes-unchecked")
    assert invoke(*certify_args(checkpoint, data_dir, "--n", "2",
                                "--classes-unchecked")).exit_code == 0


def test_counterexamples_of_two_runs_share_a_folder_and_a_bad_folder_stops_first(
        checkpoint, data_dir, tmp_path):
    """--save-adversarial: files are named by their run, so a second run with another checkpoint
    adds its own and overwrites none; a folder that cannot be one is refused before any work."""
    from lofast.checkpoint import save_checkpoint
    from lofast.config import preset
    from lofast.models.vit import create_model

    other = tmp_path / "other.safetensors"
    save_checkpoint(other, create_model(preset("tiny", num_classes=4), seed=1),
                    {"dataset": "folder", "classes": [f"class{c}" for c in range(4)]})
    saved = tmp_path / "adversarial"
    attack = ("--attack", "--attack-steps", "5", "--attack-restarts", "1", "--n", "4",
              "--save-adversarial", saved)
    assert invoke(*certify_args(checkpoint, data_dir, *attack)).exit_code == 0
    first = snapshot(saved)
    assert first
    assert invoke(*certify_args(other, data_dir, *attack)).exit_code == 0
    second = snapshot(saved)
    assert {k: second[k] for k in first} == first and len(second) > len(first)
    notes = tmp_path / "notes.txt"
    notes.write_text("not a folder\n")
    out = tmp_path / "r.jsonl"
    result = invoke(*certify_args(checkpoint, data_dir, "--attack", "--out", out,
                                  "--save-adversarial", notes / "adversarial"))
    assert_one_clear_error(result, "cannot write")
    assert not out.exists() and notes.read_text() == "not a folder\n"


def test_a_schema_1_file_resumes_as_schema_1(checkpoint, data_dir, tmp_path):
    """A record file written before the header (schema 1) is continued in its own schema, and
    a file of a newer schema is refused in one line."""
    import lofast
    from lofast.certification.records import read_run

    out = tmp_path / "r.jsonl"
    run = lofast.certify(checkpoint, data_dir, eps=0.1, n=4, device="cpu")
    out.write_text("".join(r.to_json(schema=1) + "\n" for r in run.records))
    result = invoke(*certify_args(checkpoint, data_dir, "--n", "8", "--out", out, "--resume"))
    assert result.exit_code == 0, result.output
    lines = out.read_text().splitlines()
    assert len(lines) == 8 and all('"run": ' in line for line in lines)
    assert [r.index for r in read_run(out)[:4]] == [r.index for r in run.records]
    newer = tmp_path / "newer.jsonl"
    newer.write_text('{"schema": 5, "eps": ["0.1"], "run": {}}\n')
    assert_one_clear_error(invoke("report", newer), "schema 5")


def test_a_benchmark_checks_its_out_file_before_it_measures(tmp_path):
    """A benchmark runs for minutes: an --out it cannot write stops it at the argument check with
    one error line (argparse's exit 2), and an --out in a folder not yet made gets the folder."""
    import subprocess
    import sys
    from pathlib import Path

    benchmarks = Path(__file__).parents[1] / "benchmarks"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out in (blocker / "figures.json", tmp_path):  # under a file; a folder
        result = subprocess.run([sys.executable, str(benchmarks / "bench_tokens.py"), "--out",
                                 str(out)], check=False, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith(
            "bench_tokens.py: error: argument --out:"), result.stderr
    sys.path.insert(0, str(benchmarks))
    try:
        from measure import output_file
    finally:
        sys.path.remove(str(benchmarks))
    target = tmp_path / "new" / "deeper" / "figures.json"
    assert output_file(str(target)) == str(target)
    assert target.parent.is_dir() and not target.exists()


def test_control_characters_in_a_folder_name_stay_in_one_escaped_error_line(tmp_path):
    # class folders named with a terminal escape and a newline: the error that names them is
    # one line, the escape written out (it would recolour the terminal), not sent
    from PIL import Image

    for name in ("a\x1b[31mred", "b\nnewline"):
        for split in ("train", "test"):
            (tmp_path / split / name).mkdir(parents=True)
            Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / split / name / "0.png")
    result = invoke("certify", "--data", str(tmp_path), "--eps", "0.1")
    assert_one_clear_error(result, "10 classes", r"a\x1b[31mred", r"b\nnewline")
    assert "\x1b" not in result.output and result.output.strip().count("\n") == 0
