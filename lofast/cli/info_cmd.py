"""`lofast info`: a checkpoint's config, metadata and per-stage Lipschitz constants, and, on
data, what its attention does (``lofast.certification.attention_report``)."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.table import Table

from lofast.cli.certify_cmd import POSITIVE_NUMBER
from lofast.cli.console import stderr as console
from lofast.cli.console import stdout
from lofast.config import DATASETS, SPLITS


@click.command()
@click.argument("checkpoint", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--data", "data_path", type=click.Path(path_type=Path), default=None,
              help="Also measure attention on this data set: per block and head "
                   "||Wq_l Wk_l^T|| and the total variation between P_l(X) and its mean over "
                   "the data, and the attention ablation (every P_l(X) replaced by that mean).")
@click.option("--sample", is_flag=True,
              help="Measure attention on the bundled sample of CIFAR-10 test images (the "
                   "first 50 of every class) instead of --data.")
@click.option("--dataset", type=click.Choice(DATASETS), default=None,
              help="Data set kind (default: the checkpoint's).")
@click.option("--split", type=click.Choice(SPLITS), default="test", show_default=True)
@click.option("--n", "limit", type=click.IntRange(min=1), default=None,
              help="Measure on the first N samples of the class-balanced order (default: all).")
@click.option("--eps", "eps_values", type=POSITIVE_NUMBER, multiple=True,
              help="Also certify the real and the ablated model at this l2 radius, e.g. 0.05 or "
                   "36/255 (repeatable), with the settings `lofast certify` uses by default "
                   "(LoFAST bound, kappa 1/2, --guarantee exact).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Samples per batch (default: as `lofast certify`).")
@click.option("--device", default="auto", show_default=True)
@click.option("--classes-unchecked", is_flag=True,
              help="Measure a checkpoint whose metadata names no classes on the data as it is.")
def info(checkpoint: Path, data_path, sample, dataset, split, limit, eps_values, batch_size,
         device, classes_unchecked) -> None:
    """Show CHECKPOINT's (a file, or a shipped model's name) config, metadata and per-stage
    Lipschitz constants.

    With --data or --sample, also show what attention does on that data: per block and head,
    ||Wq_l Wk_l^T|| and how far P_l(X) strays from its mean, and the attention ablation, the
    model with every P_l(X) replaced by its mean (clean accuracy, predictions changed, and with
    --eps certified accuracy of both models).
    """
    from lofast.bounds.attention_spec import AttentionSpec
    from lofast.bounds.spectral import matrix_norm_upper
    from lofast.checkpoint import open_checkpoint
    from lofast.errors import LofastError

    measuring = data_path is not None or sample
    if data_path is not None and sample:
        raise LofastError("give --data or --sample, not both")
    split_given = (click.get_current_context().get_parameter_source("split")
                   is click.core.ParameterSource.COMMANDLINE)
    if not measuring and (eps_values or limit or dataset or split_given or batch_size):
        raise LofastError("--eps, --n, --dataset, --split and --batch-size need --data or --sample")
    loaded = open_checkpoint(str(checkpoint))  # a path, or a shipped model's name; read once
    model, meta = loaded.model, dict(loaded.metadata)
    config = meta.pop("model_config")
    stdout.print(f"[bold]{loaded.path}[/]")
    stdout.print("model config: " + json.dumps(config, sort_keys=True))
    for key in sorted(meta):
        if key not in ("history", "train_options"):
            stdout.print(f"{key}: {json.dumps(meta[key])}")
    table = Table(title="stages", header_style="bold")
    for column in ("#", "stage", "Lipschitz constant", "notes"):
        table.add_column(column)
    for i, spec in enumerate(model.structure()):
        constant = spec.lipschitz()
        notes = ""
        if isinstance(spec, AttentionSpec):
            value = matrix_norm_upper(spec.value @ spec.output).max().item()
            score = matrix_norm_upper(spec.query @ spec.key.transpose(1, 2)).max().item()
            notes = f"max_l ||Wv_l Wo_l|| = {value:.4f}, max_l ||Wq_l Wk_l^T|| = {score:.4f}"
            if spec.position_bias is not None:  # how far the bias alone moves attention
                reference = spec.position_bias.softmax(dim=-1)
                spread = matrix_norm_upper(reference - 1.0 / reference.shape[-1]).max().item()
                notes += f", max_l ||softmax(C_l) - U|| = {spread:.4f}"
        table.add_row(str(i), type(spec).__name__.removesuffix("Spec"),
                      "local (LoFAST)" if constant is None else f"{constant:.6g}", notes)
    stdout.print(table)
    if measuring:
        show_attention(model, meta, data_path, dataset, split, limit, eps_values, batch_size,
                       device, classes_unchecked)


def show_attention(model, meta, data_path, dataset, split, limit, eps_values, batch_size,
                   device, classes_unchecked=False) -> None:
    """Measure attention on the data (the bundled sample when data_path is None) and print the
    per-head table and the ablation."""
    from lofast.certification.attention_report import attention_report
    from lofast.certification.certificate import CertifySettings
    from lofast.certification.pipeline import load_samples
    from lofast.certification.report import ablation_table, attention_table
    from lofast.cli.progress import phase_progress
    from lofast.runtime import default_batch_size, resolve_device

    dev = resolve_device(device)
    settings = CertifySettings()
    data, order = load_samples(model, meta, data_path, dataset, split, limit,
                               classes_unchecked)
    x, y = data.subset(order).to_tensors()
    with phase_progress(console) as progress:
        report = attention_report(model, x, y, eps=sorted(set(eps_values)), settings=settings,
                                  batch_size=batch_size or default_batch_size(
                                      dev, model.config.num_tokens), device=dev,
                                  progress=progress)
    stdout.print(attention_table(report))
    stdout.print(ablation_table(report))
    stdout.print(f"attention report: {report.samples} samples ({data.name}, {split}) in "
                 f"{report.seconds:.1f} s")
