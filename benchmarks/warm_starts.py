"""How close one power step of the training bound's zeta comes to the converged value from each
kind of start: random vectors, the previous batch's final vectors (one per sample), and the
training bound's kept vectors (``TrainingBound.WARM_STARTS`` of them, repeated over the batch).

    python benchmarks/warm_starts.py [--checkpoint CKPT] [--data PATH] [--batch-size 128]
        [--batches 6] [--iterations 1] [--reference-iterations 40]

Consecutive training batches (the first --batches x --batch-size training images) pass through
the model; at every attention stage, each start gets --iterations power steps, and the ratio of
its zeta to --reference-iterations steps is taken in the worst sample of the batch. Prints, per
kind of start, the worst ratio over all batches and stages and the mean of the per-batch worst.
The starts carry over from batch to batch as in training (each batch's final vectors start the
next).
"""

from __future__ import annotations

import argparse

import torch

from lofast.bounds.estimate import attention_sensitivity_estimate
from lofast.checkpoint import checkpoint_path, load_checkpoint
from lofast.data import load_dataset
from lofast.training.bound import TrainingBound


class RecordingBound(TrainingBound):
    """The training bound, remembering the tokens and spec of every attention stage."""

    def __init__(self) -> None:
        super().__init__(iterations=1, softmax_jacobian=True)
        self.stages = {}

    def attention(self, index, tokens, spec):
        self.stages[index] = (tokens.detach(), spec)
        return super().attention(index, tokens, spec)


def zeta(tokens, spec, start, iterations):
    """Estimated zeta (B,) from start (None: random) and the final vectors."""
    sensitivity, vectors = attention_sensitivity_estimate(
        tokens, spec, kappa=0.5, start=start, iterations=iterations, softmax_jacobian=True)
    return sensitivity.zeta, vectors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--data", default="../shared/data/cifar10-jpeg.tar.gz")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--reference-iterations", type=int, default=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_checkpoint(checkpoint_path(args.checkpoint)).eval()
    images = load_dataset(args.data, "train").images
    kept = TrainingBound.WARM_STARTS
    worst = {"random": [], "previous batch, one per sample": [], f"{kept} kept, repeated": []}
    previous: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for t in range(args.batches):
            batch = images[t * args.batch_size:(t + 1) * args.batch_size]
            x = torch.as_tensor(batch).permute(0, 3, 1, 2).float() / 255
            recorder = RecordingBound()
            recorder(model, x, 0.1)
            for index, (tokens, spec) in recorder.stages.items():
                reference, _ = zeta(tokens, spec, None, args.reference_iterations)
                if index in previous:
                    repeats = -(-len(tokens) // kept)
                    starts = {"random": None,
                              "previous batch, one per sample": previous[index],
                              f"{kept} kept, repeated":
                                  previous[index][:kept].repeat(repeats, 1, 1, 1)[:len(tokens)]}
                    for name, start in starts.items():
                        estimate, _ = zeta(tokens, spec, start, args.iterations)
                        worst[name].append((estimate / reference).min().item())
                _, previous[index] = zeta(tokens, spec, previous.get(index), args.iterations)
    for name, ratios in worst.items():
        print(f"{name:32s} worst {min(ratios):.3f}   mean of the per-batch worst "
              f"{sum(ratios) / len(ratios):.3f}")


if __name__ == "__main__":
    main()
