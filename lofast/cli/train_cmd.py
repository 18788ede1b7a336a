"""`lofast train`: train a Lipschitz ViT and write a safetensors checkpoint."""

from __future__ import annotations

import copy
import json
import os
import shlex
import sys
import time
from pathlib import Path

import click

from lofast.cli.certify_cmd import PositiveFloat
from lofast.cli.console import stderr as console
from lofast.config import DATASETS, Loss, Schedule

# Exit code of a run stopped by --time-limit (EX_TEMPFAIL): not done, nothing wrong, resumable.
EXIT_TIME_LIMIT = 75


def parse_model_options(options: tuple[str, ...]) -> dict:
    """'key=value' pairs; values are JSON (numbers, null) or plain strings; 'none' means None."""
    from lofast.errors import LofastError

    parsed = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise LofastError(f"--model-option expects key=value, got {option!r}")
        if value.lower() == "none":
            parsed[key.replace("-", "_")] = None
            continue
        try:
            parsed[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key.replace("-", "_")] = value
    return parsed


@click.command()
@click.option("--dataset", type=click.Choice(DATASETS), default="cifar10",
              show_default=True)
@click.option("--data", "data_path", type=click.Path(path_type=Path), required=True,
              help="Data set location: official files, an image folder or a .tar(.gz) of one.")
@click.option("--download", is_flag=True, help="Download CIFAR-10 to --data if it is absent.")
@click.option("--preset", default="paper-d3", show_default=True, help="Model preset.")
@click.option("--model-option", "model_options", multiple=True, metavar="KEY=VALUE",
              help="Override a model config field, e.g. value_cap=0.4 (repeatable).")
@click.option("--init", "init_path", type=click.Path(path_type=Path, dir_okay=False),
              default=None,
              help="Start from this checkpoint's weights and architecture (fine-tuning, or "
                   "more epochs on a new schedule); replaces --preset and --model-option, "
                   "except --model-option position_bias=true, which adds zero position biases "
                   "(the same function) to a checkpoint without them, score_norm=G, which "
                   "fixes every head's ||Wq_l Wk_l^T|| at G, query_key=identity, which "
                   "replaces the learned Wq, Wk by the identity, value_norm=B, which fixes "
                   "every head's ||Wv_l Wo_l|| at B, and live_blocks=N, which confines those "
                   "three to the last N blocks (value_output=identity and live_first=true only "
                   "from scratch).")
@click.option("--epochs", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--lr", type=float, default=1e-3, show_default=True)
@click.option("--weight-decay", type=float, default=0.0, show_default=True)
@click.option("--warmup-epochs", type=float, default=1.0, show_default=True)
@click.option("--schedule", type=click.Choice([s.value for s in Schedule]), default="cosine",
              show_default=True)
@click.option("--loss", type=click.Choice([loss.value for loss in Loss]), default="ce",
              show_default=True,
              help="margin: Lipschitz-margin cross-entropy (a fixed feature-space margin). "
                   "certified: cross-entropy on logits worsened by the LoFAST bound at "
                   "--train-eps for every sample. The training bound is an estimate (power "
                   "iteration from below) that only guides learning; certify the result with "
                   "`lofast certify`, whose bounds are sound.")
@click.option("--margin", type=float, default=0.0, show_default=True,
              help="Feature-space margin for --loss margin.")
@click.option("--train-eps", type=float, default=0.0, show_default=True,
              help="Image-space l2 radius for --loss certified.")
@click.option("--eps-ramp-epochs", type=float, default=0.0, show_default=True,
              help="--loss certified: grow the radius linearly from 0 over these epochs.")
@click.option("--clean-mix", type=float, default=0.0, show_default=True,
              help="--loss certified: weight of clean cross-entropy in the loss (0 to 1).")
@click.option("--power-iterations", type=click.IntRange(min=1), default=2, show_default=True,
              help="--loss certified: power steps per batch for zeta (warm-started).")
@click.option("--softmax-jacobian/--no-softmax-jacobian", default=True, show_default=True,
              help="--loss certified: include the second-order refinement of the softmax term "
                   "(as `lofast certify` does by default); one more power iteration per block.")
@click.option("--ablation-margin", type=float, default=0.0, show_default=True,
              help="Attention reward: a hinge penalty until replacing every block's attention "
                   "by its batch mean raises the cross-entropy by this many nats (0: off). "
                   "Keeps certified training from switching attention off.")
@click.option("--ablation-weight", type=float, default=1.0, show_default=True,
              help="Weight of the --ablation-margin penalty in the loss.")
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--augment/--no-augment", default=True, show_default=True,
              help="Random crop and horizontal flip. The small presets underfit CIFAR-10 "
                   "(train accuracy = test accuracy); there --no-augment trains better models "
                   "(see the model card).")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True)
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:1 ...")
@click.option("--amp/--no-amp", default=True, show_default=True,
              help="bfloat16 autocast (GPU only).")
@click.option("--compile", "compile_step", is_flag=True,
              help="Capture each training step in CUDA graphs (torch.compile, cudagraphs "
                   "backend): a certified step waits for thousands of kernel launches "
                   "otherwise. One CUDA device, one process; the first steps compile (about "
                   "20 s). Same function: a run may resume with or without it.")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Train on N images only, the first of every class in turn (quick runs).")
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="Checkpoint to write (.safetensors).")
@click.option("--resume", is_flag=True,
              help="Continue from OUT.state.pt if an earlier run was interrupted.")
@click.option("--time-limit", type=PositiveFloat(), default=None,
              metavar="SECONDS",
              help="Stop at the first step after SECONDS (counted from the start), with the "
                   "state saved mid-epoch and the weights so far written to OUT (marked as "
                   "stopped), and exit with code 75; --resume continues exactly where it "
                   "stopped. Leave room for one step and two writes.")
@click.option("--overwrite", is_flag=True,
              help="Replace an existing OUT (without it, train never overwrites a file it did "
                   "not write in this run or the run it resumes).")
def train(dataset, data_path, download, preset, model_options, init_path, epochs, batch_size, lr,
          weight_decay, warmup_epochs, schedule, loss, margin, train_eps, eps_ramp_epochs,
          clean_mix, power_iterations, softmax_jacobian, ablation_margin, ablation_weight,
          temperature, augment, seed, device, amp, compile_step,
          limit, out, resume, time_limit, overwrite) -> None:
    """Train a Lipschitz ViT on a data set and save it as a checkpoint."""
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from lofast.checkpoint import file_digest, load_checkpoint, save_checkpoint
    from lofast.cli.progress import PlainProgress
    from lofast.config import TrainConfig
    from lofast.config import preset as make_preset
    from lofast.data import load_dataset
    from lofast.data.sample import class_balanced_order
    from lofast.distributed import process_group, torchrun_rank
    from lofast.errors import LofastError, TimeLimitReached
    from lofast.files import check_writable
    from lofast.models.vit import INIT_OPTIONS, create_model, with_options
    from lofast.train import resolve_device
    from lofast.train import train as run_training

    deadline = None if time_limit is None else time.monotonic() + time_limit
    ctx = click.get_current_context()
    state_path = out.with_name(out.name + ".state.pt")
    resuming = resume and state_path.is_file()
    if out.exists() and not (overwrite or resuming):
        raise LofastError(f"{out} exists; pass --overwrite to replace it or choose another --out")
    check_writable(out)  # before any training: a run must not fail only when it saves
    dev = resolve_device(device)
    ranks = torchrun_rank()  # (rank, world size) under torchrun with several processes
    if compile_step and (dev.type != "cuda" or ranks is not None):
        raise LofastError("--compile captures CUDA graphs: it needs a CUDA device and one "
                          "process")
    leader = ranks is None or ranks[0] == 0  # writes the checkpoint, the state and the log
    if ranks is not None:
        if dev.type == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(dev)
        # gloo carries the CPU flags (time limit, divergence), NCCL the GPU gradients
        ctx.with_resource(process_group("cpu:gloo,cuda:nccl" if dev.type == "cuda"
                                        else "gloo"))
    config = TrainConfig(epochs=epochs, batch_size=batch_size, lr=lr, weight_decay=weight_decay,
                         warmup_epochs=warmup_epochs, schedule=schedule, loss=loss,
                         margin=margin, train_eps=train_eps, eps_ramp_epochs=eps_ramp_epochs,
                         clean_mix=clean_mix, power_iterations=power_iterations,
                         softmax_jacobian=softmax_jacobian, ablation_margin=ablation_margin,
                         ablation_weight=ablation_weight,
                         temperature=temperature, augment=augment, seed=seed, amp=amp)
    train_set = load_dataset(data_path, "train", dataset, download=download)
    test_set = load_dataset(data_path, "test", dataset)
    height, _, channels = train_set.images.shape[1:]
    data_shape = {"num_classes": len(train_set.classes), "image_size": height,
                  "channels": channels}
    architecture = preset
    if init_path is None:
        model = create_model(make_preset(preset, **data_shape,
                                         **parse_model_options(model_options)), seed=seed)
    else:
        preset_given = ctx.get_parameter_source("preset") is click.core.ParameterSource.COMMANDLINE
        options = parse_model_options(model_options)
        if preset_given or not set(options) <= set(INIT_OPTIONS):
            raise LofastError("--init takes the architecture from the checkpoint; drop --preset "
                              "and --model-option (only " + ", ".join(INIT_OPTIONS)
                              + " may be added)")
        model = load_checkpoint(init_path)
        if options:
            model = with_options(model, **options)
        stored = {key: getattr(model.config, key) for key in data_shape}
        if stored != data_shape:
            raise LofastError(f"{init_path}: built for {stored}, the data set has {data_shape}")
        architecture = f"{init_path.name} (--init)"
    if limit is not None:
        # class-balanced: data sets stored class by class would otherwise give a few classes
        train_set = train_set.subset(class_balanced_order(train_set.labels)[:limit])
    torch.manual_seed(seed)
    # what a resumed run must share with the run it continues, besides the training settings
    plan = {"model_config": model.config.to_json(), "dataset": train_set.name,
            "data": train_set.digest()[:16], "limit": limit,
            "init": None if init_path is None else file_digest(init_path)[:16]}
    processes = "" if ranks is None else f", {ranks[1]} processes"
    # the pause at the second step (and at an epoch's last, smaller batch) is compilation
    compiled = (", compiled (compiling pauses it at the second step and at the first "
                "epoch's last batch)") if compile_step else ""
    if leader:
        console.print(f"training [bold]{architecture}[/] on {train_set.name} ({len(train_set)} "
                      f"train, {len(test_set)} test images) on {dev}{processes}{compiled}")

    def write_checkpoint(history, stopped: str | None = None) -> None:
        """The model as it is now, with its training record; ``stopped``: where a time
        limit cut the run (the file is then the weights so far, for a look meanwhile)."""
        final = history[-1] if history else None
        options = {k: (str(v) if isinstance(v, Path) else v) for k, v in ctx.params.items()}
        if init_path is not None:
            options["preset"] = None  # the default preset was not used: init's architecture
        save_checkpoint(out, copy.deepcopy(model).cpu(), metadata={
            "dataset": train_set.name,
            "classes": list(train_set.classes),
            "train_command": "lofast train " + " ".join(shlex.quote(a) for a in sys.argv[2:])
            if Path(sys.argv[0]).name == "lofast" else options,
            "train_options": options,
            **({} if init_path is None else {"init_checkpoint_sha256": file_digest(init_path)}),
            "clean_accuracy": None if final is None else final.test_accuracy,
            "epochs": 0 if final is None else final.epoch,
            **({} if stopped is None else {"stopped": f"time limit after {stopped}"}),
            "device": str(dev),
            "train_seconds": sum(h.seconds for h in history),
            "history": [h.__dict__ for h in history],
        })

    columns = [TextColumn("epoch {task.fields[epoch]}"), BarColumn(),
               TextColumn("{task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]:.3f} acc {task.fields[acc]:.1%} "
                          "{task.fields[ips]:.0f} img/s"), TimeElapsedColumn()]
    plain = PlainProgress(console) if leader else (lambda line: None)
    with Progress(*columns, console=console, transient=True, disable=not leader) as progress:
        task = progress.add_task("train", total=1, epoch="-", loss=0.0, acc=0.0, ips=0.0)

        def on_step(s):
            progress.update(task, completed=s.step, total=s.steps, epoch=f"{s.epoch}/{epochs}",
                            loss=s.loss, acc=s.accuracy, ips=s.images_per_second)
            plain(f"epoch {s.epoch}/{epochs}, step {s.step}/{s.steps}: loss {s.loss:.4f}, "
                  f"train acc {s.accuracy:.2%}, {s.images_per_second:.0f} img/s")

        def on_epoch(s):
            if leader:
                progress.console.print(
                    f"epoch {s.epoch}/{s.epochs}: loss {s.train_loss:.4f}, train acc "
                    f"{s.train_accuracy:.2%}, test acc {s.test_accuracy:.2%}, "
                    f"{s.images_per_second:.0f} img/s, {s.seconds:.1f} s")

        try:
            history = run_training(model, train_set.images, train_set.labels, test_set.images,
                                   test_set.labels, config, dev, state_path=state_path,
                                   resume=resume, plan=plan, on_step=on_step,
                                   on_epoch=on_epoch, deadline=deadline,
                                   compile_mode="cudagraphs" if compile_step else None)
        except TimeLimitReached as stop:
            if leader:
                write_checkpoint(stop.history, str(stop))
                progress.console.print(f"time limit reached after {stop}: state saved in "
                                       f"{state_path}, the weights so far in {out}; rerun with "
                                       "--resume to continue")
            sys.exit(EXIT_TIME_LIMIT)
    if not leader:
        return
    write_checkpoint(history)
    final = history[-1]
    console.print(f"saved [bold]{out}[/]: clean test accuracy {final.test_accuracy:.2%}")
