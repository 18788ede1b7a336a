"""Per-stage radius budget: how much each stage multiplies the perturbation radius on its way
from the image to the pooled features, at a given eps, per sample (exact guarantee). A stage
whose factor is large is where the certificate loses its radius: attention blocks against
the rest. Prints a table (geometric mean and maximum of every stage's factor over the samples,
and the mean log-factor: positive expands, negative contracts), then, for every attention
block with the softmax refinement, what its factor is made of: the first-order coefficient
(>= the norm of the block's Jacobian) and the three second-order terms divided by the block's
input radius (mean over the samples; they add up to the factor wherever the refined bound is
the one in use, the share given last). Writes JSON.

--jacobians K adds, for the first K of the images, what a certificate that follows the
perturbation's direction across stages could at best gain: every stage's Jacobian norm at the
clean input, the norm of the Jacobian from the image to the stage's output, and the product of
the stage norms up to there (power iteration with forward- and reverse-mode products, float64:
estimates from below, not bounds). Where the image-to-stage norm falls below the product, the
stage-by-stage composition loses the difference even with every second-order term gone.

    python benchmarks/radius_budget.py [--checkpoint CKPT] [--n 50] [--eps 36/255]
        [--jacobians 6] [--out radius_budget.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from measure import output_file  # beside this script
from torch.func import jvp, vjp

from lofast.bounds.spectral import SpectralMethod, power_norm
from lofast.certification.certificate import Certifier, CertifySettings
from lofast.checkpoint import checkpoint_path, load_checkpoint
from lofast.data.sample import class_balanced_order, load_bundled_sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--n", type=int, default=50, help="first N bundled images")
    parser.add_argument("--eps", default="36/255")
    parser.add_argument("--jacobians", type=int, default=0, metavar="K",
                        help="Jacobian norms of every stage and every prefix on the first K "
                             "images (slow: about 10 s an image for a 17-token model)")
    parser.add_argument("--out", type=output_file, default="radius_budget.json")
    args = parser.parse_args()
    if not 0 <= args.jacobians <= args.n:
        parser.error(f"--jacobians must lie between 0 and --n ({args.n}), not {args.jacobians}")

    numerator, _, denominator = args.eps.partition("/")
    eps = float(numerator) / float(denominator or 1)
    checkpoint = checkpoint_path(args.checkpoint)
    model = load_checkpoint(checkpoint)
    data = load_bundled_sample()
    x, y = data.subset(class_balanced_order(data.labels)[: args.n]).to_tensors()
    certifier = Certifier(model, CertifySettings(method=SpectralMethod(kind="verified")))
    # the factors do not depend on the label: every image at the one the model predicts, so
    # that each gets bounds (a misclassified one would get none), tied ones left out
    with torch.no_grad():
        predicted = certifier.model(x.to(certifier.device, torch.float64)).argmax(dim=1)
    certificate = certifier.certify(x, predicted)
    x, y = x[certificate.bounded.cpu()], y[certificate.bounded.cpu()]
    radius = torch.full((len(y), 1), eps, dtype=torch.float64)
    factors = []  # (B,) per stage: output radius / input radius
    splits = {}  # stage -> what an attention block's factor is made of
    for i, step in enumerate(certificate.steps):
        out = step.delta(radius)
        factors.append((out / radius)[:, 0])
        linear = getattr(step, "refined_first_order", None)
        if linear is not None:
            parts = {k: (v / radius)[:, 0] for k, v in step.second_order_parts(radius).items()}
            refined = linear + sum(parts.values())
            splits[i] = {"first_order_geometric_mean": linear.log().mean().exp().item(),
                         **{f"{k}_mean": v.mean().item() for k, v in parts.items()},
                         "refined_in_use": (refined <= factors[-1] * (1 + 1e-12))
                         .double().mean().item()}
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
    if splits:
        print(f"{'#':>3} {'first order':>12} {'+ scores':>9} {'+ remainder':>12} {'+ values':>9} "
              f"{'refined in use':>15}")
    for i, split in splits.items():
        rows[i]["refined"] = split
        print(f"{i:>3} {split['first_order_geometric_mean']:>12.4f} {split['scores_mean']:>9.4f} "
              f"{split['remainder_mean']:>12.4f} {split['values_mean']:>9.4f} "
              f"{split['refined_in_use']:>15.0%}")
    jacobians = composition_gap(certifier.structure[:-1], x[: args.jacobians], logs, names)
    with open(args.out, "w") as f:
        json.dump({"checkpoint": str(checkpoint), "eps": eps, "images": len(y),
                   "total_geometric_mean": total.mean().exp().item(), "stages": rows,
                   "attention_factor": attention, "jacobians": jacobians}, f, indent=2)


def composition_gap(structure, images, logs, names, iterations: int = 60) -> list[dict]:
    """Per stage, geometric means over ``images`` (K, C, H, W) of: the stage's Jacobian norm at
    its clean input, the image-to-stage-output Jacobian norm, the product of the stage norms up
    to the stage, and the certificate's factor (``logs`` (S, B), log factors). Prints the table;
    returns its rows ([] without images)."""
    if len(images) == 0:
        return []
    modules = [spec.plain() for spec in structure]
    stage, prefix = [], []  # (K,) per stage
    for image in images.to(torch.float64):
        activations = [image[None]]
        for module in modules:
            activations.append(module(activations[-1]))
        stage.append([jacobian_norm(m, a, iterations) for m, a in zip(modules, activations)])
        prefix.append([jacobian_norm(torch.nn.Sequential(*modules[: k + 1]), image[None], iterations)
                       for k in range(len(modules))])
    stage_log = torch.tensor(stage, dtype=torch.float64).log().T  # (S, K)
    prefix_log = torch.tensor(prefix, dtype=torch.float64).log().T
    product_log = stage_log.cumsum(dim=0)
    factor_log = logs[:, : len(images)].cumsum(dim=0)
    print(f"Jacobian norms at the clean inputs, first {len(images)} images (geometric means; "
          "power iteration):")
    print(f"{'#':>3} {'stage':10} {'stage norm':>11} {'image->here':>12} {'product':>9} "
          f"{'certificate':>12}")
    rows = []
    for i, name in enumerate(names):
        row = {"stage": i, "kind": name, "stage_norm": stage_log[i].mean().exp().item(),
               "prefix_norm": prefix_log[i].mean().exp().item(),
               "product_of_stage_norms": product_log[i].mean().exp().item(),
               "certificate_factor": factor_log[i].mean().exp().item()}
        rows.append(row)
        print(f"{i:>3} {name:10} {row['stage_norm']:>11.4f} {row['prefix_norm']:>12.4f} "
              f"{row['product_of_stage_norms']:>9.4f} {row['certificate_factor']:>12.4f}")
    loss = (product_log[-1] - prefix_log[-1]).mean().exp().item()
    print(f"composing stage by stage loses {loss:.3g}x at the pooled features (product of the "
          "stage norms over the image-to-features norm)")
    return rows


def jacobian_norm(function, point: torch.Tensor, iterations: int) -> float:
    """Estimate of the norm of ``function``'s Jacobian at ``point`` (1, ...): the project's
    power iteration (``spectral.power_norm``, at most the norm) on forward- and reverse-mode
    products, float64."""
    _, pull = vjp(function, point)
    start = torch.randn(1, point[0].numel(), generator=torch.Generator().manual_seed(0),
                        dtype=torch.float64)
    start = start / start.norm()
    return power_norm(lambda q: jvp(function, (point,), (q,))[1], lambda y: pull(y)[0], start,
                      tuple(point.shape[1:]), iterations).item()

if __name__ == "__main__":
    main()
