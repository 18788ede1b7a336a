"""Deterministic norm bounds for operators near a fixed reference, by deflation.

Setting: linear maps J_b on R^N (one per sample, given matrix-free) that lie near one fixed
reference operator T_R: ||J_b - T_R|| <= delta_b. The reference's top right singular subspace is
found once, and the rest of T_R is bounded once with a Cholesky proof; per sample, k products
with J_b and k with J_b^T then bound ||J_b|| to within a term of second order in delta_b, where
the triangle inequality ||J_b|| <= ||T_R|| + delta_b is off by first order.

Theorem (ours; a Schur-complement form of Rayleigh-Ritz). Let V (N, k) have range(V) = R,
Gram matrix V^T V with ||V^T V - I|| <= eta < 1, and c >= sup ||J w||^2 over unit w orthogonal
to R. With M = J^T J, K = (J V)^T (J V) (k x k), C = P M V (P the orthogonal projector onto the
complement of R) and S = C^T C (k x k): for every t > c with

    (t - c) (t (1 - eta) I - K) - S  positive semidefinite,                            (*)

||J||^2 <= t. Proof: write a unit x = V a + w with w orthogonal to R, so
1 = a^T V^T V a + ||w||^2 >= (1 - eta) ||a||^2 + ||w||^2. Then
x^T M x = a^T K a + 2 w^T C a + ||J w||^2 <= a^T K a + 2 ||C a|| ||w|| + c ||w||^2, and
2 ||C a|| ||w|| <= ||C a||^2 / (t - c) + (t - c) ||w||^2, so
x^T M x <= a^T (K + S / (t - c)) a + t ||w||^2 <= t ((1 - eta) ||a||^2 + ||w||^2) <= t by (*).
The smallest such t is the top eigenvalue of [[K, S^(1/2)], [S^(1/2), c I]]. If R holds T_R's
top right singular vectors and J = T_R + E, then C = P (M - T_R^T T_R) V up to the accuracy of
R, of order ||E||, and t exceeds the Rayleigh-Ritz value lambda_max(K) <= ||J||^2 by about
||C||^2 / (||J||^2 - c): second order. For the complement, every unit w orthogonal to R has
||J w|| <= ||T_R w|| + ||E|| <= c_R + delta with c_R^2 >= lambda_max(T_R^T T_R - g V V^T)
for any g >= 0 (V^T w = 0), which ``deflate_gram`` proves once by Cholesky.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lofast.bounds.krylov import LanczosRun, LinearMap, fixed_unit_vector, lanczos_ritz
from lofast.bounds.spectral import SpectralMethod, operator_norm
from lofast.bounds.verified import (
    GRAM_BLOCKS,
    SUBNORMAL,
    UNIT_ROUNDOFF,
    gamma,
    lower_gram,
    smallest_eigenvalue_exceeds,
    verified_norm_from_negated_gram,
)

# Candidate subspace sizes k, smallest first: the smallest after whose Ritz value the reference
# spectrum has fallen by DEFLATION_GAP (relative, in singular values) is taken, else the largest.
# The per-sample cost grows with k (products with k vectors, then k x k eigenproblems); the
# bound is tight when the deviation ||J - T_R|| is smaller than the gap between ||T_R|| and the
# complement.
DEFLATION_SIZES = (8, 16, 24, 32)
DEFLATION_GAP = 0.05

# The candidates of a second, larger deflation, for callers to try where the first is not tight
# enough: a reference whose top singular values decay slowly. A residual block whose reference
# attention keeps most tokens apart has a top cluster of about n copies of each top singular
# value of I + B_l (the shipped default's first two blocks: 250 singular values within 5 % of
# the top at 17 tokens), which no deflation of 32 or 128 vectors gets past.
LARGE_DEFLATION_SIZES = tuple(range(64, 513, 32))

# Lanczos steps for the reference's top Ritz pairs of a size-k basis, RITZ_STEPS_PER_VECTOR
# max(k, RITZ_FEWEST_VECTORS) + 20 (fewer left the last vectors of a 24-vector basis loose: one
# sample's bound 5e-4 above its estimate on the live default, against 2e-5 at the 116 steps of
# 32 vectors), and for the estimate of the complement's top eigenvalue.
RITZ_STEPS_PER_VECTOR = 3
RITZ_FEWEST_VECTORS = 32
COMPLEMENT_LANCZOS_STEPS = 150

# Up to this dimension N the top eigenpairs of S and the complement's estimate come from a dense
# symmetric eigensolver (exact, and faster there than Lanczos with full reorthogonalisation:
# one thread, N = 320: 10 ms against 60-100 ms; N = 640: 60 ms), above it from Lanczos.
DENSE_SIZE = 640

# Relative slack of the complement's Cholesky proof: it enters the per-sample bound only through
# c, whose excess over the true complement costs little once ||J||^2 - c is large.
COMPLEMENT_SLACK = 1e-4

# Relative increments of t (over the top eigenvalue of the (2k x 2k) matrix above) tried in turn
# until (*) is verified with every rounding error accounted for.
TRIAL_STEPS = (1e-9, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


@dataclass(frozen=True)
class Deflation:
    """A reference operator's top right singular subspace and a bound on the rest.

    basis: V (N, k) float64, nearly orthonormal columns; orthogonality: eta >= ||V^T V - I||_2;
    complement: a float64 scalar tensor c_R >= sup ||T_R w|| over unit w orthogonal to
    range(V), a deterministic upper bound (in the units of the Gram matrix's square root);
    ritz: (k + 1,) Ritz estimates of T_R's top squared singular values (information only).
    """

    basis: Tensor
    orthogonality: float
    complement: Tensor
    ritz: Tensor

    @property
    def size(self) -> int:
        return self.basis.shape[1]

    @functools.cached_property
    def basis_frobenius(self) -> float:
        """An upper bound on ||V||_F (its float64 norm, inflated for rounding), once."""
        return float(torch.linalg.vector_norm(self.basis)) * (1.0 + 2.0 ** -40)


def deflate_gram(negated: Tensor, gram_error: float, gram: LinearMap | None = None,
                 sizes: tuple[int, ...] = DEFLATION_SIZES, tokens: int = 1, rest: float = 0.0,
                 overwrite: bool = False,
                 rebuild: Callable[[], Tensor] | None = None) -> Deflation:
    """Deflation of a reference T_R given its Gram matrix explicitly.

    With tokens = n > 1: the deflation of the uniform reference T_U(G) = H G + U G B
    (U = 1 1^T / n, B = sum_l B_l, G n x d), from the Gram matrix of its single-token
    reference T_1(a) = a (H + B) (d x d, given as negated and gram). T_U maps the token-mean
    part 1 a^T of G to 1 T_1(a)^T and the rest (I - U) G to H (I - U) G, and the two images are
    orthogonal; so for a basis W of the single-token problem, V = 1 (x) W (n d x k, W scaled by
    fl(1/sqrt(n))) spans top right singular vectors of T_U, and a unit w orthogonal to range(V)
    has ||T_U w||^2 <= max(c^2, rest^2), with c the single-token complement (proved on W, d x d)
    and rest >= ||H|| (in the units of the Gram matrix). The (n d)-dimensional deflation then
    costs a d x d proof instead of an (n d) x (n d) one.

    negated: (N, N) float64 whose lower triangle (with the diagonal) is that of -S, S symmetric
    with ||S - T_R^T T_R||_2 <= gram_error (the strict upper triangle may hold anything, NaN
    included: it enters no result; negated is not modified unless ``overwrite``, which forms S'
    in its place and saves a copy of the matrix; ``rebuild``, a function that makes negated
    afresh, then lets the proof factor S' in place too). gram: optionally T_R^T T_R as a cheaper
    matrix-free map (1, N) -> (1, N) for the Lanczos estimates (by default products with S;
    above N = DENSE_SIZE only). The basis holds estimates of the top eigenvectors (k: the smallest
    of ``sizes``, ascending, after which the estimated spectrum has fallen by DEFLATION_GAP, else
    the largest; at most N - 1; a dense eigensolver's up to N = DENSE_SIZE, Lanczos's above);
    only tightness depends on their accuracy.

    complement: the square root of a Cholesky-verified upper bound
    (``spectral.verified_norm_from_negated_gram``) on lambda_max(S') with
    S' = T_R^T T_R - g V V^T, g a power of two >= 2 lambda_max(S) (estimated). S' is formed as
    fl(-negated + fl(g fl(V V^T))) in the lower triangle, whose distance to the exact matrix is
    at most gram_error + g gamma_k ||V||_F^2 (the product, Higham eq. 3.5)
    + u (||S||_F + g (1 + gamma_k) ||V||_F^2) (the sum) + N^2 SUBNORMAL (underflow).
    """
    if negated.dim() != 2 or negated.shape[0] != negated.shape[1]:
        raise ValueError(f"expected a square matrix (N, N), got {tuple(negated.shape)}")
    size = negated.shape[0]
    if size < 2:
        raise ValueError("deflation needs a dimension of at least 2")
    device = negated.device
    # S itself only for the dense eigensolver or as the Lanczos map; otherwise its norm alone,
    # without a strided copy of the whole matrix
    explicit = gram is None or size <= DENSE_SIZE
    S = -(torch.tril(negated) + torch.tril(negated, -1).mT) if explicit else None  # symmetric
    s_frobenius = (float(torch.linalg.vector_norm(S)) * (1.0 + gamma(size * size)) if explicit
                   else _symmetric_frobenius_upper(negated))
    if gram is None:
        def gram(q: Tensor) -> Tensor:
            return q @ S
    largest = min(max(sizes), size - 1)
    if size <= DENSE_SIZE:
        values, vectors = torch.linalg.eigh(S)  # ascending
        values, vectors = values.flip(0)[: largest + 1], vectors.flip(1)[:, : largest + 1].mT
    else:
        values, vectors, sizes = _top_ritz_pairs(gram, size, sizes, device)
    top = float(values[0].clamp_min(0.0))
    basis, eta = _orthonormal_basis(values, vectors, sizes, tokens)
    count = basis.shape[1]
    frobenius = float(torch.linalg.vector_norm(basis)) * (1.0 + 2.0 ** -40)
    # a power of two >= 2 top / ||w_j||^2 for W's columns (squared norms about 1 / tokens)
    shift = math.ldexp(1.0, math.frexp(max(2.0 * top * tokens * (1.0 + 1e-6), 2.0 ** -500))[1])
    # lower triangle: -(S - g V V^T), rounded. Either triangle of the computed V V^T holds
    # rounded values of its entries (within the same bound), so a Fortran-ordered negated is
    # added to the product's transpose: both then read in the same memory order. Each row
    # block is one addmm: g is a power of two, so g fl(V V^T) is exact however the product is
    # scaled, and each entry's sum is rounded once

    def deflate(source: Tensor, in_place: bool) -> Tensor:
        deflated = source if in_place else source.clone(memory_format=torch.preserve_format)
        # only the lower triangle, in row blocks of the memory order's own rows: half the work,
        # and the other triangle, often never written (``first_order_negated_gram``), is not
        # touched (a product over untouched pages took 20x its time, 1.15 s at N = 8320)
        fortran = deflated.mT.is_contiguous()
        rows = deflated.mT if fortran else deflated  # its upper (Fortran) or lower triangle
        edges = [size * b // GRAM_BLOCKS for b in range(GRAM_BLOCKS + 1)]
        for start, stop in itertools.pairwise(edges):
            block = rows[start:stop, start:] if fortran else rows[start:stop, :stop]
            block.addmm_(basis[start:stop], (basis[start:] if fortran else basis[:stop]).mT,
                         alpha=shift)
        return deflated

    deflated = deflate(negated, overwrite)
    # the proof factors S' in place when it can be formed again for a retry: from negated if
    # that was kept, else from a rebuilt one
    if not overwrite:
        def again(rows: Tensor) -> Tensor:
            return deflate(negated, False)[None]
    elif rebuild is not None:
        def again(rows: Tensor) -> Tensor:
            return deflate(rebuild(), True)[None]
    else:
        again = None
    error = (gram_error + shift * gamma(count) * frobenius ** 2
             + UNIT_ROUNDOFF * (s_frobenius + shift * (1.0 + gamma(count)) * frobenius ** 2)
             + size * size * SUBNORMAL) * (1.0 + 2.0 ** -30)

    def deflated_gram(q: Tensor) -> Tensor:
        return gram(q) - shift * ((q @ basis) @ basis.mT)

    if size <= DENSE_SIZE:  # S' from its lower triangle, the one the proof reads
        estimate = torch.linalg.eigvalsh(-deflated, UPLO="L")[-1:]
    else:
        estimate = lanczos_ritz(deflated_gram, fixed_unit_vector(size, device)[None],
                                min(COMPLEMENT_LANCZOS_STEPS, size))
    # floored well above the rounding noise of S' (where the complement is nearly null)
    estimate = estimate.clamp_min(2.0 ** -40 * shift)
    try:
        complement = verified_norm_from_negated_gram(
            deflated[None], relative_slack=COMPLEMENT_SLACK,
            gram_error=torch.tensor([error], dtype=torch.float64, device=device),
            estimate=estimate, lower_only=True, rebuild=again)[0]
    except ValueError:  # no proof: a deflation that bounds nothing (every bound is then +inf)
        complement = torch.tensor(math.inf, dtype=torch.float64, device=device)
    if tokens > 1:  # the non-mean part of the complement: H, of norm <= rest
        complement = torch.clamp(complement, min=rest)
        basis = basis.repeat(tokens, 1)  # row i d + j of vec(G): token i, coordinate j
    return Deflation(basis=basis, orthogonality=eta, complement=complement,
                     ritz=values[: count + 1].clone())


def _top_ritz_pairs(gram: LinearMap, size: int, sizes: tuple[int, ...],
                    device: torch.device) -> tuple[Tensor, Tensor, tuple[int, ...]]:
    """Estimates of the top eigenpairs of the PSD map gram on R^size for a deflation of one of
    ``sizes`` (ascending): Ritz values (descending) and unit Ritz vectors (k + 1, size), by
    Lanczos from a fixed start, and the sizes up to k. The run grows size by size, to the
    steps of size k (RITZ_STEPS_PER_VECTOR), and stops at the first k after whose Ritz value
    the spectrum has fallen by DEFLATION_GAP (``_orthonormal_basis``' choice), else at
    the largest: the steps a size-k basis needs, not the largest size's (a reorthogonalised
    step costs in proportion to the steps before it; the live default's first block takes
    k = 320 of up to 512, 980 steps instead of 1,556). Only speed and tightness depend on the
    Ritz pairs, and each is a function of the map alone."""
    candidates = sorted({min(k, size - 1) for k in sizes})

    def steps(k: int) -> int:
        return min(size, RITZ_STEPS_PER_VECTOR * max(k, RITZ_FEWEST_VECTORS) + 20)

    run = LanczosRun(gram, fixed_unit_vector(size, device)[None], steps(candidates[-1]))
    for k in candidates:
        run.advance(steps(k))
        if k == candidates[-1] or _past_the_gap(run.ritz_values()[0], k):
            break
    values, vectors = run.ritz_pairs(min(k + 1, run.steps))
    return values[0], vectors[0], tuple(c for c in candidates if c <= k)


def _past_the_gap(values: Tensor, k: int) -> bool:
    """Whether the estimated spectrum (values descending) has fallen by DEFLATION_GAP (relative,
    in singular values) after its k-th value: a size-k deflation then leaves a complement
    clear of the top."""
    return len(values) > k and float(values[k]) <= (1.0 - DEFLATION_GAP) ** 2 * float(
        values[0].clamp_min(0.0))


def _orthonormal_basis(values: Tensor, vectors: Tensor, sizes: tuple[int, ...],
                       tokens: int = 1) -> tuple[Tensor, float]:
    """The deflation basis V (N, k) from estimated top eigenpairs (values descending, vectors
    (m, N)): k the smallest of ``sizes`` after which the values have fallen by DEFLATION_GAP
    (else the largest possible), the vectors orthonormalised by QR (scaled by fl(1/sqrt(n)) for
    the single-token basis W of V = 1 (x) W, ``deflate_gram``'s tokens), and
    eta >= ||V^T V - I||_2 (raises ValueError above 1e-6)."""
    size = vectors.shape[1]
    largest = min(max(sizes), size - 1)
    chosen = next((candidate for candidate in sizes if candidate < min(largest, len(values) - 1)
                   and _past_the_gap(values, candidate)), largest)
    count = min(chosen, len(values) - 1, size - 1)
    basis = torch.linalg.qr(vectors[:count].mT).Q.contiguous()  # (N, k)
    if tokens > 1:  # W: the single-token basis scaled so that V = 1 (x) W is nearly orthonormal
        basis = basis * (1.0 / math.sqrt(tokens))
    frobenius = float(torch.linalg.vector_norm(basis)) * (1.0 + 2.0 ** -40)
    # ||V^T V - I||_2 <= ||fl(V^T V) - I||_F + gamma_N ||V||_F^2 (rounding of the product); for
    # V = 1 (x) W, V^T V = n W^T W exactly, and fl(n fl(W^T W)) adds u n ||W^T W||_F
    eye = torch.eye(count, dtype=torch.float64, device=basis.device)
    product_k = basis.mT @ basis
    eta = (float(torch.linalg.vector_norm(tokens * product_k - eye)) * (1.0 + 2.0 ** -40)
           + tokens * gamma(size + 2) * frobenius ** 2 + count * count * UNIT_ROUNDOFF
           + (tokens * UNIT_ROUNDOFF * float(torch.linalg.vector_norm(product_k))
              * (1.0 + 2.0 ** -40) if tokens > 1 else 0.0))
    if not eta < 1e-6:
        raise ValueError(f"deflation basis is not orthonormal (||V^T V - I|| <= {eta:.3g})")
    return basis, eta


def probabilistic_deflation(gram: LinearMap, apply: LinearMap, adjoint: LinearMap,
                            shape: tuple[int, int], method: SpectralMethod,
                            generator: torch.Generator | None, device: torch.device,
                            sizes: tuple[int, ...] = DEFLATION_SIZES) -> Deflation:
    """``deflate_gram``'s deflation of a reference T_R with the probabilistic guarantee and no
    explicit matrix: the basis V from Lanczos Ritz vectors of gram = T_R^T T_R (matrix-free,
    (1, N) -> (1, N)), the complement from randomized Lanczos (``spectral.operator_norm`` with
    a Lanczos ``method``) on T_R (I - V V^T), given as apply / adjoint on (1, *shape) with
    N = prod(shape) (row-major vectors, V's rows).

    Claim: with probability >= 1 - method.failure_probability over the start drawn from
    ``generator``, complement >= sup ||T_R w|| over unit w orthogonal to range(V). For such w,
    (I - V V^T) w = w exactly, whatever V, so ||T_R w|| <= ||T_R (I - V V^T)||, which the
    Lanczos bound covers. Forming (I - V V^T) G rounds by at most gamma_(N+k+1) (1 + ||V||_F^2)
    ||G||, below 2e-9 ||G|| for N <= 33,000 and k <= 512: inside the bound's rounding margin
    (``spectral.ROUNDING_MARGIN``), as the products with T_R are."""
    size = math.prod(shape)
    values, vectors, sizes = _top_ritz_pairs(gram, size, sizes, device)
    basis, eta = _orthonormal_basis(values, vectors, sizes)

    def project(G: Tensor) -> Tensor:  # (I - V V^T) G on (B, *shape)
        vec = G.reshape(G.shape[0], size)
        return (vec - (vec @ basis) @ basis.mT).reshape(G.shape)

    complement = operator_norm(lambda G: apply(project(G)), lambda Y: project(adjoint(Y)),
                               shape, 1, method, device=device, generator=generator)[0]
    return Deflation(basis=basis, orthogonality=eta, complement=complement,
                     ritz=values[: basis.shape[1] + 1].clone())


def deflated_norm_bound(Y: Tensor, Z: Tensor, deflation: Deflation, deviation: Tensor,
                        norm_bound: Tensor, rounding: Tensor) -> tuple[Tensor, Tensor]:
    """Deterministic upper bounds on ||J_b|| (B,) by the theorem of the module docstring, and
    the Rayleigh-Ritz estimates sqrt(lambda_max(K)) (B,) (at most ||J_b|| up to rounding).

    Y: (B, k, N) the computed rows fl(J_b v_j) for the columns v_j of ``deflation.basis``;
    Z: (B, k, N) the computed rows fl(J_b^T y_j) of those rows. deviation (B,):
    delta_b >= ||J_b - T_R|| for the deflated reference T_R (in the units of
    ``deflation.complement``); norm_bound (B,): nu_b >= ||J_b||; rounding (B,): r_b with
    ||fl(J_b x) - J_b x|| <= r_b ||x|| and ||fl(J_b^T x) - J_b^T x|| <= r_b ||x|| for the
    products that formed Y and Z. A sample whose condition (*) cannot be verified gets +inf.

    Rounding: K and S are within e_K and e_S of the exact ones (``deflated_grams``).
    Forming the matrix of (*) adds at most e_F = gamma_5 ((t - c)(t + ||K||_F) + ||S||_F), so
    (*) holds for the exact K, S where the computed matrix A has lambda_min(A) >
    (t - c) e_K + e_S + e_F (Weyl), which a Cholesky factorisation proves
    (``verified.smallest_eigenvalue_exceeds``, rounding included).
    """
    V = deflation.basis
    batch, count, size = Y.shape
    if V.shape != (size, count) or Z.shape != Y.shape:
        raise ValueError(f"products {tuple(Y.shape)}, {tuple(Z.shape)} do not match the "
                         f"deflation basis {tuple(V.shape)}")
    eta = deflation.orthogonality
    inflate = 1.0 + 2.0 ** -40
    K, S, e_k, e_s = deflated_grams(Y, Z, rounding * deflation.basis_frobenius, rounding,
                                    norm_bound, eta)
    k_f = torch.linalg.vector_norm(K, dim=(1, 2)) * inflate
    s_f = torch.linalg.vector_norm(S, dim=(1, 2)) * inflate
    c = ((deflation.complement + deviation) * inflate).square() * inflate  # >= c exactly
    finite = (torch.isfinite(K).flatten(1).all(dim=1) & torch.isfinite(S).flatten(1).all(dim=1)
              & torch.isfinite(e_k) & torch.isfinite(e_s) & torch.isfinite(c))
    K, S = (torch.where(finite[:, None, None], t, 0.0) for t in (K, S))  # eigensolvers need it
    c = torch.where(finite, c, 0.0)
    values, vectors = torch.linalg.eigh(K)
    top = values[:, -1]
    ritz = torch.where(finite, top.clamp_min(0.0).sqrt(), math.nan)
    eye = torch.eye(count, dtype=torch.float64, device=Y.device).expand(batch, -1, -1)
    # an estimate of the smallest t of (*): second-order perturbation where it is reliable,
    # else the fixed point of ``_joint_top``
    smallest, settled = _perturbed_top(values, vectors, S, c)
    if not bool(settled.all()):
        rest = ~settled
        smallest = smallest.masked_scatter(rest, _joint_top(K[rest], S[rest], c[rest], top[rest],
                                                            s_f[rest]))
    smallest = torch.maximum(smallest, c)
    upper = torch.full((batch,), math.inf, dtype=torch.float64, device=Y.device)
    todo = finite & torch.isfinite(smallest)
    # lambda_min of (*)'s matrix must exceed the rounding terms below, and grows with t at a
    # rate of at least about (t - c) + (t - u^T K u) >= (t - c) + (t - top) (u its null vector
    # at t*): the trials start twice the rounding terms over that rate above the estimate (on
    # the live default 5e-9 relative, where a bare 1e-9 step always failed)
    gap = smallest - c
    floor = gap * e_k + e_s + gamma(5) * (gap * (smallest + k_f) + s_f)
    rate = (gap + (smallest - top).clamp_min(0.0)).clamp_min(2.0 ** -900)
    offset = torch.where(todo & (gap > 0), 2.0 * floor / rate, 0.0)
    for step in TRIAL_STEPS:
        if not bool(todo.any()):
            break
        t = smallest * (1.0 + step) + offset + 2.0 ** -900
        gap = t - c  # > 0 in floating point means t > c exactly
        A = gap[:, None, None] * (t[:, None, None] * (1.0 - eta) * eye - K) - S
        e_f = gamma(5) * (gap * (t + k_f) + s_f)
        needed = (gap * e_k + e_s + e_f) * inflate
        ok = todo & (gap > 0) & smallest_eigenvalue_exceeds(A, torch.where(todo, needed, 0.0))
        upper = torch.where(ok, t.sqrt() * inflate, upper)
        todo = todo & ~ok
    return upper, ritz


def deflated_grams(Y: Tensor, Z: Tensor, y_error: Tensor, z_rounding: Tensor,
                   norm_bound: Tensor, eta: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """K, S (B, k, k) of ``deflated_norm_bound``'s condition (*) from the computed rows Y, Z
    (B, k, N), and e_K, e_S (B,) with ||K - V^T M V||_F <= e_K and ||S - C^T C||_F <= e_S for
    the exact M = J^T J and C = P M V, given y_error (B,) e_Y >= ||Y - (J V)^T||_F and
    z_rounding (B,) r_Z with ||Z - Y J||_F <= r_Z ||Y||_F (Z is J^T applied to Y's rows, up to
    rounding), so that ||Z - (M V)^T||_F <= e_Z = r_Z ||Y||_F + nu e_Y; nu = norm_bound
    >= ||J||, eta >= ||V^T V - I|| for the basis V.

    Products with an error matrix are bounded with the other factor's spectral norm
    (||A D||_F <= ||A|| ||D||_F): ||J V|| <= nu (1 + eta)^(1/2), and the exact K = V^T M V and
    the exact rows M V both have norm at most nu^2 (1 + eta) =: mu. K = fl(Y Y^T) is within
    e_K = gamma_N ||Y||_F^2 + e_Y (2 (nu (1 + eta)^(1/2) + e_Y) + e_Y) of the exact K.
    S is not formed from C: with P = I - V (V^T V)^-1 V^T,
    C^T C = (M V)^T P (M V) = (M V)^T (M V) - K (V^T V)^-1 K, so S = fl(fl(Z Z^T) - fl(K K)),
    which saves the (k x k)(k x N) product that C needs. S is small, and so are its errors:
    it is within e_S = gamma_N ||Z||_F^2 + e_Z (2 (mu + e_Z) + e_Z) (the Gram of Z)
    + gamma_k ||K||_F^2 + e_K (2 (mu + e_K) + e_K) (the square of K) + mu^2 eta / (1 - eta)
    (||(V^T V)^-1 - I|| <= eta / (1 - eta)) + 2 u ||S||_F (the difference) of the exact C^T C.
    The squared Frobenius norms of Y and Z are the traces of their Grams, each diagonal entry
    within gamma_N of its exact value. Both Grams are symmetric, from their lower triangles."""
    count, size = Y.shape[1], Y.shape[2]
    inflate = 1.0 + 2.0 ** -40
    K = _symmetric(lower_gram(Y))  # each one float64 inner product per entry, as Y @ Y.mT
    gram_z = _symmetric(lower_gram(Z))
    traces = 1.0 + 2.0 * gamma(size + count)  # ||Y||_F^2 <= tr fl(Y Y^T) (1 + gamma_N + ...)
    y_f = (K.diagonal(dim1=1, dim2=2).sum(dim=1).clamp_min(0.0) * traces).sqrt() * inflate
    z_f = (gram_z.diagonal(dim1=1, dim2=2).sum(dim=1).clamp_min(0.0) * traces).sqrt() * inflate
    e_y = y_error
    e_z = (z_rounding * y_f + norm_bound * e_y) * inflate
    e_k = (gamma(size) * y_f.square()
           + e_y * (2.0 * (norm_bound * math.sqrt(1.0 + eta) * inflate + e_y) + e_y))
    k_f = torch.linalg.vector_norm(K, dim=(1, 2)) * inflate
    mu = norm_bound.square() * (1.0 + eta) * inflate  # >= ||K|| and ||M V|| exactly
    S = gram_z - K @ K
    s_f = torch.linalg.vector_norm(S, dim=(1, 2)) * inflate
    e_s = (gamma(size) * z_f.square() + e_z * (2.0 * (mu + e_z) + e_z)
           + gamma(count) * k_f.square() + e_k * (2.0 * (mu + e_k) + e_k)
           + mu.square() * (eta / (1.0 - eta)) + 2.0 * UNIT_ROUNDOFF * s_f) * inflate
    return K, S, e_k * inflate, e_s


# _perturbed_top takes its estimate where the second-order term is at most this share of the
# first: the next term is then smaller by about as much again.
PERTURBATION_SHARE = 0.05


def _perturbed_top(values: Tensor, vectors: Tensor, S: Tensor,
                   c: Tensor) -> tuple[Tensor, Tensor]:
    """Estimates (B,) of t*, the smallest t of condition (*) (eta = 0), and where they are
    reliable (B,) bool, from the eigenpairs of K (values ascending (B, k), vectors (B, k, k))
    and S (B, k, k): t* is the fixed point of t = lambda_max(K + S / (t - c)), and with
    s = u^T S Q (u the top eigenvector of K, Q all of them) second-order perturbation of
    K's top eigenvalue gives t = top + s_1 / g + sum_(j > 1) s_j^2 / (g^2 (top - lambda_j)),
    g = t - c, evaluated at g from the first-order value. Reliable where c < top and the
    second-order sum is at most PERTURBATION_SHARE of the first-order shift: near the
    reference (S small next to (top - c) times K's gaps), one k x k eigensolver instead of the
    fixed point's three. Only speed and tightness depend on these estimates: the caller
    verifies every t it tries."""
    top = values[:, -1]
    coupling = ((S @ vectors[:, :, -1:]).mT @ vectors)[:, 0]  # u^T S Q (B, k)
    spread = (top[:, None] - values[:, :-1]).clamp_min(2.0 ** -900)
    g = (top - c).clamp_min(2.0 ** -900)
    g = (top + coupling[:, -1] / g - c).clamp_min(2.0 ** -900)  # at the first-order estimate
    first = coupling[:, -1] / g
    second = (coupling[:, :-1].square() / spread).sum(dim=1) / g.square()
    estimate = top + first + second
    reliable = ((top > c) & torch.isfinite(estimate) & (first >= 0)
                & (second <= PERTURBATION_SHARE * first))
    return torch.where(reliable, estimate, top), reliable


# _joint_top: at most this many fixed-point steps on k x k matrices (one 2k x 2k eigensolver
# costs about five k x k ones); a sample settles once its last step moved by at most
# JOINT_TOLERANCE (relative) at a contraction of at most JOINT_CONTRACTION, and leaves the
# iteration for the 2k eigensolver where an iterate comes within JOINT_TOLERANCE of c.
JOINT_STEPS = 4
JOINT_CONTRACTION = 0.1
JOINT_TOLERANCE = 1e-9


def _joint_top(K: Tensor, S: Tensor, c: Tensor, top: Tensor, s_frobenius: Tensor) -> Tensor:
    """Estimates (B,) of t*, the top eigenvalue of [[K, S^(1/2)], [S^(1/2), c I]] (the smallest
    t of condition (*) with eta = 0), for K, S (B, k, k) symmetric PSD, c (B,), top (B,)
    lambda_max(K) and s_frobenius (B,) >= ||S||_F. Only speed and tightness depend on them: the
    caller verifies every t it tries, from TRIAL_STEPS' first increment above the estimate.

    For t > c, t <= t* exactly when lambda_max(K + S / (t - c)) >= t (Schur complement), and
    phi(t) = lambda_max(K + S / (t - c)) decreases in t, so t* is its fixed point. From
    t_0 = max(top, c) + ||S||_F^(1/2) >= t* (or top + ||S||_F / (top - c) where smaller and
    top > c), the iterates t_(m+1) = phi(t_m) alternate about t* and close in by about
    rho = |phi'(t*)| a step, small where S is small next to (t* - c)^2, the usual case near the
    reference. With rho ~ |t_m - t_(m-1)| / |t_(m-1) - t_(m-2)|, the extrapolation
    t_m - (t_m - t_(m-1)) rho / (1 + rho) (t_m - t* = -rho (t_(m-1) - t*) to first order) is
    the estimate once its correction is below JOINT_TOLERANCE: two or three steps on the live
    default. Samples that do not settle within JOINT_STEPS take the 2k x 2k eigensolver."""
    # both starts exceed t*: phi(t) <= top + ||S|| / (t - c) <= t there; the second is far
    # closer where ||S|| is small next to (top - c)^2
    t = torch.maximum(top, c) + s_frobenius.sqrt()
    t = torch.where(top > c, torch.minimum(t, top + s_frobenius / (top - c)), t)
    estimate, previous, before = t.clone(), t, t
    valid = torch.ones_like(t, dtype=torch.bool)
    settled = torch.zeros_like(valid)
    for step in range(JOINT_STEPS):
        # an iterate at or just above c has no phi (or a huge one): such samples leave the
        # iteration for the eigensolver
        valid = valid & (t - c > JOINT_TOLERANCE * t.abs())
        rows = (valid & ~settled).nonzero()[:, 0]
        if len(rows) == 0:
            break
        before, previous, t = previous, t, t.clone()
        gap = (previous[rows] - c[rows])[:, None, None]
        t[rows] = torch.linalg.eigvalsh(K[rows] + S[rows] / gap)[:, -1]
        if step == 0:
            continue
        first, second = previous - before, t - previous
        contraction = torch.where(first == 0, 0.0, (second / first).abs())
        correction = second * contraction / (1.0 + contraction)
        done = (valid & ~settled & (t > c) & (contraction <= JOINT_CONTRACTION)
                & (correction.abs() <= JOINT_TOLERANCE * t.abs()))
        estimate = torch.where(done, t - correction, estimate)
        settled = settled | done
    if bool(settled.all()):
        return estimate
    rest = ~settled
    values, vectors = torch.linalg.eigh(S[rest])
    root = (vectors * values.clamp_min(0.0).sqrt()[:, None, :]) @ vectors.mT
    eye = torch.eye(K.shape[-1], dtype=K.dtype, device=K.device).expand(len(values), -1, -1)
    joint = torch.cat([torch.cat([K[rest], root], dim=2),
                       torch.cat([root, c[rest][:, None, None] * eye], dim=2)], dim=1)
    return estimate.masked_scatter(rest, torch.linalg.eigvalsh(joint)[:, -1])


def _symmetric_frobenius_upper(negated: Tensor, blocks: int = 8) -> float:
    """An upper bound on ||S||_F for the symmetric S of the lower triangle of negated (N, N):
    sqrt(2) times the Frobenius norm of that triangle (with the diagonal), its rounding
    included. The triangle is read in ``blocks`` column blocks of views, the part below each
    diagonal block whole and the diagonal block's lower triangle, so no copy of the matrix is
    made (a Fortran-ordered matrix's columns are contiguous). The sum of squares of the
    blocks' float64 norms is inflated by gamma_(N^2 + blocks) for all the rounding."""
    size = negated.shape[0]
    squares = negated.new_zeros(())
    edges = [size * i // blocks for i in range(blocks + 1)]
    for first, last in itertools.pairwise(edges):
        if last == first:
            continue
        diagonal = torch.tril(negated[first:last, first:last])
        squares = squares + torch.linalg.vector_norm(diagonal).square()
        if last < size:
            squares = squares + torch.linalg.vector_norm(negated[last:, first:last]).square()
    return (math.sqrt(2.0 * float(squares)) * (1.0 + gamma(size * size + blocks))
            * (1.0 + 2.0 ** -40))


def _symmetric(A: Tensor) -> Tensor:
    """The symmetric matrices of A's lower triangles (B, k, k): the entries used, and bounded."""
    return torch.tril(A) + torch.tril(A, -1).mT
