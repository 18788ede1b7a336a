"""The training pipeline and its one driver, ``run_train``: data, the model (a preset, or a
checkpoint to start from), the device (one process or a torchrun job), the resume plan, the
loop (``training.loop``), and the checkpoint with its training record. The command line
(``lofast train``) and the Python API (``lofast.train``) both build a ``config.TrainConfig`` and
a ``config.TrainRun`` and call it; nothing here prints.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import asdict
from typing import Any

from lofast.config import TrainConfig, TrainRun, check_progress
from lofast.errors import ConfigError, LofastError, TimeLimitReached, TrainingInterrupted
from lofast.training.loop import EpochStats, StepStats


class TrainProgress:
    """What ``run_train`` reports as it goes; every method does nothing here (the API's
    default), the command line draws a bar and lines (``cli.train_cmd``). Only the process that
    writes (rank 0 under torchrun) is told."""

    def note(self, text: str) -> None:
        """A one-off message (what is trained, where)."""

    def step(self, stats: StepStats) -> None:
        """After a step (every few steps: ``train.SYNC_STEPS``)."""

    def epoch(self, stats: EpochStats) -> None:
        """After an epoch, with its test accuracy."""


def run_train(config: TrainConfig, run: TrainRun, progress: TrainProgress | None = None,
              provenance: dict[str, Any] | None = None) -> list[EpochStats]:
    """Train as ``config`` says on ``run``'s data and write the checkpoint ``run.out`` with its
    training record (``provenance``: how the run was asked for, e.g. the command line, stored
    as the checkpoint's ``train_command``); returns the epochs' statistics. A time limit saves
    the state and the weights so far (the checkpoint marked as stopped) and raises
    ``TimeLimitReached``; a SIGINT or SIGTERM on the main thread does the same and raises
    ``TrainingInterrupted`` (``training.loop.StopSignals``); ``run.resume`` continues from the
    state exactly. Under torchrun every process must call it; process 0 writes."""
    import time

    import torch

    from lofast.checkpoint import file_digest, load_checkpoint, save_checkpoint
    from lofast.config import preset as make_preset
    from lofast.data import load_dataset
    from lofast.data.sample import class_balanced_order
    from lofast.distributed import process_group, torchrun_rank
    from lofast.files import check_writable
    from lofast.models.vit import create_model, with_options
    from lofast.runtime import describe_device, resolve_device
    from lofast.training.loop import StopSignals, train

    if progress is not None:
        check_progress(progress, TrainProgress, ConfigError)
    progress = progress or TrainProgress()
    deadline = None if run.time_limit is None else time.monotonic() + run.time_limit
    out, init = run.out, run.init
    state_path = out.with_name(out.name + ".state.pt")
    resuming = run.resume and state_path.is_file()
    if out.exists() and not (run.overwrite or resuming):
        raise LofastError(f"{out} exists; pass --overwrite to replace it or choose another --out")
    check_writable(out)  # before any training: a run must not fail only when it saves
    device = resolve_device(run.device)
    ranks = torchrun_rank()  # (rank, world size) under torchrun with several processes
    if run.compile and (device.type != "cuda" or ranks is not None):
        raise LofastError("--compile captures CUDA graphs: it needs a CUDA device and one "
                          "process")
    leader = ranks is None or ranks[0] == 0  # writes the checkpoint, the state and the log
    with contextlib.ExitStack() as stack:
        if ranks is not None:
            if device.type == "cuda":
                import os

                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(device)
            # gloo carries the CPU flags (time limit, divergence), NCCL the GPU gradients
            stack.enter_context(process_group("cpu:gloo,cuda:nccl" if device.type == "cuda"
                                              else "gloo"))
        train_set = load_dataset(run.data, "train", run.dataset, download=run.download)
        test_set = load_dataset(run.data, "test", run.dataset)
        height, _, channels = train_set.images.shape[1:]
        data_shape = {"num_classes": len(train_set.classes), "image_size": height,
                      "channels": channels}
        if init is None:
            model = create_model(make_preset(run.preset, **data_shape, **run.model_options),
                                 seed=config.seed)
            architecture = run.preset
        else:
            model = load_checkpoint(init)
            if run.model_options:
                model = with_options(model, **run.model_options)
            stored = {key: getattr(model.config, key) for key in data_shape}
            if stored != data_shape:
                raise LofastError(f"{init}: built for {stored}, the data set has {data_shape}")
            architecture = f"{init.name} (--init)"
        if run.limit is not None:
            # class-balanced: data sets stored class by class would otherwise give a few
            # classes
            train_set = train_set.subset(class_balanced_order(train_set.labels)[:run.limit])
        torch.manual_seed(config.seed)
        init_digest = None if init is None else file_digest(init)
        # what a resumed run must share with the run it continues, besides the settings
        plan = {"model_config": model.config.to_json(), "dataset": train_set.name,
                "data": train_set.digest()[:16], "limit": run.limit,
                "init": None if init is None else init_digest[:16]}
        processes = "" if ranks is None else f", {ranks[1]} processes"
        # the pause at the second step (and at an epoch's last, smaller batch) is compilation
        compiled = (", compiled (compiling pauses it at the second step and at the first "
                    "epoch's last batch)") if run.compile else ""
        if leader:
            progress.note(f"training {architecture} on {train_set.name} ({len(train_set)} "
                          f"train, {len(test_set)} test images) on {device}{processes}"
                          f"{compiled}")
        options = {**{k: (str(v) if v is not None and k in ("data", "out", "init") else v)
                      for k, v in asdict(run).items()}, **asdict(config)}
        options = {k: (v.value if hasattr(v, "value") else v) for k, v in options.items()}

        def write_checkpoint(history: list[EpochStats], stopped: str | None = None) -> None:
            """The model as it is now, with its training record; ``stopped``: why and where a
            time limit or a signal cut the run (the file is then the weights so far, for a
            look meanwhile)."""
            final = history[-1] if history else None
            save_checkpoint(out, copy.deepcopy(model).cpu(), metadata={
                "dataset": train_set.name,
                "classes": list(train_set.classes),
                "train_command": provenance if provenance is not None else options,
                "train_options": options,
                **({} if init is None else {"init_checkpoint_sha256": init_digest}),
                "clean_accuracy": None if final is None else final.test_accuracy,
                "epochs": 0 if final is None else final.epoch,
                **({} if stopped is None else {"stopped": stopped}),
                "device": describe_device(device),
                "train_seconds": sum(h.seconds for h in history),
                "history": [h.__dict__ for h in history],
            })

        try:
            with StopSignals() as signals:
                history = train(model, train_set.images, train_set.labels, test_set.images,
                                test_set.labels, config, device, state_path=state_path,
                                resume=run.resume, plan=plan,
                                on_step=progress.step if leader else None,
                                on_epoch=progress.epoch if leader else None,
                                deadline=deadline, signals=signals,
                                compile_mode="cudagraphs" if run.compile else None)
        except (TimeLimitReached, TrainingInterrupted) as stop:
            if leader:
                write_checkpoint(stop.history, f"{stop.reason} after {stop}")
            raise
        if leader:
            write_checkpoint(history)
    return history
