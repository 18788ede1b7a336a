"""l2 PGD attack: counterexamples for the samples no verifier certifies (an upper bound on robust
accuracy beside the certified lower one), and the end-to-end soundness check (no certified
sample may be broken)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

# The most images one attack pass holds at once (restarts x samples): a larger batch is attacked
# in parts, so that memory does not grow with --attack-restarts x --batch-size (4096 CIFAR
# images in float64 with their gradients and activations: a few hundred MB at width 256).
MAX_ATTACK_IMAGES = 4096


@dataclass
class AttackResult:
    """What the attack found, per sample (B,).

    found: a perturbation within the ball (and the pixel box, when asked) changes the
    prediction, checked by a final forward pass of the model as given; perturbation
    (B, C, H, W): the first such perturbation found (zero where none); norm: its l2 norm;
    adversarial_class: the class the model predicts there (-1 where none).
    """

    found: Tensor
    perturbation: Tensor
    norm: Tensor
    adversarial_class: Tensor


def _project(delta: Tensor, x: Tensor, eps: Tensor, box: bool) -> Tensor:
    """Onto the l2 ball of radius eps (B,) and then, with box, into the pixel box [0,1]."""
    norms = torch.linalg.vector_norm(delta.flatten(1), dim=1).clamp_min(1e-12)
    delta = delta * torch.clamp(eps / norms, max=1.0)[:, None, None, None]
    # clipping to the box only shrinks every coordinate, so the ball constraint still holds
    return (x + delta).clamp(0.0, 1.0) - x if box else delta


def pgd_attack(model: nn.Module, x: Tensor, y: Tensor, eps: float | Tensor, steps: int = 100,
               restarts: int = 5, step_size: float | None = None, seed: int = 0,
               box: bool = True, search: nn.Module | None = None) -> AttackResult:
    """Maximises the margin loss max_{j != y} z_j - z_y with normalised gradient steps inside
    the l2 ball of radius eps (scalar or (B,)) around each image, from the clean image and from
    restarts - 1 random starts in the ball, all restarts side by side in one batch of
    restarts x B images; keeps, per image, the first perturbation that changes the prediction
    in the first restart that finds one. Deterministic for a given seed and number of images;
    more than MAX_ATTACK_IMAGES // restarts images are attacked in parts of that size (each
    part seeded by seed + its number).

    search: a copy of ``model`` in a faster precision (``LipschitzViT.frozen(device,
    torch.float32)``) that takes the gradient steps in its own dtype; the perturbation it
    finds is brought back to x's dtype, into the ball and the box there, and kept only where
    ``model`` itself misclassifies the image (default: ``model`` searches)."""
    if restarts < 1:
        raise ValueError(f"the attack needs at least one restart, not {restarts}")
    y = y.to(x.device, torch.long)  # labels from anywhere: a list's tensor lives on the host
    eps = torch.as_tensor(eps, dtype=x.dtype, device=x.device).expand(len(x))
    part = max(1, MAX_ATTACK_IMAGES // restarts)
    with _ready(model, search) as searcher:
        results = [_pgd(model, searcher, x[i:i + part], y[i:i + part], eps[i:i + part], steps,
                        restarts, step_size, seed + i // part, box)
                   for i in range(0, len(x), part)]
    return AttackResult(*(torch.cat(parts) for parts in zip(
        *((r.found, r.perturbation, r.norm, r.adversarial_class) for r in results))))


@contextlib.contextmanager
def _ready(model: nn.Module, search: nn.Module | None):
    """Yields the module that searches (``model`` where search is None), with model and search
    in eval mode, each holding its effective weights while the attack runs: a LipschitzViT
    computes its exact caps (an SVD per capped weight) once for the attack, not in every one of
    its forward passes."""
    search = model if search is None else search
    with contextlib.ExitStack() as stack:
        for module in {id(model): model, id(search): search}.values():
            module.eval()
            stack.enter_context(getattr(module, "reusing_effective_weights",
                                        contextlib.nullcontext)())
        yield search


def _dtype(module: nn.Module, default: torch.dtype) -> torch.dtype:
    """The dtype of a module's first floating-point parameter (default where it has none)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), default)


def _pgd(model: nn.Module, search: nn.Module, x: Tensor, y: Tensor, eps: Tensor, steps: int,
         restarts: int, step_size: float | None, seed: int, box: bool) -> AttackResult:
    """``pgd_attack``'s search on ``search``, its result checked on ``model``."""
    batch = len(x)
    exact, exact_eps = x, eps  # the images and radii in the model's dtype
    x = x.to(_dtype(search, x.dtype))  # the search runs in its own
    eps = eps.to(x.dtype)
    alpha = step_size if step_size is not None else 2.5 / steps
    generator = torch.Generator(device=x.device).manual_seed(seed)
    # row r * B + b: restart r of image b
    xs, ys, radii = x.repeat(restarts, 1, 1, 1), y.repeat(restarts), eps.repeat(restarts)
    found = torch.zeros(len(xs), dtype=torch.bool, device=x.device)
    best = torch.zeros_like(xs)

    def keep(delta: Tensor, logits: Tensor) -> None:
        new = (logits.argmax(dim=1) != ys) & ~found
        best[new] = delta.detach()[new]
        found.logical_or_(new)

    delta = torch.randn(xs.shape, generator=generator, device=x.device, dtype=x.dtype)
    delta = _project(delta, xs, radii * torch.rand(len(xs), generator=generator,
                                                   device=x.device, dtype=x.dtype), box)
    delta[:batch] = 0.0  # the first restart starts at the clean image
    for _ in range(steps):
        delta.requires_grad_(True)
        logits = search(xs + delta)
        keep(delta, logits)
        grad, = torch.autograd.grad(_margin_loss(logits, ys).sum(), delta)
        with torch.no_grad():
            norms = torch.linalg.vector_norm(grad.flatten(1), dim=1).clamp_min(1e-12)
            step = grad / norms[:, None, None, None] * (alpha * radii)[:, None, None, None]
            delta = _project(delta + step, xs, radii, box)
    with torch.no_grad():
        keep(delta, search(xs + delta))
    # per image, the first restart that found a perturbation (restarts x B -> B)
    found = found.view(restarts, batch)
    first = found.int().argmax(dim=0)  # 0 where none found: that row's best is zero
    best = best.view(restarts, batch, *x.shape[1:])[first, torch.arange(batch, device=x.device)]
    found = found.any(dim=0)
    x = exact
    if best.dtype != x.dtype:  # within the ball and the box in the model's dtype as well
        inside = exact_eps * (1.0 - 2.0 ** -40)  # the norm's rounding kept inside eps
        best = _project(best.to(x.dtype), x, inside, box)
    with torch.no_grad():  # a counterexample is what the model does at it, checked once more
        predicted = model(x + best).argmax(dim=1)
    found &= predicted != y
    best[~found] = 0.0
    return AttackResult(found=found, perturbation=best,
                        norm=torch.linalg.vector_norm(best.flatten(1), dim=1),
                        adversarial_class=torch.where(found, predicted, -1))


def pgd_l2(model: nn.Module, x: Tensor, y: Tensor, eps: float | Tensor, steps: int = 100,
           restarts: int = 5, step_size: float | None = None, seed: int = 0,
           search: nn.Module | None = None) -> Tensor:
    """(B,) bool: True where an image within l2 distance eps and in [0,1] changes the
    prediction away from y (``pgd_attack`` in the pixel box, searched on ``search``)."""
    return pgd_attack(model, x, y, eps, steps, restarts, step_size, seed, search=search).found


@dataclass
class MinimumNormResult:
    """The smallest adversarial perturbation found per sample (B,).

    found: the prediction at x + perturbation differs from y (checked by a final forward
    pass of the model as given); perturbation (B, C, H, W): zero where none was found; norm:
    its l2 norm, the sample's adversarial radius (an upper bound on the distance to the nearest
    image of another class; +inf where none was found); adversarial_class: the class predicted
    there (-1 where none).
    """

    found: Tensor
    perturbation: Tensor
    norm: Tensor
    adversarial_class: Tensor


def minimum_norm_attack(model: nn.Module, x: Tensor, y: Tensor, steps: int = 100,
                        start_norm: Tensor | float | None = None, box: bool = True,
                        gamma: float = 0.05, refine_steps: int = 20,
                        search: nn.Module | None = None) -> MinimumNormResult:
    """The smallest l2 perturbation that changes the prediction, searched by decoupled
    direction and norm (DDN; Rony et al., CVPR 2019) and refined along its ray.

    Each step moves along the normalised gradient of the margin loss max_{j != y} z_j - z_y
    (a cosine-decaying step) and then rescales the perturbation to the current norm budget,
    which shrinks by the factor 1 - gamma while the image is adversarial and grows by 1 + gamma
    while it is not; the smallest adversarial perturbation seen is kept. start_norm (scalar or
    (B,)): the first budget (default: the linearised distance margin / ||grad margin|| at x).
    Then ``refine_steps`` bisections on t in [0, 1] find where the segment from x to x + delta
    first changes the prediction (forward passes only): the norm returned is that point's,
    never more than DDN's. With box, every image stays in [0, 1] (the segment too: the box is
    convex). Deterministic. A misclassified sample is its own counterexample (norm 0).

    search: as ``pgd_attack``'s, it takes DDN's steps; the refinement along the ray and the
    final check run on ``model`` in x's dtype, so the norm returned is where ``model``'s own
    prediction changes.
    """
    if steps < 1:
        raise ValueError(f"the attack needs at least one step, not {steps}")
    y = y.to(x.device, torch.long)
    if start_norm is not None:
        start_norm = torch.as_tensor(start_norm, dtype=x.dtype, device=x.device).expand(len(x))
    part = MAX_ATTACK_IMAGES
    with _ready(model, search) as searcher:
        results = [_minimum_norm(model, searcher, x[i:i + part], y[i:i + part], steps,
                                 None if start_norm is None else start_norm[i:i + part], box,
                                 gamma, refine_steps) for i in range(0, len(x), part)]
    return MinimumNormResult(*(torch.cat(parts) for parts in zip(
        *((r.found, r.perturbation, r.norm, r.adversarial_class) for r in results))))


def _margin_loss(logits: Tensor, y: Tensor) -> Tensor:
    """max_{j != y} z_j - z_y per sample: positive exactly where the prediction is not y."""
    true = logits.gather(1, y[:, None])[:, 0]
    return logits.scatter(1, y[:, None], -torch.inf).max(dim=1).values - true


def _minimum_norm(model: nn.Module, search: nn.Module, x: Tensor, y: Tensor, steps: int,
                  start_norm: Tensor | float | None, box: bool, gamma: float,
                  refine_steps: int) -> MinimumNormResult:
    """``minimum_norm_attack``'s DDN steps on ``search``, refined and checked on ``model``."""
    batch = len(x)
    norms_of = lambda t: torch.linalg.vector_norm(t.flatten(1), dim=1)
    shape = (batch,) + (1,) * (x.dim() - 1)
    exact = x  # the images in the model's dtype; the steps run in the search's
    x = x.to(_dtype(search, x.dtype))
    delta = torch.zeros_like(x, requires_grad=True)
    logits = search(x + delta)
    loss = _margin_loss(logits, y)
    grad, = torch.autograd.grad(loss.sum(), delta)
    misclassified = (loss > 0).detach()
    if start_norm is None:  # the distance to the boundary of the model linearised at x
        start_norm = (-loss.detach()).clamp_min(0) / norms_of(grad).clamp_min(1e-12)
    budget = torch.as_tensor(start_norm, dtype=x.dtype, device=x.device).expand(batch).clone()
    budget = budget.clamp_min(1e-6)
    best = torch.zeros_like(x)
    best_norm = torch.where(misclassified, 0.0, torch.inf).to(x.dtype)
    delta = torch.zeros_like(x)
    for step in range(steps):
        alpha = 0.5 * budget * (1 + math.cos(math.pi * step / steps))  # cosine-decaying step
        direction = grad / norms_of(grad).clamp_min(1e-12).view(shape)
        moved = delta + alpha.view(shape) * direction
        moved = moved * (budget / norms_of(moved).clamp_min(1e-12)).view(shape)
        delta = ((x + moved).clamp(0.0, 1.0) - x if box else moved).detach().requires_grad_(True)
        loss = _margin_loss(search(x + delta), y)
        grad, = torch.autograd.grad(loss.sum(), delta)
        with torch.no_grad():
            adversarial = loss > 0
            size = norms_of(delta)
            better = adversarial & (size < best_norm)
            best[better] = delta[better]
            best_norm = torch.where(better, size, best_norm)
            budget = torch.where(adversarial, budget * (1 - gamma), budget * (1 + gamma))
    found = torch.isfinite(best_norm)
    x = exact
    if best.dtype != x.dtype:  # in the model's dtype, inside the box there as well
        best = best.to(x.dtype)
        best = (x + best).clamp(0.0, 1.0) - x if box else best
    with torch.no_grad():  # the first point of the segment x -> x + best where the label goes
        low = torch.zeros(batch, dtype=x.dtype, device=x.device)
        high = torch.ones(batch, dtype=x.dtype, device=x.device)
        for _ in range(refine_steps):
            middle = (low + high) / 2
            flipped = _margin_loss(model(x + middle.view(shape) * best), y) > 0
            high = torch.where(flipped & found, middle, high)
            low = torch.where(flipped & found, low, middle)
        best = best * high.view(shape)
        predicted = model(x + best).argmax(dim=1)  # checked once more, as the model is given
    found &= predicted != y
    best[~found] = 0.0
    norm = torch.where(found, norms_of(best), torch.inf)
    return MinimumNormResult(found=found, perturbation=best, norm=norm,
                             adversarial_class=torch.where(found, predicted, -1))
