"""(alpha-)CROWN lower bounds on the margins of an exported model, and per-sample verdicts."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lofast.crown.export import export_plain
from lofast.crown.lirpa import auto_lirpa, custom_ops, lirpa_context
from lofast.errors import LofastError
from lofast.models.vit import LipschitzViT
from lofast.runtime import TimeLimit, alarm, is_out_of_memory, memory_guard

METHODS = ("crown", "alpha-crown")


# alpha-CROWN's learning rate for the relaxation parameters. With auto_LiRPA's default (0.5),
# tuned for ReLU networks, every step made the bounds worse than CROWN's on these models.
ALPHA_LR = 0.05


@dataclass(frozen=True)
class FallbackResult:
    """The outcome of CROWN for one sample.

    certified: every margin z_y - z_j (j != y) has a positive lower bound on the whole l2 ball
        of radius eps around the image, so the prediction y cannot change there.
    reason: None when certified, otherwise why not ("misclassified", "margin lower bound
        -0.012 <= 0", "time limit (...)", "out of memory", "non-finite bounds", ...).
    seconds: wall-clock seconds spent on the sample (its batch's time divided by its size; the
        one-off graph construction is not included).
    margin_bound: min_j of the lower bounds on z_y - z_j when they were computed, else None
        (with branch and bound: the smallest over the leaves, a bound on the whole ball).
    domains: subdomains bounded by branch and bound (the root included), else None.
    verdict: branch and bound's "verified", "falsified" or "unknown", else None.
    """

    certified: bool
    reason: str | None
    seconds: float
    margin_bound: float | None = None
    domains: int | None = None
    verdict: str | None = None


def margin_spec(labels: Tensor, num_classes: int, dtype: torch.dtype) -> Tensor:
    """C (B, K-1, K) with rows e_y - e_j for the classes j != y (ascending), so C z = margins."""
    k = num_classes
    others = torch.arange(k - 1, device=labels.device)[None, :]
    others = others + (others >= labels[:, None]).long()  # skip y: (B, K-1)
    eye = torch.eye(k, dtype=dtype, device=labels.device)
    return eye[labels][:, None, :] - eye[others]


def describe_error(error: Exception) -> str:
    """A one-line reason for a failed bound computation."""
    full = str(error).strip()
    message = full.splitlines()[0] if full else ""
    if is_out_of_memory(error):
        return "out of memory"
    if isinstance(error, NotImplementedError):
        return f"unsupported by auto_LiRPA: {message[:160]}"
    return f"auto_LiRPA error: {type(error).__name__}: {message[:160]}"


class MarginBounder:
    """(alpha-)CROWN lower bounds on the margins of a model over l2 balls of radius eps.

    Wraps one auto_LiRPA BoundedModule of `export_plain(model)`, built on first use; the
    arguments are as in `crown_verify`. Imports auto_LiRPA (LofastError if it is missing).
    Its bounds are of the model as exported here: a bounder made before the model's weights
    changed bounds the old weights (``crown_verify`` exports afresh on every call).
    """

    def __init__(self, model: LipschitzViT, eps: float, method: str = "crown", *,
                 dtype: torch.dtype = torch.float64, alpha_iterations: int = 20) -> None:
        if method not in METHODS:
            raise LofastError(f"method must be one of {', '.join(METHODS)}, not {method!r}")
        if not (isinstance(eps, (int, float)) and 0 <= eps < float("inf")):
            raise LofastError(f"eps must be a finite number >= 0, not {eps!r}")
        if alpha_iterations < 1:
            raise LofastError("alpha_iterations must be at least 1")
        self.lirpa = auto_lirpa()
        self.plain = export_plain(model, dtype)
        self.num_classes = model.config.num_classes
        self.eps = float(eps)
        self.method = method
        self.dtype = dtype
        self.alpha_iterations = alpha_iterations
        self.bounded: Any = None  # the BoundedModule; None until built, or after a failure

    @property
    def device(self) -> torch.device:
        return next(iter(self.plain.buffers())).device

    def build(self, example: Tensor) -> None:
        """Trace the exported model on `example` (1, C, H, W); the batch size stays free."""
        with lirpa_context(self.dtype):
            self.bounded = self.lirpa.BoundedModule(
                self.plain, example.to(self.device, self.dtype), device=self.device,
                custom_ops=custom_ops(self.lirpa),
                bound_opts={
                    # Intersect every intermediate CROWN bound with IBP from the (already
                    # intersected) bounds of its inputs: never looser, costs little, and lifts
                    # the lower bounds of the square root's and reciprocal's arguments in
                    # LayerProject to R^2 and R, where CROWN alone may go below 0.
                    "compare_crown_with_ibp": True,
                },
            )

    def margin_bounds(self, images: Tensor, labels: Tensor,
                      max_seconds: float | None = None) -> Tensor:
        """Lower bounds (B, K-1) on z_y - z_j for the classes j != y in ascending order, valid
        for every input within l2 distance eps of each image (B, C, H, W); labels (B,).

        max_seconds (alpha-CROWN only) stops the optimisation early, keeping the best bounds
        found. Raises whatever auto_LiRPA raises; `crown_verify` turns that into results.
        """
        x = images.to(self.device, self.dtype)
        labels = labels.to(self.device, torch.long)
        if self.bounded is None:
            self.build(x[:1])
        spec = margin_spec(labels, self.num_classes, self.dtype)
        with lirpa_context(self.dtype):
            ball = self.lirpa.BoundedTensor(
                x, self.lirpa.PerturbationLpNorm(norm=2, eps=self.eps))
            if self.method == "crown":
                with torch.no_grad():
                    lower, _ = self.bounded.compute_bounds(
                        x=(ball,), C=spec, method="backward", bound_upper=False)
                return lower
            options: dict[str, Any] = {
                "iteration": self.alpha_iterations,
                "lr_alpha": ALPHA_LR,
                # Share relaxation variables between start nodes: in our measurements a third
                # of the memory (paper-d3 needs > 20 GB per sample in float64 otherwise) and
                # half the time, for slightly looser bounds.
                "use_shared_alpha": True,
                # Stop as soon as every sample in the batch is certified.
                "stop_criterion_func": lambda lb: (lb > 0).all(dim=1, keepdim=True),
                "max_time": 1e9 if max_seconds is None else max_seconds,
            }
            self.bounded.set_bound_opts({"optimize_bound_args": options})
            with torch.enable_grad():  # alpha-CROWN optimises by gradient, even inside no_grad
                lower, _ = self.bounded.compute_bounds(
                    x=(ball,), C=spec, method="CROWN-Optimized", bound_upper=False)
            return lower.detach()


def _verify_batch(bounder: MarginBounder, x: Tensor, labels: Tensor,
                  timeout: float | None) -> list[FallbackResult]:
    """Results for a batch x (B, C, H, W) with labels (B,); never raises (except
    KeyboardInterrupt). A failed batch of several samples is retried one by one."""
    start = time.perf_counter()
    budget = None if timeout is None else timeout * len(x)

    def failed(count: int, reason: str) -> list[FallbackResult]:
        seconds = (time.perf_counter() - start) / count
        return [FallbackResult(False, reason, seconds) for _ in range(count)]

    try:
        with memory_guard(bounder.device), alarm(budget):
            # alpha-CROWN stops optimising in time to return its best (sound) bounds so far.
            lower = bounder.margin_bounds(x, labels, None if budget is None else 0.8 * budget)
    except TimeLimit:
        bounder.bounded = None  # interrupted mid-computation: rebuild before reusing
        return failed(len(x), f"time limit ({timeout:.3g} s per sample)")
    except Exception as error:  # noqa: BLE001 - any failure is this batch's, not the caller's
        bounder.bounded = None
        if len(x) > 1:  # out of memory, or one sample's numerics: isolate it
            return [r for i in range(len(x))
                    for r in _verify_batch(bounder, x[i:i + 1], labels[i:i + 1], timeout)]
        return failed(1, describe_error(error))
    elapsed = time.perf_counter() - start
    if budget is not None and elapsed > budget:  # the alarm was not available
        return failed(len(x), f"time limit ({timeout:.3g} s per sample)")
    results = []
    for row in lower:
        if not torch.isfinite(row).all():
            results.append(FallbackResult(False, "non-finite bounds", elapsed / len(x)))
            continue
        bound = row.min().item()
        reason = None if bound > 0 else f"margin lower bound {bound:.4g} <= 0"
        results.append(FallbackResult(bound > 0, reason, elapsed / len(x), bound))
    return results


def check_inputs(model: LipschitzViT, images: Tensor, labels: Tensor, timeout: float | None,
                 batch_size: int) -> None:
    """LofastError unless the arguments of a fallback verifier are valid (see `crown_verify`)."""
    if timeout is not None and not timeout > 0:
        raise LofastError(f"timeout must be positive seconds or None, not {timeout!r}")
    if batch_size < 1:
        raise LofastError("batch_size must be at least 1")
    config = model.config
    expected = (config.channels, config.image_size, config.image_size)
    if images.ndim != 4 or tuple(images.shape[1:]) != expected:
        raise LofastError(f"images must have shape (N, {', '.join(map(str, expected))}), "
                          f"not {tuple(images.shape)}")
    if labels.shape != images.shape[:1]:
        raise LofastError(f"labels must have shape ({len(images)},), not {tuple(labels.shape)}")
    if len(labels) and not (0 <= int(labels.min()) and int(labels.max()) < config.num_classes):
        raise LofastError(f"labels must lie in [0, {config.num_classes})")


def crown_verify(model: LipschitzViT, images: Tensor, labels: Tensor, eps: float,
                 method: str = "crown", timeout: float | None = None, batch_size: int = 1, *,
                 dtype: torch.dtype = torch.float64,
                 alpha_iterations: int = 20) -> list[FallbackResult]:
    """Certify each image against every l2 perturbation of norm <= eps with (alpha-)CROWN.

    images (N, C, H, W) in [0,1], labels (N,) class indices; returns N FallbackResults in order.
    A sample is certified iff CROWN's lower bounds on all margins z_y - z_j (j != y) of the
    exported model are positive over the l2 ball of radius eps (not intersected with [0,1]; see
    the module docstring). Samples the model misclassifies are not bounded.

    method: "crown" (backward linear bound propagation) or "alpha-crown" (CROWN with
        `alpha_iterations` steps of relaxation optimisation, stopping early once every sample of
        the batch is certified); branch and bound on top of it is `lofast.bab` ("beta-crown").
    timeout: seconds allowed per sample; a batch of k samples gets k * timeout, and if it runs
        out every sample in it is reported as "time limit (...)".
    batch_size: samples bounded together in one auto_LiRPA call; memory grows linearly with
        it. Worth raising on a GPU; on CPU a batch of 4 took no less time per sample than 1.
    dtype: precision of the exported network and of the bounds; float64 (default) keeps
        rounding far from the certification threshold, float32 is about twice as fast. The
        weights are the model's own (float32 weights are exact in float64).

    Cost on CPU (paper-d3, one thread, per sample): CROWN ~12 s and ~1 GB in float32, ~23 s
    and ~1.2 GB in float64; alpha-CROWN needs ~8 GB (float32) or ~16 GB (float64) of memory.

    Per-sample failures (time limit, out of memory, non-finite bounds, an error inside
    auto_LiRPA) become FallbackResult(False, reason, seconds) and never raise; on Linux CPUs a
    temporary address-space limit turns memory exhaustion into such a result instead of the
    kernel killing the process. Raises LofastError
    for invalid arguments or when auto_LiRPA is not installed. Changes torch's default dtype while
    bounding (not thread-safe).
    """
    check_inputs(model, images, labels, timeout, batch_size)
    bounder = MarginBounder(model, eps, method, dtype=dtype, alpha_iterations=alpha_iterations)

    images = images.to(bounder.device, dtype)
    labels = labels.to(bounder.device, torch.long)
    with torch.no_grad():
        predictions = bounder.plain(images).argmax(dim=1)
    results: list[FallbackResult | None] = [None] * len(images)
    pending = []
    for i in range(len(images)):
        if not torch.isfinite(images[i]).all():
            results[i] = FallbackResult(False, "non-finite image", 0.0)
        elif predictions[i] != labels[i]:
            results[i] = FallbackResult(False, "misclassified", 0.0)
        else:
            pending.append(i)
    if pending:
        try:
            bounder.build(images[pending[0]:pending[0] + 1])
        except Exception as error:  # noqa: BLE001 - e.g. an operator auto_LiRPA lacks
            reason = f"auto_LiRPA cannot bound this model: {describe_error(error)}"
            for i in pending:
                results[i] = FallbackResult(False, reason, 0.0)
            pending = []
    for first in range(0, len(pending), batch_size):
        chunk = pending[first:first + batch_size]
        for i, result in zip(chunk, _verify_batch(bounder, images[chunk], labels[chunk], timeout),
                             strict=True):
            results[i] = result
    return [r for r in results if r is not None]
