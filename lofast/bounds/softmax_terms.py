"""The softmax terms of an attention block: the score norms m_l and the refinement's D_X.

M_l(G) = G A_l X^T + X A_l G^T is the change of the scores (Lemma 2 of the LoFAST paper); D_X(G)
= sum_l J_l(M_l(G)) X B_l / s is the first-order change of the attention output through the
softmax Jacobians J_l, whose norm the second-order refinement of ``bounds.attention`` uses.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lofast.bounds.first_order import sample_chunks
from lofast.bounds.krylov import LinearMap
from lofast.bounds.spectral import SpectralMethod, operator_norm, working_elements
from lofast.bounds.verified import gamma


def softmax_first_order_norm(probs: Tensor, x_query: Tensor, x_key: Tensor, x_value_out: Tensor,
                              query: Tensor, key: Tensor, score: Tensor, scale: float,
                              method: SpectralMethod,
                              generator: torch.Generator | None) -> Tensor:
    """zeta_s >= ||D_X|| per sample (B,), D_X(G) = sum_l J_l(G A_l X^T + X A_l G^T) X B_l / s.

    probs (B, h, n, n); x_query, x_key (B, h, n, dh) X Wq_l, X Wk_l; x_value_out (B, h, n, d)
    X B_l; query, key (h, d, dh); score (B, h) upper bounds on ||M_l||. The guarantee is the
    method's.

    D_X(G) = E(G) Y with E(G) = [J_1(E1_1) ... J_h(E1_h)] (n x hn) and Y = [X B_1; ...; X B_h]
    (hn x d). With Y^T = Q R (Householder QR, R: k x hn, k = min(d, hn)), ||E Y||_F = ||E R^T||_F,
    so the norm is taken of the map into n x k (200 outputs instead of 640 for paper-d3).
    Rounding of the QR: Y + dY = R^T Q^T with Q exactly orthonormal and
    ||dY||_F <= gamma~ ||Y||_F (Higham, Thm 19.4); ||E(G)||_F <= sqrt(sum_l (m_l / 2)^2) ||G||_F
    (||J_l|| <= 1/2), so adding gamma~ ||Y||_F sqrt(sum_l (m_l / 2)^2) / s covers it.
    """
    batch, heads, n, d = x_value_out.shape
    stacked = x_value_out.reshape(batch, heads * n, d)
    factor = torch.linalg.qr(stacked.mT).R.mT.reshape(batch, heads, n, -1)  # R^T, per head
    k = factor.shape[-1]
    parts = []
    for rows in sample_chunks(batch, working_elements(method, n * d, n * k), probs.device):
        p = probs[rows]
        apply, adjoint = softmax_first_order_maps(p, x_query[rows], x_key[rows], query, key,
                                                  factor[rows], scale)
        parts.append(operator_norm(apply, adjoint, (n, d), p.shape[0], method,
                                   device=probs.device, generator=generator))
    qr_error = (gamma(64 * d * heads * n) * torch.linalg.vector_norm(stacked, dim=(1, 2))
                * torch.linalg.vector_norm(score / 2, dim=1) / scale)
    return (torch.cat(parts) + qr_error) * (1.0 + 2.0 ** -40)


def score_norm(x_score: Tensor, x_score_t: Tensor, method: SpectralMethod,
                generator: torch.Generator | None) -> Tensor:
    """m_l = ||M_l|| per (sample, head), M_l(G) = G A_l X^T + X A_l G^T (n x d -> n x n), with
    adjoint M_l*(Y) = Y X A_l^T + Y^T X A_l. Heads are folded into the batch. Returns (B, h)."""
    batch, heads, n, d = x_score.shape
    xa = x_score.reshape(batch * heads, n, d)
    xat = x_score_t.reshape(batch * heads, n, d)
    parts = []
    for rows in sample_chunks(batch * heads, working_elements(method, n * d, n * n), xa.device):
        a, at = xa[rows], xat[rows]

        def apply(G: Tensor, a: Tensor = a, at: Tensor = at) -> Tensor:
            return G @ at.mT + a @ G.mT

        def adjoint(Y: Tensor, a: Tensor = a, at: Tensor = at) -> Tensor:
            return Y @ at + Y.mT @ a

        parts.append(operator_norm(apply, adjoint, (n, d), a.shape[0], method,
                                   device=xa.device, generator=generator))
    return torch.cat(parts).reshape(batch, heads)


def softmax_first_order_maps(probs: Tensor, x_query: Tensor, x_key: Tensor, query: Tensor,
                             key: Tensor, right: Tensor, scale: float) -> tuple[LinearMap,
                                                                                LinearMap]:
    """G -> sum_l J_l(G A_l X^T + X A_l G^T) right_l / s (n x d -> n x k) and its adjoint.

    probs (B, h, n, n); x_query, x_key (B, h, n, dh) X Wq_l, X Wk_l; query, key (h, d, dh);
    right (B, h, n, k): X B_l gives D_X itself, a factor R_l^T with the same Gram matrix
    [R_1^T; ...] [R_1^T; ...]^T as [X B_1; ...] gives a map of the same norm. J_l is the
    row-wise softmax Jacobian diag(p) - p p^T, self-adjoint."""

    def jacobian(E: Tensor) -> Tensor:
        weighted = probs * E
        return weighted - probs * weighted.sum(dim=-1, keepdim=True)

    def apply(G: Tensor) -> Tensor:
        scores = (torch.einsum("bnd,hde->bhne", G, query) @ x_key.mT
                  + x_query @ torch.einsum("bnd,hde->bhne", G, key).mT)  # E1_l (B, h, n, n)
        return torch.einsum("bhij,bhjk->bik", jacobian(scores), right) / scale

    def adjoint(Z: Tensor) -> Tensor:
        mixed = jacobian(torch.einsum("bik,bhjk->bhij", Z, right) / scale)
        return (torch.einsum("bhij,bhje,hde->bid", mixed, x_key, query)
                + torch.einsum("bhji,bhje,hde->bid", mixed, x_query, key))

    return apply, adjoint


def probabilities_from_projections(x_query: Tensor, x_key: Tensor, scale: float,
                                   bias: Tensor | None = None) -> Tensor:
    """row_softmax(Q_l K_l^T / s + C_l) for Q_l = X Wq_l, K_l = X Wk_l (B, h, n, dh) and an
    optional position bias C_l (h, n, n) -> (B, h, n, n), in the projections' dtype."""
    scores = x_query @ x_key.mT / scale
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    return torch.softmax(scores, dim=-1)
