"""beta-CROWN: branch and bound (`lofast.bab`) over the ReLUs of the exported model, each
subdomain bounded by auto_LiRPA with alpha-CROWN plus beta split constraints.

The root is bounded exactly as the "alpha-crown" fallback does (`MarginBounder`), so a sample
that alpha-CROWN certifies is certified here at the same cost. Its intermediate bounds (valid
on the whole l2 ball) are then kept for every subdomain, with each split applied to its neuron:
an active split raises the pre-activation's lower bound to 0 and an inactive one lowers its
upper bound to 0, so auto_LiRPA relaxes that ReLU by its exact piece (identity or zero) on the
subdomain. That alone is sound, since the subdomain contains only points where the split holds.
beta-CROWN adds the Lagrangian term beta * s * z (beta >= 0, s = +1 for z >= 0, -1 for z <= 0)
at the split neuron's pre-activation z in the backward pass, which only lowers the objective on
the subdomain, and optimises beta with the relaxation slopes (alpha). Only the margins are
re-bounded per subdomain: one backward pass from the output per optimisation step, a small
fraction of a full CROWN pass, and batched over subdomains.

The splittable units are the ReLUs of the graph: the SLL layers' (x W + b) and the
piecewise-linear pieces auto_LiRPA makes of LayerProject (its relu and min/max).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lofast.bab.driver import BabResult, BabSettings, BoundBatch, Splits, branch_and_bound
from lofast.crown.lirpa import lirpa_context
from lofast.crown.verify import (
    ALPHA_LR,
    FallbackResult,
    MarginBounder,
    check_inputs,
    describe_error,
    margin_spec,
)
from lofast.models.vit import LipschitzViT

# beta's learning rate and the optimisation steps per batch of subdomains (alpha-beta-CROWN's
# defaults are 0.05 and 20 for BaB rounds).
BETA_LR = 0.05
BAB_ITERATIONS = 20


class BetaCrownBounder:
    """A `lofast.bab.Bounder` for one image (1, C, H, W) and its label (1,), using the
    BoundedModule of `margin_bounder` (an "alpha-crown" MarginBounder; rebuilt here, so that
    nothing from an earlier sample or a batch of another size stays in it).

    timeout: the sample's time limit; the root's alpha-CROWN may use 80 % of it, as the
        "alpha-crown" fallback does. iterations: alpha/beta steps per batch of subdomains.
    """

    def __init__(self, margin_bounder: MarginBounder, image: Tensor, label: Tensor,
                 timeout: float | None = None, iterations: int = BAB_ITERATIONS) -> None:
        self.margin_bounder = margin_bounder
        self.lirpa = margin_bounder.lirpa
        self.dtype = margin_bounder.dtype
        self.image = image.to(margin_bounder.device, self.dtype)
        self.label = label.to(margin_bounder.device, torch.long)
        self.timeout = timeout
        self.iterations = iterations
        self.interm: dict[str, tuple[Tensor, Tensor]] = {}
        self.relus: list[Any] = []  # the BoundRelu nodes, one per ReLU layer of the domains

    @property
    def module(self) -> Any:
        return self.margin_bounder.bounded

    def _spec(self, count: int) -> Tensor:
        spec = margin_spec(self.label, self.margin_bounder.num_classes, self.dtype)
        return spec.expand(count, -1, -1)

    def root(self) -> BoundBatch:
        """alpha-CROWN on the whole ball, then one subdomain pass without splits (for the
        branching coefficients, and often a slightly better bound: the better one is kept)."""
        self.margin_bounder.build(self.image)
        budget = None if self.timeout is None else 0.8 * self.timeout
        lower = self.margin_bounder.margin_bounds(self.image, self.label, budget)
        module = self.module
        final = module.final_name
        for node in module.nodes():  # every intermediate bound, as alpha-CROWN left it
            if (node.name == final or not (node.used and node.perturbed)
                    or getattr(node, "perturbation", None) is not None):
                continue
            lo, up = getattr(node, "lower", None), getattr(node, "upper", None)
            if isinstance(lo, Tensor) and isinstance(up, Tensor):
                self.interm[node.name] = (lo.detach().clone(), up.detach().clone())
        self.relus = [n for n in module.nodes()
                      if type(n).__name__ == "BoundRelu" and n.used and n.perturbed
                      and n.inputs[0].name in self.interm]
        if (lower > 0).all():  # verified at the root: nothing to branch on
            return BoundBatch(lower.detach(), *self._pre_activations([{}]))
        batch = self.bound([{}], None)
        batch.lower = torch.maximum(batch.lower, lower.detach())
        return batch

    def _pre_activations(self, splits: Sequence[Splits]) -> tuple[list[Tensor], list[Tensor]]:
        """Per ReLU layer, its input's bounds (D, n_l) with each domain's splits applied."""
        d = len(splits)
        lows, ups = [], []
        for layer, relu in enumerate(self.relus):
            lo, up = self.interm[relu.inputs[0].name]
            lo = lo.reshape(1, -1).expand(d, -1).clone()
            up = up.reshape(1, -1).expand(d, -1).clone()
            for i, domain in enumerate(splits):
                for (split_layer, index), active in domain.items():
                    if split_layer != layer:
                        continue
                    if active:
                        lo[i, index] = lo[i, index].clamp(min=0)
                    else:
                        up[i, index] = up[i, index].clamp(max=0)
            lows.append(lo)
            ups.append(up)
        return lows, ups

    def bound(self, splits: Sequence[Splits], deadline: float | None) -> BoundBatch:
        d = len(splits)
        module, final = self.module, self.module.final_name
        pre_lower, pre_upper = self._pre_activations(splits)
        interm = {name: (lo.expand(d, *lo.shape[1:]).clone(), up.expand(d, *up.shape[1:]).clone())
                  for name, (lo, up) in self.interm.items()}
        for relu, lo, up in zip(self.relus, pre_lower, pre_upper, strict=True):
            name = relu.inputs[0].name
            interm[name] = (lo.reshape(interm[name][0].shape), up.reshape(interm[name][1].shape))
        x = self.image.expand(d, *self.image.shape[1:])
        spec = self._spec(d)
        with lirpa_context(self.dtype):
            ball = self.lirpa.BoundedTensor(
                x, self.lirpa.PerturbationLpNorm(norm=2, eps=self.margin_bounder.eps))
            module.set_bound_opts({"optimize_bound_args": {"enable_beta_crown": False}})
            # CROWN with the subdomains' intermediate bounds; initialises the slopes (alpha)
            with torch.no_grad():
                crown, _, _ = module.init_alpha((ball,), share_alphas=True, method="backward",
                                                c=spec, bound_upper=False, interm_bounds=interm)
            for node in module.get_enabled_opt_act():  # the bounds of the others are fixed
                if hasattr(node, "alpha"):
                    node.drop_unused_alpha([final])
            self._set_betas(splits)
            left = 1e9 if deadline is None else max(deadline - time.perf_counter(), 0.0)
            module.set_bound_opts({"optimize_bound_args": {
                "enable_beta_crown": True, "init_alpha": False, "iteration": self.iterations,
                "lr_alpha": ALPHA_LR, "lr_beta": BETA_LR, "use_shared_alpha": True,
                "fix_interm_bounds": True, "max_time": left,
                "stop_criterion_func": lambda lb: (lb > 0).all(dim=1, keepdim=True)}})
            try:
                with torch.enable_grad():
                    lower, _ = module.compute_bounds(x=(ball,), C=spec, method="CROWN-Optimized",
                                                     interm_bounds=interm, bound_upper=False)
            finally:
                module.set_bound_opts({"optimize_bound_args": {
                    "enable_beta_crown": False, "init_alpha": True}})
        lower = torch.maximum(lower.detach(), crown.detach())
        coefficients = None
        if all(isinstance(getattr(r, "lA", None), Tensor) for r in self.relus):
            # lA (S, D, *shape): coefficient of the ReLU output in the final lower bound
            coefficients = [r.lA.detach().reshape(r.lA.shape[0], d, -1).transpose(0, 1)
                            for r in self.relus]
        return BoundBatch(lower, pre_lower, pre_upper, coefficients)

    def _set_betas(self, splits: Sequence[Splits]) -> None:
        """One sparse beta per split, on the node before its ReLU (auto_LiRPA's history format:
        per domain and node, the flat neuron indices and their signs, +1 for z >= 0)."""
        module = self.module
        module.get_split_nodes()
        for node in module.split_nodes:  # nothing from an earlier batch may stay
            if hasattr(node, "sparse_betas"):
                del node.sparse_betas
        for layer, relu in enumerate(self.relus):
            node = relu.inputs[0]
            history = [{node.name: ([i for (ly, i) in s if ly == layer],
                                    [1.0 if a else -1.0 for (ly, _), a in s.items()
                                     if ly == layer])}
                       for s in splits]
            longest = max(len(h[node.name][0]) for h in history)
            if longest == 0 or node not in module.split_nodes:
                continue  # without a beta the split still holds, through the bounds
            module.reset_beta(node, (len(splits), longest), None)
            node.sparse_betas[0].apply_splits(history, node.name)

    def margins(self, points: Tensor) -> Tensor:
        """Exact margins (D, K-1) of the exported network at points (D, C, H, W)."""
        with torch.no_grad():
            logits = self.margin_bounder.plain(points.to(self.dtype))
        return torch.einsum("dsk,dk->ds", self._spec(len(points)), logits)


def beta_crown_verify(model: LipschitzViT, images: Tensor, labels: Tensor, eps: float,
                      timeout: float | None = None, settings: BabSettings | None = None, *,
                      dtype: torch.dtype = torch.float64, alpha_iterations: int = 20,
                      iterations: int = BAB_ITERATIONS) -> list[FallbackResult]:
    """Certify each image against every l2 perturbation of norm <= eps with beta-CROWN branch
    and bound; arguments and results as in `crown_verify` (one sample at a time), plus the BaB
    settings (their timeout is replaced by `timeout`) and the alpha/beta steps per batch.

    A result is certified only when every subdomain was closed by a positive alpha/beta-CROWN
    lower bound on all margins; its margin_bound is the smallest bound over the leaves and
    `domains` counts the subdomains bounded. Failures are results, as in `crown_verify`.
    """
    check_inputs(model, images, labels, timeout, 1)
    settings = dataclasses.replace(settings or BabSettings(), timeout=timeout)
    bounder = MarginBounder(model, eps, "alpha-crown", dtype=dtype,
                            alpha_iterations=alpha_iterations)
    images = images.to(bounder.device, dtype)
    labels = labels.to(bounder.device, torch.long)
    with torch.no_grad():
        predictions = bounder.plain(images).argmax(dim=1)
    results = []
    for i in range(len(images)):
        if not torch.isfinite(images[i]).all():
            results.append(FallbackResult(False, "non-finite image", 0.0))
        elif predictions[i] != labels[i]:
            results.append(FallbackResult(False, "misclassified", 0.0))
        else:
            sample = BetaCrownBounder(bounder, images[i:i + 1], labels[i:i + 1], timeout,
                                      iterations)
            results.append(_result(sample, settings, bounder.device))
    return results


def _result(bounder: BetaCrownBounder, settings: BabSettings,
            device: torch.device) -> FallbackResult:
    start = time.perf_counter()
    try:
        outcome: BabResult = branch_and_bound(bounder, settings, device)
    except Exception as error:  # noqa: BLE001 - an error inside auto_LiRPA is this sample's
        return FallbackResult(False, describe_error(error), time.perf_counter() - start)
    finally:
        bounder.margin_bounder.bounded = None  # interrupted or finished: rebuilt per sample
    reason = outcome.reason
    if reason == "time limit" and settings.timeout is not None:
        reason = f"time limit ({settings.timeout:.3g} s per sample)"
    if outcome.verdict == "unknown" and outcome.lower_bound is not None:
        reason = f"{reason}; margin lower bound {outcome.lower_bound:.4g}"
    return FallbackResult(outcome.verdict == "verified", reason, outcome.seconds,
                          outcome.lower_bound, outcome.domains, outcome.verdict)
