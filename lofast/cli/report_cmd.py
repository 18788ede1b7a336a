"""`lofast report`: summaries of saved runs (no recomputation), side by side, and their plot."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.markup import escape

from lofast.cli.certify_cmd import REQUIRE_HELP, REQUIREMENT, exit_if_unmet
from lofast.cli.console import stderr, stdout


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
def report(runs, plot_path, merge, as_json, requirements) -> None:
    """Summarise RUNS (files written by `lofast certify --out`), side by side."""
    from lofast.certification.records import load_run, merge_saved_runs
    from lofast.certification.report import summarize, summary_table

    if plot_path is not None:
        from lofast.certification.plot import check_plot_path

        check_plot_path(plot_path, runs)  # before any work
    loaded = {str(path): load_run(path, allow_empty=merge) for path in runs}
    if merge:
        loaded = {" + ".join(Path(p).name for p in loaded): merge_saved_runs(list(loaded.values()))}
    summaries = {}
    for name, saved in loaded.items():
        records = saved.records
        run = records[0].run
        eps = sorted(records[0].eps)
        summaries[name] = summarize(records, eps, sum(r.seconds for r in records),
                                    run.get("guarantee", "-"), run.get("bound", "-"),
                                    run.get("kappa", float("nan")), "-", saved.finished)
        if saved.finished is False:
            stderr.print(f"{escape(Path(name).name)}: the run did not finish; its summary "
                         f"covers the {len(records)} samples certified before it stopped",
                         soft_wrap=True)
    if plot_path is not None:
        from lofast.certification.plot import robustness_plot

        robustness_plot({Path(name).stem: saved.records for name, saved in loaded.items()},
                        plot_path)
    if as_json:
        click.echo(json.dumps({name: s.to_dict() for name, s in summaries.items()}, indent=2))
    else:
        stdout.print(summary_table(*summaries.values(), names=[Path(n).name for n in summaries]))
    if plot_path is not None:
        stderr.print(f"wrote {plot_path}")
    exit_if_unmet([f"{Path(name).name}: {line}" if len(summaries) > 1 else line
                   for name, summary in summaries.items() for line in summary.unmet(requirements)])
