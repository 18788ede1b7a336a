"""Differentiable estimates of the LoFAST quantities, for training only.

Certified training needs the bound of ``attention.attention_sensitivity`` with gradients, on
every training batch, in the working precision. Its one matrix-free norm, zeta(X) = ||T_X||, is
estimated by a few power-iteration steps started from the previous batch's vectors: power
iteration approaches ||T_X|| from below, so these values are ESTIMATES that guide learning and
never certificates (the certificate is always recomputed by ``lofast certify``). The gradient
is taken through the final vectors held fixed, d||T v|| = u^T dT v with u = T v / ||T v||, which
is the exact gradient of the top singular value once v has converged.

Every explicit norm is the square root of the top eigenvalue of the smaller Gram matrix, whose
gradient V diag(g) V^T needs no eigenvalue gaps (unlike the full SVD's).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lofast.bounds.attention import (
    TIGHT_KAPPA,
    AttentionSensitivity,
    AttentionWeights,
    first_order_maps,
    probabilities_from_projections,
)
from lofast.bounds.spectral import Guarantee, power_iterate

# Floor under squared norms before the square root (whose gradient is unbounded at 0).
SQUARED_NORM_FLOOR = 1e-12


def top_singular_value(M: Tensor) -> Tensor:
    """||M|| for matrices (..., m, k) in M's dtype, differentiable. Returns (...)."""
    gram = M @ M.mT if M.shape[-2] <= M.shape[-1] else M.mT @ M
    top = torch.linalg.eigvalsh(gram)[..., -1]
    return top.clamp_min(SQUARED_NORM_FLOOR).sqrt()


def row_space_factor(W: Tensor) -> Tensor:
    """F (..., k, min(k, d)) with ||Y W|| = ||Y F|| for every Y, for W (..., k, d), differentiable.

    With W^T = Q R (reduced QR, orthonormal columns Q), Y W = (Y R^T) Q^T and Q^T preserves
    the norm; for wide W (k < d) products with F are d/k times cheaper than with W."""
    return torch.linalg.qr(W.mT).R.mT


def product_norm(left: Tensor, right: Tensor) -> Tensor:
    """||L R|| for thin factors L (..., d, k), R (..., k, d) with k <= d, differentiable: the k x k
    problem ||R_L F_R|| with L = Q_L R_L (reduced QR) and F_R = row_space_factor(R)."""
    return top_singular_value(torch.linalg.qr(left).R @ row_space_factor(right))


def attention_sensitivity_estimate(X: Tensor, w: AttentionWeights, *, kappa: float = TIGHT_KAPPA,
                                   start: Tensor | None = None, iterations: int = 2,
                                   generator: torch.Generator | None = None,
                                   ) -> tuple[AttentionSensitivity, Tensor]:
    """The quantities of the certifier's default bound ("lofast": zeta and the relaxed score term
    xi_l = ||A_l X^T|| + ||X A_l||) at tokens X (B, n, d), in X's dtype, with gradients with
    respect to X and the weights.

    start: (B, n, d) initial vectors of the power iteration (e.g. the previous batch's; random
    when None or of another shape). Returns the sensitivity, marked ESTIMATE, and the final
    vectors (B, n, d), detached, to start the next call from.
    """
    query, key, value, output = (t.to(X.dtype) for t in (w.query, w.key, w.value, w.output))
    x_query, x_key, x_value = (torch.einsum("bnd,hde->bhne", X, weight)
                               for weight in (query, key, value))  # (B, h, n, dh)
    probs = probabilities_from_projections(x_query, x_key, w.scale)  # (B, h, n, n)

    apply, adjoint = first_order_maps(probs, value, output, w.residual)
    if start is None or start.shape != X.shape:
        start = torch.randn(X.shape, generator=generator, dtype=torch.float32,
                            device=generator.device if generator is not None else X.device)
    start = start.to(X).flatten(1)
    start = start / torch.linalg.vector_norm(start, dim=1, keepdim=True).clamp_min(
        SQUARED_NORM_FLOOR)
    with torch.no_grad():
        vector = power_iterate(lambda v: adjoint(apply(v.view(X.shape))).flatten(1), start,
                               iterations).view(X.shape)
    zeta = torch.linalg.vector_norm(apply(vector), dim=(1, 2))

    # ||X A_l^T|| = ||(X Wk_l) Wq_l^T||, ||X A_l|| = ||(X Wq_l) Wk_l^T||, ||X B_l|| = ||(X Wv_l) Wo_l||:
    # each right factor is replaced by its row-space factor, so the per-sample Gram matrices are
    # formed from (n, dh) products instead of (n, d) ones
    score = (top_singular_value(x_key @ row_space_factor(query.mT))  # X A_l^T
             + top_singular_value(x_query @ row_space_factor(key.mT)))  # X A_l, (B, h)
    value_norm = top_singular_value(x_value @ row_space_factor(output))  # (B, h) ||X B_l||
    sensitivity = AttentionSensitivity(
        zeta=zeta, score_sensitivity=score, value_norm=value_norm,
        score_weight_norm=product_norm(query, key.mT),
        value_weight_norm=product_norm(value, output), scale=float(w.scale),
        kappa=float(kappa), guarantee=Guarantee.ESTIMATE)
    return sensitivity, vector.detach()

