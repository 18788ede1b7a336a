"""LoFAST alone against LoFAST followed by each fallback verifier (CROWN, alpha-CROWN, beta-CROWN
branch and bound with either branching heuristic), on the same samples and per-sample time
limit: the shape of the LoFAST paper's Table 2. Prints a markdown table.

    OMP_NUM_THREADS=1 python benchmarks/bench_fallback.py --data CIFAR10 [--checkpoint CKPT]
        [--n 20] [--eps 0.02 --eps 0.05] [--timeout 400] [--out runs/bench_fallback]
        [--configs none,crown,alpha-crown,beta-crown,beta-crown-widest]

How it is measured:

- LoFAST: `lofast certify --fallback none --out OUT/lofast.jsonl` on the first --n images of
  the class-balanced order of the test split (the CLI's defaults otherwise).
- Each fallback: `lofast.certification.pipeline.run_fallback` (what `lofast certify --fallback
  M` runs after LoFAST) on a copy of those records with the same images, eps values and
  --timeout, one sample at a time: a sample LoFAST leaves open at an eps goes to the fallback,
  and one the fallback fails at a smaller eps is not tried at larger ones. "beta-crown" branches
  with BaBSR scores (the CLI's default), "beta-crown-widest" with the widest unstable interval.
- Seconds per fallback sample: the fallback's own time per sample it ran on (auto_LiRPA graph
  construction included; the export of the model, under a second, is not).

Each configuration runs in a process of its own and writes its records to OUT/CONFIG.jsonl; a
rerun reuses the files that exist (delete them to measure again), so an interrupted run
continues.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lofast.bab import BabSettings
from lofast.certification.pipeline import run_fallback
from lofast.certification.records import eps_key, read_run, write_records
from lofast.checkpoint import load_checkpoint
from lofast.data import load_dataset

CONFIGS = {"none": None, "crown": ("crown", None), "alpha-crown": ("alpha-crown", None),
           "beta-crown": ("beta-crown", BabSettings(heuristic="babsr")),
           "beta-crown-widest": ("beta-crown", BabSettings(heuristic="widest"))}


def lofast_records(args: argparse.Namespace, path: Path) -> list:
    if not path.exists():
        command = [sys.executable, "-m", "lofast", "certify", "--checkpoint", str(args.checkpoint),
                   "--data", str(args.data), "--n", str(args.n), "--out", str(path), "--json"]
        for e in args.eps:
            command += ["--eps", repr(e)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return read_run(path)


def progress(phase: str, done: int, total: int) -> None:
    print(f"  {phase}: {done}/{total} samples", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path,
                        default=Path(__file__).parent.parent / "checkpoints"
                        / "paper-d3-margin.safetensors")
    parser.add_argument("--data", type=Path, required=True, help="CIFAR-10 (e.g. the .tar.gz)")
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--eps", type=float, action="append", default=None)
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds per sample")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_fallback"))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--only", help=argparse.SUPPRESS)  # one config, in this process
    args = parser.parse_args()
    args.eps = sorted(args.eps or [0.02, 0.05])
    configs = args.configs.split(",")
    if unknown := set(configs) - set(CONFIGS):
        parser.error(f"unknown configs {sorted(unknown)}; choose from {list(CONFIGS)}")
    args.out.mkdir(parents=True, exist_ok=True)

    base = lofast_records(args, args.out / "lofast.jsonl")
    model = load_checkpoint(args.checkpoint)
    data = load_dataset(args.data, "test", "cifar10")
    images, _ = data.subset([r.index for r in base]).to_tensors()

    rows = {}
    for name in configs:
        path = args.out / f"{name}.jsonl"
        wall = None
        if name == "none":
            records = base
        elif path.exists():
            records = read_run(path)
        elif args.only is None:
            # a fresh process per configuration: alpha-CROWN's ~15 GB (float64, paper-d3)
            # are not always handed back to the system after one configuration ends
            subprocess.run([sys.executable, *sys.argv, "--only", name], check=True)
            records = read_run(path)
        else:
            if name != args.only:
                continue
            method, bab = CONFIGS[name]
            records = copy.deepcopy(base)
            print(f"{name}:", file=sys.stderr, flush=True)
            start = time.perf_counter()
            run_fallback(model, images, records, args.eps, method, args.timeout, progress, bab)
            wall = time.perf_counter() - start
            write_records(path, records)
            (args.out / f"{name}.wall").write_text(f"{wall:.1f}\n")
        if wall is None and (args.out / f"{name}.wall").exists():
            wall = float((args.out / f"{name}.wall").read_text())
        rows[name] = (records, wall)
    if args.only is not None:
        return

    print(f"\n{len(base)} test images, checkpoint {args.checkpoint.name}, per-sample limit "
          f"{args.timeout:g} s, torch threads {torch.get_num_threads()} "
          f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})\n")
    header = "| configuration |"
    for e in args.eps:
        header += f" certified @ {e:g} | fallback runs @ {e:g} (certified) |"
    print(header + " mean s / fallback sample | domains (mean, max) | wall s |")
    print("|" + " --- |" * (4 + 2 * len(args.eps)))
    summary = {}
    for name, (records, wall) in rows.items():
        line = f"| LoFAST{'' if name == 'none' else ' -> ' + name} |"
        seconds, domains = [], []
        for e in args.eps:
            ran = [r.results[e].fallback for r in records if r.results[e].fallback is not None]
            won = sum(entry["verdict"] == "verified" for entry in ran)
            line += f" {sum(r.results[e].certified for r in records)} | {len(ran)} ({won}) |"
            seconds += [entry["seconds"] for entry in ran]
            domains += [entry["domains"] for entry in ran if entry["domains"] is not None]
        mean = f"{statistics.mean(seconds):.1f}" if seconds else "-"
        dom = f"{statistics.mean(domains):.0f}, {max(domains)}" if domains else "-"
        print(line + f" {mean} | {dom} | {'-' if wall is None else f'{wall:.0f}'} |")
        summary[name] = {r.index: {eps_key(e): x.fallback for e, x in r.results.items()}
                         for r in records if any(x.fallback for x in r.results.values())}
    print("\nper sample (eps: verdict, bound, domains, seconds):", file=sys.stderr)
    print(json.dumps(summary, indent=1), file=sys.stderr)


if __name__ == "__main__":
    main()
