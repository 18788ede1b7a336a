"""Certificates -> per-sample records (JSONL), a summary (table or JSON)."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from lofast.errors import LofastError

if TYPE_CHECKING:
    from lofast.attention_report import AttentionReport


def eps_key(eps: float) -> str:
    """The stable text form of an eps value used as a JSON key."""
    return f"{eps:g}"


@dataclass
class SampleRecord:
    """One certified sample. verdicts/bounds/verifiers are keyed by eps_key(eps)."""

    index: int
    label: int
    prediction: int
    margin: float  # min_j z_y - z_j (negative when misclassified)
    radius: float  # largest radius LoFAST certifies (0 when misclassified)
    verdicts: dict[str, bool]  # certified at eps, by any verifier
    bounds: dict[str, float]  # LoFAST's feature-space radius at eps
    verifiers: dict[str, str | None]  # which verifier certified ("lofast", "crown", ...)
    reasons: dict[str, str] = field(default_factory=dict)  # why not certified, when known
    rule: str = "pairwise-head"  # z_y - z_j > ||w_y - w_j|| delta_h for all j
    seconds: float = 0.0  # time spent on this sample (its share of the batch, all stages)
    fallback_seconds: dict[str, float] = field(default_factory=dict)
    # What the verdicts depend on (checkpoint and data digests, bound, guarantee, fallback):
    # a resumed run must match it, so that one file never mixes two runs' certificates.
    run: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), allow_nan=False)


class RecordWriter:
    """Appends records to a JSONL file and flushes each batch, so an interrupt loses nothing
    that was finished. With resume, records already in the file are kept and reported; they
    must have been made with the same eps values and run settings."""

    def __init__(self, path: Path | None, resume: bool, eps: Sequence[float],
                 run: dict[str, Any]) -> None:
        self.path = path
        self.done: dict[int, SampleRecord] = {}
        if path is None:
            self.handle = None
            return
        if resume and path.is_file():
            self.done = read_records(path, eps, run)
            self._rewrite_clean()
        elif path.exists() and not resume:
            raise LofastError(f"{path} exists; pass --resume to continue it or choose another --out")
        path.parent.mkdir(parents=True, exist_ok=True)
        # kept open across batches so that each batch is appended and flushed as it finishes
        self.handle = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def _rewrite_clean(self) -> None:
        """Drop a torn last line left by an interrupt before appending to the file."""
        assert self.path is not None
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(record.to_json() + "\n" for record in self.done.values())
        os.replace(tmp, self.path)

    def write(self, records: Iterable[SampleRecord]) -> None:
        if self.handle is None:
            return
        self.handle.writelines(record.to_json() + "\n" for record in records)
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


def read_records(path: Path, eps: Sequence[float], run: dict[str, Any]) -> dict[int, SampleRecord]:
    """Records of a JSONL file by index; a torn final line is ignored, a file made for other
    eps values or other run settings is refused."""
    records: dict[int, SampleRecord] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            record = SampleRecord(**json.loads(line))
        except (json.JSONDecodeError, TypeError):
            if number == len(lines):
                break  # the line being written when the run stopped
            raise LofastError(f"{path}:{number}: not a lofast record") from None
        if set(record.verdicts) != {eps_key(e) for e in eps}:
            raise LofastError(f"{path}: was written for eps {sorted(record.verdicts)}; "
                              "resume with the same --eps values")
        if record.run != run:
            changed = [k for k in sorted(set(record.run) | set(run))
                       if record.run.get(k) != run.get(k)]
            detail = ", ".join(f"{k} {record.run.get(k)} (now {run.get(k)})" for k in changed)
            raise LofastError(f"{path}: was written with other settings: {detail}; resume with "
                              "the same settings or choose another --out")
        records[record.index] = record
    return records


@dataclass
class Summary:
    samples: int
    clean_accuracy: float
    certified_accuracy: dict[str, float]
    certified_by: dict[str, dict[str, int]]  # eps -> verifier -> samples it certified
    median_radius: float
    mean_radius: float
    mean_ms_per_sample: float
    total_seconds: float
    guarantee: str
    bound: str
    kappa: float
    device: str
    stage_seconds: dict[str, float] = field(default_factory=dict)  # stage -> seconds/sample

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(records: Sequence[SampleRecord], eps: Sequence[float], total_seconds: float,
              guarantee: str, bound: str, kappa: float, device: str) -> Summary:
    n = len(records)
    certified = {}
    certified_by: dict[str, dict[str, int]] = {}
    for e in eps:
        key = eps_key(e)
        certified[key] = sum(r.verdicts[key] for r in records) / n if n else math.nan
        counts: dict[str, int] = {}
        for r in records:
            if r.verifiers.get(key):
                counts[r.verifiers[key]] = counts.get(r.verifiers[key], 0) + 1
        certified_by[key] = counts
    radii = [r.radius for r in records]
    fallback = sum(sum(r.fallback_seconds.values()) for r in records)
    lofast = sum(r.seconds for r in records) - fallback
    stage_seconds = {"lofast": lofast / n if n else math.nan}
    if fallback:
        stage_seconds["fallback"] = fallback / n
    return Summary(
        samples=n,
        clean_accuracy=sum(r.prediction == r.label for r in records) / n if n else math.nan,
        certified_accuracy=certified,
        certified_by=certified_by,
        median_radius=statistics.median(radii) if radii else math.nan,
        mean_radius=statistics.fmean(radii) if radii else math.nan,
        mean_ms_per_sample=1e3 * sum(r.seconds for r in records) / n if n else math.nan,
        total_seconds=total_seconds,
        guarantee=guarantee,
        bound=bound,
        kappa=kappa,
        device=device,
        stage_seconds=stage_seconds,
    )


def summary_table(summary: Summary, attention: AttentionReport | None = None) -> Table:
    """The summary as a two-column table; with ``attention``, the ablation's rows follow."""
    table = Table(title="lofast certification", show_header=True, header_style="bold")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("samples", str(summary.samples))
    table.add_row("clean accuracy", f"{summary.clean_accuracy:.2%}")
    for key, value in summary.certified_accuracy.items():
        by = summary.certified_by.get(key, {})
        detail = ", ".join(f"{v}: {c}" for v, c in sorted(by.items()))
        table.add_row(f"certified accuracy @ eps={key}",
                      f"{value:.2%}" + (f"  ({detail})" if len(by) > 1 else ""))
    table.add_row("median / mean certified radius",
                  f"{summary.median_radius:.4f} / {summary.mean_radius:.4f}")
    table.add_row("time per sample", f"{summary.mean_ms_per_sample:.2f} ms")
    for stage, seconds in summary.stage_seconds.items():
        if len(summary.stage_seconds) > 1:
            table.add_row(f"  of which {stage}", f"{1e3 * seconds:.2f} ms")
    table.add_row("total time", f"{summary.total_seconds:.2f} s")
    table.add_row("bound", f"{summary.bound} (kappa={summary.kappa:g})")
    table.add_row("guarantee", summary.guarantee)
    table.add_row("device", summary.device)
    if attention is not None:
        for quantity, value in ablation_rows(attention):
            table.add_row(quantity, value)
    return table


def ablation_rows(report: AttentionReport) -> list[tuple[str, str]]:
    """(quantity, value) rows: how large the scores' weights are, how far attention strays from
    its mean, and what replacing it by its mean costs."""
    rows = [
        ("attention: max ||Wq_l Wk_l^T|| (/ s)",
         f"{report.max_score_norm:.3g} ({report.max_score_norm_over_scale:.3g})"),
        ("attention: TV to mean attention, max head mean / max",
         f"{report.max_mean_tv:.3g} / {report.max_tv:.3g}"),
        ("ablated attention: clean accuracy", f"{report.ablated_clean_accuracy:.2%}"),
        ("attention_ablation_drop", f"{report.attention_ablation_drop:.2f} points"),
        ("ablated attention: predictions changed", f"{report.changed_predictions:.2%}"),
    ]
    for key, value in report.ablated_certified_accuracy.items():
        rows.append((f"ablated attention: certified @ eps={key}",
                     f"{value:.2%} (drop {report.certified_ablation_drop[key]:.2f} points)"))
    rows.append(("attention report time", f"{report.seconds:.2f} s"))
    return rows


def attention_table(report: AttentionReport) -> Table:
    """One row per attention block and head: ||A_l||, ||A_l|| / s, TV to the mean attention."""
    table = Table(title=f"attention on {report.samples} samples", header_style="bold")
    for column in ("block", "stage", "head", "||A_l||", "||A_l|| / s", "TV mean", "TV max"):
        table.add_column(column, justify="right")
    for h in report.heads:
        table.add_row(str(h.block), str(h.stage), str(h.head), f"{h.score_norm:.3g}",
                      f"{h.score_norm_over_scale:.3g}", f"{h.tv_mean:.3g}", f"{h.tv_max:.3g}")
    return table


def ablation_table(report: AttentionReport) -> Table:
    """The real model against the one whose attention is replaced by its data mean."""
    table = Table(title="attention ablation: every P_l(X) replaced by its mean over the data",
                  header_style="bold")
    for column in ("quantity", "real", "ablated", "drop (points)"):
        table.add_column(column, justify="right")
    table.add_row("clean accuracy", f"{report.clean_accuracy:.2%}",
                  f"{report.ablated_clean_accuracy:.2%}", f"{report.attention_ablation_drop:.2f}")
    for key, value in report.certified_accuracy.items():
        table.add_row(f"certified @ eps={key}", f"{value:.2%}",
                      f"{report.ablated_certified_accuracy[key]:.2%}",
                      f"{report.certified_ablation_drop[key]:.2f}")
    table.add_row("predictions changed", "", f"{report.changed_predictions:.2%}", "")
    return table
