"""`lofast train`: train a Lipschitz ViT and write a safetensors checkpoint."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from lofast.cli.certify_cmd import POSITIVE_NUMBER
from lofast.cli.console import stderr as console
from lofast.config import (
    DATASETS,
    MAX_BATCH_SIZE,
    MAX_SEED,
    Loss,
    Schedule,
    TrainConfig,
    TrainRun,
    json_or_text,
)
from lofast.config.training import DEFAULT_PRESET

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
        parsed[key.replace("-", "_")] = json_or_text(value)
    return parsed


@click.command()
@click.option("--dataset", type=click.Choice(DATASETS), default=TrainRun.dataset,
              show_default=True)
@click.option("--data", "data_path", type=click.Path(path_type=Path), required=True,
              help="Data set location: official files, an image folder or a .tar(.gz) of one.")
@click.option("--download", is_flag=True, help="Download CIFAR-10 to --data if it is absent.")
@click.option("--preset", default=None,
              help=f"Model preset (default: {DEFAULT_PRESET}; none with --init).")
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
                   "every head's ||Wv_l Wo_l|| at B, live_blocks=N, which confines those "
                   "three to the last N blocks, and normalized_head=false, which frees the "
                   "head's rows from their unit norms (the same function; value_output=identity "
                   "and live_first=true only from scratch).")
@click.option("--epochs", type=click.IntRange(min=1), default=TrainConfig.epochs,
              show_default=True)
@click.option("--batch-size", type=click.IntRange(1, MAX_BATCH_SIZE),
              default=TrainConfig.batch_size, show_default=True)
@click.option("--lr", type=float, default=TrainConfig.lr, show_default=True)
@click.option("--weight-decay", type=float, default=TrainConfig.weight_decay, show_default=True)
@click.option("--warmup-epochs", type=float, default=TrainConfig.warmup_epochs,
              show_default=True)
@click.option("--schedule", type=click.Choice([s.value for s in Schedule]),
              default=TrainConfig.schedule.value, show_default=True)
@click.option("--loss", type=click.Choice([loss.value for loss in Loss]),
              default=TrainConfig.loss.value, show_default=True,
              help="margin: Lipschitz-margin cross-entropy (a fixed feature-space margin). "
                   "certified: cross-entropy on logits worsened by the LoFAST bound at "
                   "--train-eps for every sample. The training bound is an estimate (power "
                   "iteration from below) that only guides learning; certify the result with "
                   "`lofast certify`, whose bounds are sound.")
@click.option("--margin", type=float, default=TrainConfig.margin, show_default=True,
              help="Feature-space margin for --loss margin.")
@click.option("--train-eps", type=float, default=TrainConfig.train_eps, show_default=True,
              help="Image-space l2 radius for --loss certified.")
@click.option("--eps-ramp-epochs", type=float, default=TrainConfig.eps_ramp_epochs,
              show_default=True,
              help="--loss certified: grow the radius linearly from 0 over these epochs.")
@click.option("--clean-mix", type=float, default=TrainConfig.clean_mix, show_default=True,
              help="--loss certified: weight of clean cross-entropy in the loss (0 to 1).")
@click.option("--logit-annealing", type=float, default=TrainConfig.logit_annealing,
              show_default=True, metavar="GAMMA",
              help="Weight each sample's cross-entropy CE by (1 - exp(-CE))^GAMMA (logit "
                   "annealing: samples past their margin weigh less); 0: off.")
@click.option("--power-iterations", type=click.IntRange(min=1),
              default=TrainConfig.power_iterations, show_default=True,
              help="--loss certified: power steps per batch for zeta (warm-started).")
@click.option("--softmax-jacobian/--no-softmax-jacobian",
              default=TrainConfig.softmax_jacobian, show_default=True,
              help="--loss certified: include the second-order refinement of the softmax term "
                   "(as `lofast certify` does by default); one more power iteration per block.")
@click.option("--ablation-margin", type=float, default=TrainConfig.ablation_margin,
              show_default=True,
              help="Attention reward: a hinge penalty until replacing every block's attention "
                   "by its batch mean raises the cross-entropy by this many nats (0: off). "
                   "Keeps certified training from switching attention off.")
@click.option("--ablation-weight", type=float, default=TrainConfig.ablation_weight,
              show_default=True,
              help="Weight of the --ablation-margin penalty in the loss.")
@click.option("--temperature", type=float, default=TrainConfig.temperature,
              show_default=True)
@click.option("--augment/--no-augment", default=TrainConfig.augment, show_default=True,
              help="Random crop and horizontal flip. The small presets underfit CIFAR-10 "
                   "(train accuracy = test accuracy); there --no-augment trains better models "
                   "(see the model card).")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=TrainConfig.seed,
              show_default=True)
@click.option("--device", default=TrainRun.device, show_default=True,
              help="auto, cpu, cuda, cuda:1 ...")
@click.option("--amp/--no-amp", default=TrainConfig.amp, show_default=True,
              help="bfloat16 autocast of the model's forward and backward on a GPU (the "
                   "bound stays float32).")
@click.option("--cpu-amp", is_flag=True,
              help="With --amp, autocast on a CPU too: fast where the CPU computes bfloat16 "
                   "natively (AVX512-BF16, AMX; the default's certified training 1.3x faster "
                   "on an AMD EPYC thread, to the same accuracy), slower elsewhere.")
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
              help="Continue from OUT.state.pt if an earlier run was stopped. Ctrl-C or "
                   "SIGTERM stops a run at the next step with its state saved, as a time "
                   "limit does (exit code 130 / 143); a second one stops it at once.")
@click.option("--time-limit", type=POSITIVE_NUMBER, default=None,
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
          clean_mix, logit_annealing, power_iterations, softmax_jacobian, ablation_margin,
          ablation_weight, temperature, augment, seed, device, amp, cpu_amp, compile_step,
          limit, out, resume, time_limit, overwrite) -> None:
    """Train a Lipschitz ViT on a data set and save it as a checkpoint."""
    from lofast.errors import TimeLimitReached, TrainingInterrupted
    from lofast.training.pipeline import run_train

    config = TrainConfig(epochs=epochs, batch_size=batch_size, lr=lr, weight_decay=weight_decay,
                         warmup_epochs=warmup_epochs, schedule=schedule, loss=loss,
                         margin=margin, train_eps=train_eps, eps_ramp_epochs=eps_ramp_epochs,
                         clean_mix=clean_mix, logit_annealing=logit_annealing,
                         power_iterations=power_iterations,
                         softmax_jacobian=softmax_jacobian, ablation_margin=ablation_margin,
                         ablation_weight=ablation_weight, temperature=temperature,
                         augment=augment, seed=seed, amp=amp, cpu_amp=cpu_amp)
    run = TrainRun(data=data_path, out=out, dataset=dataset, download=download,
                   preset=preset, model_options=parse_model_options(model_options),
                   init=init_path, device=device, compile=compile_step, limit=limit,
                   resume=resume, time_limit=time_limit, overwrite=overwrite)
    invoked = Path(sys.argv[0]).name == "lofast"  # a command line to store, not a test's args
    provenance = ("lofast train " + " ".join(shlex.quote(a) for a in sys.argv[2:])
                  if invoked else None)
    state = out.with_name(out.name + ".state.pt")
    with BarProgress(epochs) as progress:
        try:
            history = run_train(config, run, progress, provenance)
        except (TimeLimitReached, TrainingInterrupted) as stop:
            interrupted = isinstance(stop, TrainingInterrupted)
            if progress.leader:
                why = f"interrupted ({stop.reason})" if interrupted else "time limit reached"
                console.print(f"{why} after {stop}: state saved in {state}, the weights so far "
                              f"in {out}; rerun with --resume to continue")
            # Under torchrun a process that exits with an error stops the others: the rest
            # exit 0 and leave the leader, which saves the state, to report and exit with
            # 128 + the signal's number (130 Ctrl-C, 143 SIGTERM) or 75 (time limit)
            code = 128 + stop.signum if interrupted else EXIT_TIME_LIMIT
            sys.exit(code if progress.leader else 0)
    if progress.leader:
        console.print(f"saved [bold]{out}[/]: clean test accuracy "
                      f"{history[-1].test_accuracy:.2%}")


class BarProgress:
    """``training.pipeline.TrainProgress`` drawn on stderr by the process that writes: a bar per
    epoch on a terminal, plain lines at most every PLAIN_PROGRESS_SECONDS elsewhere
    (``cli.progress.PlainProgress``), a line per epoch."""

    def __init__(self, epochs: int) -> None:
        from lofast.distributed import torchrun_rank

        ranks = torchrun_rank()
        self.leader = ranks is None or ranks[0] == 0
        self.epochs = epochs

    def __enter__(self):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        from lofast.cli.progress import PlainProgress

        columns = [TextColumn("epoch {task.fields[epoch]}"), BarColumn(),
                   TextColumn("{task.completed}/{task.total}"),
                   TextColumn("loss {task.fields[loss]:.3f} acc {task.fields[acc]:.1%} "
                              "{task.fields[ips]:.0f} img/s"), TimeElapsedColumn()]
        self.bar = Progress(*columns, console=console, transient=True, disable=not self.leader)
        self.bar.__enter__()
        self.task = self.bar.add_task("train", total=1, epoch="-", loss=0.0, acc=0.0, ips=0.0)
        self.plain = PlainProgress(console)
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def note(self, text: str) -> None:
        console.print(text)

    def step(self, s) -> None:
        self.bar.update(self.task, completed=s.step, total=s.steps,
                        epoch=f"{s.epoch}/{self.epochs}", loss=s.loss, acc=s.accuracy,
                        ips=s.images_per_second)
        self.plain(f"epoch {s.epoch}/{self.epochs}, step {s.step}/{s.steps}: loss {s.loss:.4f}, "
                   f"train acc {s.accuracy:.2%}, {s.images_per_second:.0f} img/s")

    def epoch(self, s) -> None:
        self.bar.console.print(
            f"epoch {s.epoch}/{s.epochs}: loss {s.train_loss:.4f}, train acc "
            f"{s.train_accuracy:.2%}, test acc {s.test_accuracy:.2%}, "
            f"{s.images_per_second:.0f} img/s, {s.seconds:.1f} s")
