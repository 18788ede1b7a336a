"""Differentiable estimates of the LoFAST quantities, for training only.

Certified training needs the bound of ``attention.attention_sensitivity`` with gradients, on
every training batch, in the working precision. Its one matrix-free norm, zeta(X) = ||T_X||, is
estimated by a few power-iteration steps started from the previous batch's vectors: power
iteration approaches ||T_X|| from below, so these values are ESTIMATES that guide learning and
never certificates (the certificate is always recomputed by ``lofast certify``). The gradient
is taken through the final vectors held fixed, d||T v|| = u^T dT v with u = T v / ||T v||, which
is the exact gradient of the top singular value once v has converged.

The explicit norms, of weights and per sample, are ||M v|| for an estimate v of the top
eigenvector of the smaller Gram matrix, found by repeated squaring of it: no solver, so no wait
for the device and nothing a CUDA graph cannot hold, and 2.5x cheaper than a batched
eigendecomposition for the thousands of tiny per-sample matrices of a batch (which took a
quarter of a certified step). The gradient, through v held fixed, is exact once v has
converged; the few weight matrices get 2^16 power steps, for the nearly equal top singular
values of capped, orthogonally initialised weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lofast.bounds.attention import TIGHT_KAPPA, AttentionSensitivity, centered_rows
from lofast.bounds.attention_spec import AttentionSpec
from lofast.bounds.first_order import first_order_maps
from lofast.bounds.krylov import LinearMap, power_iterate
from lofast.bounds.near_reference import SOFTMAX_NEGLIGIBLE
from lofast.bounds.softmax_terms import (
    FactoredProduct,
    probabilities_from_projections,
    score_factors,
    softmax_first_order_maps,
)
from lofast.bounds.spectral import Guarantee

# Floor under squared norms before the square root (whose gradient is unbounded at 0) and under
# the norms that vectors are divided by (a zero vector stays zero, not NaN).
SQUARED_NORM_FLOOR = 1e-12


# Squarings of the Gram matrix for the norms of weights (a few per block, so cost nothing):
# 2^16 power steps resolve top singular values equal to a relative 1e-4 (closer ones make
# the gradient a matter of choice), so the gradient is that of the exact norm.
WEIGHT_GRAM_SQUARINGS = 16

# Squarings of the Gram matrix for the per-sample norms: 2^10 = 1024 power steps, on Gram
# matrices of at most n x n. 2^6 kept the width-128 default's per-sample attention norms
# within 0.8 % of the exact ones (250 bundled images), but the centred value norms (closer top
# singular values) need more for their gradient to match finite differences.
GRAM_SQUARINGS = 10


def top_singular_value(M: Tensor) -> Tensor:
    """||M|| for a few weight matrices (..., m, k) in M's dtype, differentiable. Returns (...).

    ``top_singular_value_estimate`` with 2^16 power steps instead of an eigendecomposition:
    a solver call waits for the device (PyTorch documents ``eigvalsh`` as synchronising) and
    cannot be captured in a CUDA graph (cuSOLVER's Jacobi solver fails inside one)."""
    return top_singular_value_estimate(M, WEIGHT_GRAM_SQUARINGS)


def top_singular_value_estimate(M: Tensor, squarings: int = GRAM_SQUARINGS) -> Tensor:
    """An estimate of ||M|| from below for many small matrices (..., m, k), in M's dtype,
    differentiable. Returns (...).

    G^(2^s), for the smaller Gram matrix G and s = ``squarings``, is nearly rank one, and its
    column with the largest diagonal entry, normalised, is close to G's top eigenvector: call it
    v. ||M|| is taken as ||M v|| (||v^T M|| for wide M), which is never above it."""
    wide = M.shape[-2] < M.shape[-1]
    with torch.no_grad():
        gram = M @ M.mT if wide else M.mT @ M
        for step in range(squarings):
            if step % 2 == 0:
                # divided by its trace every second squaring: the top eigenvalue of an r x r
                # Gram matrix then stays in [r^-4, 1], far inside float32's range (and bf16's)
                trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1)
                gram = gram / trace.clamp_min(torch.finfo(M.dtype).tiny)[..., None, None]
            gram = gram @ gram
        column = gram.diagonal(dim1=-2, dim2=-1).argmax(-1)  # (...)
        v = torch.take_along_dim(gram, column[..., None, None], dim=-1)  # (..., r, 1)
        v = v / torch.linalg.vector_norm(v, dim=-2, keepdim=True).clamp_min(SQUARED_NORM_FLOOR)
    return torch.linalg.vector_norm(v.mT @ M if wide else M @ v, dim=(-2, -1))


def column_space_factors(*weights: Tensor) -> Tensor:
    """R (m, ..., k, k) for m thin weights W_i (..., d, k) of one shape, k <= d: W_i = Q_i R_i
    (reduced QR, orthonormal columns Q_i), all in one batched factorisation, differentiable.
    Q_i preserves norms, so ||Y W_i^T|| = ||Y R_i^T|| and ||W_i W_j^T|| = ||R_i R_j^T|| for
    every Y: products with R_i are d/k times cheaper than with W_i."""
    return torch.linalg.qr(torch.stack(weights)).R


@dataclass(frozen=True)
class WeightFactors:
    """The weights-only part of one block's estimate, differentiable: the (h, dh, dh) factors R
    of the column spaces of Wq_l, Wk_l, Wv_l and Wo_l^T (``column_space_factors``) and the
    estimates of ||A_l|| and ||B_l|| (h,) from them; for L blocks stacked, each with a leading
    dimension L."""

    query: Tensor
    key: Tensor
    value: Tensor
    output: Tensor
    score_weight_norm: Tensor
    value_weight_norm: Tensor


def stacked_weight_factors(blocks: Sequence[AttentionSpec], dtype: torch.dtype) -> WeightFactors:
    """``WeightFactors`` of blocks whose weights have one shape, stacked (L, ...), in ``dtype``:
    one QR and one norm estimate for all of them."""
    r = column_space_factors(*(t.to(dtype) for w in blocks for t in (
        w.query, w.key, w.value, w.output.mT)))
    r_query, r_key, r_value, r_output = r.unflatten(0, (len(blocks), 4)).unbind(1)
    norms = top_singular_value(torch.stack([r_query @ r_key.mT, r_value @ r_output.mT],
                                           dim=1))  # ||A_l||, ||B_l||: (L, 2, h)
    return WeightFactors(r_query, r_key, r_value, r_output, norms[:, 0], norms[:, 1])


def _groups(items: Sequence, key) -> list[list[int]]:
    """The indices of ``items``, grouped by ``key(item)`` in order of first appearance."""
    groups: dict = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    return list(groups.values())


def attention_sensitivity_estimate(X: Tensor, w: AttentionSpec, *, kappa: float = TIGHT_KAPPA,
                                   start: Tensor | None = None, iterations: int = 2,
                                   softmax_jacobian: bool = False,
                                   generator: torch.Generator | None = None,
                                   ) -> tuple[AttentionSensitivity, Tensor]:
    """``attention_sensitivity_estimates`` of one block at tokens X (B, n, d): its sensitivity
    and final vectors."""
    return attention_sensitivity_estimates(
        [X], [w], starts=[start], kappa=kappa, iterations=iterations,
        softmax_jacobian=softmax_jacobian, generator=generator)[0]


def attention_sensitivity_estimates(tokens: Sequence[Tensor], blocks: Sequence[AttentionSpec], *,
                                    starts: Sequence[Tensor | None] | None = None,
                                    kappa: float = TIGHT_KAPPA, iterations: int = 2,
                                    softmax_jacobian: bool = False,
                                    generator: torch.Generator | None = None,
                                    stack: bool | None = None,
                                    ) -> list[tuple[AttentionSensitivity, Tensor]]:
    """The quantities of the certifier's default bound ("lofast": zeta and the relaxed score term
    xi_l = ||A_l X^T|| + ||X A_l||) of every block at its tokens X (B, n, d), in X's dtype, with
    gradients with respect to X and the weights; with ``softmax_jacobian`` also zeta_s = ||D_X||
    of the second-order refinement, as the certifier takes it: the smaller of a cheap bound and,
    unless that is negligible next to zeta in every sample, power steps of its own.

    With ``stack`` (default: off the CPU) blocks of one shape are estimated together, stacked
    (L, B, ...): every step is one product for all of them, so a training step on an
    accelerator, which waits for kernel launches, launches those of one block; each block's
    figures are those it would get alone (the power steps of the refinement, taken for the
    group where some block needs them, are kept only by the blocks that do). A CPU waits on no
    launch, and there the products of small matrices and the elementwise steps ran at half the
    speed over six blocks' tensors at once: stacked, the default's certified step took 1.7x as
    long (two EPYC threads, batch 250).

    starts: per block, (B, V, n, d) initial vectors of the power iterations, V = 2 with the
    refinement and 1 without (e.g. the previous batch's; random when None or of another shape).
    Returns per block the sensitivity, marked ESTIMATE, and the final vectors (B, V, n, d),
    detached, to start the next call from.
    """
    starts = list(starts) if starts is not None else [None] * len(blocks)
    if stack is None:
        stack = not tokens or tokens[0].device.type != "cpu"
    results: list = [None] * len(blocks)
    for indices in _groups(range(len(blocks)), lambda i: i if not stack else (
            tokens[i].shape, blocks[i].query.shape, blocks[i].value.shape, blocks[i].scale,
            blocks[i].residual, blocks[i].position_bias is None)):
        X = torch.stack([tokens[i] for i in indices])  # (L, B, n, d)
        shape = (X.shape[1], 2 if softmax_jacobian else 1, *X.shape[2:])
        start = torch.stack([_start(starts[i], shape, X, generator) for i in indices])
        group = _estimate_stacked(X, [blocks[i] for i in indices], start, kappa, iterations,
                                  softmax_jacobian)
        for i, result in zip(indices, group):
            results[i] = result
    return results


def _start(start: Tensor | None, shape: tuple[int, ...], X: Tensor,
           generator: torch.Generator | None) -> Tensor:
    """The given start vectors, or random ones where none of ``shape`` are given, in X's dtype."""
    if start is None or start.shape != shape:
        start = torch.randn(shape, generator=generator, dtype=torch.float32,
                            device=generator.device if generator is not None else X.device)
    return start.to(X)


def _estimate_stacked(X: Tensor, blocks: Sequence[AttentionSpec], start: Tensor, kappa: float,
                      iterations: int, softmax_jacobian: bool,
                      ) -> list[tuple[AttentionSensitivity, Tensor]]:
    """``attention_sensitivity_estimates`` of L blocks of one shape at their tokens X
    (L, B, n, d), from start (L, B, V, n, d)."""
    blocks = list(blocks)
    query, key, value, output = (torch.stack([getattr(w, name) for w in blocks]).to(X.dtype)
                                 for name in ("query", "key", "value", "output"))  # (L, h, ...)
    scale, residual = blocks[0].scale, blocks[0].residual
    bias = (None if blocks[0].position_bias is None
            else torch.stack([w.position_bias for w in blocks])[:, None])  # (L, 1, h, n, n)
    x_query, x_key, x_value = (torch.einsum("lbnd,lhde->lbhne", X, weight)
                               for weight in (query, key, value))  # (L, B, h, n, dh)
    probs = probabilities_from_projections(x_query, x_key, scale, bias)  # (L, B, h, n, n)

    def estimated_norm(v: Tensor, apply: LinearMap, adjoint: LinearMap) -> tuple[Tensor, Tensor]:
        """||apply|| (L, B) after power steps from v (L, B, n, d), and the final vectors."""
        v = v.flatten(2)
        v = v / torch.linalg.vector_norm(v, dim=-1, keepdim=True).clamp_min(SQUARED_NORM_FLOOR)
        with torch.no_grad():  # the power steps on (L B, n d): the blocks' samples side by side
            v = power_iterate(lambda u: adjoint(apply(u.view(X.shape))).flatten(2).flatten(0, 1),
                              v.flatten(0, 1), iterations).view(X.shape)
        return torch.linalg.vector_norm(apply(v), dim=(-2, -1)), v

    zeta, zeta_vector = estimated_norm(start[:, :, 0],
                                       *first_order_maps(probs, value, output, residual))
    vectors = [zeta_vector]
    # ||X A_l^T|| = ||(X Wk_l) Wq_l^T||, ||X A_l|| = ||(X Wq_l) Wk_l^T||, ||X B_l|| = ||(X Wv_l) Wo_l||
    # with each right factor replaced by the (dh, dh) factor of its column space (Wq_l = Q_q R_q,
    # and Wk_l, Wv_l, Wo_l^T alike): the per-sample Gram matrices come from (n, dh) products
    # instead of (n, d) ones
    factors = stacked_weight_factors(blocks, X.dtype)
    x_score_t = x_key @ factors.query.mT[:, None]  # X A_l^T up to an isometry on the right
    x_score = x_query @ factors.key.mT[:, None]  # X A_l, likewise
    x_value_factor = x_value @ factors.output.mT[:, None]  # X B_l, likewise
    # with C = I - 1 1^T / n the centred ones of the certifier (same isometries); the five
    # (L, B, h, n, dh) families in one batched estimate, one set of kernel launches
    (x_score_norm, score_t_norm, centered_score_t, value_norm,
     centered_value_norm) = top_singular_value_estimate(torch.stack([
         x_score, x_score_t, centered_rows(x_score_t), x_value_factor,
         centered_rows(x_value_factor)])).unbind(0)  # each (L, B, h)
    score = score_t_norm + x_score_norm  # ||X A_l^T|| + ||X A_l||
    softmax = None
    if softmax_jacobian:
        # as in the certifier: the cheap bound sum_l ||J_l|| m_l ||X B_l|| / s on ||D_X||, and
        # on the CPU the power steps only for the blocks where it is not negligible next to
        # zeta (in some sample); an accelerator always takes them, since asking would stall
        # it, and so does a compiled step (asking would break its graph)
        softmax = (score * value_norm).sum(dim=-1) / (2.0 * scale)  # (L, B)
        wanted = None  # every block
        if X.device.type == "cpu" and not torch.compiler.is_compiling():
            wanted = (softmax > SOFTMAX_NEGLIGIBLE * zeta).any(dim=1)  # (L,)
        if wanted is None or bool(wanted.any()):
            norm, softmax_vector = estimated_norm(start[:, :, 1], *softmax_first_order_maps(
                probs, *score_factors(x_query, x_key, query, key),
                FactoredProduct(output.mT, x_value), scale))  # X B_l = (X Wv_l) Wo_l
            refined = torch.minimum(softmax, norm)
            if wanted is not None:
                refined = torch.where(wanted[:, None], refined, softmax)
                softmax_vector = torch.where(wanted[:, None, None, None], softmax_vector,
                                             start[:, :, 1])
            softmax = refined
        else:
            softmax_vector = start[:, :, 1]
        vectors.append(softmax_vector)
    row_score = None if softmax is None else (
        centered_score_t + torch.linalg.vector_norm(x_score, dim=-1).amax(dim=-1))
    centered_score = torch.minimum(score, centered_score_t + x_score_norm)
    final = torch.stack(vectors, dim=2).detach()  # (L, B, V, n, d)
    return [(AttentionSensitivity(
        zeta=zeta[j], score_sensitivity=score[j], value_norm=value_norm[j],
        score_weight_norm=factors.score_weight_norm[j],
        value_weight_norm=factors.value_weight_norm[j],
        scale=float(scale), kappa=float(kappa), guarantee=Guarantee.ESTIMATE,
        softmax_first_order=None if softmax is None else softmax[j],
        centered_value_norm=centered_value_norm[j],
        row_score_sensitivity=None if row_score is None else row_score[j],
        centered_score_sensitivity=centered_score[j]), final[j]) for j in range(len(blocks))]
