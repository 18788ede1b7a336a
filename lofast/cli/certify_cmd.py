"""`lofast certify`: certify a checkpoint on a data set at one or more eps values."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import click
from rich.console import Console

console = Console(stderr=True, highlight=False)
stdout = Console(highlight=False)

GUARANTEES = {"exact": "verified", "probabilistic": "lanczos", "estimate": "power"}


def default_batch_size(device) -> int:
    """Samples certified together when --batch-size is not given: 16 on CPU, where larger
    batches ran slower per sample in benchmarks/bench_certify.py, 256 on GPU."""
    return 256 if device.type == "cuda" else 16


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


def load_samples(model, meta, data_path, dataset, split, limit):
    """(data, order): the data set (the bundled sample when data_path is None, else the one at
    data_path, of kind `dataset` or the checkpoint's) and the indices to evaluate, the first
    `limit` of the class-balanced order (all when None). Refuses images of another shape."""
    from lofast.data import load_dataset
    from lofast.data.sample import class_balanced_order, load_bundled_sample
    from lofast.errors import LofastError

    if data_path is None:
        data = load_bundled_sample()
    else:
        data = load_dataset(data_path, split, dataset or meta.get("dataset"))
    expected = (model.config.image_size, model.config.image_size, model.config.channels)
    if data.images.shape[1:] != expected:
        raise LofastError(f"data images have shape {data.images.shape[1:]}, the model expects "
                          f"{expected} (H, W, C)")
    return data, class_balanced_order(data.labels)[:limit]


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
@click.option("--n", "limit", type=click.IntRange(min=1), default=None,
              help="Certify the first N samples of the class-balanced order (i-th image of "
                   "every class in turn).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Samples certified together (default: 16 on CPU, where larger batches ran "
                   "slower per sample in benchmarks/bench_certify.py, 256 on GPU).")
@click.option("--device", default="auto", show_default=True)
@click.option("--bound", type=click.Choice(["lofast", "lofast-tight", "naive"]),
              default="lofast", show_default=True,
              help="lofast: Theorem 1 with xi (delta_2^(2)); lofast-tight: with ||M_l|| "
                   "(delta_2^(1)); naive: eq. (12) first-order term.")
@click.option("--softmax-jacobian/--no-softmax-jacobian", default=True, show_default=True,
              help="Also bound the softmax's first-order term by the norm of its exact Jacobian "
                   "operator (a second-order refinement; the certificate takes the better bound). "
                   "Costs a norm per sample where attention is not near uniform.")
@click.option("--kappa", type=click.Choice(["0.5", "1"]), default="0.5", show_default=True,
              help="Softmax Lipschitz constant: 0.5 (tight) or 1 (the paper's).")
@click.option("--guarantee", type=click.Choice(list(GUARANTEES)), default="exact",
              show_default=True,
              help="exact: float64 Cholesky-verified norms (deterministic, rounding bounded "
                   "rigorously); probabilistic: randomized Lanczos, each norm an upper bound "
                   "with probability >= 1 - 1e-9; estimate: power iteration, NOT a certificate.")
@click.option("--fallback", type=click.Choice(["none", "crown", "alpha-crown"]), default="none",
              show_default=True,
              help="Run (alpha-)CROWN from auto_LiRPA on the samples LoFAST leaves uncertified.")
@click.option("--fallback-timeout", type=PositiveFloat(), default=None,
              help="Seconds the fallback may spend on one sample.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Write one JSON record per sample (JSONL) as the run goes.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from --out.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@click.option("--attention-report", is_flag=True,
              help="Also measure attention on the same samples: ||Wq_l Wk_l^T|| and how far "
                   "P_l(X) strays from its mean per head, and the attention ablation (every "
                   "P_l(X) replaced by its mean over the samples), certified at the same --eps "
                   "with the same settings and compared with LoFAST's own verdicts on the real "
                   "model (JSON key 'attention').")
def certify(checkpoint, data_path, dataset, split, eps_values, limit, batch_size, device,
            bound, softmax_jacobian, kappa, guarantee, fallback, fallback_timeout, seed, out,
            resume, as_json, attention_report) -> None:
    """Certify l2 robustness of every sample with the LoFAST bound."""
    import torch
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from lofast.bounds.spectral import SpectralMethod
    from lofast.certify import Certifier, CertifySettings
    from lofast.checkpoint import (
        default_checkpoint_path,
        file_digest,
        load_checkpoint,
        read_metadata,
    )
    from lofast.cli.progress import PlainProgress
    from lofast.errors import LofastError
    from lofast.report import RecordWriter, SampleRecord, eps_key, summarize, summary_table
    from lofast.train import resolve_device

    if resume and out is None:
        raise LofastError("--resume needs --out, the file to continue")
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
    eps = sorted(set(eps_values))
    settings = CertifySettings(bound=bound, kappa=float(kappa), seed=seed,
                               softmax_jacobian=softmax_jacobian,
                               method=SpectralMethod(kind=GUARANTEES[guarantee]))
    certifier = Certifier(model, settings, dev)
    run = {"checkpoint": file_digest(checkpoint)[:16], "data": f"{data.digest()[:16]} ({split})",
           "bound": settings.describe(), "kappa": float(kappa), "guarantee": guarantee,
           "fallback": fallback, "fallback_timeout": fallback_timeout, "seed": seed}
    writer = RecordWriter(out, resume, eps, run)
    todo = [int(i) for i in order if int(i) not in writer.done]
    records = list(writer.done.values())
    if writer.done:
        console.print(f"resuming: {len(writer.done)} samples already certified in {out}")
    eps_tensor = torch.tensor(eps, dtype=torch.float64)
    started = time.perf_counter()
    failure_probability = 0.0
    plain = PlainProgress(console)
    columns = [TextColumn("certifying"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn()]
    try:
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("certify", total=len(order), completed=len(writer.done),
                                     rate="")
            for start in range(0, len(todo), batch_size):
                index = todo[start:start + batch_size]
                x, y = data.subset(index).to_tensors()
                cert = certifier.certify(x, y)
                verdicts = cert.certified(eps_tensor).cpu()
                feature = cert.feature_radius(eps_tensor).cpu()
                radius = cert.radius().cpu()
                margin = cert.margin.cpu()
                failure_probability = max(failure_probability, cert.failure_probability)
                per_sample = cert.seconds / len(index)
                batch_records = [
                    SampleRecord(
                        index=i, label=int(y[b]), prediction=int(cert.predictions[b]),
                        margin=float(margin[b]), radius=float(radius[b]),
                        verdicts={eps_key(e): bool(verdicts[b, k]) for k, e in enumerate(eps)},
                        bounds={eps_key(e): float(feature[b, k]) for k, e in enumerate(eps)},
                        verifiers={eps_key(e): "lofast" if verdicts[b, k] else None
                                   for k, e in enumerate(eps)},
                        seconds=per_sample, run=run)
                    for b, i in enumerate(index)]
                if fallback != "none":
                    run_fallback(model, x, batch_records, eps, fallback, fallback_timeout)
                writer.write(batch_records)
                records.extend(batch_records)
                rate = f"{1e3 * per_sample:.2f} ms/sample"
                progress.update(task, advance=len(index), rate=rate)
                plain(f"certified {len(records)}/{len(order)} samples, {rate}")
    finally:
        writer.close()
    guarantee_text = settings.method.describe()
    if failure_probability > 0:
        guarantee_text += f"; per-sample failure probability <= {failure_probability:.1e}"
    summary = summarize(records, eps, time.perf_counter() - started, guarantee_text,
                        settings.describe(), float(kappa), str(dev))
    attention = None
    if attention_report:
        attention = measure_attention(model, data, order, records, eps, settings, dev,
                                      batch_size)
    if as_json:
        result = summary.to_dict()
        if attention is not None:
            result["attention"] = attention.to_dict()
        click.echo(json.dumps(result, indent=2))
    else:
        stdout.print(summary_table(summary, attention))


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


def run_fallback(model, images, records, eps, method, timeout) -> None:
    """Try (alpha-)CROWN at each eps, smallest first, on the correctly classified samples that
    LoFAST left uncertified there; a sample the fallback fails at one eps is not tried at larger
    ones (reported with that reason). Updates the records in place."""
    import torch

    from lofast.crown import crown_verify
    from lofast.report import eps_key

    failed: dict[int, str] = {}
    for e in eps:
        key = eps_key(e)
        todo = [b for b, r in enumerate(records)
                if not r.verdicts[key] and r.prediction == r.label and b not in failed]
        for b, r in enumerate(records):
            if not r.verdicts[key]:
                r.reasons[key] = ("misclassified" if r.prediction != r.label
                                  else failed.get(b, "LoFAST bound too loose"))
        if not todo:
            continue
        labels = torch.tensor([records[b].label for b in todo])
        results = crown_verify(model, images[todo], labels, e, method=method, timeout=timeout)
        for b, result in zip(todo, results):
            record = records[b]
            record.fallback_seconds[key] = result.seconds
            record.seconds += result.seconds
            if result.certified:
                record.verdicts[key] = True
                record.verifiers[key] = method
                record.reasons.pop(key, None)
            else:
                failed[b] = f"{method}: {result.reason or 'not certified'} at eps={key}"
                record.reasons[key] = failed[b]
