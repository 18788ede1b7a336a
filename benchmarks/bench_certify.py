"""Certification time per sample against batch size, and the cost split between the forward pass,
zeta, the delta_2 terms and bookkeeping. Prints a table and writes JSON.

    python benchmarks/bench_certify.py [--checkpoint CKPT]
        [--guarantee probabilistic|exact|exact-dense|estimate] [--batch-sizes 16,64,256]
        [--n 256] [--device auto] [--out bench_certify.json]

"exact" is the Cholesky-verified deterministic method (what `lofast certify --guarantee exact`
uses); "exact-dense" the dense eigensolver it replaced, kept for comparison. The split times
the attention quantities with the certifier's own bound settings: "zeta" is the cost of the
first-order norm (the run minus one with the naive first-order term), "delta_2" the rest.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time

import torch

from lofast.bounds.attention import attention_sensitivity
from lofast.bounds.spectral import SpectralMethod
from lofast.certify import BOUNDS, Certifier, CertifySettings
from lofast.checkpoint import default_checkpoint_path, load_checkpoint
from lofast.data.sample import class_balanced_order, load_bundled_sample
from lofast.models.structure import AttentionSpec
from lofast.train import resolve_device

KINDS = {"exact": "verified", "exact-dense": "dense", "probabilistic": "lanczos",
         "estimate": "power"}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


@torch.no_grad()  # as in Certifier.certify: no autograd graph (the weights require grad)
def split_costs(certifier: Certifier, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Seconds for the forward pass, zeta, delta_2 and bookkeeping on one batch."""
    device = certifier.device
    x64 = x.to(device, torch.float64)
    (_, acts), forward = timed(lambda: certifier.model.forward_with_activations(x64), device)
    settings = certifier.settings
    _, score_bound = BOUNDS[settings.bound]
    full = cheap = 0.0
    for i, spec in enumerate(certifier.structure):
        if isinstance(spec, AttentionSpec):
            w = certifier.attention[i]
            _, t_full = timed(lambda a=acts[i], w=w: attention_sensitivity(
                a, w, kappa=settings.kappa, score_bound=score_bound, method=settings.method,
                generator=certifier.generator), device)
            # the naive first-order term needs no matrix-free norm: what remains is delta_2
            _, t_cheap = timed(lambda a=acts[i], w=w: attention_sensitivity(
                a, w, kappa=settings.kappa, first_order="naive", score_bound=score_bound,
                method=settings.method, generator=certifier.generator), device)
            full += t_full
            cheap += t_cheap
    cert, total = timed(lambda: certifier.certify(x, y), device)
    eps = torch.tensor([0.02, 0.05, 0.1], dtype=torch.float64)
    _, book = timed(lambda: (cert.certified(eps), cert.radius()), device)
    return {"forward": forward, "zeta": max(full - cheap, 0.0), "delta_2": cheap,
            "bookkeeping": book, "certify_total": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--guarantee", choices=list(KINDS), default="exact")
    parser.add_argument("--batch-sizes", default="16,64,256")
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default="bench_certify.json")
    args = parser.parse_args()

    device = resolve_device(args.device)
    model = load_checkpoint(args.checkpoint or default_checkpoint_path())
    data = load_bundled_sample()
    x, y = data.subset(class_balanced_order(data.labels)[: args.n]).to_tensors()
    settings = CertifySettings(method=SpectralMethod(kind=KINDS[args.guarantee]))
    certifier = Certifier(model, settings, device)
    certifier.certify(x[:4], y[:4])  # warm-up
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        xb, yb = x[:batch], y[:batch]
        costs = split_costs(certifier, xb, yb)
        row = {"batch_size": len(xb),
               **{f"{k}_ms_per_sample": 1e3 * v / len(xb) for k, v in costs.items()}}
        rows.append(row)
        print(f"batch {len(xb):4d}: " + ", ".join(
            f"{k.removesuffix('_ms_per_sample')} {v:.2f}" for k, v in row.items()
            if k != "batch_size") + " (ms/sample)", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    report = {"device": str(device), "cuda": torch.cuda.get_device_name(device)
              if device.type == "cuda" else platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "guarantee": args.guarantee,
              "model": model.config.to_json(), "commit": commit, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
