"""Forward-pass cost of a loaded model against a plain ViT of the same shape: inference and
attacks pay no SVD per call once the model's exact spectral caps are computed.

    python benchmarks/bench_forward.py [--checkpoint CKPT] [--batch 100] [--repeats 20]
        [--device auto] [--out bench_forward.json]

The loaded model (``lofast.load_model``, eval mode, its parameters requiring gradients as
loaded) computes its caps on its first call and keeps them while its weights stay unchanged.
The plain ViT is torch's own encoder (``nn.TransformerEncoder``: pre-norm layers with the
model's width, heads, depth and MLP width, GELU, LayerNorm, no dropout) behind a patch
convolution of the same patch size, a class token, position embeddings and a mean-pooled
linear head, with random weights. Both run in float32 on random images, two ways: inference
(``torch.no_grad``) and an attack's step (forward pass and the gradient of the summed top
logit with respect to the images). Prints ms per batch of the model's first call, of its later
calls and of the plain ViT, and the ratio later / plain for each; writes JSON.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from measure import output_file, timed  # beside this script
from torch import nn

from lofast.checkpoint import checkpoint_path, load_checkpoint
from lofast.config import ModelConfig
from lofast.runtime import device_name, resolve_device


class PlainViT(nn.Module):
    """A standard pre-norm ViT with the shape of ``config`` (tokens, width, heads, depth, MLP)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        width = config.width
        self.embed = nn.Conv2d(config.channels, width, config.patch_size, config.patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.position = nn.Parameter(torch.randn(1, config.num_tokens, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, config.heads, config.mlp_ratio * width,
                                           dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, config.depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, config.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(len(tokens), -1, -1), tokens], dim=1) + self.position
        return self.head(self.norm(self.encoder(tokens)).mean(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=output_file, default="bench_forward.json")
    args = parser.parse_args()
    device = resolve_device(args.device)
    def loaded() -> nn.Module:
        return load_checkpoint(checkpoint_path(args.checkpoint)).to(device).eval()

    config = loaded().config
    plain = PlainViT(config).to(device).eval()
    images = torch.rand(args.batch, config.channels, config.image_size, config.image_size,
                        generator=torch.Generator().manual_seed(0)).to(device)

    def attack_step(net: nn.Module) -> torch.Tensor:
        x = images.clone().requires_grad_(True)
        return torch.autograd.grad(net(x).max(dim=1).values.sum(), x)[0]

    report = {"device": str(device), "cpu": device_name(device),
              "threads": torch.get_num_threads(), "batch": args.batch, "model": config.to_json()}
    for name, run in (("inference", torch.no_grad()(lambda net: net(images))),
                      ("attack_step", attack_step)):
        model = loaded()  # each way from a fresh load: nothing kept yet
        first = timed(functools.partial(run, model), device)[1]  # computes, keeps the caps
        timed(functools.partial(run, plain), device)  # warm-up
        later = timed(functools.partial(run, model), device, args.repeats)[1]
        baseline = timed(functools.partial(run, plain), device, args.repeats)[1]
        report[name] = {"first_call_ms": 1e3 * first, "later_calls_ms": 1e3 * later,
                        "plain_vit_ms": 1e3 * baseline, "ratio": later / baseline}
        print(f"{name}, batch {args.batch} on {device} ({torch.get_num_threads()} threads): "
              f"first call {1e3 * first:.1f} ms, later calls {1e3 * later:.1f} ms, plain ViT "
              f"of the same shape {1e3 * baseline:.1f} ms: ratio {later / baseline:.2f}",
              flush=True)
        with open(args.out, "w") as f:  # after each way: a run cut short keeps what it measured
            json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
