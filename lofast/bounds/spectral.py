"""Spectral norms of batched linear maps, each with a stated guarantee.

Power iteration approaches a spectral norm from below: its value is an estimate, never a
certificate. This module offers four methods and says which guarantee each carries:

- ``dense`` (EXACT): materialise the operator, take its exact float64 spectral norm and
  inflate it by ``ROUNDING_MARGIN``, which covers the rounding errors of the computation.
- ``verified`` (EXACT): materialise the operator's Gram matrix, estimate its top
  eigenvalue cheaply and prove ``c I - Gram`` positive definite with a float64 Cholesky
  factorisation, accounting for every rounding error (``verified.verified_gram_norm``); about 8x cheaper
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
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from lofast.bounds.krylov import (
    BREAKDOWN_TOL,
    LinearMap,
    fixed_unit_vector,
    lanczos_ritz,
    power_iterate,
)
from lofast.bounds.verified import (
    SUBNORMAL,
    UNIT_ROUNDOFF,
    gamma,
    gram_with_error,
    power_of_two_above,
    verified_gram_norm,
)

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

# An unscaled Gram matrix is used while its largest diagonal entry lies within 2^(+-this)
# (``matrix_norm_upper``).
GRAM_EXPONENT = 600

# On an accelerator ``matrix_norm_upper`` proves batches of Gram matrices larger than this by
# Cholesky (``verified.verified_gram_norm``) instead of calling a dense eigensolver: PyTorch's
# batched symmetric eigensolver on CUDA covers at most 32 x 32 and loops over the batch beyond
# it (pytorch/pytorch#175585: 1,024 matrices of 64 x 64 in 1.9 s against 8 ms at 32 x 32), the
# 65 x 65 Grams of a 64-token model among them. The Lanczos estimate before the proof takes
# this many steps, so that its tridiagonal matrices stay within the batched solver too. On a
# CPU LAPACK's eigensolver is the faster (65 x 65: 159 against 327 ms for 1,280 matrices).
BATCHED_EIGENSOLVER_SIZE = 32

# The proof's relative slack: its bound is at most (1 + this) times the exact norm (plus the
# Gram matrix's rounding) wherever the estimate is that close; elsewhere it retries from the
# exact top eigenvalue of those matrices alone.
PROVED_NORM_SLACK = 1e-6


# The constant of the Kuczynski-Wozniakowski (1992) bound for the Lanczos algorithm.
KW_CONSTANT = 1.648

# Working memory (float64 elements) for one block of basis vectors when materialising a dense
# operator: 2^24 elements = 128 MiB.
DENSE_BLOCK_ELEMENTS = 1 << 24


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


# With input-dependent attention and the refined bound, a block's Jacobian T_X + D_X is first
# bounded by deflation around its reference (``near_reference``); samples whose bound lies more
# than this relative slack above its Rayleigh-Ritz estimate (a lower estimate of the norm) get
# the method's own per-sample norms of zeta and ||D_X|| as well.
JACOBIAN_SLACK = 1e-2


@dataclass(frozen=True)
class SpectralMethod:
    """How matrix-free spectral norms are computed.

    jacobian_slack: where the deflated bound on a live attention block's Jacobian lies within
    this relative slack of its Rayleigh-Ritz estimate, it is kept and the method's own
    per-sample norms (Gram matrices and Cholesky proofs for the exact guarantee) are skipped: a
    larger slack is faster and the radii smaller, never less sound (every bound kept is an
    upper bound with the method's guarantee)."""

    kind: str = "lanczos"  # "dense" | "lanczos" | "power" | "verified"
    failure_probability: float = 1e-9  # per norm, lanczos only
    # lanczos: bound / Ritz estimate = 1 + relative_slack; verified: the bound tried first is
    # (1 + relative_slack) times the square root of the top-eigenvalue estimate
    relative_slack: float = 1e-3
    power_iterations: int = 100  # power only
    estimate_steps: int = 10  # verified only: Lanczos steps of the top-eigenvalue estimate
    jacobian_slack: float = JACOBIAN_SLACK

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
        slack = self.jacobian_slack
        if isinstance(slack, bool) or not isinstance(slack, numbers.Real) \
                or not 0.0 <= slack <= 1.0:  # NaN fails too
            raise ValueError(f"jacobian_slack must be a number in [0, 1], not {slack!r}")
        object.__setattr__(self, "jacobian_slack", float(slack))  # numpy's too, as a float

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


def matrix_norm_upper(M: Tensor, per_sample: bool = False) -> Tensor:
    """Deterministic upper bound on the spectral norms of explicit matrices (..., m, k).

    Exact float64 spectral norm (largest eigenvalue of the smaller Gram matrix, or the largest
    singular value when that Gram matrix would round too much, see ``GRAM_LIMIT``), times
    (1 + ROUNDING_MARGIN). Returns (...) float64 on M's device.

    The Gram matrix of M itself is used wherever its largest diagonal entry (the largest squared
    row or column norm) lies in [2^-GRAM_EXPONENT, 2^GRAM_EXPONENT]: then no entry or partial sum
    overflows, and underflow adds at most k SUBNORMAL per entry, at most m k SUBNORMAL in norm,
    against a top eigenvalue of at least 2^-GRAM_EXPONENT / 2 (relative error below 2^-440,
    nothing next to ROUNDING_MARGIN). Elsewhere (zero, tiny, huge or non-finite matrices) M is
    first scaled by a power of two, exactly, so that its largest entry lies in [1/2, 1).
    Unscaled, the common case reads M once and allocates nothing of M's size.

    per_sample: M holds per-sample matrices (a batch's, of any size: each gets the same bound
    alone or in a batch). On an accelerator those whose smaller side exceeds
    BATCHED_EIGENSOLVER_SIZE get a Cholesky proof instead (``_proved_norms``): at most
    (1 + PROVED_NORM_SLACK) times the exact norm. Per-model matrices (weights) keep the exact
    route on every device.
    """
    if M.dim() < 2:
        raise ValueError(f"expected matrices (..., m, k), got shape {tuple(M.shape)}")
    M = M.to(torch.float64)
    rows, cols = M.shape[-2:]
    if rows == 0 or cols == 0:
        return M.new_zeros(M.shape[:-2])
    if rows * cols > GRAM_LIMIT:
        return _scaled_norm(M) * (1.0 + ROUNDING_MARGIN)
    if per_sample and _takes_the_proof(M):
        return _proved_norms(M.reshape(-1, rows, cols)).reshape(M.shape[:-2])
    single = M.dim() == 2
    if single:
        M = M[None]
    gram = M @ M.mT if rows <= cols else M.mT @ M
    top = gram.diagonal(dim1=-2, dim2=-1).amax(dim=-1)
    in_range = (top >= 2.0 ** -GRAM_EXPONENT) & (top <= 2.0 ** GRAM_EXPONENT)  # False for NaN
    if bool(in_range.all()):
        sigma = _top_singular_value(gram)
    else:
        sigma = torch.empty(M.shape[:-2], dtype=torch.float64, device=M.device)
        sigma[in_range] = _top_singular_value(gram[in_range])
        sigma[~in_range] = _scaled_norm(M[~in_range])
    sigma = sigma * (1.0 + ROUNDING_MARGIN)
    return sigma[0] if single else sigma


# ``product_norm_upper`` keeps its r x r route where the rounding it adds is at most this share
# of the squared norm (the margin every computed norm carries); beyond, the product is formed.
PRODUCT_ROUNDING_SHARE = ROUNDING_MARGIN


@dataclass(frozen=True)
class ProductFactor:
    """A fixed right factor B (..., d, r), r <= d, of products A B^T (a weight behind
    per-sample activations), with what ``product_norm_upper`` needs of it, made once: a
    square root S (..., r, r) of W = B^T B and bounds on how far S S^T is from the exact W.

    factor: B; root: S (S S^T = W up to ``residual``); residual (...) >= ||B^T B - S S^T||_2
    for the exact B^T B; root_square (...) >= ||S||_F^2.
    """

    factor: Tensor
    root: Tensor
    residual: Tensor
    root_square: Tensor

    @property
    def rank(self) -> int:
        return self.root.shape[-1]


def product_factor(B: Tensor) -> ProductFactor:
    """``ProductFactor`` of B (..., d, r) with r <= d, float64.

    W = fl(B^T B) is within e_W of the exact Gram (``verified.gram_with_error``); S = Q
    diag(max(lambda, 0))^(1/2) from the eigenpairs of W. Then ||W_exact - S S^T|| <= e_W +
    ||fl(W - fl(S S^T))||_F / (1 - u) + gamma_r ||S||_F^2 (the product S S^T rounds by at most
    gamma_r |S| |S|^T, the difference by u of itself), whatever the eigensolver's accuracy:
    it enters the bound, never its soundness."""
    B = B.to(torch.float64)
    d, r = B.shape[-2:]
    if r > d:
        raise ValueError(f"a product factor needs rank <= rows, got {tuple(B.shape)}")
    lead = B.shape[:-2]
    W, w_error = gram_with_error(B.reshape(-1, d, r))
    values, vectors = torch.linalg.eigh(W)
    root = vectors * values.clamp_min(0.0).sqrt()[:, None, :]
    difference = torch.linalg.vector_norm(W - root @ root.mT, dim=(-2, -1))
    root_square = (root.square().sum(dim=(-2, -1)) * (1.0 + gamma(r * r + 2))
                   + r * r * SUBNORMAL)
    residual = (w_error + difference * (1.0 + gamma(r * r + 2)) / (1.0 - UNIT_ROUNDOFF)
                + gamma(r) * root_square) * (1.0 + 2.0 ** -40)
    return ProductFactor(factor=B, root=root.reshape(*lead, r, r),
                         residual=residual.reshape(lead), root_square=root_square.reshape(lead))


def takes_the_factors(rank: int, product: Tensor) -> bool:
    """Whether per-sample products (..., n, d) of rank ``rank`` take ``product_norm_upper``:
    where the rank is at most half of n and of d (at rank 16, 512 products of 17 x 128 took
    6.1 ms that way against 4.6 ms formed, of 65 x 128 8.2 against 48 ms, on two CPU threads),
    and off the CPU at most BATCHED_EIGENSOLVER_SIZE (above it an accelerator's r x r
    eigensolver loops over the batch, and the formed product's Cholesky proof,
    ``matrix_norm_upper``, does not)."""
    n, d = product.shape[-2:]
    small = product.device.type == "cpu" or rank <= BATCHED_EIGENSOLVER_SIZE
    return 2 * rank <= min(n, d) and small


def product_norm_upper(A: Tensor, right: ProductFactor) -> Tensor:
    """Deterministic upper bounds (...) on ||A B^T||_2 for per-sample A (..., n, r) and the
    factor B (..., d, r) of ``right`` (its leading dims broadcast against A's), float64: the
    norm of a rank-r product from r x r matrices, where ``matrix_norm_upper`` of the n x d
    product takes a min(n, d) eigenproblem (an r x r one is batched on every device from
    r <= 32).

    ||A B^T||^2 = lambda_max(A W A^T) <= lambda_max(S^T G S) + ||W - S S^T|| ||A||^2 with
    G = A^T A. G is formed within e_G (``gram_with_error``), H = fl(S^T G S) within
    gamma_(2r+1) ||S||_F^2 ||G||_F of S^T fl(G) S, so ||A B^T||^2 <= lambda_max(H) + E with
    E = gamma_(2r+1) ||S||_F^2 ||G||_F + ||S||_F^2 e_G + residual ||A||_F^2, and the bound is
    sqrt(lambda_max(H) + E) (1 + ROUNDING_MARGIN), the margin for the r x r eigensolver as in
    ``matrix_norm_upper``. E is about u (n + d) ||S||^2 ||A||^2, tiny against the norm unless
    B is nearly singular along A: samples whose E exceeds PRODUCT_ROUNDING_SHARE of
    lambda_max(H), or whose Gram leaves [2^-GRAM_EXPONENT, 2^GRAM_EXPONENT] (tiny, huge or
    zero A), take ``matrix_norm_upper`` of the product itself, so the bound is never
    looser than that one's by more than this share. A non-finite A gets +inf."""
    A = A.to(torch.float64)
    n, r = A.shape[-2:]
    if r != right.rank or n < r:
        raise ValueError(f"products of {tuple(A.shape)} with a rank-{right.rank} factor: "
                         "need n >= r columns of the factor's rank")
    lead = torch.broadcast_shapes(A.shape[:-2], right.root.shape[:-2])
    A = A.expand(*lead, n, r)
    gram, gram_error = gram_with_error(A.reshape(-1, n, r))
    gram, gram_error = gram.reshape(*lead, r, r), gram_error.reshape(lead)
    diagonal = gram.diagonal(dim1=-2, dim2=-1).amax(dim=-1)
    in_range = ((diagonal >= 2.0 ** -GRAM_EXPONENT) & (diagonal <= 2.0 ** GRAM_EXPONENT)
                & torch.isfinite(gram).flatten(-2).all(dim=-1))  # False for NaN
    gram = torch.where(in_range[..., None, None], gram, 0.0)  # the eigensolver needs it finite
    root = right.root.expand(*lead, r, r)
    top = torch.linalg.eigvalsh(root.mT @ (gram @ root))[..., -1].clamp_min(0.0)
    rounding = _product_rounding(A, gram, gram_error, right)
    bound = (top + rounding).sqrt() * (1.0 + ROUNDING_MARGIN)
    finite = torch.isfinite(A).flatten(-2).all(dim=-1)
    bound = torch.where(finite, bound, math.inf)
    dense = finite & ~(in_range & (rounding <= PRODUCT_ROUNDING_SHARE * top)
                       & torch.isfinite(bound))
    if bool(dense.any()):
        product = A[dense] @ right.factor.expand(*lead, *right.factor.shape[-2:])[dense].mT
        bound = bound.masked_scatter(dense, matrix_norm_upper(product, per_sample=True))
    return bound


def _product_rounding(A: Tensor, gram: Tensor, gram_error: Tensor,
                      right: ProductFactor) -> Tensor:
    """E of ``product_norm_upper``: gamma_(2r+1) ||S||_F^2 ||G||_F + ||S||_F^2 e_G +
    residual ||A||_F^2, for A (..., n, r), its computed Gram G (..., r, r) within e_G (...)."""
    n, r = A.shape[-2:]
    a_square = A.square().sum(dim=(-2, -1)) * (1.0 + gamma(n * r + 2)) + n * r * SUBNORMAL
    g_frobenius = torch.linalg.vector_norm(gram, dim=(-2, -1)) * (1.0 + gamma(r * r + 2))
    return (gamma(2 * r + 1) * right.root_square * g_frobenius
            + right.root_square * gram_error + right.residual * a_square) * (1.0 + 2.0 ** -40)


def _takes_the_proof(M: Tensor) -> bool:
    """Whether ``matrix_norm_upper`` proves per-sample matrices M (..., m, k) by
    ``_proved_norms``: off the CPU, with both sides above BATCHED_EIGENSOLVER_SIZE."""
    return M.device.type != "cpu" and min(M.shape[-2:]) > BATCHED_EIGENSOLVER_SIZE


def _proved_norms(M: Tensor) -> Tensor:
    """Deterministic upper bounds (B,) on the spectral norms of M (B, m, k), float64: the
    smaller Gram matrix with its rounding bound (``verified.gram_with_error``), a Lanczos
    estimate of its top eigenvalue (BATCHED_EIGENSOLVER_SIZE steps from a fixed start) and a
    Cholesky proof at (1 + PROVED_NORM_SLACK)^2 times it (``verified.verified_gram_norm``, which
    retries from the exact eigenvalue where the estimate was too low). Matrices whose Gram
    diagonal leaves [2^-GRAM_EXPONENT, 2^GRAM_EXPONENT] (tiny, huge or non-finite) take the
    rescaled float64 norm with ROUNDING_MARGIN, as in ``matrix_norm_upper``; zero matrices 0
    (a fixed attention's P_l - R_l is exactly zero for every sample: no eigensolver for them)."""
    gram, error = gram_with_error(M)
    top = gram.diagonal(dim1=-2, dim2=-1).amax(dim=-1)
    in_range = ((top >= 2.0 ** -GRAM_EXPONENT) & (top <= 2.0 ** GRAM_EXPONENT)
                & torch.isfinite(error))  # False for NaN
    if bool(in_range.all()):
        return _proved_gram_norms(gram, error)
    sigma = torch.zeros(M.shape[0], dtype=torch.float64, device=M.device)
    if bool(in_range.any()):
        sigma[in_range] = _proved_gram_norms(gram[in_range], error[in_range])
    rescaled = ~in_range & (M != 0).flatten(1).any(dim=1)
    if bool(rescaled.any()):
        sigma[rescaled] = _scaled_norm(M[rescaled]) * (1.0 + ROUNDING_MARGIN)
    return sigma


def _proved_gram_norms(gram: Tensor, error: Tensor) -> Tensor:
    """``_proved_norms`` of exactly symmetric Gram matrices (B, N, N) within ``error`` (B,) of
    the exact ones; gram is used as workspace."""
    size = gram.shape[-1]
    start = fixed_unit_vector(size, gram.device).expand(gram.shape[0], size)
    estimate = lanczos_ritz(lambda q: (gram @ q[..., None])[..., 0], start,
                            min(size, BATCHED_EIGENSOLVER_SIZE))
    return verified_gram_norm(gram, relative_slack=PROVED_NORM_SLACK, gram_error=error,
                              estimate=estimate, symmetric=True, overwrite=True)


def _top_singular_value(gram: Tensor) -> Tensor:
    """sqrt(lambda_max) of symmetric positive semidefinite Gram matrices (..., r, r)."""
    return torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0.0).sqrt()


def _scaled_norm(M: Tensor) -> Tensor:
    """The float64 spectral norms of M (..., m, k), computed after an exact rescaling of each
    matrix by a power of two (its largest entry then lies in [1/2, 1): no overflow, and
    underflow negligible next to the norm), from the smaller Gram matrix up to GRAM_LIMIT and
    by the SVD beyond; +inf for a matrix with a NaN or an infinite entry (no eigensolver
    takes it)."""
    finite = torch.isfinite(M).flatten(-2).all(dim=-1)
    if not bool(finite.all()):
        sigma = torch.full(M.shape[:-2], math.inf, dtype=M.dtype, device=M.device)
        sigma[finite] = _scaled_norm(M[finite])
        return sigma
    rows, cols = M.shape[-2:]
    unit = power_of_two_above(M.abs().amax(dim=(-2, -1)))
    M = M / unit[..., None, None]
    if rows * cols <= GRAM_LIMIT:
        sigma = _top_singular_value(M @ M.mT if rows <= cols else M.mT @ M)
    else:
        sigma = torch.linalg.svdvals(M)[..., 0]
    return unit * sigma


def operator_norm(apply: LinearMap, adjoint: LinearMap, in_shape: tuple[int, ...], batch: int,
                  method: SpectralMethod, dtype: torch.dtype = torch.float64,
                  device: torch.device | str | None = None,
                  generator: torch.Generator | None = None,
                  start: Tensor | None = None) -> Tensor:
    """Spectral norms ||L_b|| of a batch of linear maps given matrix-free.

    ``apply`` maps (B, *in_shape) -> (B, *out_shape) and ``adjoint`` the reverse, both built
    from torch operations (the dense method evaluates them under ``torch.func.vmap``). The
    iterations run on the smaller side (L^T L or L L^T), from ``start`` (B, N) unit vectors on
    that side where given (each drawn uniformly on the sphere, independently of the maps, for
    the lanczos guarantee), else drawn from ``generator``. Returns (B,) float64:

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
        return explicit_norm(_materialise(apply, in_shape, math.prod(out_shape), batch, device),
                             method)
    if start is None:
        start = random_unit(batch, math.prod(in_shape), device, generator)
    if method.kind == "lanczos":
        return lanczos_norm(apply, adjoint, start, in_shape, method)
    return power_norm(apply, adjoint, start, in_shape, method.power_iterations)


def explicit_norm(matrix: Tensor, method: SpectralMethod) -> Tensor:
    """Upper bounds (B,) on the spectral norms of explicit matrices (B, m, k) that represent
    linear maps, for the dense and verified methods (``operator_norm``'s guarantee for them;
    ROUNDING_MARGIN covers the rounding of forming the matrices, which the callers keep to
    sums of a few products per entry, as a matrix-free product has)."""
    if method.kind == "dense":
        return matrix_norm_upper(matrix)
    if method.kind != "verified":
        raise ValueError(f"explicit matrices take the dense or verified method, not {method.kind}")
    # exact rescaling by a power of two (an entry that underflows moves by at most
    # SUBNORMAL / 2, the matrix by at most sqrt(m k) SUBNORMAL / 2 in norm)
    unit = power_of_two_above(matrix.abs().amax(dim=(-2, -1)))
    gram, error = gram_with_error(matrix / unit[:, None, None])
    norm = verified_gram_norm(gram, relative_slack=method.relative_slack, gram_error=error,
                              steps=method.estimate_steps, symmetric=True, overwrite=True)
    spill = torch.where(unit > 1, math.sqrt(matrix.shape[1] * matrix.shape[2]) * SUBNORMAL,
                        0.0)  # dividing by unit <= 1 is exact
    return (norm + spill) * unit * (1.0 + ROUNDING_MARGIN)


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
    reorthogonalisation (classical Gram-Schmidt against all previous vectors after each
    three-term step, repeated where it cancelled most of the vector: ``krylov._reorthogonalise``).
    The recursion runs on A / c^2 for an exact power-of-two c (``_normalised_gram``), which
    changes no ratio above and keeps every intermediate away from underflow and overflow.

    start: (B, N) unit vectors. Returns (B,) float64.
    """
    plan = lanczos_plan(start.shape[1], method)
    gram, unit = _normalised_gram(apply, adjoint, start, in_shape)
    ritz = lanczos_ritz(gram, start, plan.steps)
    inflation = math.sqrt(1.0 / ((1.0 - plan.eps) * (1.0 - BREAKDOWN_TOL)))
    return unit * ritz.sqrt() * (inflation * (1.0 + ROUNDING_MARGIN))


def power_norm(apply: LinearMap, adjoint: LinearMap, start: Tensor, in_shape: tuple[int, ...],
               iterations: int) -> Tensor:
    """Estimate ||L_b|| by power iteration on L^T L: returns ||L x|| for the final unit x, which
    is never above the true norm in exact arithmetic. start: (B, N) unit vectors -> (B,)."""
    gram, unit = _normalised_gram(apply, adjoint, start, in_shape)
    x = power_iterate(gram, start, iterations)
    image = apply(x.reshape(x.shape[0], *in_shape)).reshape(x.shape[0], -1)
    return torch.linalg.vector_norm(image / unit[:, None], dim=1) * unit


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
    unit = power_of_two_above(image.reshape(batch, -1).abs().amax(dim=1))
    out_unit = unit.reshape(batch, *(1,) * (image.dim() - 1))

    def gram(q: Tensor) -> Tensor:
        y = apply(q.reshape(batch, *in_shape)) / out_unit
        return adjoint(y).reshape(batch, -1) / unit[:, None]

    return gram, unit


def random_unit(batch: int, dim: int, device: torch.device,
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
