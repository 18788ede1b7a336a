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
    estimates of ||A_l|| and ||B_l|| (h,) from them."""

    query: Tensor
    key: Tensor
    value: Tensor
    output: Tensor
    score_weight_norm: Tensor
    value_weight_norm: Tensor


def weight_factors(blocks: Sequence[AttentionSpec], dtype: torch.dtype) -> list[WeightFactors]:
    """``WeightFactors`` of every block in ``dtype``, computed for all blocks of one shape
    together (one QR, one norm estimate): a training step on a GPU waits for kernel launches,
    and six blocks then cost the launches of one."""
    groups: dict[tuple[tuple[int, ...], ...], list[int]] = {}
    for i, w in enumerate(blocks):
        groups.setdefault((tuple(w.query.shape), tuple(w.value.shape)), []).append(i)
    result: list[WeightFactors | None] = [None] * len(blocks)
    for indices in groups.values():
        r = column_space_factors(*(t.to(dtype) for i in indices for t in (
            blocks[i].query, blocks[i].key, blocks[i].value, blocks[i].output.mT)))
        r_query, r_key, r_value, r_output = r.unflatten(0, (len(indices), 4)).unbind(1)
        norms = top_singular_value(torch.stack([r_query @ r_key.mT, r_value @ r_output.mT],
                                               dim=1))  # ||A_l||, ||B_l||: (g, 2, h)
        for j, i in enumerate(indices):
            result[i] = WeightFactors(r_query[j], r_key[j], r_value[j], r_output[j],
                                      norms[j, 0], norms[j, 1])
    return result


def attention_sensitivity_estimate(X: Tensor, w: AttentionSpec, *, kappa: float = TIGHT_KAPPA,
                                   start: Tensor | None = None, iterations: int = 2,
                                   softmax_jacobian: bool = False,
                                   generator: torch.Generator | None = None,
                                   factors: WeightFactors | None = None,
                                   ) -> tuple[AttentionSensitivity, Tensor]:
    """The quantities of the certifier's default bound ("lofast": zeta and the relaxed score term
    xi_l = ||A_l X^T|| + ||X A_l||) at tokens X (B, n, d), in X's dtype, with gradients with
    respect to X and the weights; with ``softmax_jacobian`` also zeta_s = ||D_X|| of the
    second-order refinement, as the certifier takes it: the smaller of a cheap bound and, unless
    that is negligible next to zeta in every sample, power steps of its own.

    start: (B, V, n, d) initial vectors of the power iterations, V = 2 with the refinement and 1
    without (e.g. the previous batch's; random when None or of another shape). Returns the
    sensitivity, marked ESTIMATE, and the final vectors (B, V, n, d), detached, to start the
    next call from. factors: the block's ``weight_factors`` in X's dtype, if made already.
    """
    query, key, value, output = (t.to(X.dtype) for t in (w.query, w.key, w.value, w.output))
    x_query, x_key, x_value = (torch.einsum("bnd,hde->bhne", X, weight)
                               for weight in (query, key, value))  # (B, h, n, dh)
    probs = probabilities_from_projections(x_query, x_key, w.scale,
                                           w.position_bias)  # (B, h, n, n)

    shape = (X.shape[0], 2 if softmax_jacobian else 1, *X.shape[1:])
    if start is None or start.shape != shape:
        start = torch.randn(shape, generator=generator, dtype=torch.float32,
                            device=generator.device if generator is not None else X.device)
    start = start.to(X)

    def estimated_norm(v: Tensor, apply: LinearMap, adjoint: LinearMap) -> tuple[Tensor, Tensor]:
        """||apply|| (B,) after power steps from v (B, n, d), and the final vectors."""
        v = v.flatten(1)
        v = v / torch.linalg.vector_norm(v, dim=1, keepdim=True).clamp_min(SQUARED_NORM_FLOOR)
        with torch.no_grad():
            v = power_iterate(lambda u: adjoint(apply(u.view(X.shape))).flatten(1),
                              v, iterations).view(X.shape)
        return torch.linalg.vector_norm(apply(v), dim=(1, 2)), v

    zeta, zeta_vector = estimated_norm(start[:, 0],
                                       *first_order_maps(probs, value, output, w.residual))
    vectors = [zeta_vector]
    # ||X A_l^T|| = ||(X Wk_l) Wq_l^T||, ||X A_l|| = ||(X Wq_l) Wk_l^T||, ||X B_l|| = ||(X Wv_l) Wo_l||
    # with each right factor replaced by the (dh, dh) factor of its column space (Wq_l = Q_q R_q,
    # and Wk_l, Wv_l, Wo_l^T alike): the per-sample Gram matrices come from (n, dh) products
    # instead of (n, d) ones
    if factors is None:
        factors = weight_factors([w], X.dtype)[0]
    x_score_t = x_key @ factors.query.mT  # X A_l^T up to an isometry on the right (row norms kept)
    x_score = x_query @ factors.key.mT  # X A_l, likewise
    x_value_factor = x_value @ factors.output.mT  # X B_l, likewise
    # with C = I - 1 1^T / n the centred ones of the certifier (same isometries); the five
    # (B, h, n, dh) families in one batched estimate, one set of kernel launches
    (x_score_norm, score_t_norm, centered_score_t, value_norm,
     centered_value_norm) = top_singular_value_estimate(torch.stack([
         x_score, x_score_t, centered_rows(x_score_t), x_value_factor,
         centered_rows(x_value_factor)])).unbind(0)  # each (B, h)
    score = score_t_norm + x_score_norm  # ||X A_l^T|| + ||X A_l||
    softmax = None
    if softmax_jacobian:
        # as in the certifier: the cheap bound sum_l ||J_l|| m_l ||X B_l|| / s on ||D_X||, and
        # on the CPU the power steps only where it is not negligible next to zeta (in some
        # sample); an accelerator always takes them, since asking would stall it, and so does
        # a compiled step (asking would break its graph)
        softmax = (score * value_norm).sum(dim=1) / (2.0 * w.scale)
        if (X.device.type != "cpu" or torch.compiler.is_compiling()
                or bool((softmax > SOFTMAX_NEGLIGIBLE * zeta).any())):
            norm, softmax_vector = estimated_norm(start[:, 1], *softmax_first_order_maps(
                probs, *score_factors(x_query, x_key, query, key),
                FactoredProduct(output.mT, x_value), w.scale))  # X B_l = (X Wv_l) Wo_l
            softmax = torch.minimum(softmax, norm)
        else:
            softmax_vector = start[:, 1]
        vectors.append(softmax_vector)
    sensitivity = AttentionSensitivity(
        zeta=zeta, score_sensitivity=score, value_norm=value_norm,
        score_weight_norm=factors.score_weight_norm,
        value_weight_norm=factors.value_weight_norm,
        scale=float(w.scale),
        kappa=float(kappa), guarantee=Guarantee.ESTIMATE, softmax_first_order=softmax,
        centered_value_norm=centered_value_norm,
        row_score_sensitivity=None if softmax is None else (
            centered_score_t + torch.linalg.vector_norm(x_score, dim=-1).amax(dim=-1)),
        centered_score_sensitivity=torch.minimum(score, centered_score_t + x_score_norm))
    return sensitivity, torch.stack(vectors, dim=1).detach()

