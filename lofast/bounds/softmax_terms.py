"""The softmax terms of an attention block: the score norms m_l and the refinement's D_X.

M_l(G) = G A_l X^T + X A_l G^T is the change of the scores (Lemma 2 of the LoFAST paper); D_X(G)
= sum_l J_l(M_l(G)) X B_l / s is the first-order change of the attention output through the
softmax Jacobians J_l, whose norm the second-order refinement of ``bounds.attention`` uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lofast.bounds.first_order import sample_chunks
from lofast.bounds.krylov import LinearMap
from lofast.bounds.spectral import (
    SpectralMethod,
    explicit_norm,
    operator_norm,
    working_elements,
)
from lofast.bounds.verified import gamma


def softmax_first_order_norm(probs: Tensor, x_query: Tensor, x_key: Tensor, x_value_out: Tensor,
                              query: Tensor, key: Tensor, score: Tensor, scale: float,
                              method: SpectralMethod,
                              generator: torch.Generator | None) -> Tensor:
    """zeta_s >= ||D_X|| per sample (B,), D_X(G) = sum_l J_l(G A_l X^T + X A_l G^T) X B_l / s.

    probs (B, h, n, n); x_query, x_key (B, h, n, dh) X Wq_l, X Wk_l; x_value_out (B, h, n, d)
    X B_l; query, key (h, d, dh); score (B, h) upper bounds on ||M_l||. The guarantee is the
    method's.

    Both sides of D_X are compressed by Householder QR before its norm is taken, which changes
    the norm only by the rounding terms added at the end:

    - Output. D_X(G) = E(G) Y with E(G) = [J_1(E1_1) ... J_h(E1_h)] (n x hn) and
      Y = [X B_1; ...; X B_h] (hn x d). With Y^T = Q R (R: k x hn, k = min(d, hn)),
      ||E Y||_F = ||E R^T||_F, so the map goes into n x k (200 outputs instead of 640 for
      paper-d3).
    - Input. E1_l(G) = G K_l + (G U_l)^T with K_l = Wq_l (X Wk_l)^T and U_l = Wk_l (X Wq_l)^T
      (d x n) sees G only through S = [K_1 U_1 ... K_h U_h] (d x 2hn). With S = Q' R'
      (R': r x 2hn, r = 2hn, when 2hn < d), G -> G Q' maps the unit ball of n x d onto that of
      n x r, so D_X has the norm of the map H -> E'(H) R^T on n x r whose E1_l reads K_l, U_l
      from R' (578 inputs instead of 2176 for one head on 17 tokens of width 128).

    Rounding (Higham, Thm 19.4): Y + dY = R^T Q^T and S + dS = Q' R' with Q, Q' exactly
    orthonormal, ||dY||_F <= gamma~ ||Y||_F and ||dS||_F <= gamma~ ||S||_F. Let E~ be E with S
    replaced by S + dS. Since ||J_l|| <= 1/2, ||(E - E~)(G)||_F <= ||dS||_F ||G||_F / sqrt(2)
    and ||E(G)||_F <= sqrt(sum_l (m_l / 2)^2) ||G||_F, hence
    ||D_X|| <= ||H -> E'(H) R^T|| + (||dS||_F ||Y||_F / sqrt(2)
               + ||dY||_F (sqrt(sum_l (m_l / 2)^2) + ||dS||_F / sqrt(2))) / s.
    """
    batch, heads, n, d = x_value_out.shape
    stacked = x_value_out.reshape(batch, heads * n, d)
    factor = torch.linalg.qr(stacked.mT, mode="r").R.mT.reshape(batch, heads, n, -1)  # R^T
    k = factor.shape[-1]
    through_keys, through_queries = (product.materialised() for product in  # (B, h, d, n)
                                     score_factors(x_query, x_key, query, key))
    left_error = torch.zeros(batch, dtype=torch.float64, device=probs.device)
    if 2 * heads * n < d:
        left = torch.stack([through_keys, through_queries], dim=2)  # (B, h, 2, d, n)
        columns = left.permute(0, 3, 1, 2, 4).reshape(batch, d, 2 * heads * n)
        compressed = torch.linalg.qr(columns, mode="r").R  # (B, r, 2hn), r = 2hn
        through_keys, through_queries = (compressed.reshape(batch, -1, heads, 2, n)
                                         .permute(0, 2, 3, 1, 4).unbind(dim=2))
        left_error = qr_backward_error(torch.linalg.vector_norm(columns, dim=(1, 2)), d,
                                       2 * heads * n)
    width = through_keys.shape[-2]
    parts = []
    for rows in sample_chunks(batch, working_elements(method, n * width, n * k), probs.device):
        if method.kind in ("dense", "verified"):  # the matrix in closed form, then its norm
            parts.append(explicit_norm(softmax_first_order_matrix(
                probs[rows], through_keys[rows], through_queries[rows], factor[rows], scale),
                method))
            continue
        apply, adjoint = softmax_first_order_maps(probs[rows], through_keys[rows],
                                                  through_queries[rows], factor[rows], scale)
        parts.append(operator_norm(apply, adjoint, (n, width), probs[rows].shape[0], method,
                                   device=probs.device, generator=generator))
    right_error = qr_backward_error(torch.linalg.vector_norm(stacked, dim=(1, 2)), d, heads * n)
    score_bound = torch.linalg.vector_norm(score / 2, dim=1)
    rounding = (left_error * torch.linalg.vector_norm(stacked, dim=(1, 2)) / math.sqrt(2.0)
                + right_error * (score_bound + left_error / math.sqrt(2.0))) / scale
    return (torch.cat(parts) + rounding) * (1.0 + 2.0 ** -40)


def qr_backward_error(frobenius: Tensor, rows: int, columns: int) -> Tensor:
    """||dA||_F for Householder QR of a (rows x columns) matrix A with ||A||_F <= frobenius:
    the computed R is exact for A + dA with an exactly orthonormal Q (Higham, Thm 19.4, whose
    gamma~ is c m n u for a small constant c; 64 covers it)."""
    return gamma(64 * rows * columns) * frobenius


@dataclass(frozen=True)
class FactoredProduct:
    """K_l = weight_l projected_l^T (m x n) for every head l, kept as its factors: weight
    (h, m, dh), shared by the batch, and projected (B, h, n, dh). ``softmax_first_order_maps``
    then forms G K_l as (G weight_l) projected_l^T: one (B n x m)(m x h dh) product for all
    heads and an (n x dh)(dh x n) one per head, instead of an (n x m)(m x n) one per head with
    the (B, h, m, n) K_l in memory (twice as fast for lofast-s on a CPU thread). For L blocks
    stacked (``estimate.attention_sensitivity_estimates``): weight (L, h, m, dh) and projected
    (L, B, h, n, dh), every product taken block by block."""

    weight: Tensor
    projected: Tensor

    def materialised(self) -> Tensor:
        """K_l (B, h, m, n)."""
        return self.weight @ self.projected.mT

    def stacked_weight(self) -> Tensor:
        """[weight_1 ... weight_h] (m, h dh), or (L, m, h dh) for stacked blocks."""
        return self.weight.movedim(-3, -2).flatten(-2)


def _times_weight(G: Tensor, weight: Tensor) -> Tensor:
    """G W for G (B, n, m) and W (m, k), one product for the batch; or block by block, G
    (L, B, n, m) and W (L, m, k), without copying W once per sample (as broadcasting would)."""
    return G @ weight if weight.dim() == 2 else torch.einsum("lbnm,lmk->lbnk", G, weight)


# per head an (m x n) matrix: multiplied out (B, h, m, n), or as its factors
HeadMatrices = Tensor | FactoredProduct


def score_factors(x_query: Tensor, x_key: Tensor, query: Tensor,
                  key: Tensor) -> tuple[FactoredProduct, FactoredProduct]:
    """K_l = Wq_l (X Wk_l)^T and U_l = Wk_l (X Wq_l)^T (each d x n), from x_query, x_key
    (B, h, n, dh) and query, key (h, d, dh): the change of head l's scores is
    G A_l X^T + X A_l G^T = G K_l + (G U_l)^T."""
    return FactoredProduct(query, x_key), FactoredProduct(key, x_query)


def _times(G: Tensor, factor: HeadMatrices) -> Tensor:
    """G K_l for G (B, n, m) and every head: (B, h, n, n); (L, B, ...) for stacked blocks."""
    if isinstance(factor, Tensor):
        return G[:, None] @ factor
    heads, _, dh = factor.weight.shape[-3:]
    projected = _times_weight(G, factor.stacked_weight()).unflatten(-1, (heads, dh))
    return projected.transpose(-3, -2) @ factor.projected.mT


def _times_transposed(M: Tensor, factor: HeadMatrices) -> Tensor:
    """sum_l M_l K_l^T for M (B, h, n, n): (B, n, m); (L, B, ...) for stacked blocks."""
    if isinstance(factor, Tensor):
        return (M @ factor.mT).sum(dim=1)
    return _times_weight((M @ factor.projected).transpose(-3, -2).flatten(-2),
                         factor.stacked_weight().mT)


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


def row_softmax_jacobian(probs: Tensor, E: Tensor, out: Tensor | None = None,
                         dim: int = -1) -> Tensor:
    """The row-wise softmax Jacobian diag(p) - p p^T (self-adjoint) applied to the rows of E,
    for probabilities probs broadcastable to E's shape, a row running along ``dim`` (the last
    by default; another for rows stored key-major). E is overwritten as scratch; the result
    goes to out (E itself, for no new memory, or a view of any strides), else to a new tensor:
    the form torch.func.vmap batches (it has no batching rule for in-place addcmul)."""
    weighted = E.mul_(probs)
    rows = weighted.sum(dim=dim, keepdim=True)
    if out is None:
        return torch.addcmul(weighted, probs, rows, value=-1.0)
    return torch.addcmul(weighted, probs, rows, value=-1.0, out=out)


def softmax_first_order_maps(probs: Tensor, through_keys: HeadMatrices,
                             through_queries: HeadMatrices, right: HeadMatrices,
                             scale: float) -> tuple[LinearMap, LinearMap]:
    """G -> sum_l J_l(G K_l + (G U_l)^T) right_l / s (n x m -> n x k) and its adjoint.

    probs (B, h, n, n); through_keys K_l and through_queries U_l (each m x n, multiplied out
    (B, h, m, n) or as a ``FactoredProduct``): with ``score_factors`` (m = d),
    G K_l + (G U_l)^T is G A_l X^T + X A_l G^T, the change of head l's scores; right_l
    (n x k), multiplied out (B, h, n, k) or its transpose as a ``FactoredProduct``: X B_l
    (``FactoredProduct(Wo^T, X Wv)``) gives D_X itself, a factor R_l^T with the same Gram
    matrix [R_1^T; ...] [R_1^T; ...]^T as [X B_1; ...] gives a map of the same norm. J_l is
    the row-wise softmax Jacobian diag(p) - p p^T, self-adjoint."""

    def apply(G: Tensor) -> Tensor:
        mixed = row_softmax_jacobian(  # (B, h, n, n)
            probs, _times(G, through_keys) + _times(G, through_queries).mT)
        if isinstance(right, FactoredProduct):  # sum_l M_l right_l = sum_l M_l (right_l^T)^T
            return _times_transposed(mixed, right) / scale
        return torch.einsum("bhij,bhjk->bik", mixed, right) / scale

    def adjoint(Z: Tensor) -> Tensor:
        values = (_times(Z, right) if isinstance(right, FactoredProduct)  # Z right_l^T
                  else torch.einsum("bik,bhjk->bhij", Z, right))
        mixed = row_softmax_jacobian(probs, values / scale)
        return _times_transposed(mixed, through_keys) + _times_transposed(mixed.mT,
                                                                          through_queries)

    return apply, adjoint


def softmax_first_order_matrix(probs: Tensor, through_keys: Tensor, through_queries: Tensor,
                               right: Tensor, scale: float) -> Tensor:
    """The explicit matrix (B, n k, n m) of ``softmax_first_order_maps``' map
    G -> sum_l J_l(G K_l + (G U_l)^T) right_l / s (n x m -> n x k, row-major vec on both sides),
    built in closed form instead of column by column.

    probs (B, h, n, n); through_keys K_l and through_queries U_l (B, h, m, n); right (B, h, n, k).
    Row i of J_l(E) R_l (R_l = right_l) is sum_j p_ij E_ij (R_l[j] - (P_l R_l)[i]), so with
    M_l[i, j, a] = p_ij (R_l[j, a] - (P_l R_l)[i, a]) / s and
    E_ij = g_i . K_l[:, j] + g_j . U_l[:, i]:
        d Z[i, a] / d G[i', c] = [i = i'] sum_{l, j} K_l[c, j] M_l[i, j, a]
                                 + sum_l M_l[i, i', a] U_l[c, i].
    Each entry is a sum of at most h (n + 2) products of the data, as in one matrix-free
    product (``spectral.explicit_norm``'s ROUNDING_MARGIN covers both)."""
    batch, n = probs.shape[0], probs.shape[-1]
    m, k = through_keys.shape[-2], right.shape[-1]
    mixed = probs[..., None] * (right[:, :, None] - (probs @ right)[:, :, :, None]) / scale
    matrix = torch.einsum("blima,blci->biamc", mixed, through_queries)  # (B, n, k, n, m)
    diagonal = torch.einsum("blcj,blija->biac", through_keys, mixed)  # (B, n, k, m)
    tokens = torch.arange(n, device=probs.device)
    matrix[:, tokens, :, tokens, :] += diagonal.transpose(0, 1)
    return matrix.reshape(batch, n * k, n * m)


def probabilities_from_projections(x_query: Tensor, x_key: Tensor, scale: float,
                                   bias: Tensor | None = None) -> Tensor:
    """row_softmax(Q_l K_l^T / s + C_l) for Q_l = X Wq_l, K_l = X Wk_l (B, h, n, dh) and an
    optional position bias C_l (h, n, n) -> (B, h, n, n), in the projections' dtype."""
    scores = x_query @ x_key.mT / scale
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    return torch.softmax(scores, dim=-1)
