"""Measures the figures of the model card: for every shipped checkpoint, its training record
and its certified accuracy per eps, mean certified radius and time per sample on the current
device. Writes markdown and JSON; with --update-registry (the full test set: --data, no --n)
also the registry's figures of each shipped model (accuracy, mean radius, attention ablation
drop; its time per sample is measured apart, on idle threads) and, from them, the tables of
the README and the model card (``lofast.model_card``).

    python benchmarks/model_card.py [--data ../shared/data/cifar10-jpeg.tar.gz] [--n N]
        [--checkpoint CKPT ...] [--guarantee exact] [--device auto] [--work runs/model-card]
        [--update-registry]

Without --data the bundled 500-image sample is used. Certification goes through `lofast certify`
with --out, so an interrupted run continues where it stopped when started again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from lofast import model_card
from lofast.checkpoint import REGISTRY, SHIPPED_DIR, list_models, read_metadata, shipped_path

EPS = (0.02, 0.05, 0.1, 36 / 255)
EPS_NAMES = ("0.02", "0.05", "0.1", "36/255")
PAPER_LOFAST = {"0.02": "29.1 %", "0.05": "16.0 %", "0.1": "3.0 %", "36/255": "-"}


def certify(checkpoint: Path, args: argparse.Namespace, work: Path) -> dict:
    """Runs `lofast certify` on one checkpoint (resuming its JSONL) and returns its summary."""
    command = [sys.executable, "-m", "lofast", "certify", "--checkpoint", str(checkpoint),
               "--guarantee", args.guarantee, "--device", args.device, "--json",
               "--out", str(work / f"{checkpoint.stem}.jsonl"), "--resume"]
    for e in EPS:
        command += ["--eps", repr(e)]
    if args.data:
        command += ["--data", args.data]
    if args.n:
        command += ["--n", str(args.n)]
    if args.update_registry:
        command += ["--attention-report"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{checkpoint.name}: certification failed: {result.stderr.strip()[-500:]}")
    return json.loads(result.stdout)


def markdown(rows: list[dict], data: str) -> str:
    lines = ["| checkpoint | preset | epochs | device | clean | "
             + " | ".join(f"cert. {e}" for e in EPS_NAMES) + " | mean radius | ms/sample |",
             "| --- " * (7 + len(EPS)) + "|"]
    for row in rows:
        s, meta = row["summary"], row["metadata"]
        certified = [f"{100 * v:.1f} %" for v in s["certified_accuracy"].values()]
        lines.append(
            f"| {row['checkpoint']} | {(meta.get('train_options') or {}).get('preset', '-')} | "
            f"{meta.get('epochs', '-')} | {meta.get('device', '-')} | "
            f"{100 * s['clean_accuracy']:.1f} % | " + " | ".join(certified)
            + f" | {s['mean_radius']:.4f} | {s['mean_ms_per_sample']:.2f} |")
    lines.append("| LoFAST paper, Table 1 (ViT 3-layer) | paper-d3 | - | - | - | "
                 + " | ".join(PAPER_LOFAST[e] for e in EPS_NAMES) + " | - | - |")
    first = rows[0]["summary"] if rows else {}
    lines += ["", (f"Data: {data}, {first.get('samples', 0)} images. Guarantee: "
              f"{first.get('guarantee', '-')}. Bound {first.get('bound', '-')}, kappa "
              f"{first.get('kappa', '-')}, device {first.get('device', '-')}.")]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="data set path (default: bundled sample)")
    parser.add_argument("--n", type=int, default=None, help="first N images (default: all)")
    parser.add_argument("--checkpoint", action="append", default=None,
                        help="checkpoint(s) (default: every .safetensors in checkpoints/)")
    parser.add_argument("--guarantee", default="exact")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--work", default="runs/model-card",
                        help="JSONL, markdown and JSON go here")
    parser.add_argument("--update-registry", action="store_true",
                        help="write the figures into checkpoints/registry.json and regenerate "
                             "the README's and the model card's tables (full test set only)")
    args = parser.parse_args()
    if args.update_registry and (not args.data or args.n or args.checkpoint):
        parser.error("--update-registry takes the full test set of the shipped models: "
                     "--data, without --n or --checkpoint")

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    checkpoints = ([Path(c) for c in args.checkpoint] if args.checkpoint
                   else [shipped_path(name) for name in list_models()])
    rows = []
    for checkpoint in checkpoints:
        print(f"certifying {checkpoint.name} ...", flush=True)
        metadata = read_metadata(checkpoint)
        rows.append({"checkpoint": checkpoint.name, "metadata": {
            k: metadata.get(k) for k in ("train_options", "train_command", "epochs", "device",
                                         "train_seconds", "clean_accuracy")},
            "summary": certify(checkpoint, args, work)})
    data = args.data or "bundled sample (500 CIFAR-10 test images)"
    table = markdown(rows, data)
    (work / "model_card.md").write_text(table + "\n")
    (work / "model_card.json").write_text(json.dumps({"data": data, "rows": rows}, indent=2))
    print(table)
    print(f"wrote {work / 'model_card.md'} and {work / 'model_card.json'}")
    if args.update_registry:
        update_registry(rows)


def update_registry(rows: list[dict]) -> None:
    """The measured figures into the registry, then the tables regenerated from it."""
    path = SHIPPED_DIR / REGISTRY
    registry = json.loads(path.read_text())
    by_file = {entry["file"]: entry for entry in registry["models"].values()}
    for row in rows:  # the time per sample is measured apart, on idle threads: kept
        s = row["summary"]
        by_file[row["checkpoint"]]["figures"].update(
            clean=s["clean_accuracy"], certified=s["certified_accuracy"],
            mean_radius=round(s["mean_radius"], 4),
            ablation_drop=round(s["attention"]["attention_ablation_drop"], 2))
    path.write_text(json.dumps(registry, indent=2) + "\n")
    for relative in model_card.stale_files(write=True):
        print(f"{relative}: rewritten from the registry")


if __name__ == "__main__":
    main()
