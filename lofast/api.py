"""The Python API, as ``import lofast`` exposes it: load a checkpoint, load data, certify.

    import lofast

    run = lofast.certify(eps=[0.02, 0.05], n=20)  # the shipped default, bundled test images
    print(run.summary.certified_accuracy)          # {'0.02': ..., '0.05': ...}
    print([r.radius for r in run.records][:5])     # certified l2 radius per sample

``certify`` runs exactly what ``lofast certify`` runs, with the same defaults (the exact
guarantee, ``config.CERTIFY_DEFAULTS``), on the same samples (the first ``n`` of the
class-balanced order), and returns the same per-sample records and summary.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lofast.certificate import Certifier, CertifySettings
from lofast.checkpoint import default_checkpoint_path, file_digest, load_checkpoint, read_metadata
from lofast.data import ImageDataset, load_dataset
from lofast.data.sample import load_bundled_sample
from lofast.models.vit import LipschitzViT
from lofast.pipeline import (
    certified_batches,
    default_batch_size,
    guarantee_text,
    load_samples,
    run_settings,
)
from lofast.report import SampleRecord, Summary, summarize
from lofast.train import resolve_device


def load_model(checkpoint: str | Path | None = None) -> LipschitzViT:
    """The model of a safetensors checkpoint (the shipped default when None), validated."""
    return load_checkpoint(Path(checkpoint) if checkpoint is not None
                           else default_checkpoint_path())


def load_data(path: str | Path | None = None, split: str = "test",
              dataset: str | None = None) -> ImageDataset:
    """A data set: CIFAR-10 (python format), SVHN (.mat) or an image folder, as a directory or a
    .tar(.gz), of kind ``dataset`` (guessed from the files when None); the bundled sample of
    500 CIFAR-10 test images when ``path`` is None."""
    return load_bundled_sample() if path is None else load_dataset(Path(path), split, dataset)


@dataclass
class Certification:
    """What ``certify`` found: one record per sample, in evaluation order, and their summary
    (certified accuracy per eps, radii, time), as ``lofast certify --out/--json`` writes them."""

    records: list[SampleRecord]
    summary: Summary


def certify(checkpoint: str | Path | LipschitzViT | None = None,
            data: str | Path | ImageDataset | None = None,
            eps: float | Sequence[float] = 0.05, *, n: int | None = None, split: str = "test",
            dataset: str | None = None, settings: CertifySettings | None = None,
            device: str = "auto",
            batch_size: int | None = None) -> Certification:
    """Certify the first ``n`` samples (all when None) of ``data`` at every ``eps`` (l2 radii in
    [0, 1] pixel scale) with LoFAST.

    checkpoint: a path (the shipped default when None) or a model; data: a path, a loaded data
    set, or None for the bundled sample; dataset: the kind of data at a path ("cifar10",
    "svhn", "folder"; the checkpoint's when None). A checkpoint read from a file also checks
    that the data's class names are those it was trained on. settings: ``CertifySettings()``
    (the CLI's defaults) when None.
    """
    if isinstance(checkpoint, LipschitzViT):
        model, metadata, digest = checkpoint, {}, "in memory"
    else:
        path = Path(checkpoint) if checkpoint is not None else default_checkpoint_path()
        model, metadata, digest = load_checkpoint(path), read_metadata(path), file_digest(path)[:16]
    data, order = load_samples(model, metadata, data, dataset, split, n)
    eps = sorted({float(eps)} if isinstance(eps, (int, float)) else {float(e) for e in eps})
    settings = settings or CertifySettings()
    dev = resolve_device(device)
    batch_size = batch_size or default_batch_size(dev)
    certifier = Certifier(model, settings, dev)
    run = run_settings(digest, data, split, settings)
    started = time.perf_counter()
    records: list[SampleRecord] = []
    failure = 0.0
    for _, batch, batch_failure in certified_batches(certifier, data, order, eps, run,
                                                     batch_size):
        records.extend(batch)
        failure = max(failure, batch_failure)
    summary = summarize(records, eps, time.perf_counter() - started,
                        guarantee_text(settings, failure), settings.describe(), settings.kappa,
                        str(dev))
    return Certification(records=records, summary=summary)
