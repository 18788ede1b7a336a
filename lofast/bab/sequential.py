"""A bounder in plain torch for sequential Linear/ReLU networks: interval bound propagation for
the pre-activations, and either intervals or a backward linear relaxation (CROWN) for the
margins, on l2 balls, honouring branch-and-bound splits.

It exists so that the branch-and-bound driver can be tested (and used) without auto_LiRPA; the
lofast models are bounded by `lofast.crown.beta.BetaCrownBounder`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lofast.bab.driver import BoundBatch, Splits
from lofast.errors import LofastError

SEQUENTIAL_METHODS = ("ibp", "crown")
BETA_LR = 0.05  # Adam's step for the split multipliers


class SequentialBounder:
    """Margin bounds for net(x') over the l2 ball ||x' - x|| <= eps (not intersected with a box).

    net: nn.Sequential of Linear and ReLU layers (an nn.Flatten first is allowed), starting and
        ending with Linear, ReLU never twice in a row; computed in float64.
    x: one input (any shape whose numel is the first layer's in_features); label: its class.
    method: "ibp" (intervals all the way) or "crown" (intervals for the pre-activations, then a
        backward linear relaxation of the margins, intersected with the intervals' bound; in
        split domains with beta-CROWN's split multipliers, optimised for `beta_steps` steps).

    Splits (see `lofast.bab.driver`) are applied where the pre-activation intervals are formed:
    an active neuron's interval is cut to [max(l, 0), u], an inactive one's to [l, min(u, 0)],
    so its ReLU is its exact linear piece on the domain; later layers' intervals are computed
    from the cut ones. A domain whose cut interval is empty (l > u) contains no point of the
    ball and gets the bound +inf.
    """

    def __init__(self, net: nn.Sequential, x: Tensor, label: int, eps: float,
                 method: str = "crown", beta_steps: int = 30) -> None:
        if method not in SEQUENTIAL_METHODS:
            raise LofastError(f"method must be one of {', '.join(SEQUENTIAL_METHODS)}")
        if not eps >= 0:
            raise LofastError(f"eps must be >= 0, not {eps!r}")
        layers = [m for m in net if not isinstance(m, nn.Flatten)]
        linear = [m for m in layers if isinstance(m, nn.Linear)]
        kinds = "".join("L" if isinstance(m, nn.Linear) else "R" if isinstance(m, nn.ReLU)
                        else "?" for m in layers)
        if kinds != "LR" * (len(linear) - 1) + "L" or "?" in kinds:
            raise LofastError("net must alternate Linear and ReLU layers, Linear first and last")
        self.weights = [m.weight.detach().double() for m in linear]
        self.biases = [m.bias.detach().double() if m.bias is not None
                       else torch.zeros(m.out_features, dtype=torch.float64) for m in linear]
        self.shape = tuple(x.shape)
        self.x = x.detach().double().reshape(-1)
        self.eps = float(eps)
        self.method = method
        self.beta_steps = beta_steps
        k = self.weights[-1].shape[0]
        if not 0 <= label < k:
            raise LofastError(f"label must lie in [0, {k})")
        others = [j for j in range(k) if j != label]
        self.spec = torch.eye(k, dtype=torch.float64)[label] - torch.eye(k, dtype=torch.float64)[others]

    def root(self) -> BoundBatch:
        return self.bound([{}])

    def margins(self, points: Tensor) -> Tensor:
        """Exact margins (D, S) at points (D, *x.shape)."""
        h = points.double().reshape(len(points), -1)
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            h = h @ w.T + b
            if i < len(self.weights) - 1:
                h = h.relu()
        return h @ self.spec.T

    def _masks(self, splits: Sequence[Splits]) -> list[tuple[Tensor, Tensor]]:
        """Per ReLU layer, (active, inactive) boolean masks (D, n_l)."""
        masks = [(torch.zeros(len(splits), w.shape[0], dtype=torch.bool),
                  torch.zeros(len(splits), w.shape[0], dtype=torch.bool))
                 for w in self.weights[:-1]]
        for d, domain in enumerate(splits):
            for (layer, index), active in domain.items():
                masks[layer][0 if active else 1][d, index] = True
        return masks

    def bound(self, splits: Sequence[Splits], deadline: float | None = None) -> BoundBatch:
        """Bounds for each domain (see `lofast.bab.driver.BoundBatch`); deadline is unused
        (one call is a few matrix products)."""
        d = len(splits)
        masks = self._masks(splits)
        w0 = self.weights[0]
        mid = (self.x @ w0.T + self.biases[0]).expand(d, -1)
        rad = (self.eps * w0.norm(dim=1)).expand(d, -1)  # exact per neuron on an l2 ball
        lo, up = mid - rad, mid + rad
        empty = torch.zeros(d, dtype=torch.bool)
        pre_lower, pre_upper = [], []
        for i, (active, inactive) in enumerate(masks):
            lo = torch.where(active, lo.clamp(min=0), lo)
            up = torch.where(inactive, up.clamp(max=0), up)
            empty |= (lo > up).any(dim=1)
            pre_lower.append(lo)
            pre_upper.append(up)
            h_lo, h_up = lo.relu(), up.relu()
            w, b = self.weights[i + 1], self.biases[i + 1]
            if i + 1 == len(masks):  # fold the margins into the last layer: tighter
                w, b = self.spec @ w, self.spec @ b
            mid, rad = (h_lo + h_up) / 2 @ w.T + b, (h_up - h_lo) / 2 @ w.abs().T
            lo, up = mid - rad, mid + rad
        if not masks:  # a single linear layer: the margins are exactly linear
            w, b = self.spec @ w0, self.spec @ self.biases[0]
            a = w.expand(d, -1, -1)
            lower = self.x @ w.T + b - self.eps * w.norm(dim=1)
            lower = lower.expand(d, -1).clone()
            candidates = self._minimisers(a, lower)
            return BoundBatch(lower, [], [], [], candidates)
        lower, coefficients, candidates = lo, None, None
        if self.method == "crown":
            crown, coefficients, a = self._optimised(pre_lower, pre_upper, masks)
            lower = torch.maximum(lower, crown)
            candidates = self._minimisers(a, crown)
        lower = torch.where(empty[:, None], torch.inf, lower)
        return BoundBatch(lower, pre_lower, pre_upper, coefficients, candidates)

    def _optimised(self, pre_lower: list[Tensor], pre_upper: list[Tensor],
                   masks: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, list[Tensor], Tensor]:
        """`_backward` with beta >= 0 for every split, each margin's maximised by projected
        gradient ascent (Adam); returns the best bound found per margin and the coefficients
        of the last step. Any beta >= 0 gives a sound bound, so stopping anywhere is safe."""
        signs = [active.double() - inactive.double() for active, inactive in masks]  # (D, n_l)
        if not any(s.any() for s in signs) or self.beta_steps == 0:
            return self._backward(pre_lower, pre_upper)
        s_count = self.spec.shape[0]
        betas = [torch.zeros(len(s), s_count, s.shape[1], dtype=torch.float64,
                             requires_grad=True) for s in signs]
        optimiser = torch.optim.Adam(betas, lr=BETA_LR)
        best = None
        for _ in range(self.beta_steps):
            with torch.enable_grad():
                terms = [b * s[:, None] for b, s in zip(betas, signs, strict=True)]
                lower, coefficients, a = self._backward(pre_lower, pre_upper, terms)
                optimiser.zero_grad()
                (-lower.sum()).backward()
            optimiser.step()
            with torch.no_grad():
                for b in betas:
                    b.clamp_(min=0)
            lower = lower.detach()
            best = lower if best is None else torch.maximum(best, lower)
        return best, [c.detach() for c in coefficients], a.detach()

    def _backward(self, pre_lower: list[Tensor], pre_upper: list[Tensor],
                  betas: list[Tensor] | None = None) -> tuple[Tensor, list[Tensor], Tensor]:
        """CROWN: the margins' lower bounds (D, S), the coefficients of every ReLU output
        (per layer (D, S, n_l)) and the input coefficients (D, S, n_in).

        betas: per layer (D, S, n_l), beta * s for the split neurons (s = +1 for z >= 0, -1
        for z <= 0, beta >= 0), else 0: beta-CROWN's Lagrangian term -beta s z, which is <= 0
        on the domain, is added to the margin before bounding it, so the bound stays sound and
        the splits constrain the input, not only their own neurons."""
        d = pre_lower[0].shape[0]
        a = (self.spec @ self.weights[-1]).expand(d, -1, -1)  # on the last ReLU's output
        const = (self.spec @ self.biases[-1]).expand(d, -1)
        coefficients: list[Tensor] = [None] * len(pre_lower)  # type: ignore[list-item]
        for i in reversed(range(len(pre_lower))):
            coefficients[i] = a
            lo, up = pre_lower[i], pre_upper[i]
            on, off = lo >= 0, up <= 0  # a split neuron is one of these: its exact piece
            unstable = ~on & ~off
            width = torch.where(unstable, up - lo, 1.0)
            upper_slope = torch.where(unstable, up / width, on.double())
            upper_icpt = torch.where(unstable, -upper_slope * lo, 0.0)
            # lower line through the origin: slope 1 where u > -l, else 0 (CROWN's choice)
            lower_slope = torch.where(unstable, (up > -lo).double(), on.double())
            positive = a >= 0
            slope = torch.where(positive, lower_slope[:, None], upper_slope[:, None])
            const = const + torch.where(positive, 0.0, a * upper_icpt[:, None]).sum(dim=-1)
            a = a * slope  # on the pre-activation
            if betas is not None:
                a = a - betas[i]
            const = const + a @ self.biases[i]
            a = a @ self.weights[i]
        lower = a @ self.x + const - self.eps * a.norm(dim=-1)
        return lower, coefficients, a

    def _minimisers(self, a: Tensor, lower: Tensor) -> Tensor:
        """For each domain, the point of the ball minimising the linear bound of its worst
        margin: x - eps a / ||a|| (D, *x.shape)."""
        worst = lower.argmin(dim=1)
        rows = a[torch.arange(len(a)), worst]  # (D, n_in)
        step = rows / rows.norm(dim=1, keepdim=True).clamp(min=1e-300)
        return (self.x - self.eps * step).reshape(len(a), *self.shape)
