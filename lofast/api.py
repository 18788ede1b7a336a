"""The Python API, as ``import lofast`` exposes it: load a checkpoint, load data, certify.

    import lofast

    run = lofast.certify(eps=[0.02, 0.05], n=20)  # the shipped default, bundled test images
    print(run.summary.certified_accuracy)          # {0.02: ..., 0.05: ...}
    print([r.radius for r in run.records][:5])     # certified l2 radius per sample

``certify`` runs what ``lofast certify`` runs: it builds the same ``config.CertifyConfig``,
checked by the same rules (``errors.ConfigError`` for a bad argument), and calls the same
driver, ``pipeline.run_certify``, with the same defaults (``config.CERTIFY_DEFAULTS``; the
guarantee "auto" is exact for the shipped models), on the same samples (the first ``n`` of the
class-balanced order); fallback, attack, record file, resume, shard and attention report included.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lofast.certification.certificate import CertifySettings
from lofast.certification.pipeline import Certification, RunProgress, run_certify
from lofast.checkpoint import list_models, open_checkpoint
from lofast.config import AttackSettings, CertifyConfig, ConfigError, TrainConfig, TrainRun
from lofast.data import ImageDataset, load_dataset
from lofast.data.sample import load_bundled_sample
from lofast.models.vit import LipschitzViT
from lofast.training.loop import EpochStats
from lofast.training.pipeline import TrainProgress, run_train

__all__ = ["Certification", "certify", "list_models", "load_data", "load_model", "train"]


def load_model(checkpoint: str | Path | None = None) -> LipschitzViT:
    """The model of a safetensors checkpoint: a path, the name of a shipped model
    (``list_models()``, e.g. "lofast-live"), or None for the shipped default; validated."""
    return open_checkpoint(checkpoint).model


def load_data(path: str | Path | None = None, split: str = "test",
              dataset: str | None = None) -> ImageDataset:
    """A data set: CIFAR-10 (python format), SVHN (.mat) or an image folder, as a directory or a
    .tar(.gz), of kind ``dataset`` (guessed from the files when None); the bundled sample of
    500 CIFAR-10 test images when ``path`` is None."""
    return load_bundled_sample() if path is None else load_dataset(Path(path), split, dataset)


def certify(checkpoint: str | Path | LipschitzViT | None = None,
            data: str | Path | ImageDataset | None = None,
            eps: float | str | Sequence[float | str] = 0.05, *, n: int | None = None,
            split: str = "test", dataset: str | None = None,
            settings: CertifySettings | None = None, device: str = "auto",
            batch_size: int | None = None, fallback: str | None = None,
            fallback_timeout: float | None = None,
            attack: bool | AttackSettings = False, out: str | Path | None = None,
            resume: bool = False, shard: str | tuple[int, int] | None = None,
            attention_report: bool = False, classes_unchecked: bool = False,
            verdicts_only: bool = False, progress: RunProgress | None = None) -> Certification:
    """Certify the first ``n`` samples (all when None) of ``data`` at every ``eps`` (l2 radii in
    [0, 1] pixel scale: numbers, or texts such as "36/255") with LoFAST.

    checkpoint: a path (the shipped default when None) or a model; data: a path, a loaded data
    set, or None for the bundled sample; dataset: the kind of data at a path ("cifar10",
    "svhn", "folder"; the checkpoint's when None). A checkpoint read from a file also checks
    that the data's class names are those it was trained on. settings: ``CertifySettings()``
    (the CLI's defaults) when None. fallback: "crown", "alpha-crown" or "beta-crown" on the
    samples LoFAST leaves (needs auto_LiRPA); attack: PGD on the samples no verifier certified
    (True, or an ``AttackSettings``); out: a JSONL file of records, continued with resume;
    shard: part "I/N" of the samples; attention_report: also measure and ablate attention
    (``Certification.attention``); classes_unchecked: use data with a checkpoint whose
    metadata names no classes (refused otherwise); verdicts_only: the per-sample proofs only
    where a verdict at some eps needs them (the same certified accuracy, faster with live
    attention; other radii may be smaller, each still certified). Raises ``errors.ConfigError`` for an argument out of range
    and other ``errors.LofastError`` for files and data, before any certification.
    Under torchrun every process must call it; process 0 returns the whole run, the others None.
    """
    config = CertifyConfig(eps=eps, checkpoint=checkpoint, data=data, dataset=dataset,
                           split=split, limit=n, batch_size=batch_size, device=device,
                           settings=settings, fallback=fallback,
                           fallback_timeout=fallback_timeout, attack=attack, out=out,
                           resume=resume, shard=shard, attention_report=attention_report,
                           classes_unchecked=classes_unchecked, verdicts_only=verdicts_only)
    return run_certify(config, progress)


def train(data: str | Path, out: str | Path, *, dataset: str = "cifar10",
          preset: str | None = None, model_options: dict | None = None,
          init: str | Path | None = None, limit: int | None = None, device: str = "auto",
          resume: bool = False, time_limit: float | None = None, overwrite: bool = False,
          compile: bool = False, download: bool = False,
          progress: TrainProgress | None = None, **settings) -> list[EpochStats]:
    """Train a Lipschitz ViT on ``data`` (a path) and write the checkpoint ``out``, as ``lofast
    train`` does: the same driver (``training.pipeline.run_train``), checks and defaults.

    settings: fields of ``config.TrainConfig`` (epochs, batch_size, lr, loss, train_eps,
    ablation_margin, ...); preset (default "paper-d3") and model_options (ModelConfig fields),
    or init, a checkpoint to start from (its architecture kept); limit: the first N training
    images; time_limit: seconds, then the state is saved and ``errors.TimeLimitReached`` raised
    (resume=True continues); on the main thread a Ctrl-C or SIGTERM saves it likewise at the
    next step and raises ``errors.TrainingInterrupted``, a KeyboardInterrupt. Returns the statistics of every epoch. Raises
    ``errors.ConfigError`` for a bad argument, before any work."""
    try:
        config = TrainConfig(**settings)
    except TypeError as e:  # an unknown setting
        raise ConfigError(f"{e}; the settings are TrainConfig's fields") from None
    run = TrainRun(data=data, out=out, dataset=dataset, download=download, preset=preset,
                   model_options=model_options, init=init, device=device, compile=compile,
                   limit=limit, resume=resume, time_limit=time_limit, overwrite=overwrite)
    return run_train(config, run, progress)
