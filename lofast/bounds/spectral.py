"""Spectral norms of batched linear maps, each with a stated guarantee.

Power iteration approaches a spectral norm from below: its value is an estimate, never a
certificate. This module offers four methods and says which guarantee each carries:

- ``dense`` (EXACT): materialise the operator, take its exact float64 spectral norm and
  inflate it by ``ROUNDING_MARGIN``, which covers the rounding errors of the computation.
- ``verified`` (EXACT): materialise the operator's Gram matrix, estimate its top
  eigenvalue cheaply and prove ``c I - Gram`` positive definite with a float64 Cholesky
  factorisation, accounting for every rounding error (``verified_gram_norm``); about 8x cheaper
  than an eigensolver for a 640 x 640 Gram matrix, and at most ``1 + relative_slack`` times the
  exact norm whenever the estimate is good (it is refined until the proof succeeds).
- ``lanczos`` (PROBABILISTIC): randomized Lanczos with full reorthogonalisation; the Ritz value is
  inflated by the Kuczynski-Wozniakowski (1992) bound so that it is an upper bound with
  probability at least ``1 - failure_probability``, and at most ``1 + relative_slack`` times the
  Ritz estimate.
- ``power`` (ESTIMATE): plain power iteration, no inflation.

Everything runs in float64 on the device of its inputs and is batched over a leading dim B.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# Relative inflation of every computed norm (dense and Lanczos). Why 1e-8 (about 9e7 u, with
# u = 1.1e-16 the unit roundoff of float64) covers the rounding: LAPACK's symmetric eigensolver and SVD are backward stable, the computed
# singular values are exact for A + E with ||E|| <= p(N) u ||A||, so by Weyl
# |sigma_hat - sigma| <= p(N) u ||A||, with p(N) a modest polynomial. Even the generous
# p(N) = N^1.5 stays below 3.5e7 for N <= 1e5. Forming the Gram matrix of an m x k matrix
# (k >= m) adds a worst-case relative error k m u / 2 to sigma (|fl(A A^T) - A A^T| <=
# k u |A| |A|^T and || |A| |A|^T || <= ||A||_F^2 <= m ||A||^2); ``matrix_norm_upper`` forms it only
# while k m <= GRAM_LIMIT (error <= 1.1e-9) and uses the SVD beyond. The same margin also covers
# the rounding of the matrix-free products (errors of order d u, for inner sums of length d,
# relative to the magnitudes of the factors, which for softmax rows and bounded weights are not
# large against the norm) and the Lanczos Ritz value, which full reorthogonalisation keeps within
# a small multiple of m sqrt(N) u of an exact Ritz value. Typical errors are orders smaller.
ROUNDING_MARGIN = 1e-8

# Largest k m for which an m x k matrix's norm is taken from its Gram matrix (see above).
GRAM_LIMIT = 2e7

# Lanczos breakdown: beta_j <= BREAKDOWN_TOL * max_i ||A q_i|| means span(q_0..q_j) is invariant
# up to a perturbation E of A with ||E|| <= beta_j <= BREAKDOWN_TOL * lambda_max(A); this factor
# is added to the bound. It sits a few decades above the rounding noise of a reorthogonalised
# residual (about m u) so that true breakdowns are caught, and far below ROUNDING_MARGIN.
BREAKDOWN_TOL = 1e-12

# The constant of the Kuczynski-Wozniakowski (1992) bound for the Lanczos algorithm.
KW_CONSTANT = 1.648

# Working memory (float64 elements) for one block of basis vectors when materialising a dense
# operator: 2^24 elements = 128 MiB.
DENSE_BLOCK_ELEMENTS = 1 << 24

LinearMap = Callable[[Tensor], Tensor]

# float64 unit roundoff u and the smallest positive subnormal (the absolute error of one
# multiplication or division under gradual underflow is at most half of it).
UNIT_ROUNDOFF = 2.0 ** -53
SUBNORMAL = 2.0 ** -1074

# verified_gram_norm leaves a Gram matrix unscaled while its largest diagonal entry lies in
# [2^-RANGE_EXPONENT, 2^RANGE_EXPONENT] (no overflow or harmful underflow can occur there) and
# rescales it by an exact power of two otherwise.
RANGE_EXPONENT = 400

# Explicit Gram matrices up to this size get their top-eigenvalue estimate from a dense
# eigensolver; larger ones from Lanczos (``SpectralMethod.estimate_steps``).
SMALL_GRAM = 64

# verified_gram_norm raises c by doubling at most this many times after the exact-eigenvalue
# retry (it never needs to for a PSD input; the limit only stops a runaway on garbage input).
MAX_DOUBLINGS = 64


class Guarantee(str, enum.Enum):
    """What a computed norm is: a certificate (exact or probabilistic) or an estimate. The
    values are the names users choose (``lofast certify --guarantee``, ``config.GUARANTEES``)."""

    EXACT = "exact"  # a deterministic upper bound: every rounding error accounted for
    PROBABILISTIC = "probabilistic"  # randomized Lanczos with a stated failure probability
    ESTIMATE = "estimate"  # power iteration: NOT an upper bound, never a certificate


_ORDER = (Guarantee.EXACT, Guarantee.PROBABILISTIC, Guarantee.ESTIMATE)


def weakest_guarantee(*guarantees: Guarantee) -> Guarantee:
    """The weakest of some guarantees (EXACT for none)."""
    return max(guarantees, key=_ORDER.index, default=Guarantee.EXACT)


@dataclass(frozen=True)
class LanczosPlan:
    """Number of Lanczos steps (Krylov dimension) and the relative eigenvalue gap eps used."""

    steps: int
    eps: float


@dataclass(frozen=True)
class SpectralMethod:
    """How matrix-free spectral norms are computed."""

    kind: str = "lanczos"  # "dense" | "lanczos" | "power" | "verified"
    failure_probability: float = 1e-9  # per norm, lanczos only
    # lanczos: bound / Ritz estimate = 1 + relative_slack; verified: the bound tried first is
    # (1 + relative_slack) times the square root of the top-eigenvalue estimate
    relative_slack: float = 1e-3
    power_iterations: int = 100  # power only
    estimate_steps: int = 10  # verified only: Lanczos steps of the top-eigenvalue estimate

    def __post_init__(self) -> None:
        if self.kind not in ("dense", "lanczos", "power", "verified"):
            raise ValueError(f"unknown spectral method {self.kind!r}; "
                             "choose 'dense', 'lanczos', 'power' or 'verified'")
        if not 0.0 < self.failure_probability < 1.0:
            raise ValueError("failure_probability must lie in (0, 1)")
        if not 1e-6 <= self.relative_slack <= 1.0:
            raise ValueError("relative_slack must lie in [1e-6, 1]")
        if self.power_iterations < 1:
            raise ValueError("power_iterations must be at least 1")
        if self.estimate_steps < 1:
            raise ValueError("estimate_steps must be at least 1")

    @property
    def guarantee(self) -> Guarantee:
        return {"dense": Guarantee.EXACT, "lanczos": Guarantee.PROBABILISTIC,
                "power": Guarantee.ESTIMATE, "verified": Guarantee.EXACT}[self.kind]

    def describe(self, dim: int | None = None) -> str:
        """One human line; with ``dim`` (the operator's smaller side) Lanczos names its steps."""
        if self.kind == "dense":
            return (f"exact: float64 spectral norms, inflated by a relative "
                    f"rounding margin of {ROUNDING_MARGIN:g}")
        if self.kind == "verified":
            return ("exact: float64 Cholesky-verified upper bounds on the spectral norms "
                    "(rounding errors bounded rigorously), normally within a relative slack of "
                    f"{self.relative_slack:g} of the exact norm")
        if self.kind == "power":
            return (f"estimate: power iteration ({self.power_iterations} steps), a lower estimate "
                    "of each norm, NOT a certificate")
        steps = (f"{lanczos_plan(dim, self).steps} steps" if dim is not None
                 else "Kuczynski-Wozniakowski step count")
        return (f"probabilistic: randomized Lanczos ({steps}, relative slack "
                f"{self.relative_slack:g}), each norm an upper bound with probability >= "
                f"1 - {self.failure_probability:g}")


def kw_failure_bound(dim: int, steps: int, eps: float) -> float:
    """Kuczynski-Wozniakowski bound on P[xi < (1 - eps) lambda_max] for Lanczos on a PSD
    dim x dim matrix from a uniformly random start, with a Krylov space of dimension ``steps``
    (counted conservatively as k = steps - 1 products beyond the start):
    1.648 sqrt(dim) exp(-(2k - 1) sqrt(eps)). Values >= 1 say nothing."""
    k = steps - 1
    return KW_CONSTANT * math.sqrt(dim) * math.exp(-(2 * k - 1) * math.sqrt(eps))


def lanczos_plan(dim: int, method: SpectralMethod) -> LanczosPlan:
    """Fewest Lanczos steps m for which the KW bound is <= the failure probability.

    eps is chosen so that the returned bound sqrt(xi / ((1 - eps)(1 - BREAKDOWN_TOL))) *
    (1 + ROUNDING_MARGIN) is exactly (1 + relative_slack) sqrt(xi). When m would reach dim, it is
    capped at dim: a Krylov space of the full dimension gives lambda_max exactly in exact
    arithmetic (for almost every start), and eps = 0.
    """
    if dim < 1:
        raise ValueError("operator dimension must be at least 1")
    inflation = (1.0 + ROUNDING_MARGIN) ** 2 / (1.0 - BREAKDOWN_TOL)
    eps = 1.0 - inflation / (1.0 + method.relative_slack) ** 2
    needed = math.log(KW_CONSTANT * math.sqrt(dim) / method.failure_probability) / math.sqrt(eps)
    k = math.ceil((needed + 1.0) / 2.0)  # (2k - 1) sqrt(eps) >= log(1.648 sqrt(N) / p)
    if k + 1 >= dim:
        return LanczosPlan(steps=dim, eps=0.0)
    return LanczosPlan(steps=k + 1, eps=eps)


def working_elements(method: SpectralMethod, in_dim: int, out_dim: int) -> int:
    """Float64 elements ``operator_norm`` holds per batch item (to size batch chunks)."""
    small = min(in_dim, out_dim)
    if method.kind == "dense":
        return 2 * in_dim * out_dim + small * small
    if method.kind == "verified":
        return 2 * in_dim * out_dim + 3 * small * small + method.estimate_steps * small
    if method.kind == "lanczos":
        steps = lanczos_plan(small, method).steps
        return (steps + 4) * small + steps * steps
    return 4 * (in_dim + out_dim)


def matrix_norm_upper(M: Tensor) -> Tensor:
    """Deterministic upper bound on the spectral norms of explicit matrices (..., m, k).

    Exact float64 spectral norm (largest eigenvalue of the smaller Gram matrix, or the largest
    singular value when that Gram matrix would round too much, see ``GRAM_LIMIT``), times
    (1 + ROUNDING_MARGIN). Returns (...) float64 on M's device.
    """
    if M.dim() < 2:
        raise ValueError(f"expected matrices (..., m, k), got shape {tuple(M.shape)}")
    M = M.to(torch.float64)
    rows, cols = M.shape[-2:]
    if rows == 0 or cols == 0:
        return M.new_zeros(M.shape[:-2])
    unit = _power_of_two_above(M.abs().amax(dim=(-2, -1)))  # exact rescaling: no underflow
    M = M / unit[..., None, None]
    if rows * cols <= GRAM_LIMIT:
        gram = M @ M.mT if rows <= cols else M.mT @ M
        sigma = torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0.0).sqrt()
    else:
        sigma = torch.linalg.svdvals(M)[..., 0]
    return unit * sigma * (1.0 + ROUNDING_MARGIN)


def gamma(k: int) -> float:
    """Higham's gamma_k = k u / (1 - k u): |theta| <= gamma_k for any product of k factors
    (1 + delta_i)^(+-1) with |delta_i| <= u."""
    if k * UNIT_ROUNDOFF >= 0.5:
        raise ValueError(f"dimension {k} too large for the rounding analysis")
    return k * UNIT_ROUNDOFF / (1.0 - k * UNIT_ROUNDOFF)


def gram_with_error(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """The smaller Gram matrix of explicit matrices (B, m, k) and a bound on its rounding error.

    Returns (gram, error): gram is M^T M (k <= m) or M M^T (k > m), float64 and exactly
    symmetric (its lower triangle mirrored); error (B,) bounds ||gram - exact Gram||_2. Each
    entry is one float64 inner product of length m' = max(m, k), so |fl - exact| <=
    gamma_m' |M|^T |M| entrywise (Higham, Accuracy and Stability, eq. 3.5), plus at most
    m' SUBNORMAL from underflowing products; ||(|M|^T |M|)||_2 <= ||M||_F^2.
    """
    M = matrix.to(torch.float64)
    if M.dim() != 3:
        raise ValueError(f"expected matrices (B, m, k), got shape {tuple(M.shape)}")
    rows, cols = M.shape[-2:]
    tall = cols <= rows
    inner, small = (rows, cols) if tall else (cols, rows)
    gram = M.mT @ M if tall else M @ M.mT
    gram = torch.tril(gram) + torch.tril(gram, -1).mT
    unit = _power_of_two_above(M.abs().amax(dim=(-2, -1)) if M.numel() else M.new_zeros(M.shape[0]))
    scaled = (M / unit[:, None, None]).square().sum(dim=(-2, -1))  # ||M||_F^2 / unit^2, ~exact
    frobenius = (scaled * (1.0 + 2.0 * gamma(rows * cols + 2))
                 + torch.where(scaled > 0, rows * cols * 2.0 ** -1000, 0.0)) * unit.square()
    # an underflowing product needs two nonzero factors: none for a zero matrix
    underflow = torch.where(scaled > 0, small * inner * SUBNORMAL, 0.0)
    error = gamma(inner) * frobenius + underflow
    return gram, error * (1.0 + 2.0 ** -40)


def verified_gram_norm(gram: Tensor, *, relative_slack: float = 1e-3,
                       gram_error: Tensor | None = None, estimate: Tensor | None = None,
                       steps: int = 10, symmetric: bool = False,
                       overwrite: bool = False) -> Tensor:
    """Deterministic upper bounds on sqrt(lambda_max) of PSD matrices given explicitly.

    gram: (B, N, N). The matrix used is S, the symmetric matrix of gram's lower triangle
    (``symmetric=True`` asserts gram is exactly symmetric, S = gram, and saves a copy). If the
    matrix of interest G_b is only known up to rounding, ``gram_error`` (B,) must bound
    ||S_b - G_b||_2; the result then bounds sqrt(lambda_max(G_b)) (= ||L_b|| for G_b = L_b^T L_b).
    estimate: optional (B,) estimates of lambda_max(G_b) (only speed and tightness depend on
    them); by default the top eigenvalue of S is estimated by ``steps`` Lanczos steps
    (a dense eigensolver up to N = SMALL_GRAM). overwrite: gram may be used as workspace.
    Returns (B,) float64 on gram's device.

    Method. With mu the estimate (raised to max_i S_ii, which is <= lambda_max), try
    c = mu (1 + relative_slack)^2 and factor A = fl(c I - S) by float64 Cholesky. Samples whose
    factorisation fails are retried with c from a dense eigensolver, then by doubling c; no
    value is returned unverified. For the c that succeeds the result is
    sqrt(c + 2 u max_i A_ii + alpha tr(A) + underflow terms + gram_error), inflated by 2^-40
    relative to cover the rounding of this short sum and of the square root.

    Theorem used (Demmel 1989, Higham 2002 Thm 10.3; as applied by Rump, "Verification of
    positive definiteness", BIT 46 (2006)): if floating-point Cholesky runs to completion on a
    symmetric A (every pivot positive; the analysis does not need A to be positive definite),
    the computed factor R satisfies R^T R = A + dA with |dA| <= gamma_{N+1} |R^T| |R|. As
    ||r_j||^2 = a_jj + da_jj <= a_jj + gamma_{N+1} ||r_j||^2, Cauchy-Schwarz gives
    |dA_ij| <= alpha sqrt(a_ii a_jj) with alpha = gamma_{N+1} / (1 - gamma_{N+1}), hence
    ||dA||_2 <= alpha tr(A) and lambda_min(A) >= -alpha tr(A). We use gamma_{2(N+2)} in place of
    gamma_{N+1}, covering implementations that divide through reciprocals (LAPACK's dpotf2,
    blocked trsm kernels) with room to spare. Gradual underflow adds at most SUBNORMAL per
    multiplication or division: <= 2 N (N + 2 + max a_ii) SUBNORMAL to ||dA||_2 (r_ii <= 1 + a_ii).
    Since A = c I - S + D with D diagonal, |D_ii| <= 2 u a_ii (the rounding of c - S_ii; the
    off-diagonal entries are exact negations), lambda_max(S) <= c + ||D|| + ||dA||, and
    lambda_max(G) <= lambda_max(S) + gram_error (Weyl). Exact rescaling by a power of two (only
    outside [2^-RANGE_EXPONENT, 2^RANGE_EXPONENT]) adds at most N SUBNORMAL in the scaled units.
    """
    if gram.dim() != 3 or gram.shape[-1] != gram.shape[-2]:
        raise ValueError(f"expected square matrices (B, N, N), got shape {tuple(gram.shape)}")
    G = gram.to(torch.float64)
    owned = overwrite or G is not gram
    if symmetric:
        negated = G.neg_() if owned else -G
    else:
        lower = torch.tril(G, -1)
        negated = (lower + lower.mT).neg_()
        negated.diagonal(dim1=-2, dim2=-1).copy_(-G.diagonal(dim1=-2, dim2=-1))
    if negated.stride(-1) != 1:
        negated = negated.contiguous()
    # negated is exactly symmetric: its transpose is the same matrix, in the Fortran order
    # that spares cholesky_ex a transposing copy
    return verified_norm_from_negated_gram(negated.mT, relative_slack=relative_slack,
                                           gram_error=gram_error, estimate=estimate, steps=steps)


def verified_norm_from_negated_gram(negated: Tensor, *, relative_slack: float = 1e-3,
                                    gram_error: Tensor | None = None,
                                    estimate: Tensor | None = None, steps: int = 10,
                                    lower_only: bool = False) -> Tensor:
    """``verified_gram_norm`` of S = -negated for a float64 (B, N, N) ``negated``, which is used
    as workspace (its contents are destroyed); saves the negation pass when the caller can
    assemble -S directly. Fortran order (a transposed contiguous tensor) is fastest.

    The proof reads only the lower triangle (with the diagonal): S is the symmetric matrix of
    -negated's lower triangle. torch.linalg.cholesky_ex copies only tril(A) into its factor on
    a CPU (ATen's linalg_cholesky_ex_out) and calls LAPACK-style routines with uplo = 'L',
    which reference only the lower triangle, elsewhere; eigvalsh reads UPLO = 'L'. With
    ``lower_only`` the strict upper triangle may be unset: it is then mirrored from the lower
    one (on accelerators, as a precaution, and before an explicit Lanczos estimate); without
    it, negated must be exactly symmetric for the Lanczos estimate to be accurate (soundness
    never depends on the estimate)."""
    if negated.dim() != 3 or negated.shape[-1] != negated.shape[-2]:
        raise ValueError(f"expected square matrices (B, N, N), got shape {tuple(negated.shape)}")
    if negated.dtype != torch.float64:
        raise ValueError("the negated gram matrix must be float64")
    if not 1e-6 <= relative_slack <= 1.0:
        raise ValueError("relative_slack must lie in [1e-6, 1]")
    batch, size = negated.shape[0], negated.shape[-1]
    device = negated.device
    error = (torch.zeros(batch, dtype=torch.float64, device=device) if gram_error is None
             else gram_error.to(device=device, dtype=torch.float64).reshape(batch))
    if not bool(((error >= 0) & ~torch.isnan(error)).all()):
        raise ValueError("gram_error must be nonnegative")
    if batch == 0 or size == 0:
        return error.sqrt()
    A = negated  # = -S; its diagonal is replaced by fl(c - S_ii) for each trial c
    if lower_only and (device.type != "cpu" or (estimate is None and size > SMALL_GRAM)):
        A = torch.tril(A) + torch.tril(A, -1).mT
    diagonal = -A.diagonal(dim1=-2, dim2=-1)  # S_ii (B, N), a new tensor
    peak = diagonal.abs().amax(dim=1)
    in_range = (peak == 0) | ((peak >= 2.0 ** -RANGE_EXPONENT) & (peak <= 2.0 ** RANGE_EXPONENT))
    unit = torch.where(in_range, 1.0, _power_of_two_above(peak))
    if not bool(in_range.all()):
        A.div_(unit[:, None, None])
        diagonal = diagonal / unit[:, None]
    zero = (diagonal == 0).all(dim=1)
    if bool(zero.any()):  # a zero diagonal: S = 0 if S is PSD; check the whole matrix
        zero[zero.clone()] = (torch.tril(A[zero]) == 0).flatten(1).all(dim=1)
    top = diagonal.amax(dim=1)  # max_i S_ii <= lambda_max(S)
    if estimate is not None:
        mu = estimate.to(device=device, dtype=torch.float64).reshape(batch) / unit
    elif size <= SMALL_GRAM:
        mu = _top_eigenvalue(-A)
    else:
        start = fixed_unit_vector(size, device).expand(batch, size)
        mu = lanczos_ritz(lambda q: -(A @ q[..., None])[..., 0], start, min(steps, size))
    grow = (1.0 + relative_slack) ** 2
    c = torch.nan_to_num(torch.maximum(mu, top) * grow, nan=0.0, posinf=0.0).clamp_min(TINY)
    bound = torch.zeros(batch, dtype=torch.float64, device=device)  # lambda_max(S) / unit
    todo = ~zero
    # first trial: all samples at once, writing c into A's diagonal in place
    A.diagonal(dim1=-2, dim2=-1).add_(c[:, None])
    passed = _cholesky_passes(A) & todo
    bound = torch.where(passed, _verified_bound(c, A.diagonal(dim1=-2, dim2=-1), size), bound)
    todo = todo & ~passed
    for attempt in range(MAX_DOUBLINGS + 1):
        if not bool(todo.any()):
            break
        rows = todo.nonzero()[:, 0]
        trial = A[rows]  # (failing samples) a copy
        if attempt == 0:  # the exact top eigenvalue of S
            if not bool(torch.isfinite(torch.tril(trial)).all()):
                raise ValueError("gram matrix contains NaN or infinity")
            trial.diagonal(dim1=-2, dim2=-1).copy_(-diagonal[rows])
            exact = _top_eigenvalue(trial.neg())
            c_rows = torch.maximum(c[rows], torch.maximum(exact, top[rows])) * grow
            c_rows = torch.nan_to_num(c_rows, nan=TINY, posinf=TINY).clamp_min(TINY)
        else:
            c_rows = c[rows] * 2.0
        c[rows] = c_rows
        trial.diagonal(dim1=-2, dim2=-1).copy_(c_rows[:, None] - diagonal[rows])
        ok = _cholesky_passes(trial)
        bound[rows] = torch.where(ok, _verified_bound(c_rows, trial.diagonal(dim1=-2, dim2=-1),
                                                      size), bound[rows])
        todo[rows] = ~ok
    if bool(todo.any()):
        raise ValueError("could not verify an upper bound on lambda_max: the gram matrix is "
                         "far from symmetric positive semidefinite or badly scaled")
    lam = bound * unit + error
    return (lam * (1.0 + 2.0 ** -40)).sqrt() * (1.0 + 2.0 ** -40)


# Smallest trial c (scaled units): only matters for matrices whose estimate and diagonal are
# <= 0, i.e. zero or not positive semidefinite.
TINY = 2.0 ** -900


def _top_eigenvalue(S: Tensor) -> Tensor:
    """Largest eigenvalue (B,) of the symmetric matrices of S's lower triangles (an estimate:
    LAPACK's, accurate to a few N u ||S||)."""
    return torch.linalg.eigvalsh(S, UPLO="L")[:, -1]


def _cholesky_passes(A: Tensor) -> Tensor:
    """(B,) bool: float64 Cholesky of the symmetric matrix of A's lower triangle (B, N, N) ran
    to completion (cholesky_ex reads the lower triangle only, see
    ``verified_norm_from_negated_gram``)."""
    return torch.linalg.cholesky_ex(A).info == 0


def _verified_bound(c: Tensor, factored_diagonal: Tensor, size: int) -> Tensor:
    """c + ||D|| + ||dA|| bound on lambda_max(S) after fl(c I - S) passed Cholesky; see
    ``verified_gram_norm``. factored_diagonal: (B, N) the diagonal A_ii that was factored."""
    alpha = gamma(2 * (size + 2))
    alpha = alpha / (1.0 - alpha)
    positive = factored_diagonal.clamp_min(0.0)  # > 0 wherever Cholesky passed
    trace = positive.sum(dim=1) * (1.0 + 2.0 * gamma(size))
    largest = positive.amax(dim=1)
    underflow = (2.0 * size * (size + 2.0 + largest) + size) * SUBNORMAL
    return (c + 2.0 * UNIT_ROUNDOFF * largest + alpha * trace + underflow) * (1.0 + 2.0 ** -40)


def fixed_unit_vector(size: int, device: torch.device) -> Tensor:
    """A fixed pseudo-random unit vector (size,) (seed 0, drawn on the CPU): the same start for
    every sample, so that a sample's bound does not depend on its batch."""
    x = torch.randn(size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return (x / torch.linalg.vector_norm(x)).to(device)


def operator_norm(apply: LinearMap, adjoint: LinearMap, in_shape: tuple[int, ...], batch: int,
                  method: SpectralMethod, dtype: torch.dtype = torch.float64,
                  device: torch.device | str | None = None,
                  generator: torch.Generator | None = None) -> Tensor:
    """Spectral norms ||L_b|| of a batch of linear maps given matrix-free.

    ``apply`` maps (B, *in_shape) -> (B, *out_shape) and ``adjoint`` the reverse, both built
    from torch operations (the dense method evaluates them under ``torch.func.vmap``). The
    iterations run on the smaller side (L^T L or L L^T). Returns (B,) float64:

    - dense: exact norm times (1 + ROUNDING_MARGIN), a deterministic upper bound;
    - lanczos: an upper bound with probability >= 1 - failure_probability for each b
      separately (over the random start drawn from ``generator``), see ``lanczos_norm``;
    - verified: a deterministic upper bound, from the materialised operator L (as dense; the
      same ``ROUNDING_MARGIN`` covers the rounding of its matrix-free products) and a
      Cholesky-verified bound on the top eigenvalue of L^T L (``verified_gram_norm``);
    - power: an estimate from below, no guarantee.
    """
    if dtype != torch.float64:
        raise ValueError("spectral norms are computed in float64 only")
    device = torch.device(device) if device is not None else torch.device("cpu")
    in_shape = tuple(in_shape)
    out_shape = tuple(apply(torch.zeros((batch, *in_shape), dtype=dtype, device=device)).shape[1:])
    if math.prod(out_shape) < math.prod(in_shape):  # iterate on the smaller side
        apply, adjoint, in_shape, out_shape = adjoint, apply, out_shape, in_shape
    if method.kind in ("dense", "verified"):
        matrix = _materialise(apply, in_shape, math.prod(out_shape), batch, device)
        if method.kind == "dense":
            return matrix_norm_upper(matrix)
        # exact rescaling by a power of two (an entry that underflows moves by at most
        # SUBNORMAL / 2, the matrix by at most sqrt(m k) SUBNORMAL / 2 in norm)
        unit = _power_of_two_above(matrix.abs().amax(dim=(-2, -1)))
        gram, error = gram_with_error(matrix / unit[:, None, None])
        norm = verified_gram_norm(gram, relative_slack=method.relative_slack, gram_error=error,
                                  steps=method.estimate_steps, symmetric=True, overwrite=True)
        spill = torch.where(unit > 1, math.sqrt(matrix.shape[1] * matrix.shape[2]) * SUBNORMAL,
                            0.0)  # dividing by unit <= 1 is exact
        return (norm + spill) * unit * (1.0 + ROUNDING_MARGIN)
    start = _random_unit(batch, math.prod(in_shape), device, generator)
    if method.kind == "lanczos":
        return lanczos_norm(apply, adjoint, start, in_shape, method)
    return power_norm(apply, adjoint, start, in_shape, method.power_iterations)


def lanczos_norm(apply: LinearMap, adjoint: LinearMap, start: Tensor, in_shape: tuple[int, ...],
                 method: SpectralMethod) -> Tensor:
    """Probabilistic upper bound on ||L_b|| by Lanczos on A = L^T L (N = prod(in_shape)).

    Guarantee. Let xi be the largest Ritz value after m steps (Krylov space of dimension m,
    ``lanczos_plan``) from a start drawn uniformly on the unit sphere. In exact arithmetic
    xi <= lambda_max(A) always, and by Kuczynski & Wozniakowski (1992, Thm 4.2)
    P[xi < (1 - eps) lambda_max] <= 1.648 sqrt(N) exp(-(2(m - 1) - 1) sqrt(eps)) <= p. Hence,
    with probability >= 1 - p for each sample (draws are independent across the batch),
    ||L_b|| <= sqrt(xi / ((1 - eps)(1 - BREAKDOWN_TOL))) * (1 + ROUNDING_MARGIN), the value
    returned, which equals (1 + relative_slack) sqrt(xi). The BREAKDOWN_TOL factor accounts for
    stopping at a numerical breakdown; ROUNDING_MARGIN for float64 rounding, kept small by full
    reorthogonalisation (classical Gram-Schmidt, applied twice, against all previous vectors).
    The recursion runs on A / c^2 for an exact power-of-two c (``_normalised_gram``), which
    changes no ratio above and keeps every intermediate away from underflow and overflow.

    start: (B, N) unit vectors. Returns (B,) float64.
    """
    plan = lanczos_plan(start.shape[1], method)
    gram, unit = _normalised_gram(apply, adjoint, start, in_shape)
    ritz = lanczos_ritz(gram, start, plan.steps)
    inflation = math.sqrt(1.0 / ((1.0 - plan.eps) * (1.0 - BREAKDOWN_TOL)))
    return unit * ritz.sqrt() * (inflation * (1.0 + ROUNDING_MARGIN))


def lanczos_ritz(gram: LinearMap, start: Tensor, m: int) -> Tensor:
    """Largest Ritz value (clamped at 0) of m Lanczos steps on the symmetric PSD maps ``gram``
    ((B, N) -> (B, N)) from the unit vectors ``start`` (B, N), with full reorthogonalisation
    (CGS2) and breakdown handling; at most lambda_max in exact arithmetic. Returns (B,)."""
    tridiagonal, _ = _lanczos(gram, start, m)
    return torch.linalg.eigvalsh(tridiagonal)[:, -1].clamp_min(0.0)


def lanczos_ritz_pair(gram: LinearMap, start: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """``lanczos_ritz`` and its Ritz vectors (B, N), unit (an estimate of the top eigenvector,
    for starting later iterations)."""
    tridiagonal, basis = _lanczos(gram, start, m)
    values, vectors = torch.linalg.eigh(tridiagonal)
    ritz = (vectors[:, None, :, -1] @ basis)[:, 0]  # (B, N)
    ritz = ritz / torch.linalg.vector_norm(ritz, dim=1, keepdim=True).clamp_min(1e-300)
    return values[:, -1].clamp_min(0.0), ritz


def lanczos_ritz_vectors(gram: LinearMap, start: Tensor, m: int,
                         count: int) -> tuple[Tensor, Tensor]:
    """The ``count`` largest Ritz values (B, count), in descending order, and their unit Ritz
    vectors (B, count, N) after m Lanczos steps (see ``lanczos_ritz``): estimates of the top
    eigenpairs (count <= m), for deflation. No guarantee attaches to them."""
    tridiagonal, basis = _lanczos(gram, start, m)
    values, vectors = torch.linalg.eigh(tridiagonal)
    top = vectors[..., -count:].flip(-1)  # (B, m, count)
    ritz = top.mT @ basis  # (B, count, N)
    ritz = ritz / torch.linalg.vector_norm(ritz, dim=-1, keepdim=True).clamp_min(1e-300)
    return values[..., -count:].flip(-1), ritz


def _lanczos(gram: LinearMap, start: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """m Lanczos steps (see ``lanczos_ritz``): the tridiagonal matrices (B, m, m) and the bases
    (B, m, N)."""
    batch, dim = start.shape
    basis = start.new_zeros(batch, m, dim)
    alpha = start.new_zeros(batch, m)
    beta = start.new_zeros(batch, m)
    scale = start.new_zeros(batch)  # running max ||A q_i|| <= lambda_max(A)
    broken = torch.zeros(batch, dtype=torch.bool, device=start.device)
    q = start
    for j in range(m):
        basis[:, j] = q
        w = gram(q)
        alpha[:, j] = (q * w).sum(dim=1)
        scale = torch.maximum(scale, torch.linalg.vector_norm(w, dim=1))
        if j == m - 1:
            break
        previous = basis[:, : j + 1]
        for _ in range(2):  # CGS2: removes alpha_j q_j, beta_{j-1} q_{j-1} and rounding drift
            # row-vector products (1 x N)(N x j+1) and (1 x j+1)(j+1 x N): the fastest layout
            coefficients = torch.bmm(w[:, None, :], previous.mT)  # (B, 1, j + 1)
            w = w - torch.bmm(coefficients, previous)[:, 0]
        norm = torch.linalg.vector_norm(w, dim=1)
        # Breakdown: span(q_0..q_j) is an exact invariant subspace of A + E, ||E|| <= beta_j (the
        # recursion so far is that of A + E). Zero the sample's recursion: its later vectors are
        # 0, adding zero rows and columns to T, which keep its top eigenvalue (T is PSD).
        broken = broken | (norm <= BREAKDOWN_TOL * scale)
        beta[:, j] = torch.where(broken, 0.0, norm)
        q = torch.where(broken[:, None], 0.0, w / torch.where(broken, 1.0, norm)[:, None])
    tridiagonal = (torch.diag_embed(alpha) + torch.diag_embed(beta[:, :-1], offset=1)
                   + torch.diag_embed(beta[:, :-1], offset=-1))
    return tridiagonal, basis


def power_norm(apply: LinearMap, adjoint: LinearMap, start: Tensor, in_shape: tuple[int, ...],
               iterations: int) -> Tensor:
    """Estimate ||L_b|| by power iteration on L^T L: returns ||L x|| for the final unit x, which
    is never above the true norm in exact arithmetic. start: (B, N) unit vectors -> (B,)."""
    gram, unit = _normalised_gram(apply, adjoint, start, in_shape)
    x = power_iterate(gram, start, iterations)
    image = apply(x.reshape(x.shape[0], *in_shape)).reshape(x.shape[0], -1)
    return torch.linalg.vector_norm(image / unit[:, None], dim=1) * unit


def power_iterate(gram: LinearMap, start: Tensor, iterations: int) -> Tensor:
    """Power iteration on symmetric PSD maps ``gram`` ((B, N) -> (B, N)) from unit vectors
    ``start`` (B, N); returns the final unit vectors (a vector is kept where gram maps it to 0)."""
    x = start
    for _ in range(iterations):
        y = gram(x)
        norm = torch.linalg.vector_norm(y, dim=1, keepdim=True)
        x = torch.where(norm > 0, y / torch.where(norm > 0, norm, 1.0), x)
    return x


def _normalised_gram(apply: LinearMap, adjoint: LinearMap, start: Tensor,
                     in_shape: tuple[int, ...]) -> tuple[LinearMap, Tensor]:
    """The map q -> L^T (L q / c) / c on (B, N) and the per-sample powers of two c (B,) with
    max |L q_0| < c <= 2 max |L q_0| (c = 1 where L q_0 = 0).

    A / c^2 = L^T L / c^2 has entries of moderate size whatever the scale of L, so squares in
    norms and in L^T L neither underflow nor overflow; scaling by a power of two is exact, and
    ||L|| = c sqrt(lambda_max(A / c^2)).
    """
    batch = start.shape[0]
    image = apply(start.reshape(batch, *in_shape))
    unit = _power_of_two_above(image.reshape(batch, -1).abs().amax(dim=1))
    out_unit = unit.reshape(batch, *(1,) * (image.dim() - 1))

    def gram(q: Tensor) -> Tensor:
        y = apply(q.reshape(batch, *in_shape)) / out_unit
        return adjoint(y).reshape(batch, -1) / unit[:, None]

    return gram, unit


def _power_of_two_above(x: Tensor) -> Tensor:
    """2^e with x < 2^e <= 2x for positive finite x (elementwise), 1 elsewhere."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa 2^exponent, mantissa in [0.5, 1)
    ok = (mantissa > 0) & torch.isfinite(x)
    return torch.where(ok, torch.ldexp(torch.ones_like(x), exponent), torch.ones_like(x))


def _random_unit(batch: int, dim: int, device: torch.device,
                 generator: torch.Generator | None) -> Tensor:
    """(batch, dim) float64 vectors uniform on the unit sphere (normalised Gaussians), drawn on
    the generator's device so that a seeded generator gives the same vectors everywhere."""
    source = generator.device if generator is not None else device
    x = torch.randn(batch, dim, generator=generator, dtype=torch.float64, device=source)
    return (x / torch.linalg.vector_norm(x, dim=1, keepdim=True)).to(device)


def _materialise(apply: LinearMap, in_shape: tuple[int, ...], out_dim: int, batch: int,
                 device: torch.device) -> Tensor:
    """The explicit matrices (B, out_dim, in_dim) of the maps, one column per basis vector of
    the input side, mapped in blocks with torch.func.vmap."""
    in_dim = math.prod(in_shape)
    matrix = torch.empty(batch, out_dim, in_dim, dtype=torch.float64, device=device)
    block = max(1, DENSE_BLOCK_ELEMENTS // max(1, batch * max(in_dim, out_dim)))
    mapped = torch.func.vmap(apply)
    for first in range(0, in_dim, block):
        count = min(block, in_dim - first)
        basis = torch.zeros(count, in_dim, dtype=torch.float64, device=device)
        basis[:, first: first + count] = torch.eye(count, dtype=torch.float64, device=device)
        vectors = basis.reshape(count, 1, *in_shape).expand(count, batch, *in_shape)
        columns = mapped(vectors).reshape(count, batch, out_dim)
        matrix[:, :, first: first + count] = columns.permute(1, 2, 0)
    return matrix
