"""Certification split over processes: shards (job arrays) and torchrun ranks give the records
and the summary of one process on the same samples."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from lofast.certification.records import load_run, read_run
from lofast.cli.main import cli

COMPARED = ("samples", "clean_accuracy", "certified_accuracy", "median_radius", "falsified")


@pytest.fixture(scope="module")
def setup(data_dir, checkpoint):
    return data_dir, checkpoint


def certify_args(setup, out, *extra):
    root, checkpoint = setup
    return ["certify", "--checkpoint", str(checkpoint), "--data", str(root),
            "--device", "cpu", "--eps", "0.05", "--eps", "0.3", "--limit", "12", "--batch-size",
            "4", "--attack", "--attack-steps", "5", "--attack-restarts", "1", "--json",
            "--out", str(out), *extra]


@pytest.fixture(scope="module")
def single(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "all.jsonl"
    result = CliRunner().invoke(cli, certify_args(setup, out))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), {r.index: r for r in read_run(out)}


def assert_same_records(records, reference):
    assert sorted(r.index for r in records) == sorted(reference)
    for r in records:
        ref = reference[r.index]
        assert {e: (x.certified, x.falsified) for e, x in r.results.items()} == {
            e: (x.certified, x.falsified) for e, x in ref.results.items()}
        assert r.prediction == ref.prediction
        assert r.radius == pytest.approx(ref.radius, rel=1e-9, abs=1e-12)


def test_shards_merge_into_the_single_run(setup, single, tmp_path):
    parts = []
    for i in range(3):
        out = tmp_path / f"part{i}.jsonl"
        result = CliRunner().invoke(cli, certify_args(setup, out, "--shard", f"{i}/3"))
        assert result.exit_code == 0, result.output
        shown = json.loads(result.stdout)
        assert shown["samples"] == 4  # a part's figures say they are a part's
        assert shown["part"] == {"part": i, "parts": 3, "samples": 12}
        parts.append(str(out))
    alone = CliRunner().invoke(cli, ["report", parts[1]])
    assert "part 1/3 of a run of 12" in " ".join(alone.output.split())
    merged = CliRunner().invoke(cli, ["report", "--merge", "--json", *parts])
    assert merged.exit_code == 0, merged.output
    (summary,) = json.loads(merged.stdout).values()
    assert summary["part"] is None
    for key in COMPARED:
        assert summary[key] == pytest.approx(single[0][key])
    assert_same_records([r for p in parts for r in read_run(p)], single[1])


def test_merge_refuses_parts_of_other_runs(setup, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert CliRunner().invoke(cli, certify_args(setup, a, "--shard", "0/2")).exit_code == 0
    assert CliRunner().invoke(cli, certify_args(setup, b, "--shard", "1/2", "--bound",
                                                "naive")).exit_code == 0
    result = CliRunner().invoke(cli, ["report", "--merge", str(a), str(b)])
    assert result.exit_code == 1 and "one run" in result.output


def test_merge_takes_exactly_a_complete_set_of_shards(setup, tmp_path):
    """Every part I of N once, with all its samples, of runs over one number of samples: a part
    with no samples may be empty; a missing part, one given twice, or parts of runs over other
    numbers of samples are refused, naming what is wrong."""
    root, checkpoint = setup

    def shard(part, limit):
        out = tmp_path / f"n{limit}-{part.replace('/', 'of')}.jsonl"
        result = CliRunner().invoke(cli, [
            "certify", "--checkpoint", str(checkpoint), "--data", str(root), "--device", "cpu",
            "--eps", "0.05", "--limit", str(limit), "--shard", part, "--out", str(out)])
        assert result.exit_code == 0, result.output
        return str(out)

    def merge(*parts):
        return CliRunner().invoke(cli, ["report", "--merge", "--json", *parts])

    small = [shard(f"{i}/3", 2) for i in range(3)]  # part 2 of 3 has no sample of 2
    assert read_run(tmp_path / "n2-2of3.jsonl", allow_empty=True) == []
    for parts in (small, small[:2]):
        result = merge(*parts)
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)[" + ".join(p.split("/")[-1] for p in parts)][
            "samples"] == 2
    large = [shard(f"{i}/3", 5) for i in range(3)]
    assert merge(*large).exit_code == 0
    result = merge(*large[:2])
    assert result.exit_code == 1 and "2/3 (0 of 1 samples)" in result.output
    again = tmp_path / "again.jsonl"
    again.write_bytes(Path(large[0]).read_bytes())
    result = merge(*large, str(again))
    assert result.exit_code == 1 and "0/3 (4 of 2 samples)" in result.output
    result = merge(small[0], small[1], large[2])
    assert result.exit_code == 1 and "different runs" in result.output


@pytest.mark.parametrize("shard", ["2/2", "x", "1/0"])
def test_bad_shard_is_one_clear_error(setup, tmp_path, shard):
    result = CliRunner().invoke(cli, certify_args(setup, tmp_path / "o.jsonl", "--shard", shard))
    assert result.exit_code == 2 and ("I/N" in result.output or "0 .. N-1" in result.output)


@pytest.mark.parametrize(("environment", "named"), [
    ({"WORLD_SIZE": "2"}, "RANK, MASTER_ADDR and MASTER_PORT are not set"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR and MASTER_PORT are not set"),
    ({"WORLD_SIZE": "0"}, "at least one process"),
    ({"WORLD_SIZE": "2", "RANK": "5", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"},
     "outside WORLD_SIZE 2"),
])
def test_a_partial_torchrun_environment_is_one_clear_error(setup, tmp_path, monkeypatch,
                                                           environment, named):
    # WORLD_SIZE left set in a shell or a job script without the rest of torchrun's variables:
    # one line before any work, not torch.distributed's traceback
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    for args in (certify_args(setup, tmp_path / "o.jsonl"),
                 ["train", "--dataset", "folder", "--data", str(setup[0]), "--preset", "tiny",
                  "--out", str(tmp_path / "m.safetensors")]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 1 and named in result.output, result.output
        assert "Traceback" not in result.output and not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize(("args", "code", "stream", "text"),
                         [(["--version"], 0, "stdout", "lofast, version"),
                          (["nosuch"], 2, "stderr", "No such command")])
def test_a_torchrun_process_ends_without_finalization(args, code, stream, text):
    """With WORLD_SIZE > 1 the command's process ends by os._exit once its output is flushed
    (``cli.main.main``: gloo can abort a process in Python's finalization): the output and the
    exit code survive and nothing registered with atexit runs; a single process finalizes."""
    program = ("import atexit, sys; atexit.register(lambda: print('finalized')); "
               f"sys.argv = ['lofast', *{args!r}]; from lofast.cli.main import main; main()")
    for world, finalized in (("2", False), ("1", True)):
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                              env={**os.environ, "WORLD_SIZE": world}, timeout=60, check=False)
        assert done.returncode == code, done.stderr
        assert text in getattr(done, stream)
        assert ("finalized" in done.stdout) == finalized


@pytest.mark.slow
def test_torchrun_with_two_gloo_processes_equals_one_process(setup, single, tmp_path):
    out = tmp_path / "merged.jsonl"
    # (--limit, not --n: torchrun would read --n as an abbreviation of its own options)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "LOFAST_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "lofast", *certify_args(setup, out)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)  # rank 0 alone prints
    for key in COMPARED:
        assert summary[key] == pytest.approx(single[0][key])
    assert_same_records(read_run(out), single[1])
    for rank in range(2):
        assert len(read_run(tmp_path / f"merged.jsonl.rank{rank}of2")) == 6
    # the merged file keeps where each rank ran and its proofs' time
    sessions = load_run(out).sessions
    assert len(sessions) == 2 and all(s.device.startswith("cpu (") for s in sessions)
    assert summary["proof_seconds"] in [s.proof_seconds for s in sessions]


def torchrun(args, tmp_path, processes=2):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOFAST_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(processes), "-m", "lofast", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300,
                          check=False)


def train_args(setup, out, *extra):
    root, _ = setup
    return ["train", "--dataset", "folder", "--data", str(root), "--preset", "tiny",
            "--batch-size", "16", "--device", "cpu", "--no-augment", "--lr", "3e-3",
            "--out", str(out), *extra]


def assert_same_run(a, b):
    """Two checkpoints of the same run, up to the rounding of gradients averaged over processes:
    their weights, and every epoch's training loss and accuracy in their records."""
    from safetensors.torch import load_file

    from lofast.checkpoint import read_metadata

    weights_a, weights_b = load_file(str(a)), load_file(str(b))
    for key in weights_a:
        assert torch.allclose(weights_a[key], weights_b[key], rtol=1e-4, atol=1e-5), key
    history_a, history_b = (read_metadata(path)["history"] for path in (a, b))
    assert len(history_a) == len(history_b)
    for epoch_a, epoch_b in zip(history_a, history_b):
        assert epoch_b["train_loss"] == pytest.approx(epoch_a["train_loss"], rel=1e-5)
        assert epoch_b["train_accuracy"] == epoch_a["train_accuracy"]


@pytest.fixture(scope="module")
def one_process_model(setup, tmp_path_factory, one_thread):
    """Two epochs of plain training in this process, on one thread as torchrun's processes."""
    one = tmp_path_factory.mktemp("one") / "one.safetensors"
    assert CliRunner().invoke(cli, train_args(setup, one, "--epochs", "2")).exit_code == 0
    return one


@pytest.mark.slow
def test_torchrun_resumes_a_one_process_run_to_the_same_model(setup, tmp_path, one_process_model,
                                                              one_thread):
    """A run stopped by its time limit after one step on one process, resumed by two gloo
    processes averaging the gradients of half batches: they take the steps one process takes on
    whole batches (up to rounding), across the epoch boundary, and the epochs' records count
    the steps before the stop once; rank 0 alone writes."""
    two = tmp_path / "two.safetensors"
    cut = CliRunner().invoke(cli, train_args(setup, two, "--epochs", "2", "--time-limit", "1e-6"))
    assert cut.exit_code != 0 and "time limit reached after epoch 1, step 1/" in cut.output
    done = torchrun(train_args(setup, two, "--epochs", "2", "--resume"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("saved ") == 1 and "2 processes" in done.stderr
    assert_same_run(one_process_model, two)


@pytest.mark.slow
def test_torchrun_certified_training(setup, tmp_path):
    """The certified loss trains data-parallel too. Its bound is an estimate from random power
    iteration starts of the shape of each process's part of the batch, so the runs are close,
    not equal."""
    certified = ["--epochs", "2", "--loss", "certified", "--train-eps", "0.1"]
    one = tmp_path / "one.safetensors"
    assert CliRunner().invoke(cli, train_args(setup, one, *certified)).exit_code == 0
    two = tmp_path / "two.safetensors"
    done = torchrun(train_args(setup, two, *certified), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    from lofast.checkpoint import read_metadata

    losses = [read_metadata(p)["history"][-1]["train_loss"] for p in (one, two)]
    assert losses[1] == pytest.approx(losses[0], rel=0.05)


@pytest.mark.parametrize(("stop", "rank", "code", "line"), [
    ("time limit", 0, 75, "time limit reached after"), ("time limit", 1, 0, None),
    ("SIGTERM", 0, 143, "interrupted (SIGTERM) after"), ("SIGTERM", 1, 0, None)])
def test_a_stop_exits_with_its_code_on_the_leader_only(setup, tmp_path, monkeypatch, stop, rank,
                                                       code, line):
    """torchrun stops every process once one exits with an error, so a process other than the
    leader, stopped by --time-limit or a signal, exits 0 and leaves the leader to save, report
    and exit 75 or 143 (a second process exiting 75 first had the leader killed before it
    could report)."""
    import signal

    import lofast.distributed
    import lofast.training.pipeline
    from lofast.errors import TimeLimitReached, TrainingInterrupted

    def stopped(*args, **kwargs):
        if stop == "time limit":
            raise TimeLimitReached("epoch 1, step 1/2", [])
        raise TrainingInterrupted("epoch 1, step 1/2", [], signal.SIGTERM)

    monkeypatch.setattr(lofast.training.pipeline, "run_train", stopped)
    monkeypatch.setattr(lofast.distributed, "torchrun_rank", lambda: (rank, 2))
    result = CliRunner().invoke(cli, train_args(setup, tmp_path / "m.safetensors"))
    assert result.exit_code == code, result.output
    assert (line is not None) == (f"{line} epoch 1, step 1/2" in result.output)


# (signal received by process 0 and 1, their deadlines, the stop both must agree on)
STOP_CASES = [
    ((0, 0), (None, None), 0),
    ((0, 0), (None, 0.0), 1),  # one process past its deadline: a time limit for both
    ((15, 0), (None, None), 15),  # SIGTERM reached one process first
    ((2, 0), (None, 0.0), 2),  # a signal outranks a time limit
]


def _agree_on_stop(rank: int, store_path: str, answers) -> None:
    """One process of test_every_process_stops_for_the_same_reason."""
    import torch.distributed as dist

    from lofast.training.loop import StopSignals, _stop_requested

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank,
                            world_size=2)
    try:
        for received, deadlines, _ in STOP_CASES:
            signals = StopSignals()
            signals.received = received[rank]
            answers.put((rank, _stop_requested(deadlines[rank], signals)))
    finally:
        dist.destroy_process_group()


def test_every_process_stops_for_the_same_reason(tmp_path):
    """Two gloo processes: whichever sees a signal or its deadline first, both stop at that step
    and for the same reason, else one would wait in the next step's gradient reduction."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    answers = context.Queue()
    processes = [context.Process(target=_agree_on_stop,
                                 args=(rank, str(tmp_path / "store"), answers))
                 for rank in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(120)
    assert [p.exitcode for p in processes] == [0, 0]
    got = [answers.get(timeout=5) for _ in range(2 * len(STOP_CASES))]
    for rank in range(2):
        assert [code for r, code in got if r == rank] == [agreed for *_, agreed in STOP_CASES]


@pytest.mark.slow
def test_torchrun_run_stopped_by_time_limit_resumes_on_one_process(setup, tmp_path,
                                                                  one_process_model, one_thread):
    one = one_process_model
    cut = tmp_path / "cut.safetensors"
    done = torchrun(train_args(setup, cut, "--epochs", "2", "--time-limit", "1e-6"), tmp_path)
    assert done.returncode != 0 and "time limit reached after epoch 1, step 1/" in done.stderr, \
        done.stderr[-4000:]  # the workers' own errors, should this ever fail again
    from lofast.checkpoint import read_metadata

    assert read_metadata(cut)["stopped"].startswith("time limit after epoch 1, step 1/")
    result = CliRunner().invoke(cli, train_args(setup, cut, "--epochs", "2", "--resume"))
    assert result.exit_code == 0, result.output
    assert_same_run(one, cut)  # the stopped step's sums of both processes counted once
