"""`lofast info`: a checkpoint's config, metadata and per-stage Lipschitz constants."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

stdout = Console(highlight=False)


@click.command()
@click.argument("checkpoint", type=click.Path(path_type=Path, dir_okay=False))
def info(checkpoint: Path) -> None:
    """Show CHECKPOINT's model config, metadata and per-stage Lipschitz constants."""
    from lofast.bounds.spectral import matrix_norm_upper
    from lofast.certify import stage_lipschitz
    from lofast.checkpoint import load_checkpoint, read_metadata
    from lofast.models.structure import AttentionSpec

    model = load_checkpoint(checkpoint)
    meta = read_metadata(checkpoint)
    config = meta.pop("model_config")
    stdout.print(f"[bold]{checkpoint}[/]")
    stdout.print("model config: " + json.dumps(config, sort_keys=True))
    for key in sorted(meta):
        if key not in ("history", "train_options"):
            stdout.print(f"{key}: {json.dumps(meta[key])}")
    table = Table(title="stages", header_style="bold")
    for column in ("#", "stage", "Lipschitz constant", "notes"):
        table.add_column(column)
    for i, spec in enumerate(model.structure()):
        constant = stage_lipschitz(spec)
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
