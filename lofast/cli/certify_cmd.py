"""`lofast certify`: certify a checkpoint on a data set at one or more eps values."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import click

from lofast.cli.console import stderr as console
from lofast.cli.console import stdout
from lofast.config import BOUNDS, CERTIFY_DEFAULTS, GUARANTEES, KAPPAS


class PositiveFloat(click.ParamType):
    """A positive finite number, also written as a fraction such as 36/255."""

    name = "positive number"

    def convert(self, value, param, ctx):
        try:
            if isinstance(value, str) and value.count("/") == 1:
                numerator, denominator = value.split("/")
                number = float(numerator) / float(denominator)
            else:
                number = float(value)
        except (TypeError, ValueError, ZeroDivisionError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number) or number <= 0:
            self.fail(f"{value!r} must be a positive finite number", param, ctx)
        return number


class Shard(click.ParamType):
    """I/N: the I-th (from 0) of N interleaved parts of the samples."""

    name = "I/N"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            index, count = (int(part) for part in str(value).split("/"))
        except ValueError:
            self.fail(f"{value!r} is not I/N (e.g. 0/4)", param, ctx)
        if not 0 <= index < count:
            self.fail(f"{value!r}: I must lie in 0 .. N-1", param, ctx)
        return index, count


@click.command()
@click.option("--checkpoint", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Model to certify (default: the shipped default checkpoint).")
@click.option("--data", "data_path", type=click.Path(path_type=Path), default=None,
              help="Data set (default: the sample of CIFAR-10 test images bundled with lofast).")
@click.option("--dataset", type=click.Choice(["cifar10", "svhn", "folder"]), default=None,
              help="Data set kind (default: the checkpoint's).")
@click.option("--split", type=click.Choice(["test", "train"]), default="test", show_default=True)
@click.option("--eps", "eps_values", type=PositiveFloat(), multiple=True, required=True,
              help="l2 radius in [0,1] pixel scale, e.g. 0.05 or 36/255 (repeatable).")
@click.option("--n", "--limit", "limit", type=click.IntRange(min=1), default=None,
              help="Certify the first N samples of the class-balanced order (i-th image of "
                   "every class in turn).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Samples certified together (default: 16 on CPU, where larger batches ran "
                   "slower per sample in benchmarks/bench_certify.py, 1024 on a GPU).")
@click.option("--device", default="auto", show_default=True)
@click.option("--bound", type=click.Choice(BOUNDS), default=CERTIFY_DEFAULTS.bound.value,
              show_default=True,
              help="lofast: Theorem 1 with xi (delta_2^(2)); lofast-tight: with ||M_l|| "
                   "(delta_2^(1)); naive: eq. (12) first-order term.")
@click.option("--softmax-jacobian/--no-softmax-jacobian",
              default=CERTIFY_DEFAULTS.softmax_jacobian, show_default=True,
              help="Also bound the softmax's first-order term by the norm of its exact Jacobian "
                   "operator (a second-order refinement; the certificate takes the better bound). "
                   "Costs a norm per sample where attention is not near uniform.")
@click.option("--kappa", type=click.Choice([f"{k:g}" for k in KAPPAS]),
              default=f"{CERTIFY_DEFAULTS.kappa:g}", show_default=True,
              help="Softmax Lipschitz constant: 0.5 (tight) or 1 (the paper's).")
@click.option("--guarantee", type=click.Choice(list(GUARANTEES)),
              default=CERTIFY_DEFAULTS.guarantee, show_default=True,
              help="exact: float64 Cholesky-verified norms (deterministic, rounding bounded "
                   "rigorously); probabilistic: randomized Lanczos, each norm an upper bound "
                   "with probability >= 1 - 1e-9; estimate: power iteration, NOT a certificate.")
@click.option("--fallback", type=click.Choice(["none", "crown", "alpha-crown", "beta-crown"]),
              default="none", show_default=True,
              help="Run a verifier from auto_LiRPA on the samples LoFAST leaves uncertified: "
                   "CROWN, alpha-CROWN, or alpha-CROWN with beta-CROWN branch and bound over "
                   "the ReLUs (the strongest, and slowest).")
@click.option("--fallback-timeout", type=PositiveFloat(), default=None,
              help="Seconds the fallback may spend on one sample (branch and bound stops "
                   "there with an unknown verdict).")
@click.option("--attack", is_flag=True,
              help="Run l2 PGD on the samples no verifier certified: a sample with an "
                   "adversarial example is falsified, the rest unknown (the summary shows "
                   "certified / falsified / unknown per eps).")
@click.option("--attack-steps", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--attack-restarts", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--attack-box/--no-attack-box", default=True, show_default=True,
              help="Keep adversarial images in the pixel box [0, 1] (the certificate holds "
                   "on the whole l2 ball either way).")
@click.option("--save-adversarial", type=click.Path(path_type=Path, file_okay=False),
              default=None, help="With --attack: write each counterexample to this folder "
                                 "(.npz: image, perturbation, label, adversarial_class, eps).")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=CERTIFY_DEFAULTS.seed,
              show_default=True)
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Write one JSON record per sample (JSONL) as the run goes.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from --out.")
@click.option("--shard", type=Shard(), default=None,
              help="Certify only part I of N (every N-th sample from the I-th), e.g. one task "
                   "of a job array; `lofast report --merge` joins the parts' --out files. Under "
                   "torchrun every rank takes its part itself (--out gets .rankIofN per rank) "
                   "and rank 0 prints the merged summary and writes the merged --out.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@click.option("--attention-report", is_flag=True,
              help="Also measure attention on the same samples: ||Wq_l Wk_l^T|| and how far "
                   "P_l(X) strays from its mean per head, and the attention ablation (every "
                   "P_l(X) replaced by its mean over the samples), certified at the same --eps "
                   "with the same settings and compared with LoFAST's own verdicts on the real "
                   "model (JSON key 'attention').")
def certify(checkpoint, data_path, dataset, split, eps_values, limit, batch_size, device,
            bound, softmax_jacobian, kappa, guarantee, fallback, fallback_timeout, attack,
            attack_steps, attack_restarts, attack_box, save_adversarial, seed, out,
            resume, shard, as_json, attention_report) -> None:
    """Certify l2 robustness of every sample with the LoFAST bound."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from lofast.certificate import Certifier, CertifySettings
    from lofast.checkpoint import (
        default_checkpoint_path,
        file_digest,
        load_checkpoint,
        read_metadata,
    )
    from lofast.cli.progress import PlainProgress
    from lofast.distributed import gather_on_first, process_group, torchrun_rank
    from lofast.errors import LofastError
    from lofast.pipeline import (
        AttackSettings,
        certified_batches,
        default_batch_size,
        guarantee_text,
        load_samples,
        run_attack,
        run_fallback,
        run_settings,
    )
    from lofast.report import (
        RecordWriter,
        merge_runs,
        summarize,
        summary_table,
        write_records,
    )
    from lofast.train import resolve_device

    if resume and out is None:
        raise LofastError("--resume needs --out, the file to continue")
    ranks = torchrun_rank()
    merged_out = None
    if ranks is not None:
        if shard is not None:
            raise LofastError("under torchrun every rank takes its shard itself; drop --shard")
        shard = ranks
        if out is not None:
            if out.exists() and not resume:
                raise LofastError(f"{out} exists; pass --resume to continue it or choose "
                                  "another --out")
            merged_out, out = out, out.with_name(f"{out.name}.rank{ranks[0]}of{ranks[1]}")
    if save_adversarial is not None and not attack:
        raise LofastError("--save-adversarial needs --attack")
    attack_settings = AttackSettings(steps=attack_steps, restarts=attack_restarts,
                                     box=attack_box, seed=seed, save_dir=save_adversarial)
    dev = resolve_device(device)
    batch_size = batch_size or default_batch_size(dev)
    if fallback != "none":
        from lofast.crown import INSTALL_HINT, crown_available

        if not crown_available():
            raise LofastError(f"--fallback {fallback} needs auto_LiRPA; install it with: "
                              f"{INSTALL_HINT}")
    checkpoint = checkpoint or default_checkpoint_path()
    model = load_checkpoint(checkpoint)
    meta = read_metadata(checkpoint)
    data, order = load_samples(model, meta, data_path, dataset, split, limit)
    if shard is not None:
        order = order[shard[0]::shard[1]]
    eps = sorted(set(eps_values))
    settings = CertifySettings(bound=bound, kappa=float(kappa), seed=seed,
                               softmax_jacobian=softmax_jacobian, guarantee=guarantee)
    certifier = Certifier(model, settings, dev)
    run = run_settings(file_digest(checkpoint)[:16], data, split, settings, fallback,
                       fallback_timeout, attack_settings if attack else None)
    writer = RecordWriter(out, resume, eps, run)
    todo = [int(i) for i in order if int(i) not in writer.done]
    # a file resumed with a smaller --n holds records outside this run's samples: not counted
    records = [writer.done[int(i)] for i in order if int(i) in writer.done]
    if records:
        console.print(f"resuming: {len(records)} samples already certified in {out}")
    started = time.perf_counter()
    failure_probability = 0.0
    plain = PlainProgress(console)
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn()]
    try:
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("certifying", total=len(order), completed=len(records),
                                     rate="")
            fallback_progress = FallbackProgress(progress, plain)
            for x, batch_records, failure in certified_batches(certifier, data, todo, eps, run,
                                                               batch_size):
                failure_probability = max(failure_probability, failure)
                per_sample = batch_records[0].seconds
                if fallback != "none":
                    run_fallback(model, x, batch_records, eps, fallback, fallback_timeout,
                                 fallback_progress)
                if attack:
                    run_attack(model, x, batch_records, eps, attack_settings)
                writer.write(batch_records)
                records.extend(batch_records)
                rate = f"{1e3 * per_sample:.2f} ms/sample"
                progress.update(task, advance=len(batch_records), rate=rate)
                plain(f"certified {len(records)}/{len(order)} samples, {rate}")
    finally:
        writer.close()
    if ranks is not None:
        with process_group("gloo"):
            parts = gather_on_first(records)
        if parts is None:
            return  # rank 0 reports for all
        records = merge_runs(parts)
        if merged_out is not None:
            write_records(merged_out, records)
    summary = summarize(records, eps, time.perf_counter() - started,
                        guarantee_text(settings, failure_probability), settings.describe(),
                        float(kappa), str(dev))
    attention = None
    if attention_report:
        attention = measure_attention(model, data, [r.index for r in records], records, eps,
                                      settings, dev, batch_size)
    if as_json:
        result = summary.to_dict()
        if attention is not None:
            result["attention"] = attention.to_dict()
        click.echo(json.dumps(result, indent=2))
    else:
        stdout.print(summary_table(summary, attention=attention))


class FallbackProgress:
    """progress(phase, done, total) for `run_fallback` (done = 0 when a phase starts): a bar
    per phase (fallback and eps) in the live display, with elapsed and remaining time, and a
    plain line (see PlainProgress) with the same figures where no bar is drawn. A phase's bar
    is replaced when the next batch of samples starts it again."""

    def __init__(self, progress, plain) -> None:
        self.progress = progress
        self.plain = plain
        self.tasks: dict[str, tuple[int, float]] = {}  # phase -> (task, start)

    def __call__(self, phase: str, done: int, total: int) -> None:
        if done == 0:  # a phase starts (again, for the next batch of samples)
            if phase in self.tasks:
                self.progress.remove_task(self.tasks[phase][0])
            task = self.progress.add_task(phase, total=total, rate="")
            self.tasks[phase] = (task, time.perf_counter())
            return
        task, start = self.tasks[phase]
        elapsed = time.perf_counter() - start
        self.progress.update(task, completed=done, total=total,
                             rate=f"{elapsed / done:.1f} s/sample")
        remaining = elapsed / done * (total - done)
        self.plain(f"{phase}: {done}/{total} samples, {elapsed:.0f} s elapsed, about "
                   f"{remaining:.0f} s remaining in this batch")


def measure_attention(model, data, order, records, eps, settings, device, batch_size):
    """The attention report on the certified samples. The real model's verdicts are LoFAST's
    own, read from the records (a sample only a fallback certified counts as not certified):
    the ablated model is certified by LoFAST alone, so both sides are compared alike."""
    import torch

    from lofast.attention_report import attention_report
    from lofast.cli.progress import phase_progress
    from lofast.report import eps_key

    by_index = {r.index: r for r in records}
    chosen = [int(i) for i in order]
    lofast_verdicts = torch.tensor(
        [[by_index[i].verifiers.get(eps_key(e)) == "lofast" for e in eps] for i in chosen],
        dtype=torch.bool).reshape(len(chosen), len(eps))
    x, y = data.subset(chosen).to_tensors()
    with phase_progress(console) as progress:
        return attention_report(model, x, y, eps=eps, settings=settings,
                                certified=lofast_verdicts, batch_size=batch_size,
                                device=device, progress=progress)
