"""Per-stage radius budget: how much each stage multiplies the perturbation radius on its way
from the image to the pooled features, at a given eps, per sample (exact guarantee). A stage
whose factor is large is where the certificate loses its radius: attention blocks against
the rest. Prints a table (geometric mean and maximum of every stage's factor over the samples,
and the mean log-factor: positive expands, negative contracts) and writes JSON.

    python benchmarks/radius_budget.py [--checkpoint CKPT] [--n 50] [--eps 36/255]
        [--out radius_budget.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from lofast.bounds.spectral import SpectralMethod
from lofast.certificate import Certifier, CertifySettings
from lofast.checkpoint import default_checkpoint_path, load_checkpoint
from lofast.data.sample import class_balanced_order, load_bundled_sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--n", type=int, default=50, help="first N bundled images")
    parser.add_argument("--eps", default="36/255")
    parser.add_argument("--out", default="radius_budget.json")
    args = parser.parse_args()

    numerator, _, denominator = args.eps.partition("/")
    eps = float(numerator) / float(denominator or 1)
    checkpoint = args.checkpoint or default_checkpoint_path()
    model = load_checkpoint(checkpoint)
    data = load_bundled_sample()
    x, y = data.subset(class_balanced_order(data.labels)[: args.n]).to_tensors()
    certifier = Certifier(model, CertifySettings(method=SpectralMethod(kind="verified")))
    certificate = certifier.certify(x, y)
    radius = torch.full((len(y), 1), eps, dtype=torch.float64)
    factors = []  # (B,) per stage: output radius / input radius
    for step in certificate.steps:
        out = step.delta(radius)
        factors.append((out / radius)[:, 0])
        radius = out
    names = [type(spec).__name__.removesuffix("Spec") for spec in certifier.structure[:-1]]
    logs = torch.stack([f.log() for f in factors])  # (S, B)
    total = logs.sum(dim=0)
    rows = []
    print(f"{checkpoint}: {len(y)} images at eps {eps:.6g}; feature radius / eps: geometric "
          f"mean {total.mean().exp():.4g}")
    print(f"{'#':>3} {'stage':10} {'geo-mean factor':>16} {'max factor':>11} {'mean log':>9}")
    for i, (name, log) in enumerate(zip(names, logs)):
        rows.append({"stage": i, "kind": name, "geometric_mean": log.mean().exp().item(),
                     "max": log.exp().max().item(), "mean_log": log.mean().item()})
        print(f"{i:>3} {name:10} {rows[-1]['geometric_mean']:>16.4f} {rows[-1]['max']:>11.4f} "
              f"{rows[-1]['mean_log']:>9.4f}")
    attention = math.exp(sum(r["mean_log"] for r in rows if r["kind"] == "Attention"))
    print(f"attention blocks together multiply the radius by {attention:.4g} (geometric mean)")
    with open(args.out, "w") as f:
        json.dump({"checkpoint": str(checkpoint), "eps": eps, "images": len(y),
                   "total_geometric_mean": total.mean().exp().item(), "stages": rows,
                   "attention_factor": attention}, f, indent=2)


if __name__ == "__main__":
    main()
