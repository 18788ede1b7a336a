"""End-to-end soundness check of a checkpoint: certify images, then attack every certified sample
with l2 PGD at 0.999 x its certified radius (must break none) and at a multiple of it (shows the
attack has teeth). Prints the counts and writes JSON; exits 1 if a certified sample is broken.

    python benchmarks/attack_certified.py [--checkpoint CKPT] [--data PATH] [--n 200]
        [--guarantee exact] [--steps 100] [--restarts 3] [--beyond 3] [--out attack_certified.json]
        [--live-attention K [--seed 0] [--spread R]] [--tokens T [--depth 2]] [--search float64]

The attack takes its gradient steps on a float32 copy of the model (``--search float32``, the
default, as ``lofast certify --attack``; half the time on a CPU) and counts a sample broken only
where the float64 model misclassifies the image it found, inside the float64 ball and the box;
``--search float64`` searches on the float64 model itself.

--live-attention K attacks the checkpoint with attention switched on as in
``bench_certify.py --live-attention K`` (``live_attention.py``); --spread R gives Wq and Wk
singular values spread by the ratio R in place of orthonormal columns.

--tokens T attacks, instead of a checkpoint, a fresh model of ``bench_tokens.py``'s shape with
T patch tokens (4 / 16 / 64 from 32 x 32 images, 256 from 64 x 64; width 128, 8 heads, position
biases, depth --depth, seed --seed) on --n images of uniform random pixels (seed 0), each
labelled by the model's own prediction: the certifier's paths at token counts no shipped model
has (at 256 tokens the probabilistic guarantee; with --live-attention, its blocks' attention
switched on as above).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_tokens import SHAPES  # beside this script
from live_attention import score_spectra, with_live_attention  # beside this script
from measure import output_file  # beside this script

from lofast.certification.attack import pgd_l2
from lofast.certification.certificate import Certifier, CertifySettings
from lofast.checkpoint import checkpoint_path, open_checkpoint
from lofast.config import ModelConfig
from lofast.data import load_dataset
from lofast.data.sample import class_balanced_order, load_bundled_sample
from lofast.errors import LofastError
from lofast.models.vit import create_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--data", default=None, help="test split of this data set (default: "
                        "the bundled sample)")
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--guarantee", choices=["exact", "probabilistic"], default="exact",
                        help="the certificates to attack (as `lofast certify --guarantee`)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--beyond", type=float, default=3.0,
                        help="also attack at this multiple of the radius")
    parser.add_argument("--search", choices=["float32", "float64"], default="float32",
                        help="the precision of the attack's gradient steps (every break is "
                             "checked in float64)")
    parser.add_argument("--out", type=output_file, default="attack_certified.json")
    parser.add_argument("--live-attention", type=float, default=None, metavar="K",
                        help="switch attention on: ||A_l|| / s = K in every block")
    parser.add_argument("--seed", type=int, default=0, help="seed of --live-attention and of the --tokens model")
    parser.add_argument("--spread", type=float, default=1.0,
                        help="--live-attention with Wq, Wk singular values spread by this ratio")
    parser.add_argument("--tokens", type=int, default=None, choices=sorted(SHAPES),
                        help="attack a fresh model with this many patch tokens on random images "
                             "instead of a checkpoint")
    parser.add_argument("--depth", type=int, default=2, help="depth of the --tokens model")
    args = parser.parse_args()
    if args.tokens is not None and (args.checkpoint or args.data or args.depth < 1):
        parser.error("--tokens attacks a fresh model (--depth >= 1) on random images: no "
                     "--checkpoint, no --data")

    if args.tokens is None:
        checkpoint = checkpoint_path(args.checkpoint)
        try:  # a path, or a shipped model's name (lofast-live), as `lofast certify` takes
            model = open_checkpoint(args.checkpoint).model
        except LofastError as error:
            parser.error(str(error))
    else:
        size, patch = SHAPES[args.tokens]
        checkpoint = f"fresh: {args.tokens} tokens, depth {args.depth}, seed {args.seed}"
        model = create_model(ModelConfig(image_size=size, patch_size=patch, width=128,
                                         depth=args.depth, heads=8, position_bias=True),
                             seed=args.seed)
    if args.live_attention is not None:
        try:
            model = with_live_attention(model, args.live_attention, args.seed, args.spread)
        except ValueError as error:
            parser.error(str(error))
    model = model.double().eval()
    if args.tokens is None:
        data = load_dataset(args.data, "test") if args.data else load_bundled_sample()
        x, y = data.subset(class_balanced_order(data.labels)[: args.n]).to_tensors()
    else:
        x = torch.rand(args.n, 3, size, size, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            y = model(x.double()).argmax(dim=1)
    settings = CertifySettings(guarantee=args.guarantee)
    certificate = Certifier(model, settings).certify(x, y)
    radius = certificate.radius()
    chosen = radius > 0
    xs, ys, rs = x[chosen].double(), y[chosen], radius[chosen]
    search = model.frozen("cpu", torch.float32) if args.search == "float32" else None
    inside = pgd_l2(model, xs, ys, 0.999 * rs, steps=args.steps, restarts=args.restarts,
                    search=search)
    outside = pgd_l2(model, xs, ys, args.beyond * rs, steps=args.steps, restarts=args.restarts,
                     search=search)
    report = {"checkpoint": str(checkpoint), "tokens": args.tokens,
              "live_attention": args.live_attention,
              "seed": args.seed if args.live_attention is not None or args.tokens else None,
              "spread": args.spread if args.live_attention is not None else None,
              "score_spectra": score_spectra(model),
              "guarantee": args.guarantee, "images": len(y),
              "certified": int(chosen.sum()),
              "mean_radius_of_certified": rs.mean().item() if len(rs) else 0.0,
              "broken_at_0.999_radius": int(inside.sum()),
              f"broken_at_{args.beyond:g}_radius": int(outside.sum()),
              "pgd": {"steps": args.steps, "restarts": args.restarts, "search": args.search}}
    print(json.dumps(report, indent=2))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    if inside.any():
        print("UNSOUND: a certified sample was broken inside its certified radius", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
