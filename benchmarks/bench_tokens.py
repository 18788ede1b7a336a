"""Certification time against the token count, per guarantee, with the growth exponent.

    python benchmarks/bench_tokens.py [--tokens 4,16,64] [--guarantees exact,probabilistic]
        [--models 2] [--depth 3] [--small 4] [--large 12] [--position-bias] [--device auto]
        [--profile ROWS] [--workspace-mib 512,4096] [--out bench_tokens.json]

The models are fresh Lipschitz ViTs of width 128, depth --depth and 8 heads, with live attention
as initialised. They cut 4 / 16 / 64 patch tokens from 32 x 32 images (patch 16 / 8 / 4), and 256
from 64 x 64 images (patch 4); pass --tokens 4,16,64,256 for the last (minutes on a CPU). For
each shape, guarantee and model (seeds 0, 1, ...), a new Certifier certifies the first --small
of a fixed set of random images (uniform pixels, labels the model's own predictions), which
makes its per-model proofs, and then all --large of them:

- per sample: the second run's time over --large (the proofs are made once per Certifier);
- once per model (the per-model proofs): the first run's time less --small per-sample times.

On a GPU a small model is certified once, untimed, before the first row, so that no row pays
the device libraries' start-up.

--workspace-mib M1,M2,... repeats every row with the certifier's chunk workspace set to each
size (``first_order.DEVICE_WORKSPACE_ELEMENTS`` on an accelerator, ``CPU_WORKSPACE_ELEMENTS``
on a CPU; default: the library's, on a GPU 1/16 of its memory within 512 MiB-4 GiB): how many
samples its products and Lanczos bases take at once (at 257 tokens 512 MiB holds one sample's
Jacobian products).

--profile ROWS adds, to each row, torch.profiler's table of one more certification of the
--large images by the last model's Certifier (its proofs made): the ROWS operators with the
most time of their own (device time on a GPU), grouped by input shape.

The growth exponent is the least-squares slope of log(ms a sample) on log(tokens) over the
shapes run. On a GPU each row also gives the peak device memory of its runs (PyTorch's
allocator). Prints a table and writes JSON; radii are not compared (``bench_certify.py``).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from measure import output_file, profile_table, timed  # beside this script

from lofast.bounds import first_order
from lofast.certification.certificate import Certifier, CertifySettings
from lofast.config import ModelConfig
from lofast.models.vit import create_model
from lofast.runtime import device_name, resolve_device

# patch tokens -> (image size, patch size)
SHAPES = {4: (32, 16), 16: (32, 8), 64: (32, 4), 256: (64, 4)}


def measure(tokens: int, guarantee: str, args: argparse.Namespace,
            device: torch.device) -> dict:
    """Per-sample milliseconds and once-per-model seconds, averaged over --models models."""
    size, patch = SHAPES[tokens]
    config = ModelConfig(image_size=size, patch_size=patch, width=128, depth=args.depth, heads=8,
                         position_bias=args.position_bias)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(args.large, 3, size, size, generator=generator)
    per_sample, once = [], []
    for seed in range(args.models):
        model = create_model(config, seed=seed).eval()
        with torch.no_grad():
            labels = model(images).argmax(dim=1)
        certifier = Certifier(model, CertifySettings(guarantee=guarantee), device)
        small = timed(lambda c=certifier, y=labels: c.certify(images[: args.small],
                                                              y[: args.small]), device)[1]
        sample = timed(lambda c=certifier, y=labels: c.certify(images, y), device)[1] / args.large
        per_sample.append(sample)
        once.append(max(small - args.small * sample, 0.0))
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    profile = None
    if args.profile:
        table, sort = profile_table(device, lambda: certifier.certify(images, labels),
                                    rows=args.profile, shapes=True)
        profile = f"one certification of {args.large} images, sorted by {sort}\n{table}"
    budget = first_order.workspace_elements(device)
    return {"tokens": tokens, "image_size": size, "patch_size": patch, "guarantee": guarantee,
            "workspace_mib": 8 * budget / 2 ** 20,
            "ms_per_sample": 1e3 * sum(per_sample) / len(per_sample),
            "once_per_model_s": sum(once) / len(once), "peak_gib": peak, "profile": profile}


def growth_exponent(rows: list[dict]) -> float | None:
    """Least-squares slope of log(ms a sample) on log(tokens); None below two token counts."""
    points = [(math.log(r["tokens"]), math.log(r["ms_per_sample"])) for r in rows
              if r["ms_per_sample"] > 0]
    if len({x for x, _ in points}) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="4,16,64",
                        help=f"patch token counts, from {sorted(SHAPES)}")
    parser.add_argument("--guarantees", default="exact,probabilistic")
    parser.add_argument("--models", type=int, default=2)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--small", type=int, default=4)
    parser.add_argument("--large", type=int, default=12)
    parser.add_argument("--position-bias", action="store_true",
                        help="models with position biases (the shipped models' kind)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="add each row's profile table of ROWS operators")
    parser.add_argument("--workspace-mib", default=None,
                        help="comma-separated chunk workspaces in MiB (default: the library's)")
    parser.add_argument("--out", type=output_file, default="bench_tokens.json")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if any(t not in SHAPES for t in tokens):
        parser.error(f"--tokens takes counts from {sorted(SHAPES)}")
    if not 1 <= args.small < args.large or args.models < 1 or args.depth < 1 or args.profile < 0:
        parser.error("need --models >= 1, --depth >= 1, --profile >= 0 and 1 <= --small < "
                     "--large")
    try:
        workspaces = [int(m) for m in args.workspace_mib.split(",")] if args.workspace_mib else []
    except ValueError:
        parser.error("--workspace-mib takes whole MiB, e.g. 512,4096")
    if any(m < 1 for m in workspaces):
        parser.error("--workspace-mib takes sizes of at least 1 MiB")
    device = resolve_device(args.device)
    guarantees = args.guarantees.split(",")
    if device.type == "cuda":  # the device libraries' start-up, paid by no row
        warm_up = create_model(ModelConfig(image_size=32, patch_size=16, width=128, depth=1,
                                           heads=8), seed=0).eval()
        images = torch.rand(2, 3, 32, 32)
        with torch.no_grad():
            labels = warm_up(images).argmax(dim=1)
        Certifier(warm_up, CertifySettings(), device).certify(images, labels)
    name = "CPU_WORKSPACE_ELEMENTS" if device.type == "cpu" else "DEVICE_WORKSPACE_ELEMENTS"
    rows = []
    print("| tokens | image, patch | guarantee | workspace MiB | ms a sample | s once per model "
          "| peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mib in workspaces or [None]:
        if mib is not None:
            setattr(first_order, name, mib * 2 ** 20 // 8)
        for t in tokens:
            for guarantee in guarantees:
                row = measure(t, guarantee, args, device)
                rows.append(row)
                print(f"| {t} | {row['image_size']}, {row['patch_size']} | {guarantee} | "
                      f"{row['workspace_mib']:g} | {row['ms_per_sample']:.1f} | "
                      f"{row['once_per_model_s']:.2f} | "
                      + ("-" if row["peak_gib"] is None else f"{row['peak_gib']:.1f}") + " |",
                      flush=True)
                if row["profile"]:
                    print(row["profile"], flush=True)
    last = rows[-1]["workspace_mib"]  # the exponent at the last workspace size
    exponents = {g: growth_exponent([r for r in rows if r["guarantee"] == g
                                     and r["workspace_mib"] == last]) for g in guarantees}
    for g, e in exponents.items():
        if e is not None:
            print(f"{g}: ms a sample grows as tokens^{e:.2f}")
    with open(args.out, "w") as f:
        json.dump({"device": device_name(device), "threads": torch.get_num_threads(),
                   "models": args.models, "depth": args.depth, "small": args.small,
                   "large": args.large,
                   "position_bias": args.position_bias, "rows": rows,
                   "growth_exponent": exponents}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
