"""`lofast report`: summaries of saved runs (no recomputation), side by side, and their plot."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.markup import escape

from lofast.cli.certify_cmd import REQUIRE_HELP, REQUIREMENT, Parsed, exit_if_unmet
from lofast.cli.console import stderr, stdout
from lofast.config import parse_allowed_drop

# EPS=POINTS or clean=POINTS: the most an accuracy may fall below the baseline's
ALLOWED_DROP = Parsed("EPS=POINTS", lambda value, _: parse_allowed_drop(value))


@click.command()
@click.argument("runs", nargs=-1, required=True,
                type=click.Path(path_type=Path, dir_okay=False, exists=True))
@click.option("--plot", "plot_path", type=click.Path(path_type=Path, dir_okay=False),
              default=None, help="Write the robustness curve (certified accuracy against eps, "
                                 "and the falsified upper bound where --attack ran) as a PNG.")
@click.option("--merge", is_flag=True,
              help="RUNS are parts of one run (certify --shard): one summary over all of them.")
@click.option("--json", "as_json", is_flag=True, help="Print the summaries as JSON on stdout.")
@click.option("--require", "requirements", type=REQUIREMENT, multiple=True,
              help=REQUIRE_HELP + " Every run (the merged run with --merge) must meet them.")
@click.option("--baseline", "baseline_path",
              type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              help="A run of the same data (an earlier model or release) to compare each run "
                   "with, on the samples both hold: accuracy against the baseline's and the "
                   "samples each eps lost and gained (JSON: 'against_baseline').")
@click.option("--max-drop", "drops", type=ALLOWED_DROP, multiple=True,
              help="With --baseline: exit with code 3 where certified accuracy at EPS (or "
                   "clean accuracy, clean=POINTS) fell by more than POINTS percentage points "
                   "below the baseline's on the same samples, e.g. 36/255=0.5 (repeatable; "
                   "for CI).")
def report(runs, plot_path, merge, as_json, requirements, baseline_path, drops) -> None:
    """Summarise RUNS (files written by `lofast certify --out`), side by side."""
    from lofast.certification.records import load_run, merge_saved_runs
    from lofast.certification.report import (
        compare,
        comparison_table,
        summarize_saved,
        summary_table,
    )

    if drops and baseline_path is None:
        raise click.UsageError("--max-drop needs --baseline")
    if plot_path is not None:
        from lofast.certification.plot import check_plot_path

        check_plot_path(plot_path, runs)  # before any work
    loaded = {str(path): load_run(path, allow_empty=merge) for path in runs}
    baseline = load_run(baseline_path) if baseline_path is not None else None
    if merge:
        loaded = {" + ".join(Path(p).name for p in loaded): merge_saved_runs(list(loaded.values()))}
    summaries = {}
    for name, saved in loaded.items():
        summaries[name] = summarize_saved(saved)
        if saved.finished is False:
            stderr.print(f"{escape(Path(name).name)}: the run did not finish; its summary "
                         f"covers the {len(saved.records)} samples certified before it "
                         "stopped", soft_wrap=True)
    comparisons = {}
    if baseline is not None:
        if baseline.finished is False:
            stderr.print(f"{escape(baseline_path.name)}: the baseline did not finish; runs are "
                         "compared with it on the samples it holds", soft_wrap=True)
        comparisons = {name: compare(saved.records, baseline.records,
                                     (baseline.finished, saved.finished))
                       for name, saved in loaded.items()}
    # an allowed drop at an eps the runs do not share is refused here, before any output
    exceeded = {name: c.exceeded(drops) for name, c in comparisons.items()} if drops else {}
    if plot_path is not None:
        from lofast.certification.plot import robustness_plot

        robustness_plot({Path(name).stem: saved.records for name, saved in loaded.items()},
                        plot_path)
    if as_json:
        shown = {name: s.to_dict() for name, s in summaries.items()}
        if baseline is not None:  # the summaries move under "runs" beside the comparisons
            shown = {"runs": shown, "baseline": str(baseline_path),
                     "against_baseline": {name: c.to_dict() for name, c in comparisons.items()}}
        click.echo(json.dumps(shown, indent=2))
    else:
        stdout.print(summary_table(*summaries.values(), names=[Path(n).name for n in summaries]))
        for name, comparison in comparisons.items():
            stdout.print(comparison_table(comparison, Path(name).name, baseline_path.name))
    if plot_path is not None:
        stderr.print(f"wrote {plot_path}")
    exit_if_unmet([f"{Path(name).name}: {line}" if len(summaries) > 1 else line
                   for name, summary in summaries.items()
                   for line in summary.unmet(requirements)
                   + exceeded.get(name, [])])
