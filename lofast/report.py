"""Certificates -> per-sample records (JSONL), a summary (table or JSON)."""

from __future__ import annotations

import collections
import dataclasses
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
from lofast.files import check_readable, read_lines

if TYPE_CHECKING:
    from lofast.attention_report import AttentionReport

def eps_key(eps: float) -> str:
    """The text form of an eps value used as a JSON key: the shortest decimal that reads back
    as the same float, so two distinct eps never share a key (36/255 is 0.1411764705882353)."""
    return repr(float(eps))


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
    # With --attack: whether an adversarial example was found at eps (never where certified),
    # and for each found one {"norm": its l2 norm, "class": the class predicted there, "file":
    # where it was saved or None}. Empty where no attack ran.
    falsified: dict[str, bool] = field(default_factory=dict)
    counterexamples: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Per eps where a fallback verifier ran: {"method", "verdict" ("verified" / "unknown" /
    # "falsified"), "bound" (its lower bound on the smallest margin, or None), "domains"
    # (subdomains bounded by branch and bound, or None), "seconds"}. Empty in older files.
    fallback: dict[str, dict[str, Any]] = field(default_factory=dict)
    # With --attack: the smallest l2 distance at which an attack changed the prediction (0 when
    # misclassified; None where none was found, or no attack ran). radius / adversarial_radius
    # says how much of the robustness the attack cannot break the certificate shows.
    adversarial_radius: float | None = None

    @property
    def certified_radius(self) -> float:
        """The largest radius certified by any verifier: LoFAST's radius, or a larger eps a
        fallback verifier certified."""
        return max([self.radius] + [float(k) for k, v in self.verdicts.items() if v])

    def verdict(self, key: str) -> str:
        """"certified", "falsified" or "unknown" at eps key (VNN-COMP's three verdicts)."""
        if self.verdicts[key]:
            return "certified"
        return "falsified" if self.falsified.get(key) else "unknown"

    def to_json(self) -> str:
        return json.dumps(asdict(self), allow_nan=False)


# Every record line starts so (dataclass field order): a final line without its newline that
# starts so is one torn by an interrupt; anything else is not a record file of ours.
RECORD_START = b'{"index": '

# Field -> accepted JSON types, checked when records are read back (--resume, lofast report).
RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "index": (int,), "label": (int,), "prediction": (int,), "margin": (int, float),
    "radius": (int, float), "verdicts": (dict,), "bounds": (dict,), "verifiers": (dict,),
    "reasons": (dict,), "rule": (str,), "seconds": (int, float), "fallback_seconds": (dict,),
    "run": (dict,),
}
OPTIONAL_FIELDS: dict[str, tuple[type, ...]] = {"falsified": (dict,), "counterexamples": (dict,),
                                                 "fallback": (dict,),
                                                 "adversarial_radius": (int, float, type(None))}


def _lock(handle) -> bool:
    """An exclusive advisory lock on the open file, without waiting; True where taken (or
    where the platform has no flock, which leaves the file unlocked)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return True
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


class RecordWriter:
    """Appends records to a JSONL file and flushes each batch, so an interrupt loses nothing
    that was finished. The file is locked while the run lasts: a second process writing the same
    file is refused rather than interleaving with the first. With resume, records already in the
    file are kept and reported; they must have been made with the same eps values and run
    settings. A file that is not a record file of ours is never modified."""

    def __init__(self, path: Path | None, resume: bool, eps: Sequence[float],
                 run: dict[str, Any]) -> None:
        self.path = path
        self.done: dict[int, SampleRecord] = {}
        self.handle = None
        if path is None:
            return
        if path.is_dir():
            raise LofastError(f"{path} is a folder; --out names the record file to write")
        if path.exists() and not resume:
            raise LofastError(f"{path} exists; pass --resume to continue it or choose another --out")
        if resume and path.exists():  # opening a FIFO would wait, reading /dev/zero never end
            check_readable(path, "record file")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # "a+b" creates the file, never truncates it, and appends every write
            handle = open(path, "a+b")  # noqa: SIM115 - kept open (and locked) across batches
        except OSError as e:
            raise LofastError(f"cannot write {path}: {e.strerror or e}") from None
        if not _lock(handle):
            handle.close()
            raise LofastError(f"{path} is being written by another lofast process; wait for it "
                              "to finish or choose another --out")
        try:
            if resume:
                handle.seek(0)
                self.done, valid = parse_records(read_lines(handle, path), path, eps, run)
                if valid < handle.seek(0, os.SEEK_END):
                    handle.truncate(valid)  # drop the torn last line, nothing else
        except BaseException:
            handle.close()
            raise
        self.handle = handle

    def write(self, records: Iterable[SampleRecord]) -> None:
        if self.handle is None:
            return
        lines = "".join(record.to_json() + "\n" for record in records).encode("utf-8")
        try:
            self.handle.write(lines)
            self.handle.flush()
            os.fsync(self.handle.fileno())
        except OSError as e:
            raise LofastError(f"cannot write {self.path}: {e.strerror or e}; the records written "
                              "before are kept, rerun with --resume") from None

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()  # releases the lock
            self.handle = None


def record_from_json(values: Any) -> SampleRecord:
    """A SampleRecord from one decoded JSON line; ValueError where a field is missing, unknown,
    of the wrong type, or out of range (a radius that is not a finite number >= 0, an eps key
    that is not a positive radius in its exact text form, verdicts missing)."""
    if not isinstance(values, dict) or not (
            set(RECORD_FIELDS) <= set(values) <= set(RECORD_FIELDS) | set(OPTIONAL_FIELDS)):
        raise ValueError("not a record")
    for name, types in {**RECORD_FIELDS, **OPTIONAL_FIELDS}.items():
        if name not in values:
            continue
        # bool is an int to Python, never a number to us
        if not isinstance(values[name], types) or isinstance(values[name], bool):
            raise ValueError(f"field {name} has the wrong type")  # noqa: TRY004 - one error kind
    keys = set(values["verdicts"])
    if not keys or not all(_is_eps_key(k) for k in keys):
        raise ValueError("verdicts must be keyed by eps")
    for name in ("bounds", "verifiers", "reasons", "fallback_seconds", "falsified",
                 "counterexamples", "fallback"):
        if not set(values.get(name, {})) <= keys:
            raise ValueError(f"{name} has keys that are not the record's eps")
    if not all(isinstance(v, bool) for v in values["verdicts"].values()) or not all(
            isinstance(v, bool) for v in values.get("falsified", {}).values()):
        raise ValueError("verdicts must be true or false")
    if not all(v is None or isinstance(v, str) for v in values["verifiers"].values()):
        raise ValueError("verifiers must be names")
    numbers = [values["margin"], values["radius"], values["seconds"],
               *values["bounds"].values()]
    if values.get("adversarial_radius") is not None:
        numbers.append(values["adversarial_radius"])
    if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                             and math.isfinite(v)) for v in numbers):
        raise ValueError("numbers must be finite")
    if min(values["index"], values["label"], values["radius"], values["seconds"]) < 0:
        raise ValueError("index, label, radius and seconds must be >= 0")
    return SampleRecord(**values)


def _is_eps_key(key: str) -> bool:
    """Whether key is eps_key(e) of a positive finite radius e."""
    try:
        value = float(key)
    except ValueError:
        return False
    return math.isfinite(value) and value > 0 and eps_key(value) == key


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not a number a record holds")


def parse_records(lines: Iterable[bytes], path: Path, eps: Sequence[float] | None = None,
                  run: dict[str, Any] | None = None) -> tuple[dict[int, SampleRecord], int]:
    """Records of a JSONL file's lines (``files.read_lines``) by index, and the length of its
    valid part (all but a torn final line). A file that is not ours, or whose records were
    made for other eps values or other run settings than given (or, where none are given,
    than its first record's), is refused with LofastError naming the file and line."""
    records: dict[int, SampleRecord] = {}
    keys = None if eps is None else {eps_key(e) for e in eps}
    valid = 0
    torn = b""
    for number, line in enumerate(lines, 1):
        if torn:  # a line without its break was not the last one
            raise LofastError(f"{path}:{number - 1}: not a lofast record")
        if not line.endswith(b"\n"):
            torn = line
            continue
        try:
            record = record_from_json(json.loads(line.decode("utf-8"),
                                                 parse_constant=_no_constants))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise LofastError(f"{path}:{number}: not a lofast record (a file lofast certify "
                              "--out writes)") from None
        keys = set(record.verdicts) if keys is None else keys
        run = record.run if run is None else run
        if set(record.verdicts) != keys:
            raise LofastError(f"{path}: was written for eps {sorted(record.verdicts)}, not "
                              f"{sorted(keys)}; resume with the same --eps values")
        # a setting a record lacks is one it was made without (None), as the run may say
        changed = [k for k in sorted(set(record.run) | set(run))
                   if record.run.get(k) != run.get(k)]
        if changed:
            detail = ", ".join(f"{k} {record.run.get(k)} (now {run.get(k)})" for k in changed)
            raise LofastError(f"{path}: was written with other settings: {detail}; resume with "
                              "the same settings or choose another --out")
        records[record.index] = record
        valid += len(line)
    if torn and not (torn.startswith(RECORD_START) or RECORD_START.startswith(torn)):
        raise LofastError(f"{path}: not a lofast record file (its last line is not a record); "
                          "--resume continues only a file that lofast certify wrote")
    return records, valid


def read_run(path: Path, allow_empty: bool = False) -> list[SampleRecord]:
    """The records of one `lofast certify --out` file, in file order (a torn last line left by
    an interrupt is skipped); LofastError for a missing or foreign file, one that is not a
    regular file (a FIFO, a device), or one without records unless ``allow_empty`` (a shard
    that had no samples)."""
    path = Path(path)
    check_readable(path, "record file")
    try:
        with open(path, "rb") as handle:
            records, _ = parse_records(read_lines(handle, path), path)
    except OSError as e:
        raise LofastError(f"cannot read {path}: {e.strerror or e}") from None
    if not records and not allow_empty:
        raise LofastError(f"{path}: holds no records")
    return list(records.values())


def write_records(path: Path, records: Iterable[SampleRecord]) -> None:
    """Write records as one JSONL file, atomically (a temporary file renamed into place)."""
    from lofast.files import atomic_write

    lines = "".join(record.to_json() + "\n" for record in records)
    atomic_write(Path(path), lambda tmp: Path(tmp).write_text(lines, encoding="utf-8"))


def merge_runs(runs: Sequence[Sequence[SampleRecord]]) -> list[SampleRecord]:
    """The records of the parts of one run, by sample index, as one whole run (its records no
    longer name a shard). Refused, naming what is wrong: parts made with other eps values or
    settings, parts that disagree on a sample, and a set of shards that is not complete and
    consistent (every part I of N present once with all its samples, of runs over the same
    number of samples; a part with no samples may be absent or empty)."""
    records = [record for part in runs for record in part]
    if not records:
        raise LofastError("the runs to merge hold no records")
    first = records[0]
    whole = _unsharded(first.run)
    for record in records:
        if set(record.verdicts) != set(first.verdicts) or _unsharded(record.run) != whole:
            raise LofastError("the runs to merge were made with other eps values or "
                              "settings; merge only the parts of one run")
    shards = [record.run.get("shard") for record in records]
    if any(shard is not None for shard in shards):
        _check_complete(shards)
    merged: dict[int, SampleRecord] = {}
    for record in records:
        if record.index in merged:
            raise LofastError(f"sample {record.index} is in two of the parts"
                              + ("" if merged[record.index].verdicts == record.verdicts
                                 else ", with other verdicts"))
        merged[record.index] = dataclasses.replace(record, run=whole)
    return [merged[i] for i in sorted(merged)]


def _unsharded(run: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in run.items() if key != "shard"}


def _check_complete(shards: Sequence[dict[str, int] | None]) -> None:
    """Refuse shards (``run["shard"]`` of every record) that are not all parts I of one N of a
    run over one number of samples, each with all its samples (part I has the samples
    I, I + N, ... below that number)."""
    if any(shard is None for shard in shards):
        raise LofastError("the runs to merge mix shards with a whole run")
    counts = {(shard["parts"], shard["samples"]) for shard in shards}
    if len(counts) > 1:
        detail = ", ".join(f"of {n} parts over {total} samples" for n, total in sorted(counts))
        raise LofastError(f"the shards to merge come from different runs ({detail})")
    (parts, total), = counts
    found = collections.Counter(shard["part"] for shard in shards)
    wrong = [f"{i}/{parts} ({found[i]} of {len(range(i, total, parts))} samples)"
             for i in range(parts) if found[i] != len(range(i, total, parts))]
    if wrong:
        raise LofastError(f"the shards do not make one run of {total} samples: "
                          f"{', '.join(wrong)}; merge every part once")


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
    # With --attack, per eps: share of samples with a counterexample, and share with neither a
    # certificate nor a counterexample. 1 - falsified bounds robust accuracy from above.
    falsified: dict[str, float] = field(default_factory=dict)
    unknown: dict[str, float] = field(default_factory=dict)
    # With --attack: per eps, the share with no counterexample (>= robust accuracy >= certified
    # accuracy); over the correctly classified samples with a counterexample, the median
    # adversarial radius and the median of certified radius / adversarial radius (1: the
    # certificate shows all the robustness no attack breaks).
    not_falsified: dict[str, float] = field(default_factory=dict)
    median_adversarial_radius: float | None = None
    median_radius_ratio: float | None = None

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
    falsified: dict[str, float] = {}
    unknown: dict[str, float] = {}
    if n and any(r.falsified for r in records):
        for e in eps:
            key = eps_key(e)
            verdicts = [r.verdict(key) for r in records]
            falsified[key] = verdicts.count("falsified") / n
            unknown[key] = verdicts.count("unknown") / n
    attacked = [r for r in records
                if r.prediction == r.label and r.adversarial_radius is not None]
    adversarial = [r.adversarial_radius for r in attacked]
    ratios = [r.certified_radius / r.adversarial_radius for r in attacked]
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
        falsified=falsified,
        unknown=unknown,
        not_falsified={key: 1.0 - share for key, share in falsified.items()},
        median_adversarial_radius=statistics.median(adversarial) if adversarial else None,
        median_radius_ratio=statistics.median(ratios) if ratios else None,
    )


def summary_rows(summary: Summary) -> dict[str, str]:
    """The summary as (quantity -> formatted value), in display order."""
    rows = {"samples": str(summary.samples), "clean accuracy": f"{summary.clean_accuracy:.2%}"}
    for key, value in summary.certified_accuracy.items():
        by = summary.certified_by.get(key, {})
        detail = ", ".join(f"{v}: {c}" for v, c in sorted(by.items()))
        shown = f"{float(key):.6g}"  # the key is exact (JSON); six digits read better
        rows[f"certified accuracy @ eps={shown}"] = (f"{value:.2%}"
                                                     + (f"  ({detail})" if len(by) > 1 else ""))
        if key in summary.falsified:
            rows[f"  not falsified @ eps={shown}"] = (
                f"{summary.not_falsified[key]:.2%}  (unknown {summary.unknown[key]:.2%})")
    rows["median / mean certified radius"] = (f"{summary.median_radius:.4f} / "
                                              f"{summary.mean_radius:.4f}")
    if summary.median_adversarial_radius is not None:
        rows["median adversarial radius"] = f"{summary.median_adversarial_radius:.4f}"
    if summary.median_radius_ratio is not None:
        rows["median cert. / adv. radius"] = f"{summary.median_radius_ratio:.3f}"
    rows["time per sample"] = f"{summary.mean_ms_per_sample:.2f} ms"
    for stage, seconds in summary.stage_seconds.items():
        if len(summary.stage_seconds) > 1:
            rows[f"  of which {stage}"] = f"{1e3 * seconds:.2f} ms"
    rows["total time"] = f"{summary.total_seconds:.2f} s"
    rows["bound"] = f"{summary.bound} (kappa={summary.kappa:g})"
    rows["guarantee"] = summary.guarantee
    rows["device"] = summary.device
    return rows


def summary_table(*summaries: Summary, names: Sequence[str] | None = None,
                  attention: AttentionReport | None = None) -> Table:
    """One summary as a two-column table, or several side by side (one column per run, named
    by `names`; a quantity a run lacks shows as -); with ``attention`` (one summary), the
    attention ablation's rows follow."""
    table = Table(title="lofast certification", show_header=True, header_style="bold")
    table.add_column("quantity")
    names = names or ["value"] * len(summaries)
    rows = [summary_rows(s) for s in summaries]
    labels = list(dict.fromkeys(label for r in rows for label in r))
    for name in names:
        table.add_column(name, justify="right")
    for label in labels:
        table.add_row(label, *(r.get(label, "-") for r in rows))
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
