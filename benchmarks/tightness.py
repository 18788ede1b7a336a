"""How much robustness the certificate leaves on the table, for every shipped checkpoint: on the
first N class-balanced test images, certified accuracy against the share that no attack
falsifies (l2 PGD at each eps plus the minimum-norm attack, checked in float64), the median
adversarial radius, and the median certified / adversarial radius over the correctly classified
samples.
With --frozen, also each model with every block's attention replaced by its mean over the same
images (``attention_report.ablate_attention``): what attention buys, and whether the
certificate sees it. Prints a markdown table and writes JSON; every run is resumable (its
records go to --work).

    python benchmarks/tightness.py --data ../shared/data/cifar10-jpeg.tar.gz [--n 300]
        [--checkpoint CKPT ...] [--frozen] [--steps 100] [--restarts 2] [--work runs/tightness]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from measure import output_file  # beside this script

import lofast
from lofast.certification.attention_report import ablate_attention, mean_attention
from lofast.checkpoint import list_models, shipped_path
from lofast.config import AttackSettings
from lofast.data.sample import class_balanced_order
from lofast.runtime import resolve_device

EPS = (0.02, 0.05, 0.1, 36 / 255)
EPS_NAMES = ("0.02", "0.05", "0.1", "36/255")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="test data (default: the bundled sample)")
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--checkpoint", action="append", default=None)
    parser.add_argument("--frozen", action="store_true")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--work", default="runs/tightness")
    parser.add_argument("--out", type=output_file, default="tightness.json")
    args = parser.parse_args()

    checkpoints = ([Path(c) for c in args.checkpoint] if args.checkpoint
                   else [shipped_path(name) for name in list_models()])
    data = lofast.load_data(args.data)
    attack = AttackSettings(steps=args.steps, restarts=args.restarts)
    work = Path(args.work)
    rows = []
    for checkpoint in checkpoints:
        model = lofast.load_model(checkpoint)
        variants = [(checkpoint.stem, checkpoint)]
        if args.frozen:
            x, _ = data.subset(class_balanced_order(data.labels)[:args.n]).to_tensors()
            frozen = ablate_attention(model, mean_attention(
                model, x, device=resolve_device(args.device)))
            variants.append((f"{checkpoint.stem}, frozen", frozen))
        for name, source in variants:
            started = time.perf_counter()
            out = work / f"{name.replace(', ', '-')}.jsonl"
            run = lofast.certify(source, data, eps=EPS, n=args.n, attack=attack, out=out,
                                 resume=out.exists(), device=args.device)
            correct = [r.certified_radius for r in run.records if r.prediction == r.label]
            rows.append({"model": name, "seconds": time.perf_counter() - started,
                         "summary": run.summary.to_dict(),
                         "median_certified_radius_correct": statistics.median(correct)})
            print(line(rows[-1]), flush=True)
    print(table(rows, args))
    Path(args.out).write_text(json.dumps({"data": args.data or "bundled sample", "n": args.n,
                                          "attack": attack.describe(), "rows": rows}, indent=2))


def line(row: dict) -> str:
    s = row["summary"]
    return (f"{row['model']}: clean {100 * s['clean_accuracy']:.1f} %, "
            + ", ".join(f"{n} {100 * c:.1f} / {100 * s['not_falsified'][k]:.1f} %"
                        for n, (k, c) in zip(EPS_NAMES, s["certified_accuracy"].items()))
            + f", median radii {row['median_certified_radius_correct']:.4f} / "
            f"{s['median_adversarial_radius']:.4f},"
            f" ratio {s['median_radius_ratio']:.3f} ({row['seconds']:.0f} s)")


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = ["| model | clean | " + " | ".join(f"{e} cert / not falsified" for e in EPS_NAMES)
             + " | median radius: certified / adversarial | median ratio |",
             "| --- " * (4 + len(EPS)) + "|"]
    for row in rows:
        s = row["summary"]
        cells = [f"{100 * c:.1f} / {100 * s['not_falsified'][k]:.1f}"
                 for k, c in s["certified_accuracy"].items()]
        lines.append(f"| {row['model']} | {100 * s['clean_accuracy']:.1f} % | "
                     + " | ".join(cells) + f" | {row['median_certified_radius_correct']:.4f} / "
                     f"{s['median_adversarial_radius']:.4f} | {s['median_radius_ratio']:.3f} |")
    lines.append(f"\nFirst {args.n} class-balanced images of {args.data or 'the bundled sample'};"
                 f" attack: minimum-norm ({args.steps} steps) and l2 PGD ({args.steps} steps, "
                 f"{args.restarts} restarts) at each eps, pixel box, searched in float32 and "
                 "checked in float64; radii and ratios over the correctly classified images.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
