"""The certification pipeline on a data set, with its one driver ``run_certify``: LoFAST on each
batch gives one record per sample (``certified_batches``); then, on the samples it leaves open,
the CROWN-family fallback and the PGD falsifier update those records in place, eps by eps; the
records are written as each batch finishes, resumed, sharded (also under torchrun) and
summarised, with the attention report on request. The command line and the Python API
(``lofast.certify``) both build a ``config.CertifyConfig`` and call the driver; neither
repeats any of it, and nothing here prints.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from lofast.certification.certificate import Certifier, CertifySettings
from lofast.certification.records import EpsResult, SampleRecord, eps_key
from lofast.certification.report import Summary
from lofast.config import DATASETS, FALLBACKS, AttackSettings, CertifyConfig, check_progress
from lofast.errors import CertificationError, ConfigError, LofastError

if TYPE_CHECKING:
    from lofast.bab import BabSettings
    from lofast.certification.attention_report import AttentionReport
    from lofast.models.vit import LipschitzViT

# progress(phase, done, total): called after every sample a fallback verifier finishes
Progress = Callable[[str, int, int], None]


@dataclass
class Certification:
    """What a run found: one record per sample, in evaluation order, their summary (certified
    accuracy per eps, radii, time), as ``lofast certify --out/--json`` writes them, and the
    attention report where asked for."""

    records: list[SampleRecord]
    summary: Summary
    attention: AttentionReport | None = None


class RunProgress:
    """What ``run_certify`` reports as it goes. Every method does nothing here (the Python
    API's default); the command line draws bars and lines (``cli.certify_cmd``)."""

    def note(self, text: str) -> None:
        """A one-off message (a resumed file's count)."""

    def samples(self, done: int, total: int, ms_per_sample: float | None) -> None:
        """done of total samples have records (called once before the first batch)."""

    def phase(self, name: str, done: int, total: int) -> None:
        """A pass over some samples (a fallback at one eps, the attention report): done = 0
        when it starts."""


def run_certify(config: CertifyConfig, progress: RunProgress | None = None,
                ) -> Certification | None:
    """Certify ``config.limit`` samples of the data at every eps: LoFAST, then the fallback
    and the attack on what it leaves, records written to ``config.out`` batch by batch (and
    resumed from it), the summary, the attention report. Under torchrun every process takes its
    interleaved part and writes ``out.rankIofN``; process 0 merges the parts, writes ``out``
    and returns the whole run, the others return None."""
    from lofast.certification.records import RecordWriter, Session, merge_runs, write_records
    from lofast.certification.report import summarize
    from lofast.data import ImageDataset
    from lofast.distributed import gather_on_first, process_group, torchrun_rank
    from lofast.files import check_writable
    from lofast.runtime import default_batch_size, describe_device, resolve_device

    if progress is not None:
        check_progress(progress, RunProgress, ConfigError)
    progress = progress or RunProgress()
    if config.settings is not None and not isinstance(config.settings, CertifySettings):
        raise ConfigError(f"settings must be a CertifySettings, not "
                          f"{type(config.settings).__name__}")
    requested = verdict_settings(config)
    if config.data is not None and not isinstance(config.data, (Path, ImageDataset)):
        raise ConfigError(f"data must be a path, an ImageDataset or None, not "
                          f"{type(config.data).__name__}")
    shard, out, merged_out = config.shard, config.out, None
    ranks = torchrun_rank()
    if ranks is not None:
        if shard is not None:
            raise ConfigError("under torchrun every rank takes its shard itself; drop --shard")
        shard = ranks
        if out is not None:
            if out.exists() and not config.resume:
                raise LofastError(f"{out} exists; pass --resume to continue it or choose "
                                  "another --out")
            merged_out, out = out, out.with_name(f"{out.name}.rank{ranks[0]}of{ranks[1]}")
    device = resolve_device(config.device)
    if config.fallback is not None:
        from lofast.crown import INSTALL_HINT, crown_available

        if not crown_available():
            raise LofastError(f"--fallback {config.fallback} needs auto_LiRPA; install it "
                              f"with: {INSTALL_HINT}")
    model, metadata, digest = load_source(config.checkpoint)
    batch_size = config.batch_size or default_batch_size(device, model.config.num_tokens)
    data, order = load_samples(model, metadata, config.data, config.dataset, config.split,
                               config.limit, config.classes_unchecked)
    certifier = Certifier(model, requested, device)
    settings = certifier.settings  # "auto" resolved for the model
    run = run_settings(digest, data, config.split, settings, config.fallback or "none",
                       config.fallback_timeout, config.attack)
    if shard is not None:  # which part of how many samples: a merge checks it is complete
        run["shard"] = {"part": shard[0], "parts": shard[1], "samples": len(order)}
        order = order[shard[0]::shard[1]]
    if config.attack is not None and config.attack.save_dir is not None:
        check_writable(config.attack.save_dir / f"{run_name(run)}.npz")  # before any work
    # the attack's float64 copy and its float32 search twin, once per run (their effective
    # weights held: no SVD per batch), on the run's device: PGD on a GPU, not on the host's cores
    attacking = config.attack is not None
    attacked = model.frozen(device) if attacking else None
    searched = model.frozen(device, torch.float32) if attacking else None
    writer = RecordWriter(out, config.resume, config.eps, run)
    # from here on the file is closed (and unlocked) whatever stops the run, even where the
    # error and its frames are kept (a notebook's last traceback)
    try:
        todo = [int(i) for i in order if int(i) not in writer.done]
        # a file resumed with a smaller --n holds records outside this run's samples: not counted
        records = [writer.done[int(i)] for i in order if int(i) in writer.done]
        if records:
            progress.note(f"resuming: {len(records)} samples already certified in {out}")
        started = time.perf_counter()
        failure = 0.0
        progress.samples(len(records), len(order), None)
        proof_seconds = make_proofs(certifier, data, todo)
        session = Session(describe_device(device), proof_seconds)
        if todo:  # where and how long the proofs took, for a summary of the saved run
            writer.begin_session(session)
        for x, batch, batch_failure in certified_batches(certifier, data, todo, config.eps,
                                                         run, batch_size, progress.note):
            failure = max(failure, batch_failure)
            per_sample = batch[0].seconds
            if config.fallback is not None:
                run_fallback(model, x, batch, config.eps, config.fallback,
                             config.fallback_timeout, progress.phase)
            if config.attack is not None:
                run_attack(attacked, searched, x, batch, config.eps, config.attack)
            writer.write(batch)
            records.extend(batch)
            progress.samples(len(records), len(order), 1e3 * per_sample)
        writer.finish(len(order))  # every sample of this run (this shard) has its record
    finally:
        writer.close()
    if ranks is not None:
        with process_group("gloo"):
            parts = gather_on_first((records, writer.sessions))
        if parts is None:
            return None  # process 0 reports for all
        records = merge_runs([part_records for part_records, _ in parts])
        if merged_out is not None:  # with every session of every rank
            write_records(merged_out, records, [s for _, sessions in parts for s in sessions])
    summary = summarize(records, config.eps, time.perf_counter() - started,
                        guarantee_text(settings, failure), settings.describe(),
                        float(settings.kappa), session.device, proof_seconds=proof_seconds,
                        part=run.get("shard") if ranks is None else None)
    attention = None
    if config.attention_report:
        attention = measure_attention(model, data, records, config.eps, settings, device,
                                      batch_size, progress.phase)
    return Certification(records=records, summary=summary, attention=attention)


def load_source(checkpoint: object) -> tuple[nn.Module, dict, str]:
    """(model, its checkpoint metadata, the digest records name it by) for a checkpoint path,
    the name of a shipped model, a loaded LipschitzViT (no metadata; named by its weights, so
    that a run resumed with other weights is refused) or None (the shipped default)."""
    from lofast.checkpoint import open_checkpoint, weights_digest
    from lofast.models.vit import LipschitzViT

    if isinstance(checkpoint, LipschitzViT):
        return checkpoint, {}, f"in memory, weights {weights_digest(checkpoint)[:16]}"
    if checkpoint is not None and not isinstance(checkpoint, Path):
        raise ConfigError(f"checkpoint must be a path or a LipschitzViT, not "
                          f"{type(checkpoint).__name__}")
    loaded = open_checkpoint(None if checkpoint is None else str(checkpoint))
    return loaded.model, loaded.metadata, loaded.sha256[:16]


def measure_attention(model: nn.Module, data: object, records: Sequence[SampleRecord],
                      eps: Sequence[float], settings: CertifySettings, device: torch.device,
                      batch_size: int, progress: Progress | None = None) -> AttentionReport:
    """The attention report on the records' samples. The real model's verdicts are LoFAST's
    own, read from the records (a sample only a fallback certified counts as not certified):
    the ablated model is certified by LoFAST alone, so both sides are compared alike."""
    from lofast.certification.attention_report import attention_report

    chosen = [r.index for r in records]
    lofast_verdicts = torch.tensor(
        [[r.results[e].verifier == "lofast" for e in eps] for r in records],
        dtype=torch.bool).reshape(len(records), len(eps))
    x, y = data.subset(chosen).to_tensors()
    return attention_report(model, x, y, eps=eps, settings=settings, certified=lofast_verdicts,
                            batch_size=batch_size, device=device, progress=progress)


def run_fallback(model: nn.Module, images: Tensor, records: Sequence[SampleRecord],
                 eps: Sequence[float], method: str, timeout: float | None,
                 progress: Progress | None = None, bab: BabSettings | None = None) -> None:
    """Try a fallback verifier at each eps, smallest first, on the correctly classified samples
    that LoFAST left uncertified there; a sample the fallback fails at one eps is not tried at
    larger ones (reported with that reason). method: "crown" or "alpha-crown"
    (`lofast.crown.crown_verify`), or "beta-crown" (branch and bound,
    `lofast.crown.beta.beta_crown_verify`); timeout: seconds per sample. Each record gets the
    fallback's verdict, bound, domains and seconds under `fallback`; images (B, C, H, W) in
    the records' order; bab: branch-and-bound settings for "beta-crown" (the default's
    heuristic and limits; its timeout is replaced by `timeout`). Samples are verified one at a time, reporting to `progress` (done = 0
    before the first)."""
    from lofast.crown import crown_verify
    from lofast.crown.beta import beta_crown_verify

    if method not in FALLBACKS:
        raise LofastError(f"fallback must be one of {', '.join(FALLBACKS)}, not {method!r}")
    failed: dict[int, str] = {}
    for e in eps:
        key = eps_key(e)
        todo = [b for b, r in enumerate(records)
                if not r.results[e].certified and r.prediction == r.label and b not in failed]
        for b, r in enumerate(records):
            if not r.results[e].certified:
                r.update(e, reason="misclassified" if r.prediction != r.label
                         else failed.get(b, "LoFAST bound too loose"))
        if todo and progress is not None:
            progress(f"{method} at eps={key}", 0, len(todo))
        for done, b in enumerate(todo):
            record = records[b]
            label = torch.tensor([record.label])
            if method == "beta-crown":
                result, = beta_crown_verify(model, images[b:b + 1], label, e, timeout=timeout,
                                            settings=bab)
            else:
                result, = crown_verify(model, images[b:b + 1], label, e, method=method,
                                       timeout=timeout)
            record.seconds += result.seconds
            verdict = result.verdict or ("verified" if result.certified else "unknown")
            found = {"method": method, "verdict": verdict, "bound": result.margin_bound,
                     "domains": result.domains, "seconds": result.seconds}
            if result.certified:
                record.update(e, certified=True, verifier=method, reason=None, fallback=found,
                              fallback_seconds=result.seconds)
            else:
                failed[b] = f"{method}: {result.reason or 'not certified'} at eps={key}"
                record.update(e, reason=failed[b], fallback=found,
                              fallback_seconds=result.seconds)
            if progress is not None:
                progress(f"{method} at eps={key}", done + 1, len(todo))


def run_attack(model: LipschitzViT, search: LipschitzViT | None, images: Tensor,
               records: Sequence[SampleRecord], eps: Sequence[float],
               settings: AttackSettings) -> None:
    """Measure how far each sample's certificate is from the nearest counterexample found, and
    mark each open sample falsified at each eps where one is found (images (B, C, H, W) in
    [0, 1] in the records' order; model: the float64 copy to attack, ``LipschitzViT.frozen``,
    made once for all batches; search: its float32 copy, whose gradient steps take about half
    the float64 ones' time on a CPU, or None to search in float64 as well):

    - every correctly classified sample, certified or not, gets the minimum-norm attack
      (``attack.minimum_norm_attack``); a misclassified sample is its own counterexample
      (norm 0). The smallest norm found is the record's ``adversarial_radius`` (None where
      nothing was found);
    - PGD at each eps (smallest first) on the samples no verifier certified there and no
      counterexample within eps covers yet; a smaller counterexample replaces the one kept.

    Every counterexample is re-checked in float64 before it is reported (the minimum-norm
    attack's refinement along its ray runs in float64 too); one within a certified radius raises
    CertificationError (the certificate would be broken)."""
    from lofast.certification.attack import minimum_norm_attack, pgd_attack

    if next(model.parameters()).dtype != torch.float64:
        raise ValueError("run_attack takes a float64 model (LipschitzViT.frozen)")
    x = images.to(next(model.parameters()).device, torch.float64)
    found: dict[int, tuple[Tensor, int]] = {}  # sample -> (perturbation, adversarial class)
    correct = [b for b, r in enumerate(records) if r.prediction == r.label]
    for b, r in enumerate(records):
        if r.prediction != r.label:
            found[b] = (torch.zeros_like(x[b]), r.prediction)
    if correct:
        labels = torch.tensor([records[b].label for b in correct])  # the attacks move them
        nearest = minimum_norm_attack(model, x[correct], labels, steps=settings.steps,
                                      box=settings.box, search=search)
        for i, b in enumerate(correct):
            if nearest.found[i]:
                found[b] = (nearest.perturbation[i], int(nearest.adversarial_class[i]))

    def size(b: int) -> float:
        return float(found[b][0].norm()) if b in found else math.inf

    for e in eps:
        todo = [b for b, r in enumerate(records)
                if not r.results[e].certified and not size(b) <= e]
        if todo:
            labels = torch.tensor([records[b].label for b in todo])  # the attacks move them
            result = pgd_attack(model, x[todo], labels, e, steps=settings.steps,
                                restarts=settings.restarts, seed=settings.seed, box=settings.box,
                                search=search)
            for i, b in enumerate(todo):
                if result.found[i] and float(result.norm[i]) < size(b):
                    found[b] = (result.perturbation[i], int(result.adversarial_class[i]))
    for b, record in enumerate(records):
        record.adversarial_radius = size(b) if b in found else None
        certified_to = record.certified_radius  # every verifier's, LoFAST's included
        if certified_to > 0 and size(b) <= certified_to:
            raise CertificationError(
                f"sample {record.index} is certified to radius {certified_to:.6g} and has a "
                f"counterexample at distance {size(b):.6g}: the certificate is unsound")
        for e in eps:
            falsified = size(b) <= e
            record.update(e, falsified=falsified, counterexample=_describe(
                found[b], x[b], record, eps_key(e), settings.save_dir) if falsified else None)


def _describe(counterexample: tuple[Tensor, int], image: Tensor, record: SampleRecord, key: str,
              save_dir: Path | None) -> dict:
    """The record's entry for a counterexample at eps key; with save_dir, written there as
    ``RUN-INDEX-epsKEY.npz`` (RUN: ``run_name`` of the record's settings, so that runs sharing
    a folder never overwrite each other's files), whole or not at all."""
    from lofast.files import atomic_write

    perturbation, adversarial_class = counterexample
    file = None
    if save_dir is not None:
        path = Path(save_dir) / f"{run_name(record.run)}-{record.index}-eps{key}.npz"

        def write(tmp: str) -> None:
            with open(tmp, "wb") as out:
                np.savez(out, image=(image + perturbation).cpu().numpy(),
                         perturbation=perturbation.cpu().numpy(), label=record.label,
                         adversarial_class=adversarial_class, eps=float(key))

        try:
            atomic_write(path, write)
        except OSError as e:
            raise LofastError(f"cannot write {path}: {e.strerror or e}") from None
        file = str(path)
    return {"norm": float(perturbation.norm()), "class": adversarial_class, "file": file}


def run_name(run: dict) -> str:
    """Twelve hex digits of SHA-256 over a run's settings (``run_settings``): a name shared by
    the files of one run alone."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest()[:12]


def load_samples(model: nn.Module, metadata: dict, data: object, dataset: str | None,
                 split: str, limit: int | None, classes_unchecked: bool = False,
                 ) -> tuple[object, np.ndarray]:
    """(data set, indices to evaluate): ``data`` is None (the bundled sample), a path, or an
    ImageDataset already loaded; ``dataset`` its kind (default: the checkpoint's). The indices
    are the first ``limit`` of the class-balanced order (all when None). Refuses images of
    another shape, or classes other than the checkpoint's (``checkpoint.check_data_fits``)."""
    from lofast.checkpoint import check_data_fits
    from lofast.data import ImageDataset, load_dataset
    from lofast.data.sample import class_balanced_order, load_bundled_sample

    if data is None:
        data = load_bundled_sample()
    elif not isinstance(data, ImageDataset):
        if dataset is None:  # the checkpoint's kind, unless its data was not one read from
            # paths (an ImageDataset made in memory): then the kind the path shows
            trained_on = metadata.get("dataset")
            dataset = trained_on if trained_on in DATASETS else None
        data = load_dataset(data, split, dataset)
    check_data_fits(model, metadata, data, classes_unchecked)
    return data, class_balanced_order(data.labels)[:limit]


def verdict_settings(config: CertifyConfig) -> CertifySettings | None:
    """The run's certifier settings: with ``verdicts_only``, verdicts at the run's eps
    (``verdicts_at``). ConfigError for a ``verdicts_at`` that lacks one of them: there the
    verdicts could be fewer than the full certificate's."""
    settings = config.settings
    if config.verdicts_only:
        return dataclasses.replace(settings or CertifySettings(), verdicts_at=config.eps)
    if settings is not None and settings.verdicts_at is not None:
        missing = sorted(set(config.eps) - set(settings.verdicts_at))
        if missing:
            raise ConfigError(f"verdicts_at lacks eps {', '.join(f'{e:g}' for e in missing)}; "
                              f"add it, or pass verdicts_only")
    return settings


def run_settings(checkpoint_digest: str, data: object, split: str, settings: CertifySettings,
                 fallback: str = "none", fallback_timeout: float | None = None,
                 attack: AttackSettings | None = None) -> dict:
    """What every record's verdicts depend on (``SampleRecord.run``): a resumed run must match."""
    return {"checkpoint": checkpoint_digest, "data": f"{data.digest()[:16]} ({split})",
            "bound": settings.describe(), "kappa": float(settings.kappa),
            "guarantee": settings.guarantee, "fallback": fallback,
            "fallback_timeout": fallback_timeout, "seed": settings.seed,
            "attack": attack.describe() if attack is not None else None}


# make_proofs tries at most this many of the run's first samples for one that gets bounds
PROOF_SAMPLES = 8


def make_proofs(certifier: Certifier, data: object, indices: Sequence[int]) -> float:
    """Seconds the certifier takes for its once-per-model proofs (the blocks' reference norms
    and deflations, the weights' factors), made before the first batch so that each record's
    seconds, and the time per sample, are the samples' own. The proofs are made where a
    sample first needs them, so the first of ``indices`` (up to PROOF_SAMPLES of them: a
    misclassified sample gets no bounds and needs none) is certified alone
    (``Certifier.make_proofs``: its certificate dropped, the random starts of the batches as
    they were), and certified again in its batch. A proof that only some samples need (a
    block's larger deflation) still falls in the batch of the first. A sample the device has
    no memory for stops the attempt: the batches then report it."""
    started = time.perf_counter()
    for index in list(indices)[:PROOF_SAMPLES]:
        x, y = data.subset([int(index)]).to_tensors()
        bounded = _unless_out_of_memory(certifier, certifier.make_proofs, x, y)
        if bounded is None or bounded:
            break
    return time.perf_counter() - started


def _unless_out_of_memory(certifier: Certifier, work: Callable[..., object],
                          *arguments: object) -> object | None:
    """work(*arguments), or None where the certifier's device had no memory for it (its cached
    memory then released, the error and its frames, holding the work's tensors, dropped
    here)."""
    from lofast.runtime import is_out_of_memory, release_cached_memory

    try:
        return work(*arguments)
    except Exception as error:  # torch.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(error):
            raise
    release_cached_memory(certifier.device)
    return None


def certified_batches(certifier: Certifier, data: object, indices: Sequence[int],
                      eps: Sequence[float], run: dict, batch_size: int,
                      note: Callable[[str], None] | None = None,
                      ) -> Iterator[tuple[Tensor, list[SampleRecord], float]]:
    """LoFAST on ``data``'s samples ``indices``, batch by batch: yields the batch's images
    (B, C, H, W), a record per sample and the per-sample failure probability of the batch's
    certificate (0 under the exact guarantee).

    A batch the device has no memory for is certified again in halves, and the rest of the
    run keeps the smaller size (told to ``note``): the records are those of a run with that
    batch size. A lone sample without memory raises LofastError."""
    start, size = 0, batch_size
    while start < len(indices):
        index = [int(i) for i in indices[start:start + size]]
        x, y = data.subset(index).to_tensors()
        made = _unless_out_of_memory(certifier, _batch_records, certifier, x, y, index, eps, run)
        if made is None:
            if len(index) == 1:
                raise LofastError(f"out of memory on {certifier.device} certifying a single "
                                  f"sample: the model's once-per-model proofs or one sample's "
                                  f"bounds need more than the device has")
            size = (len(index) + 1) // 2
            if note is not None:
                note(f"out of memory on {certifier.device} at a batch of {len(index)}: "
                     f"certifying {size} at a time (--batch-size {size})")
            continue
        records, failure = made
        yield x, records, failure
        start += len(index)


def _batch_records(certifier: Certifier, images: Tensor, labels: Tensor, indices: Sequence[int],
                   eps: Sequence[float], run: dict) -> tuple[list[SampleRecord], float]:
    """A record per sample (verdicts, feature radii and certified radius at every eps, keyed by
    ``eps_key``; no feature radius, and the reason, where the sample is misclassified or tied
    and so gets no bounds) and the failure probability; images (B, C, H, W), labels (B,)."""
    cert = certifier.certify(images, labels)
    eps_tensor = torch.tensor(list(eps), dtype=torch.float64)
    verdicts = cert.certified(eps_tensor).cpu()
    feature = cert.feature_radius(eps_tensor).cpu()
    radius = cert.radius().cpu()
    margin = cert.margin.cpu()
    predictions = cert.predictions.cpu()
    per_sample = cert.seconds / len(indices)
    finite = torch.isfinite(feature)  # a bound that overflowed certifies nothing
    bounded = cert.bounded.cpu()  # the others have no bound: misclassified, or tied

    def unbounded_reason(b: int) -> str:
        if not bounded[b]:
            return ("misclassified" if int(predictions[b]) != int(labels[b])
                    else "tied with another class")
        return "bound overflow"

    records = [
        SampleRecord(
            index=int(i), label=int(labels[b]), prediction=int(predictions[b]),
            margin=float(margin[b]), radius=float(radius[b]),
            results={float(e): EpsResult(
                certified=bool(verdicts[b, k]),
                verifier="lofast" if verdicts[b, k] else None,
                bound=float(feature[b, k]) if finite[b, k] else None,
                reason=None if finite[b, k] else unbounded_reason(b))
                for k, e in enumerate(eps)},
            seconds=per_sample, run=run)
        for b, i in enumerate(indices)]
    return records, cert.failure_probability


def guarantee_text(settings: CertifySettings, failure_probability: float) -> str:
    """The summary's line on what the certificates guarantee."""
    text = settings.method.describe()
    if settings.automatic:
        text += f" ({settings.automatic})"
    if failure_probability > 0:
        text += f"; per-sample failure probability <= {failure_probability:.1e}"
    return text
