"""Records -> a summary (certified accuracy per eps, radii, tightness, time) as a table or JSON,
a run against a baseline run (``compare``), and the attention report's tables. The records
and their files: ``lofast.certification.records``."""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from lofast.bounds.spectral import Guarantee
from lofast.certification.records import SampleRecord, SavedRun, eps_key
from lofast.config import Requirement, check_requirements, parse_allowed_drop, parse_requirement
from lofast.errors import ConfigError, LofastError

if TYPE_CHECKING:
    from lofast.certification.attention_report import AttentionReport


def is_estimate(guarantee: str) -> bool:
    """Whether a run's guarantee (its name, or the line describing it) is the estimate one:
    power iteration, whose radii are NOT certificates, so no certified-accuracy gate passes."""
    return guarantee.partition(":")[0].strip() == Guarantee.ESTIMATE.value


ESTIMATE_GATE = ("radii are estimates (guarantee estimate), NOT certificates: a gate on "
                 "certified accuracy needs a run made with --guarantee auto, exact or "
                 "probabilistic")


@dataclass
class Summary:
    samples: int
    clean_accuracy: float
    certified_accuracy: dict[float, float]  # eps -> share certified (JSON: keyed by eps_key)
    certified_by: dict[float, dict[str, int]]  # eps -> verifier -> samples it certified
    median_radius: float
    mean_radius: float
    mean_ms_per_sample: float
    # A run's wall time; a saved run's, the samples' seconds and its proofs' (over its sessions
    # and merged parts: machine time, not wall time)
    total_seconds: float
    guarantee: str
    bound: str
    kappa: float
    device: str
    stage_seconds: dict[str, float] = field(default_factory=dict)  # stage -> seconds/sample
    # With --attack, per eps: share of samples with a counterexample, and share with neither a
    # certificate nor a counterexample. 1 - falsified bounds robust accuracy from above.
    falsified: dict[float, float] = field(default_factory=dict)
    unknown: dict[float, float] = field(default_factory=dict)
    # With --attack: per eps, the share with no counterexample (>= robust accuracy >= certified
    # accuracy); over the correctly classified samples with a counterexample, the median
    # adversarial radius and the median of certified radius / adversarial radius (1: the
    # certificate shows all the robustness no attack breaks).
    not_falsified: dict[float, float] = field(default_factory=dict)
    median_adversarial_radius: float | None = None
    median_radius_ratio: float | None = None
    # Whether the run had certified all its samples: False for a saved run that stopped before
    # (the summary covers the samples certified until then), None for a file of an earlier
    # lofast, which does not say (``records.SavedRun``).
    finished: bool | None = True
    # Seconds of the certifier's once-per-model proofs, made before the first batch and kept
    # out of the samples' times (``pipeline.make_proofs``); for a saved run, summed over its
    # sessions (None for a file of an earlier lofast, which holds only the samples' times).
    proof_seconds: float | None = None
    # For one part of a sharded run (``certify --shard``; not merged): its "part" (0-based),
    # "parts" and the whole run's "samples", so that a part's figures are not read as the run's
    part: dict[str, int] | None = None

    def unmet(self, requirements: Sequence[Requirement | str]) -> list[str]:
        """One line for each requirement (a ``config.Requirement`` or its text, "36/255=42")
        the summary falls short of, one first for a run under the estimate guarantee (where a
        requirement names an eps: no radius of it is a certificate) and one for a saved run that
        did not finish (its figures are those of the samples certified before it stopped); none
        where all are met.
        Counts of samples are compared with the exact percentage; a summary of no samples meets
        none. ConfigError where a requirement names an eps the run was not certified at."""
        requirements = [r if isinstance(r, Requirement) else parse_requirement(r)
                        for r in requirements]
        check_requirements(requirements, list(self.certified_accuracy))
        lines = []
        if is_estimate(self.guarantee) and any(r.eps is not None for r in requirements):
            lines.append(f"the run's {ESTIMATE_GATE}")
        if requirements and self.finished is False:
            lines.append(f"the run did not finish: its {self.samples} samples are those "
                         "certified before it stopped; finish it with lofast certify --resume "
                         "and the same options")
        for requirement in requirements:
            if requirement.eps is None:
                what, share = "clean accuracy", self.clean_accuracy
            else:
                what = "certified accuracy"
                share = self.certified_accuracy[requirement.eps]
            count = round(share * self.samples) if self.samples else 0
            if not self.samples or Fraction(100 * count, self.samples) < requirement.percent:
                lines.append(f"requirement {requirement.text} not met: {what} "
                             f"{float(Fraction(100 * count, max(self.samples, 1))):.2f} % "
                             f"({count} of {self.samples} samples)")
        return lines

    def to_dict(self) -> dict:
        """The summary as JSON-ready values: eps keys as ``eps_key`` texts."""
        values = asdict(self)
        for name in ("certified_accuracy", "certified_by", "falsified", "unknown",
                     "not_falsified"):
            values[name] = {eps_key(e): v for e, v in values[name].items()}
        return values


def summarize(records: Sequence[SampleRecord], eps: Sequence[float], total_seconds: float,
              guarantee: str, bound: str, kappa: float, device: str,
              finished: bool | None = True, proof_seconds: float | None = None,
              part: dict[str, int] | None = None) -> Summary:
    n = len(records)
    eps = [float(e) for e in eps]
    certified = {e: sum(r.results[e].certified for r in records) / n if n else math.nan
                 for e in eps}
    certified_by = {e: dict(collections.Counter(r.results[e].verifier for r in records
                                                if r.results[e].verifier))
                    for e in eps}
    falsified: dict[float, float] = {}
    unknown: dict[float, float] = {}
    if n and any(r.attacked for r in records):
        for e in eps:
            verdicts = [r.results[e].verdict for r in records]
            falsified[e] = verdicts.count("falsified") / n
            unknown[e] = verdicts.count("unknown") / n
    attacked = [r for r in records
                if r.prediction == r.label and r.adversarial_radius is not None]
    adversarial = [r.adversarial_radius for r in attacked]
    ratios = [r.certified_radius / r.adversarial_radius for r in attacked]
    radii = [r.radius for r in records]
    fallback = sum(result.fallback_seconds or 0.0 for r in records
                   for result in r.results.values())
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
        finished=finished,
        proof_seconds=proof_seconds,
        part=part,
    )


def summarize_saved(saved: SavedRun) -> Summary:
    """``summarize`` of a saved run (``lofast report``): its settings from its records, its
    device from its sessions (each distinct one, "; " between them; "-" for a file of an
    earlier lofast, which does not say) and its total time the samples' seconds plus the
    sessions' proofs."""
    records = saved.records
    run = records[0].run if records else {}
    devices = list(dict.fromkeys(session.device for session in saved.sessions))
    proofs = (sum(session.proof_seconds for session in saved.sessions) if saved.sessions
              else None)
    return summarize(records, sorted(records[0].eps) if records else [],
                     sum(r.seconds for r in records) + (proofs or 0.0),
                     run.get("guarantee", "-"), run.get("bound", "-"),
                     run.get("kappa", math.nan), "; ".join(devices) or "-", saved.finished,
                     proofs, run.get("shard"))


@dataclass
class Comparison:
    """A run against a baseline run of the same data, over the samples both hold (``compare``):
    what a change of model or settings did to each sample's certificate.

    samples: the samples compared; run_only / baseline_only: samples one run holds and the
    other does not (left out); eps: the radii both runs certified at, ascending; clean: the
    (baseline, run) counts of correctly classified samples; certified: per eps, the
    (baseline, run) counts of certified samples (by any verifier); lost / gained: per eps, the
    indices the baseline certified and the run does not, and the other way, ascending;
    median_radius: (baseline, run) of the certified radii; finished: (baseline, run), as
    ``Summary.finished``."""

    samples: int
    run_only: int
    baseline_only: int
    eps: list[float]
    clean: tuple[int, int]
    certified: dict[float, tuple[int, int]]
    lost: dict[float, list[int]]
    gained: dict[float, list[int]]
    median_radius: tuple[float, float]
    finished: tuple[bool | None, bool | None] = (True, True)
    guarantees: tuple[str, str] = ("-", "-")  # (baseline, run), as their records name them

    def change(self, eps: float | None) -> Fraction:
        """The run's accuracy less the baseline's, in exact percentage points: certified at
        eps, or clean where eps is None."""
        baseline, run = self.clean if eps is None else self.certified[eps]
        return Fraction(100 * (run - baseline), self.samples)

    def exceeded(self, drops: Sequence[Requirement | str]) -> list[str]:
        """One line for each allowed drop ("36/255=0.5", ``config.parse_allowed_drop``) the
        run's accuracy fell by more than, against the baseline on the compared samples (exact
        counts), and one first where the run did not finish; none where every drop is within
        its allowance; one for each side under the estimate guarantee where a drop names an eps
        (its radii are no certificates). ConfigError where a drop names an eps the two runs do
        not share."""
        drops = [d if isinstance(d, Requirement) else parse_allowed_drop(d) for d in drops]
        for drop in drops:
            if drop.eps is not None and drop.eps not in self.eps:
                shown = ", ".join(f"{e:g}" for e in self.eps)
                raise ConfigError(f"allowed drop {drop.text}: the run and the baseline both "
                                  f"certify at eps {shown}, not {drop.eps:g}")
        lines = []
        if any(d.eps is not None for d in drops):
            lines.extend(f"the {side}'s {ESTIMATE_GATE}"
                         for side, guarantee in zip(("baseline", "run"), self.guarantees)
                         if is_estimate(guarantee))
        if drops and self.finished[1] is False:
            lines.append("the run did not finish: it is compared on the samples certified "
                         "before it stopped; finish it with lofast certify --resume and the same "
                         "options")
        for drop in drops:
            if -self.change(drop.eps) > drop.percent:
                what = "clean accuracy" if drop.eps is None else "certified accuracy"
                baseline, run = self.clean if drop.eps is None else self.certified[drop.eps]
                detail = ("" if drop.eps is None else
                          f", {len(self.lost[drop.eps])} samples lost and "
                          f"{len(self.gained[drop.eps])} gained")
                lines.append(f"allowed drop {drop.text} exceeded: {what} fell by "
                             f"{float(-self.change(drop.eps)):.2f} points against the baseline, "
                             f"from {100 * baseline / self.samples:.2f} % to "
                             f"{100 * run / self.samples:.2f} % ({self.samples} samples "
                             f"compared{detail})")
        return lines

    def to_dict(self) -> dict:
        """JSON-ready values: eps keys as ``eps_key`` texts, and each change in points."""
        values = asdict(self)
        values["eps"] = [eps_key(e) for e in self.eps]
        for name in ("certified", "lost", "gained"):
            values[name] = {eps_key(e): v for e, v in values[name].items()}
        values["change_points"] = {"clean": float(self.change(None)),
                                   **{eps_key(e): float(self.change(e)) for e in self.eps}}
        return values


def compare(run: Sequence[SampleRecord], baseline: Sequence[SampleRecord],
            finished: tuple[bool | None, bool | None] = (True, True)) -> Comparison:
    """``Comparison`` of a run's records against a baseline's, on the sample indices both hold.
    LofastError where the two were certified on other data (their digests differ, or a sample
    has another label: an index would name another image), where they share no sample, or
    where they share no eps. finished: (baseline, run), as ``Summary.finished``."""
    if not run or not baseline:
        raise LofastError("a comparison needs records in both the run and the baseline")
    data, baseline_data = run[0].run.get("data"), baseline[0].run.get("data")
    if data != baseline_data:
        raise LofastError(f"the baseline was certified on other data ({baseline_data}) than the "
                          f"run ({data}): its sample indices name other images")
    ours, theirs = {r.index: r for r in run}, {r.index: r for r in baseline}
    common = sorted(ours.keys() & theirs.keys())
    if not common:
        raise LofastError("the run and the baseline hold no sample in common")
    for index in common:
        if ours[index].label != theirs[index].label:
            raise LofastError(f"sample {index} has label {ours[index].label} in the run and "
                              f"{theirs[index].label} in the baseline: other data")
    eps = sorted(set(run[0].eps) & set(baseline[0].eps))
    if not eps:
        raise LofastError("the run and the baseline share no eps")
    pairs = [(theirs[i], ours[i]) for i in common]
    lost = {e: [b.index for b, r in pairs if b.results[e].certified and not r.results[e].certified]
            for e in eps}
    gained = {e: [b.index for b, r in pairs if r.results[e].certified and not b.results[e].certified]
              for e in eps}
    return Comparison(
        samples=len(common), run_only=len(ours) - len(common),
        baseline_only=len(theirs) - len(common), eps=eps,
        clean=tuple(sum(x.prediction == x.label for x in side) for side in zip(*pairs)),
        certified={e: tuple(sum(x.results[e].certified for x in side) for side in zip(*pairs))
                   for e in eps},
        lost=lost, gained=gained,
        median_radius=tuple(statistics.median(x.certified_radius for x in side)
                            for side in zip(*pairs)),
        finished=finished,
        guarantees=tuple(str(side[0].run.get("guarantee", "-")) for side in (baseline, run)))


# comparison_table names at most this many lost samples an eps (the JSON holds them all)
LOST_SHOWN = 8


def comparison_table(comparison: Comparison, name: str, baseline: str) -> Table:
    """The run against its baseline: accuracy and median radius of each on the compared
    samples, the change in points, and per eps the samples lost and gained (the first
    LOST_SHOWN lost by index)."""
    table = Table(title=escape(f"{name} against the baseline {baseline}"), header_style="bold")
    table.add_column("quantity")
    for column in ("baseline", "run", "change"):
        table.add_column(column, justify="right")
    table.add_row("samples compared", "", "", str(comparison.samples))
    for count, side in ((comparison.baseline_only, "baseline"), (comparison.run_only, "run")):
        if count:
            table.add_row(f"  left out: only in the {side}", "", "", str(count))

    def shares(counts: tuple[int, int], eps: float | None) -> tuple[str, str, str]:
        return (*(f"{count / comparison.samples:.2%}" for count in counts),
                f"{float(comparison.change(eps)):+.2f} points")

    table.add_row("clean accuracy", *shares(comparison.clean, None))
    for e in comparison.eps:
        table.add_row(f"certified @ eps={e:.6g}", *shares(comparison.certified[e], e))
        lost, gained = comparison.lost[e], comparison.gained[e]
        table.add_row("  samples lost / gained", "", "", f"{len(lost)} / {len(gained)}")
        if lost:
            more = f" +{len(lost) - LOST_SHOWN}" if len(lost) > LOST_SHOWN else ""
            table.add_row("  lost", "", "", ", ".join(map(str, lost[:LOST_SHOWN])) + more)
    table.add_row("median certified radius",
                  *(f"{radius:.4f}" for radius in comparison.median_radius),
                  f"{comparison.median_radius[1] - comparison.median_radius[0]:+.4f}")
    return table


def summary_rows(summary: Summary) -> dict[str, str]:
    """The summary as (quantity -> formatted value), in display order."""
    unfinished = "  (the run did not finish)" if summary.finished is False else ""
    if summary.part is not None:
        part = summary.part
        unfinished += (f"  (part {part['part']}/{part['parts']} of a run of {part['samples']}: "
                       f"lofast report --merge its parts for the run's figures)")
    rows = {"samples": f"{summary.samples}{unfinished}",
            "clean accuracy": f"{summary.clean_accuracy:.2%}"}
    for e, value in summary.certified_accuracy.items():
        by = summary.certified_by.get(e, {})
        detail = ", ".join(f"{v}: {c}" for v, c in sorted(by.items()))
        shown = f"{e:.6g}"  # six digits read better than the exact value
        rows[f"certified accuracy @ eps={shown}"] = (f"{value:.2%}"
                                                     + (f"  ({detail})" if len(by) > 1 else ""))
        if e in summary.falsified:
            rows[f"  not falsified @ eps={shown}"] = (
                f"{summary.not_falsified[e]:.2%}  (unknown {summary.unknown[e]:.2%})")
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
    if summary.proof_seconds is not None:
        rows["per-model proofs"] = f"{summary.proof_seconds:.2f} s"
    rows["total time"] = f"{summary.total_seconds:.2f} s"
    rows["bound"] = f"{summary.bound} (kappa={summary.kappa:g})"
    rows["guarantee"] = (f"{summary.guarantee}: NOT a certificate"
                         if summary.guarantee == Guarantee.ESTIMATE.value else summary.guarantee)
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
