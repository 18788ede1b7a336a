"""Certification time per sample against batch size, and the cost split between the forward pass,
zeta, the delta_2 terms and bookkeeping, after the per-model proofs and a warm-up batch of 4
images (timed apart: "setup_seconds"). Prints a table and writes JSON.

    python benchmarks/bench_certify.py [--checkpoint CKPT]
        [--guarantee probabilistic|exact|exact-dense|estimate] [--batch-sizes 16,64,256]
        [--n 256] [--device auto] [--out bench_certify.json]
    python benchmarks/bench_certify.py --live-attention K [--seed 0] [--n 20] [--batch-sizes 16]
        [--spread R] [--checkpoint CKPT] [--guarantee exact] [--jacobian-slack S]
        [--repeats 3] [--out bench_certify.json]

--profile ROWS adds torch.profiler's table of one certification of the first batch (the ROWS
operators with the most self time, device time on a GPU, by input shape).

--live-attention K switches attention on without retraining (``live_attention.py``: every
block's Wq, Wk replaced by seeded random weights scaled to ||A_l|| / s = K, with singular
values spread by the ratio --spread) and
certifies the first --n images of the bundled sample's class-balanced order in batches of the
first --batch-sizes value, once and then --repeats times: it prints the median ms per sample
of the repeated passes with their range (a shared host's speed varies by a third from pass to
pass; every pass is the same work, and the script checks that each certifies the same), the
mean certified radius and certified accuracy at 0.02, 0.05, 0.1 and 36/255. The first pass
(timed apart, "first_pass_seconds") makes every per-model proof some sample needs: a block's larger
deflation is made when a sample first needs it, so with another --jacobian-slack the warm-up
batch may not make it, and its seconds would count against the samples. --jacobian-slack sets
the certifier's (``lofast certify --jacobian-slack``).

Every image is certified at the label the model predicts, so that every one gets bounds (the
certifier skips a misclassified sample's): ms per sample is the cost of a sample the
certificate bounds. Radii and certified accuracy are the true labels' (a sample counts where
the prediction is right, as the certifier would have it).

"exact" is the Cholesky-verified deterministic method (what `lofast certify --guarantee exact`
uses); "exact-dense" the dense eigensolver it replaced, kept for comparison. The split times
the attention quantities with the certifier's own bound settings: "zeta" is the cost of the
first-order norm (the run minus one with the naive first-order term), "delta_2" the rest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch
from live_attention import with_live_attention  # beside this script
from measure import output_file, positive_int, profile_table, timed  # beside this script

from lofast.bounds.attention import attention_sensitivity
from lofast.bounds.attention_spec import AttentionSpec
from lofast.bounds.spectral import SpectralMethod
from lofast.certification.certificate import BOUND_TERMS, Certifier, CertifySettings
from lofast.checkpoint import checkpoint_path, load_checkpoint
from lofast.config import parse_radii
from lofast.data.sample import class_balanced_order, load_bundled_sample
from lofast.errors import LofastError
from lofast.runtime import device_name, resolve_device

KINDS = {"exact": "verified", "exact-dense": "dense", "probabilistic": "lanczos",
         "estimate": "power"}


@torch.no_grad()  # as in Certifier.certify: no autograd graph (the weights require grad)
def split_costs(certifier: Certifier, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Seconds for the forward pass, zeta, delta_2 and bookkeeping on one batch."""
    device = certifier.device
    x64 = x.to(device, torch.float64)
    (_, acts), forward = timed(lambda: certifier.model.forward_with_activations(x64), device)
    settings = certifier.settings
    _, score_bound = BOUND_TERMS[settings.bound]
    full = cheap = 0.0
    for i, spec in enumerate(certifier.structure):
        if isinstance(spec, AttentionSpec):
            w = spec
            _, t_full = timed(lambda a=acts[i], w=w: attention_sensitivity(
                a, w, kappa=settings.kappa, score_bound=score_bound, method=settings.method,
                generator=certifier.norms.generator), device)
            # the naive first-order term needs no matrix-free norm: what remains is delta_2
            _, t_cheap = timed(lambda a=acts[i], w=w: attention_sensitivity(
                a, w, kappa=settings.kappa, first_order="naive", score_bound=score_bound,
                method=settings.method, generator=certifier.norms.generator), device)
            full += t_full
            cheap += t_cheap
    cert, total = timed(lambda: certifier.certify(x, y), device)
    eps = torch.tensor([0.02, 0.05, 0.1], dtype=torch.float64)
    _, book = timed(lambda: (cert.certified(eps), cert.radius()), device)
    return {"forward": forward, "zeta": max(full - cheap, 0.0), "delta_2": cheap,
            "bookkeeping": book, "certify_total": total}


LIVE_EPS = (0.02, 0.05, 0.1, 36 / 255)


@torch.no_grad()
def live_summary(certifier: Certifier, x: torch.Tensor, y: torch.Tensor, correct: torch.Tensor,
                 batch: int) -> dict[str, float]:
    """Certify (x, y) in batches, y the predicted labels and correct (B,) where they are the
    true ones: ms per sample, mean radius, certified accuracy per eps (of the true labels)."""
    device = certifier.device
    eps = torch.tensor(LIVE_EPS, dtype=torch.float64)
    radii, verdicts, seconds = [], [], 0.0
    for start in range(0, len(x), batch):
        cert, took = timed(lambda s=start: certifier.certify(x[s: s + batch], y[s: s + batch]),
                           device)
        seconds += took
        radii.append(cert.radius().cpu())
        verdicts.append(cert.certified(eps).cpu())
    radius = torch.cat(radii) * correct
    certified = torch.cat(verdicts) & correct[:, None]
    return {"ms_per_sample": 1e3 * seconds / len(x), "mean_radius": radius.mean().item(),
            **{f"certified_{e:.4g}": certified[:, i].double().mean().item()
               for i, e in enumerate(LIVE_EPS)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--guarantee", choices=list(KINDS), default="exact")
    parser.add_argument("--batch-sizes", default="16,64,256")
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=output_file, default="bench_certify.json")
    parser.add_argument("--live-attention", type=float, default=None, metavar="K",
                        help="switch attention on: ||A_l|| / s = K in every block")
    parser.add_argument("--seed", type=int, default=0, help="seed of --live-attention")
    parser.add_argument("--spread", type=float, default=1.0,
                        help="--live-attention with Wq, Wk singular values spread by this ratio")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="--live-attention: timed passes after the first (their median "
                             "is reported, with the range: a shared host's speed varies)")
    parser.add_argument("--jacobian-slack", type=float, default=None,
                        help="the certifier's jacobian_slack (lofast certify --jacobian-slack)")
    parser.add_argument("--verdicts-at", default=None, metavar="EPS[,EPS...]",
                        help="verdicts-only certificates at these eps (lofast certify "
                             "--verdicts-only): e.g. 0.02,0.05,0.1,36/255, the eps "
                             "--live-attention reports")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="then profile one certification of the first batch: print the "
                             "ROWS operators with the most self time (device time on a GPU), "
                             "by input shape, and keep the table in the JSON")
    args = parser.parse_args()

    device = resolve_device(args.device)
    model = load_checkpoint(checkpoint_path(args.checkpoint))
    if args.live_attention is not None:
        try:
            model = with_live_attention(model, args.live_attention, args.seed, args.spread)
        except ValueError as error:
            parser.error(str(error))
    data = load_bundled_sample()
    x, y = data.subset(class_balanced_order(data.labels)[: args.n]).to_tensors()
    slack = {} if args.jacobian_slack is None else {"jacobian_slack": args.jacobian_slack}
    try:
        verdicts_at = (None if args.verdicts_at is None
                       else parse_radii(args.verdicts_at.split(","), "--verdicts-at"))
        settings = CertifySettings(method=SpectralMethod(kind=KINDS[args.guarantee], **slack),
                                   verdicts_at=verdicts_at)
    except (ValueError, LofastError) as error:
        parser.error(str(error))
    started = time.perf_counter()
    certifier = Certifier(model, settings, device)
    with torch.no_grad():  # the labels every sample is certified at (see the docstring)
        predicted = certifier.model(x.to(device, torch.float64)).argmax(dim=1).cpu()
    correct, y = predicted == y, predicted
    certifier.certify(x[:4], y[:4])  # warm-up (and the per-model quantities)
    setup = time.perf_counter() - started
    print(f"per-model proofs and a warm-up batch of 4: {setup:.1f} s", flush=True)
    rows = []
    if args.live_attention is not None:
        batch = int(args.batch_sizes.split(",")[0])
        first = live_summary(certifier, x, y, correct, batch)  # every per-model proof made
        passes = [live_summary(certifier, x, y, correct, batch) for _ in range(args.repeats)]
        times = [p.pop("ms_per_sample") for p in passes]
        if any(p != passes[0] for p in passes):  # the certificates are deterministic
            raise SystemExit("bench_certify.py: the timed passes certified differently")
        row = {"live_attention": args.live_attention, "seed": args.seed, "spread": args.spread,
               "n": len(x), "batch_size": batch,
               "first_pass_seconds": first["ms_per_sample"] * len(x) / 1e3,
               "ms_per_sample": statistics.median(times), "ms_per_sample_passes": times,
               **passes[0]}
        rows.append(row)
        spread = (f" (median of {len(times)}: {min(times):.1f}-{max(times):.1f})"
                  if len(times) > 1 else "")
        print(f"live attention K={args.live_attention:g} (seed {args.seed}), {len(x)} images, "
              f"batch {batch}: first pass {row['first_pass_seconds']:.1f} s, then "
              f"{row['ms_per_sample']:.1f} ms/sample{spread}, mean radius "
              f"{row['mean_radius']:.4f}, certified " + " / ".join(
                  f"{100 * row[f'certified_{e:.4g}']:.0f} %" for e in LIVE_EPS)
              + " at " + " / ".join(f"{e:.4g}" for e in LIVE_EPS), flush=True)
    for batch in ([] if args.live_attention is not None
                  else (int(b) for b in args.batch_sizes.split(","))):
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
    report = {"device": str(device), "cuda": device_name(device),
              "threads": torch.get_num_threads(), "guarantee": args.guarantee,
              "model": model.config.to_json(), "commit": commit, "setup_seconds": setup,
              "clean_accuracy": correct.double().mean().item(),
              "jacobian_slack": settings.method.jacobian_slack, "verdicts_at": verdicts_at,
              "rows": rows, "profile": None}
    with open(args.out, "w") as f:  # before the profile, which a time limit may cut short
        json.dump(report, f, indent=2)
    if args.profile:
        batch = int(args.batch_sizes.split(",")[0])
        table, sort = profile_table(device, lambda: certifier.certify(x[:batch], y[:batch]),
                                    rows=args.profile, shapes=True)
        report["profile"] = (f"one certification of {min(batch, len(x))} images, sorted by "
                             f"{sort}\n{table}")
        print(report["profile"], flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
