"""Attention blocks whose values, or scores and values, act on each head's own coordinates
(``value_output=identity``, ``query_key=identity``): zeta in closed form from h (n x n) norms
(``coordinate_first_order_norm``), and the block's whole Jacobian from one small operator per
head and sample (ours; below).

Setting (``query_key=identity`` with ``value_output=identity``): A_l = Wq_l Wk_l^T = g_l Pi_l and
B_l = Wv_l Wo_l = c_l Pi_l, Pi_l = Q_l Q_l^T the projection on head l's coordinates S_l (columns
of the identity, disjoint between heads), H = r I. The block's Jacobian at X
(notation of ``bounds.attention``) is
    (T_X + D_X)(G) = r G + sum_l c_l P_l G Pi_l
                     + sum_l (g_l c_l / s) J_l(G Pi_l X^T + X Pi_l G^T) X Pi_l,
so on head l's columns G_l = G[:, S_l] it acts by
    F_l(G_l) = r G_l + c_l P_l G_l + k_l J_l(G_l X_l^T + X_l G_l^T) X_l,   k_l = g_l c_l / s,
X_l = X[:, S_l] (n x dh), on columns in no head by r, and the parts do not mix:
||T_X + D_X|| = max(max_l ||F_l||, r if some coordinate is no head's).

Theorem. Let X_l^T = Q R with Q (dh x m) orthonormal columns, R (m x n), m = min(n, dh), and
let F^_l be F_l with X_l replaced by X^_l = R^T Q^T. Write G_l = H Q^T + W with W Q = 0. Then
W X^_l^T = 0 and X^_l W^T = 0, so F^_l(W) = (r I + c_l P_l) W, whose rows stay orthogonal to
range(Q), while F^_l(H Q^T) = L_l(H) Q^T with
    L_l(H) = r H + c_l P_l H + k_l J_l(H R + R^T H^T) R^T     (n x m -> n x m).
The two parts are orthogonal and ||H Q^T||_F = ||H||_F, hence
    ||F^_l|| = max(||L_l||, ||(r I + c_l P_l) on W||) <= max(||L_l||, ||r I + c_l P_l||),
and the second is at most zeta (``coordinate_first_order_norm``). L_l is an
(n m x n m) operator: 289 x 289 for one head of width 128 on 17 tokens, where T_X + D_X is
2176 x 2176; its norm is taken with the caller's spectral method.

Rounding. Householder QR is backward stable (Higham, Thm 19.4): the computed R is exact for
X_l^T + Delta with an exactly orthonormal Q and ||Delta||_F <= gamma_{64 dh n} ||X_l||_F, so the
theorem holds for X^_l = X_l + Delta^T. As each row of J_l has norm <= 1/2,
    ||F_l - F^_l|| <= |k_l| ||Delta|| (||X_l|| + ||X^_l||) <= |k_l| delta (2 ||X_l||_F + delta),
delta >= ||Delta||_F. The coefficients fl(c_l), fl(k_l) are within gamma_6 of c_l, k_l
relatively, which moves L_l by at most gamma_6 (|c_l| sqrt(n) + |k_l| ||R||_F^2) (||P_l||_F
<= sqrt(n), ||J_l(H R + R^T H^T) R^T||_F <= ||R||^2 ||H||_F). P_l and J_l are those computed
from X, as everywhere in ``lofast.bounds``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lofast.bounds.softmax_terms import qr_backward_error, softmax_first_order_maps
from lofast.bounds.spectral import SpectralMethod, matrix_norm_upper, operator_norm
from lofast.bounds.verified import gamma


@dataclass(frozen=True)
class CoordinateValues:
    """Value paths B_l = Wv_l Wo_l = b_l Q_l Q_l^T with Q_l (d, dv) distinct columns of the
    identity, the heads' columns disjoint (``value_output=identity``: head l's own coordinates).
    scales: (h,) fl(b_l); coordinates: (h, dv) int64, head l's coordinates (the columns of
    Q_l); covers: whether the heads' coordinates are all d of them."""

    scales: Tensor
    coordinates: Tensor
    covers: bool


def coordinate_values(value: Tensor, output: Tensor) -> CoordinateValues | None:
    """The structure above if the float64 factors value (h, d, dv), output (h, dv, d) have it
    exactly (checked on the factors, not on a rounded product): column j of Wv_l holds one
    nonzero entry alpha_l, in a row r_l(j) that no other column of any head uses, and row j of
    Wo_l one nonzero entry beta_l, in column r_l(j). Then B_l = alpha_l beta_l Q_l Q_l^T in
    exact arithmetic. None otherwise."""
    heads, d, dv = value.shape
    value_nonzero, output_nonzero = value != 0, output != 0
    if not (bool((value_nonzero.sum(dim=1) == 1).all())
            and bool((output_nonzero.sum(dim=2) == 1).all())):
        return None
    rows = value_nonzero.to(torch.int64).argmax(dim=1)  # (h, dv) r_l(j)
    if not bool((output_nonzero.to(torch.int64).argmax(dim=2) == rows).all()):
        return None
    if rows.flatten().unique().numel() != heads * dv:
        return None
    alpha = value.gather(1, rows[:, None, :])[:, 0]  # (h, dv)
    beta = output.gather(2, rows[:, :, None])[..., 0]
    if not (bool((alpha == alpha[:, :1]).all()) and bool((beta == beta[:, :1]).all())):
        return None
    return CoordinateValues(scales=alpha[:, 0] * beta[:, 0], coordinates=rows,
                            covers=heads * dv == d)


def coordinate_first_order_norm(probs: Tensor, values: CoordinateValues,
                                residual: bool) -> Tensor:
    """||T_X|| (B,), a deterministic upper bound within rounding of the exact value, for value
    paths with ``coordinate_values``' structure. T_X(G) = r G + sum_l b_l P_l G Q_l Q_l^T maps
    the columns of G in head l's coordinates by M_l = r I + b_l P_l and any other columns by r,
    independently, so ||T_X|| = max(max_l ||M_l||, r if some coordinate is no head's): h norms
    of (n, n) matrices per sample. probs (B, h, n, n) float64.

    Rounding: the computed M_l differs from r I + b_l P_l (b_l = alpha_l beta_l exactly, its
    float64 product off by u |b_l|) by at most 3u (r + |fl(b_l)| p_ij) per entry, whose
    Frobenius norm is at most gamma_3 sqrt(n) (r + |fl(b_l)|) (||P_l||_F <= sqrt(n): every row
    of P_l has norm <= 1)."""
    n = probs.shape[-1]
    r = 1.0 if residual else 0.0
    scales = values.scales.to(probs.device)
    mixed = scales[:, None, None] * probs  # (B, h, n, n)
    if residual:
        mixed = mixed + torch.eye(n, dtype=torch.float64, device=probs.device)
    rounding = gamma(3) * math.sqrt(n) * (r + scales.abs()) * (1.0 + 2.0 ** -30)
    norms = (matrix_norm_upper(mixed, per_sample=True) + rounding).amax(dim=1)
    return norms if values.covers else torch.clamp(norms, min=r)


@dataclass(frozen=True)
class CoordinateAttention:
    """Scores and values on the heads' own coordinates: A_l = g_l Pi_l and B_l = c_l Pi_l.

    score_scales, value_scales: (h,) float64 fl(g_l), fl(c_l); coordinates: (h, dh) int64, the
    columns S_l of head l."""

    score_scales: Tensor
    value_scales: Tensor
    coordinates: Tensor


def coordinate_attention(scores: CoordinateValues | None,
                         values: CoordinateValues | None) -> CoordinateAttention | None:
    """The structure above when ``coordinate_values`` found it for the score factors
    (Wq_l, Wk_l^T) and the value factors (Wv_l, Wo_l) on the same coordinates; None otherwise."""
    if scores is None or values is None:
        return None
    same = scores.coordinates.shape == values.coordinates.shape and bool(
        (scores.coordinates.sort(dim=1).values == values.coordinates.sort(dim=1).values).all())
    if not same:
        return None
    return CoordinateAttention(score_scales=scores.scales, value_scales=values.scales,
                               coordinates=values.coordinates)


def coordinate_jacobian_norm(X: Tensor, probs: Tensor, structure: CoordinateAttention,
                             residual: bool, scale: float, method: SpectralMethod,
                             generator: torch.Generator | None = None) -> Tensor:
    """An upper bound (B,) on max_l ||F_l|| of the module docstring (with the method's
    guarantee); the caller takes its maximum with zeta for ||T_X + D_X||.

    X (B, n, d) float64 tokens; probs (B, h, n, n) P_l at X; scale s."""
    batch, n, _ = X.shape
    heads, width = structure.coordinates.shape
    tokens = X[:, :, structure.coordinates.to(X.device)].permute(0, 2, 1, 3)  # X_l (B, h, n, dh)
    factor = torch.linalg.qr(tokens.mT, mode="r").R  # (B, h, m, n)
    value_scales = structure.value_scales.to(X.device)
    coupling = structure.score_scales.to(X.device) * value_scales / scale  # k_l
    r = 1.0 if residual else 0.0
    folded = (batch * heads, 1)  # every head its own operator

    mixing = (value_scales[:, None, None] * probs).reshape(*folded, n, n)  # c_l P_l
    through = factor.reshape(*folded, -1, n)
    softmax_apply, softmax_adjoint = softmax_first_order_maps(
        probs.reshape(*folded, n, n), through, through,
        (coupling[:, None, None] * factor.mT).reshape(*folded, n, -1), 1.0)

    def apply(H: Tensor) -> Tensor:
        return r * H + (mixing @ H[:, None])[:, 0] + softmax_apply(H)

    def adjoint(Y: Tensor) -> Tensor:
        return r * Y + (mixing.mT @ Y[:, None])[:, 0] + softmax_adjoint(Y)

    norms = operator_norm(apply, adjoint, (n, factor.shape[-2]), batch * heads, method,
                          device=X.device, generator=generator).reshape(batch, heads)
    frob = torch.linalg.vector_norm
    token_f = frob(tokens, dim=(2, 3))  # (B, h)
    delta = qr_backward_error(token_f, width, n)
    rounding = (coupling.abs() * delta * (2.0 * token_f + delta)
                + gamma(6) * (value_scales.abs() * math.sqrt(n)
                              + coupling.abs() * frob(factor, dim=(2, 3)).square()))
    return ((norms + rounding) * (1.0 + 2.0 ** -40)).amax(dim=1)
