"""`lofast certify`: certify a checkpoint on a data set at one or more eps values."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from lofast.cli.console import stderr as console
from lofast.cli.console import stdout
from lofast.config import (
    BOUNDS,
    CERTIFY_DEFAULTS,
    DATASETS,
    FALLBACKS,
    GUARANTEE_CHOICES,
    KAPPAS,
    MAX_ATTACK_RESTARTS,
    MAX_ATTACK_STEPS,
    MAX_BATCH_SIZE,
    MAX_SEED,
    SPLITS,
    AttackSettings,
    parse_radius,
    parse_requirement,
    parse_shard,
)
from lofast.errors import ConfigError


class Parsed(click.ParamType):
    """An option value read by a parser of ``lofast.config``, the one the Python API applies
    to the same argument; its ConfigError becomes click's usage error (exit code 2).
    parse(value, the option's name as written, e.g. "eps") -> the value."""

    def __init__(self, name: str, parse: Callable[[Any, str], Any]) -> None:
        self.name = name
        self.parse = parse

    def convert(self, value, param, ctx):
        try:
            name = param.opts[0].lstrip("-") if param is not None and param.opts else "value"
            return self.parse(value, name)
        except ConfigError as e:
            self.fail(str(e), param, ctx)


# a positive finite number, also written as a fraction such as 36/255
POSITIVE_NUMBER = Parsed("positive number", parse_radius)
# I/N: the I-th (from 0) of N interleaved parts of the samples
SHARD = Parsed("I/N", lambda value, _: parse_shard(value))
# EPS=PERCENT or clean=PERCENT: a floor on certified (clean) accuracy
REQUIREMENT = Parsed("EPS=PERCENT", lambda value, _: parse_requirement(value))


# Exit code where the run is complete and sound but misses a --require floor: CI fails on it,
# and can tell it from an error (1) and a bad command line (2).
EXIT_UNMET = 3

REQUIRE_HELP = ("Exit with code 3 unless certified accuracy at EPS (or clean accuracy, "
                "clean=PERCENT) is at least PERCENT, e.g. 36/255=42 (repeatable; for CI).")


def exit_if_unmet(lines: list[str]) -> None:
    """Print each unmet requirement (``report.Summary.unmet``) on stderr and exit with
    EXIT_UNMET; return where there is none."""
    if lines:
        for line in lines:
            console.print(f"[bold red]{escape(line)}[/]", soft_wrap=True)
        sys.exit(EXIT_UNMET)


@click.command()
@click.option("--checkpoint", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Model to certify (default: the shipped default checkpoint).")
@click.option("--data", "data_path", type=click.Path(path_type=Path), default=None,
              help="Data set (default: the sample of CIFAR-10 test images bundled with lofast).")
@click.option("--dataset", type=click.Choice(DATASETS), default=None,
              help="Data set kind (default: the checkpoint's).")
@click.option("--split", type=click.Choice(SPLITS), default="test", show_default=True)
@click.option("--eps", "eps_values", type=POSITIVE_NUMBER, multiple=True, required=True,
              help="l2 radius in [0,1] pixel scale, e.g. 0.05 or 36/255 (repeatable).")
@click.option("--n", "--limit", "limit", type=click.IntRange(min=1), default=None,
              help="Certify the first N samples of the class-balanced order (i-th image of "
                   "every class in turn).")
@click.option("--batch-size", type=click.IntRange(1, MAX_BATCH_SIZE), default=None,
              help="Samples certified together (default: 64 on CPU, 16 for a model of more "
                   "than 65 tokens; 1024 on a GPU).")
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
@click.option("--jacobian-slack", type=float, default=None,
              help="With input-dependent attention: keep the cheap deflated bound on a block's "
                   "Jacobian where it lies within this relative slack of its estimate, and skip "
                   "the per-sample proofs there (default 0.01). Larger is faster, with smaller "
                   "radii; as sound.")
@click.option("--verdicts-only", is_flag=True,
              help="Make the per-sample proofs only for the samples whose verdict at some --eps "
                   "needs them: the same certified accuracy at every eps, faster on models with "
                   "live attention; other samples' radii may be smaller (each still certified), "
                   "so median and mean radius become lower bounds.")
@click.option("--kappa", type=click.Choice([f"{k:g}" for k in KAPPAS]),
              default=f"{CERTIFY_DEFAULTS.kappa:g}", show_default=True,
              help="Softmax Lipschitz constant: 0.5 (tight) or 1 (the paper's).")
@click.option("--guarantee", type=click.Choice(list(GUARANTEE_CHOICES)),
              default=CERTIFY_DEFAULTS.guarantee, show_default=True,
              help="exact: float64 Cholesky-verified norms (deterministic, rounding bounded "
                   "rigorously); probabilistic: randomized Lanczos, each norm an upper bound "
                   "with probability >= 1 - 1e-9; estimate: power iteration, NOT a certificate; "
                   "auto: exact unless the model's blocks (tokens x width) are too large for its "
                   "proofs, then probabilistic; the summary says which.")
@click.option("--fallback", type=click.Choice(["none", *FALLBACKS]),
              default="none", show_default=True,
              help="Run a verifier from auto_LiRPA on the samples LoFAST leaves uncertified: "
                   "CROWN, alpha-CROWN, or alpha-CROWN with beta-CROWN branch and bound over "
                   "the ReLUs (the strongest, and slowest).")
@click.option("--fallback-timeout", type=POSITIVE_NUMBER, default=None,
              help="Seconds the fallback may spend on one sample (branch and bound stops "
                   "there with an unknown verdict).")
@click.option("--attack", is_flag=True,
              help="Attack after the verifiers: a minimum-norm attack on every correctly "
                   "classified sample (its adversarial radius, beside the certified one) and "
                   "l2 PGD at each eps on the samples still open, searched in float32 and "
                   "every counterexample checked in float64. The summary shows "
                   "certified against not-falsified accuracy per eps and the median certified "
                   "/ adversarial radius.")
@click.option("--attack-steps", type=click.IntRange(1, MAX_ATTACK_STEPS),
              default=AttackSettings.steps, show_default=True)
@click.option("--attack-restarts", type=click.IntRange(1, MAX_ATTACK_RESTARTS),
              default=AttackSettings.restarts, show_default=True)
@click.option("--attack-box/--no-attack-box", default=True, show_default=True,
              help="Keep adversarial images in the pixel box [0, 1] (the certificate holds "
                   "on the whole l2 ball either way).")
@click.option("--save-adversarial", type=click.Path(path_type=Path, file_okay=False),
              default=None, help="With --attack: write each counterexample to this folder "
                                 "(.npz: image, perturbation, label, adversarial_class, eps).")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=CERTIFY_DEFAULTS.seed,
              show_default=True)
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Write one JSON record per sample (JSONL) as the run goes.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from --out.")
@click.option("--shard", type=SHARD, default=None,
              help="Certify only part I of N (every N-th sample from the I-th), e.g. one task "
                   "of a job array; `lofast report --merge` joins the parts' --out files. Under "
                   "torchrun every rank takes its part itself (--out gets .rankIofN per rank) "
                   "and rank 0 prints the merged summary and writes the merged --out.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@click.option("--require", "requirements", type=REQUIREMENT, multiple=True,
              help=REQUIRE_HELP)
@click.option("--attention-report", is_flag=True,
              help="Also measure attention on the same samples: ||Wq_l Wk_l^T|| and how far "
                   "P_l(X) strays from its mean per head, and the attention ablation (every "
                   "P_l(X) replaced by its mean over the samples), certified at the same --eps "
                   "with the same settings and compared with LoFAST's own verdicts on the real "
                   "model (JSON key 'attention').")
@click.option("--classes-unchecked", is_flag=True,
              help="Certify with a checkpoint whose metadata names no classes, taking the "
                   "data's labels as they are (refused otherwise: they could mean anything).")
def certify(checkpoint, data_path, dataset, split, eps_values, limit, batch_size, device,
            bound, softmax_jacobian, jacobian_slack, verdicts_only, kappa, guarantee, fallback, fallback_timeout, attack,
            attack_steps, attack_restarts, attack_box, save_adversarial, seed, out,
            resume, shard, as_json, requirements, attention_report, classes_unchecked) -> None:
    """Certify l2 robustness of every sample with the LoFAST bound."""
    from lofast.certification.certificate import CertifySettings
    from lofast.certification.pipeline import run_certify
    from lofast.certification.report import summary_table
    from lofast.config import CertifyConfig, check_requirements

    if save_adversarial is not None and not attack:
        raise ConfigError("--save-adversarial needs --attack")
    check_requirements(requirements, eps_values)
    settings = CertifySettings(bound=bound, kappa=float(kappa), seed=seed,
                               softmax_jacobian=softmax_jacobian, guarantee=guarantee,
                               jacobian_slack=jacobian_slack)
    attack_settings = AttackSettings(steps=attack_steps, restarts=attack_restarts,
                                     box=attack_box, seed=seed, save_dir=save_adversarial)
    config = CertifyConfig(eps=eps_values, checkpoint=checkpoint, data=data_path,
                           dataset=dataset, split=split, limit=limit, batch_size=batch_size,
                           device=device, settings=settings,
                           fallback=None if fallback == "none" else fallback,
                           fallback_timeout=fallback_timeout,
                           attack=attack_settings if attack else None, out=out, resume=resume,
                           shard=shard, attention_report=attention_report,
                           classes_unchecked=classes_unchecked, verdicts_only=verdicts_only)
    with BarProgress() as progress:
        certification = run_certify(config, progress)
    if certification is None:
        return  # a torchrun process other than 0: process 0 reports for all
    if as_json:
        result = certification.summary.to_dict()
        if certification.attention is not None:
            result["attention"] = certification.attention.to_dict()
        click.echo(json.dumps(result, indent=2))
    else:
        stdout.print(summary_table(certification.summary, attention=certification.attention))
    exit_if_unmet(certification.summary.unmet(requirements))


class BarProgress:
    """``pipeline.RunProgress`` drawn on stderr: a bar for the samples and one per phase (a
    fallback at one eps, the attention report's passes) on a terminal, with elapsed and
    remaining time; elsewhere plain lines at most every PLAIN_PROGRESS_SECONDS
    (``cli.progress.PlainProgress``). A phase's bar is replaced when the next batch of samples
    starts it again."""

    def __enter__(self):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        from lofast.cli.progress import PlainProgress

        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                   TimeRemainingColumn()]
        self.bar = Progress(*columns, console=console, transient=True)
        self.bar.__enter__()
        self.plain = PlainProgress(console)
        self.task = None
        self.phases: dict[str, tuple[int, float]] = {}  # phase -> (task, start)
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def note(self, text: str) -> None:
        console.print(text)

    def samples(self, done: int, total: int, ms_per_sample: float | None) -> None:
        rate = "" if ms_per_sample is None else f"{ms_per_sample:.2f} ms/sample"
        if self.task is None:
            self.task = self.bar.add_task("certifying", total=total, completed=done, rate=rate)
            return
        self.bar.update(self.task, completed=done, rate=rate)
        self.plain(f"certified {done}/{total} samples, {rate}")

    def phase(self, name: str, done: int, total: int) -> None:
        if done == 0 or name not in self.phases:  # a phase starts (again, for a new batch)
            if name in self.phases:
                self.bar.remove_task(self.phases[name][0])
            task = self.bar.add_task(name, total=total, rate="")
            self.phases[name] = (task, time.perf_counter())
            if done == 0:
                return
        task, start = self.phases[name]
        elapsed = time.perf_counter() - start
        self.bar.update(task, completed=done, total=total,
                        rate=f"{elapsed / done:.1f} s/sample")
        remaining = elapsed / done * (total - done)
        self.plain(f"{name}: {done}/{total} samples, {elapsed:.0f} s elapsed, about "
                   f"{remaining:.0f} s remaining")
