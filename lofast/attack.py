"""l2 PGD attack: an empirical upper bound on robust accuracy, and the end-to-end soundness check
(no certified sample may be broken)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def _project(delta: Tensor, x: Tensor, eps: Tensor) -> Tensor:
    """Onto the l2 ball of radius eps (B,) and then into the pixel box [0,1]."""
    norms = torch.linalg.vector_norm(delta.flatten(1), dim=1).clamp_min(1e-12)
    delta = delta * torch.clamp(eps / norms, max=1.0)[:, None, None, None]
    # clipping to the box only shrinks every coordinate, so the ball constraint still holds
    return (x + delta).clamp(0.0, 1.0) - x


def pgd_l2(model: nn.Module, x: Tensor, y: Tensor, eps: float | Tensor, steps: int = 100,
           restarts: int = 5, step_size: float | None = None, seed: int = 0) -> Tensor:
    """Returns a bool tensor (B,): True where an image within l2 distance eps (and in [0,1])
    changes the prediction away from y. Maximises the margin loss max_{j != y} z_j - z_y with
    normalised gradient steps, from the clean image and from random starts in the ball."""
    model.eval()
    eps = torch.as_tensor(eps, dtype=x.dtype, device=x.device).expand(len(x)).clone()
    alpha = step_size if step_size is not None else 2.5 / steps
    generator = torch.Generator(device=x.device).manual_seed(seed)
    broken = torch.zeros(len(x), dtype=torch.bool, device=x.device)
    for restart in range(restarts):
        if restart == 0:
            delta = torch.zeros_like(x)
        else:
            delta = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
            delta = _project(delta, x, eps * torch.rand(len(x), generator=generator,
                                                        device=x.device, dtype=x.dtype))
        for _ in range(steps):
            delta.requires_grad_(True)
            logits = model(x + delta)
            true = logits.gather(1, y[:, None])[:, 0]
            other = logits.scatter(1, y[:, None], -torch.inf).max(dim=1).values
            broken |= (logits.argmax(dim=1) != y).detach()
            grad, = torch.autograd.grad((other - true).sum(), delta)
            with torch.no_grad():
                norms = torch.linalg.vector_norm(grad.flatten(1), dim=1).clamp_min(1e-12)
                step = grad / norms[:, None, None, None] * (alpha * eps)[:, None, None, None]
                delta = _project(delta + step, x, eps)
        with torch.no_grad():
            broken |= model(x + delta).argmax(dim=1) != y
    return broken
