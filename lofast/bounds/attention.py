"""LoFAST local sensitivity of one dot-product attention block (Theorem 1, Lemmas 1 and 2).

The block is F(X) = H X + sum_l P_l(X) X B_l with P_l(X) = row_softmax(X A_l X^T / s),
A_l = Wq_l Wk_l^T, B_l = Wv_l Wo_l, and H = I (residual) or H = 0. For every X' with
||X' - X||_F <= eps:

    ||F(X') - F(X)||_F <= zeta(X) eps
                          + sum_l (kappa eps / s) (m_l(X) + eps ||A_l||) (||X B_l|| + eps ||B_l||)

with zeta = ||T_X||, T_X(G) = H G + sum_l P_l G B_l (Lemma 1), m_l = ||M_l||,
M_l(G) = G A_l X^T + X A_l G^T (Lemma 2) or its relaxation xi_l = ||A_l X^T|| + ||X A_l||, and
kappa a Lipschitz constant of the row softmax (1 in the paper; 1/2 is tight and sound).

All quantities are float64 and computed once per sample; ``AttentionSensitivity.delta`` then
evaluates the bound for any radii.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lofast.bounds.spectral import (
    Guarantee,
    SpectralMethod,
    matrix_norm_upper,
    operator_norm,
    working_elements,
)

# Working memory (float64 elements) for one chunk of samples in a matrix-free norm computation.
# On a CPU the Lanczos basis of a chunk should stay in the last-level cache (2^21 = 16 MiB): the
# reorthogonalisation is memory-bound and runs ~2.5x faster than from main memory. On an
# accelerator larger chunks (2^26 = 512 MiB) keep it busy.
CPU_WORKSPACE_ELEMENTS = 1 << 21
DEVICE_WORKSPACE_ELEMENTS = 1 << 26

# The softmax Jacobian diag(p) - p p^T has spectral norm <= 1/2 (Gershgorin), so no kappa below
# 1/2 is a valid Lipschitz constant for every input.
TIGHT_KAPPA = 0.5

DEFAULT_METHOD = SpectralMethod()  # randomized Lanczos (frozen, safe to share)


@dataclass(frozen=True)
class AttentionWeights:
    """Weights of one attention block, per head l = 1..h.

    query, key: (h, d, dh) Wq_l, Wk_l; value: (h, d, dv) Wv_l; output: (h, dv, d) Wo_l;
    residual: H = I if True else H = 0; scale: s, the score divisor (sqrt(d/h) usually).
    """

    query: Tensor
    key: Tensor
    value: Tensor
    output: Tensor
    residual: bool
    scale: float

    def __post_init__(self) -> None:
        shapes = {name: tuple(getattr(self, name).shape)
                  for name in ("query", "key", "value", "output")}
        if any(len(shape) != 3 for shape in shapes.values()):
            raise ValueError(f"attention weights must be 3-d (h, ., .), got {shapes}")
        h, d, dh = shapes["query"]
        dv = shapes["value"][2]
        expected = {"query": (h, d, dh), "key": (h, d, dh), "value": (h, d, dv),
                    "output": (h, dv, d)}
        if shapes != expected or min(h, d, dh, dv) < 1:
            raise ValueError(f"inconsistent attention weight shapes {shapes}; expected "
                             "query, key (h, d, dh), value (h, d, dv), output (h, dv, d)")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"attention scale must be positive and finite, got {self.scale}")

    @property
    def heads(self) -> int:
        return self.query.shape[0]

    @property
    def width(self) -> int:
        return self.query.shape[1]

    def score_matrices(self) -> Tensor:
        """A_l = Wq_l Wk_l^T, (h, d, d) float64."""
        return _f64(self.query) @ _f64(self.key).mT

    def value_matrices(self) -> Tensor:
        """B_l = Wv_l Wo_l, (h, d, d) float64 (matrix-vector products use the factors)."""
        return _f64(self.value) @ _f64(self.output)


@dataclass(frozen=True)
class AttentionSensitivity:
    """Per-sample, eps-independent quantities of one block; delta(eps) is a scalar formula.

    guarantee: the weakest guarantee of the norms (see ``spectral.Guarantee``);
    failure_probability: per sample, a union bound over its probabilistic norms (0 unless the
    guarantee is PROBABILISTIC).
    """

    zeta: Tensor  # (B,) first-order sensitivity ||T_X|| (or the naive eq.-12 value)
    score_sensitivity: Tensor  # (B, h) m_l(X) = ||M_l|| or its relaxation xi_l(X)
    value_norm: Tensor  # (B, h) ||X B_l||
    score_weight_norm: Tensor  # (h,) ||A_l||
    value_weight_norm: Tensor  # (h,) ||B_l||
    scale: float  # s
    kappa: float  # softmax Lipschitz constant used (1 = paper, 0.5 = tight)
    guarantee: Guarantee = Guarantee.DETERMINISTIC
    failure_probability: float = 0.0

    def delta(self, eps: Tensor) -> Tensor:
        """Bound on ||F(X') - F(X)||_F over ||X' - X||_F <= eps.

        eps: (B,) or (B, E) radii >= 0. Returns the same shape:
        zeta eps + sum_l (kappa eps / s)(m_l + eps ||A_l||)(||X B_l|| + eps ||B_l||), a
        polynomial in eps with nonnegative coefficients, hence nondecreasing in eps.
        """
        if eps.dim() not in (1, 2) or eps.shape[0] != self.zeta.shape[0]:
            raise ValueError(f"eps must have shape (B,) or (B, E) with B = {self.zeta.shape[0]}, "
                             f"got {tuple(eps.shape)}")
        eps = eps.to(device=self.zeta.device, dtype=torch.float64)  # float64 whatever the inputs
        extra = (None,) * (eps.dim() - 1)  # broadcast the per-sample quantities over E
        zeta = self.zeta[(slice(None), *extra)]
        score = self.score_sensitivity[(slice(None), *extra, slice(None))]
        value = self.value_norm[(slice(None), *extra, slice(None))]
        e = eps[..., None]
        second = (score + e * self.score_weight_norm) * (value + e * self.value_weight_norm)
        return zeta * eps + (self.kappa / self.scale) * eps * second.sum(dim=-1)


def attention_probabilities(X: Tensor, w: AttentionWeights) -> Tensor:
    """P_l(X) = row_softmax(X Wq_l (X Wk_l)^T / s): (B, n, d) -> (B, h, n, n) float64."""
    X = _check_tokens(X, w)
    return _probabilities(X, _f64(w.query, X.device), _f64(w.key, X.device), w.scale)


def attention_forward(X: Tensor, w: AttentionWeights) -> Tensor:
    """The exact block F(X) = H X + sum_l P_l(X) X Wv_l Wo_l: (B, n, d) -> (B, n, d) float64."""
    X = _check_tokens(X, w)
    probs = _probabilities(X, _f64(w.query, X.device), _f64(w.key, X.device), w.scale)
    out = _mix(probs, X, _f64(w.value, X.device), _f64(w.output, X.device))
    return out + X if w.residual else out


def attention_sensitivity(X: Tensor, w: AttentionWeights, *, kappa: float = 0.5,
                          first_order: str = "lofast", score_bound: str = "exact",
                          method: SpectralMethod = DEFAULT_METHOD,
                          generator: torch.Generator | None = None) -> AttentionSensitivity:
    """The LoFAST quantities of one block at clean tokens X (B, n, d).

    first_order: "lofast" (zeta = ||T_X||, exact by Lemma 1) or "naive" (eq. 12:
    ||H|| + sum_l ||B_l|| ||P_l(X)||). score_bound: "exact" (m_l = ||M_l||, delta_2^(1)) or
    "relaxed" (xi_l = ||A_l X^T|| + ||X A_l||, delta_2^(2)). kappa >= 1/2: the softmax constant.

    The matrix-free norms ||T_X|| and ||M_l|| use ``method``; every explicit matrix norm
    (||X B_l||, ||A_l X^T||, ||X A_l||, ||P_l||, ||A_l||, ||B_l||) is a deterministic upper bound
    (``matrix_norm_upper``). The returned guarantee is the weakest involved.
    """
    if first_order not in ("lofast", "naive"):
        raise ValueError(f"first_order must be 'lofast' or 'naive', got {first_order!r}")
    if score_bound not in ("exact", "relaxed"):
        raise ValueError(f"score_bound must be 'exact' or 'relaxed', got {score_bound!r}")
    if not (math.isfinite(kappa) and kappa >= TIGHT_KAPPA):
        raise ValueError(f"kappa must be >= {TIGHT_KAPPA} (the softmax's tight Lipschitz "
                         f"constant), got {kappa}")
    X = _check_tokens(X, w)
    device = X.device
    query, key = _f64(w.query, device), _f64(w.key, device)
    value, output = _f64(w.value, device), _f64(w.output, device)
    score_weights = query @ key.mT  # (h, d, d) A_l
    x_score = X[:, None] @ score_weights  # (B, h, n, d) X A_l
    probs = _probabilities(X, query, key, w.scale)  # (B, h, n, n)
    x_value = torch.einsum("bnd,hde->bhne", X, value)  # (B, h, n, dv) X Wv_l
    value_norm = matrix_norm_upper(x_value @ output)  # (B, h) ||X B_l||
    score_weight_norm = matrix_norm_upper(score_weights)
    value_weight_norm = matrix_norm_upper(value @ output)
    x_score_t = X[:, None] @ score_weights.mT  # (B, h, n, d) X A_l^T; ||X A_l^T|| = ||A_l X^T||

    matrix_free = 0  # probabilistic / estimated norms per sample
    if first_order == "lofast":
        zeta = _first_order_norm(X, probs, value, output, w.residual, method, generator)
        matrix_free += 1
    else:
        identity_norm = 1.0 if w.residual else 0.0
        zeta = identity_norm + (value_weight_norm * matrix_norm_upper(probs)).sum(dim=1)
    if score_bound == "exact":
        score = _score_norm(x_score, x_score_t, method, generator)
        matrix_free += w.heads
    else:
        score = matrix_norm_upper(x_score_t) + matrix_norm_upper(x_score)

    guarantee = method.guarantee if matrix_free else Guarantee.DETERMINISTIC
    failure = (matrix_free * method.failure_probability
               if guarantee is Guarantee.PROBABILISTIC else 0.0)
    return AttentionSensitivity(zeta=zeta, score_sensitivity=score, value_norm=value_norm,
                                score_weight_norm=score_weight_norm,
                                value_weight_norm=value_weight_norm, scale=float(w.scale),
                                kappa=float(kappa), guarantee=guarantee,
                                failure_probability=failure)


def _first_order_norm(X: Tensor, probs: Tensor, value: Tensor, output: Tensor, residual: bool,
                      method: SpectralMethod, generator: torch.Generator | None) -> Tensor:
    """zeta = ||T_X|| per sample, T_X(G) = H G + sum_l P_l G Wv_l Wo_l (n x d -> n x d), with
    adjoint T_X*(Y) = H^T Y + sum_l P_l^T Y Wo_l^T Wv_l^T. Returns (B,)."""
    batch, n, d = X.shape
    parts = []
    for rows in _chunks(batch, working_elements(method, n * d, n * d), X.device):
        p = probs[rows]

        def apply(G: Tensor, p: Tensor = p) -> Tensor:
            out = _mix(p, G, value, output)
            return out + G if residual else out

        def adjoint(Y: Tensor, p: Tensor = p) -> Tensor:
            out = _mix(p.mT, Y, output.mT, value.mT)
            return out + Y if residual else out

        parts.append(operator_norm(apply, adjoint, (n, d), p.shape[0], method,
                                   device=X.device, generator=generator))
    return torch.cat(parts)


def _score_norm(x_score: Tensor, x_score_t: Tensor, method: SpectralMethod,
                generator: torch.Generator | None) -> Tensor:
    """m_l = ||M_l|| per (sample, head), M_l(G) = G A_l X^T + X A_l G^T (n x d -> n x n), with
    adjoint M_l*(Y) = Y X A_l^T + Y^T X A_l. Heads are folded into the batch. Returns (B, h)."""
    batch, heads, n, d = x_score.shape
    xa = x_score.reshape(batch * heads, n, d)
    xat = x_score_t.reshape(batch * heads, n, d)
    parts = []
    for rows in _chunks(batch * heads, working_elements(method, n * d, n * n), xa.device):
        a, at = xa[rows], xat[rows]

        def apply(G: Tensor, a: Tensor = a, at: Tensor = at) -> Tensor:
            return G @ at.mT + a @ G.mT

        def adjoint(Y: Tensor, a: Tensor = a, at: Tensor = at) -> Tensor:
            return Y @ at + Y.mT @ a

        parts.append(operator_norm(apply, adjoint, (n, d), a.shape[0], method,
                                   device=xa.device, generator=generator))
    return torch.cat(parts).reshape(batch, heads)


def _probabilities(X: Tensor, query: Tensor, key: Tensor, scale: float) -> Tensor:
    """row_softmax((X Wq_l)(X Wk_l)^T / s): X (B, n, d), Wq, Wk (h, d, dh) -> (B, h, n, n)."""
    q = torch.einsum("bnd,hde->bhne", X, query)
    k = torch.einsum("bnd,hde->bhne", X, key)
    return torch.softmax(q @ k.mT / scale, dim=-1)


def _mix(probs: Tensor, G: Tensor, first: Tensor, second: Tensor) -> Tensor:
    """sum_l probs_l G first_l second_l: probs (B, h, n, n), G (B, n, d), first (h, d, e),
    second (h, e, d) -> (B, n, d). The head matrices stay factored (d x e, e x d)."""
    mixed = probs @ torch.einsum("bnd,hde->bhne", G, first)  # (B, h, n, e)
    return torch.einsum("bhne,hef->bnf", mixed, second)


def _chunks(total: int, per_item: int, device: torch.device) -> list[slice]:
    """Consecutive slices of range(total) whose working memory (per_item float64 elements each)
    fits the device's workspace (at least one item per slice)."""
    budget = CPU_WORKSPACE_ELEMENTS if device.type == "cpu" else DEVICE_WORKSPACE_ELEMENTS
    size = max(1, budget // max(1, per_item))
    return [slice(start, min(start + size, total)) for start in range(0, total, size)]


def _check_tokens(X: Tensor, w: AttentionWeights) -> Tensor:
    """Validate clean tokens (B, n, d) and return them as float64."""
    if not isinstance(X, Tensor) or X.dim() != 3:
        raise ValueError(f"tokens must be a tensor (B, n, d), got "
                         f"{tuple(X.shape) if isinstance(X, Tensor) else type(X).__name__}")
    if X.shape[2] != w.width:
        raise ValueError(f"tokens have width {X.shape[2]}, the attention weights expect {w.width}")
    if X.shape[0] < 1 or X.shape[1] < 1:
        raise ValueError(f"tokens must have at least one sample and one token, got {tuple(X.shape)}")
    X = X.to(torch.float64)
    if not torch.isfinite(X).all():
        raise ValueError("tokens contain NaN or infinity")
    return X


def _f64(t: Tensor, device: torch.device | None = None) -> Tensor:
    return t.to(device=device if device is not None else t.device, dtype=torch.float64)
