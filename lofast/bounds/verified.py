"""Rigorous upper bounds on the largest eigenvalue of explicit PSD matrices: a float64 Cholesky
proof with every rounding error bounded.

``verified_gram_norm`` bounds sqrt(lambda_max(G)) for Gram matrices G given explicitly (up to a
stated error): with a cheap estimate mu of lambda_max, it factors fl(c I - G) by float64
Cholesky for c slightly above mu; success proves c I - G + dA positive definite for a
perturbation dA bounded by Demmel's analysis, hence lambda_max(G) <= c + ||dA||. The bound is
never returned unproven: a failed factorisation raises c (the exact eigenvalue, then doubling).
The certifier uses it for the verified zeta (``bounds.first_order``), the verified operator
norms (``spectral.operator_norm``) and the SLL check (``bounds.stages``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import Tensor

from lofast.bounds.krylov import fixed_unit_vector, lanczos_ritz

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
    side = M.mT if tall else M  # (B, small, inner): gram = side side^T
    gram = lower_gram(side)
    gram = torch.tril(gram) + torch.tril(gram, -1).mT
    unit = power_of_two_above(M.abs().amax(dim=(-2, -1)) if M.numel() else M.new_zeros(M.shape[0]))
    scaled = (M / unit[:, None, None]).square().sum(dim=(-2, -1))  # ||M||_F^2 / unit^2, ~exact
    frobenius = (scaled * (1.0 + 2.0 * gamma(rows * cols + 2))
                 + torch.where(scaled > 0, rows * cols * 2.0 ** -1000, 0.0)) * unit.square()
    # an underflowing product needs two nonzero factors: none for a zero matrix
    underflow = torch.where(scaled > 0, small * inner * SUBNORMAL, 0.0)
    error = gamma(inner) * frobenius + underflow
    return gram, error * (1.0 + 2.0 ** -40)


# Row blocks of the lower-triangle Gram product (``lower_gram``): about half the work of the
# whole product from 8 blocks on.
GRAM_BLOCKS = 8


def lower_gram(side: Tensor) -> Tensor:
    """side side^T (B, r, r) with only its lower triangle (and diagonal) guaranteed: row block
    b is multiplied by the rows up to its own end, about (1 + 1/GRAM_BLOCKS) / 2 of the whole
    product's work. Each entry is still one float64 inner product over side's last dimension
    (``gram_with_error``'s bound does not depend on the order of its sum)."""
    batch, size, _ = side.shape
    if size < 2 * GRAM_BLOCKS:
        return side @ side.mT
    gram = torch.empty(batch, size, size, dtype=side.dtype, device=side.device)
    bounds = [size * b // GRAM_BLOCKS for b in range(GRAM_BLOCKS + 1)]
    for start, stop in itertools.pairwise(bounds):
        gram[:, start:stop, :stop] = side[:, start:stop] @ side[:, :stop].mT
    return gram


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
                                    lower_only: bool = False,
                                    rebuild: Callable[[Tensor], Tensor] | None = None) -> Tensor:
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
    never depends on the estimate).

    ``rebuild``: optional, rows (k,) int64 -> a fresh copy of those samples' ``negated``
    (k, N, N), as given. With it the first trial factors ``negated`` in place, with no copy of
    the matrix (at n d = 32,896 one copy is 8.6 GB), and a sample whose trial fails, the rare
    case, is rebuilt for the retries. Without it every trial factors a copy."""
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
        mirror_lower_(A)
    diagonal = -A.diagonal(dim1=-2, dim2=-1)  # S_ii (B, N), a new tensor
    peak = diagonal.abs().amax(dim=1)
    in_range = (peak == 0) | ((peak >= 2.0 ** -RANGE_EXPONENT) & (peak <= 2.0 ** RANGE_EXPONENT))
    unit = torch.where(in_range, 1.0, power_of_two_above(peak))
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
    factored = A.diagonal(dim1=-2, dim2=-1).clone()  # fl(c - S_ii), before any factorisation
    passed = _cholesky_passes(A, in_place=rebuild is not None) & todo
    bound = torch.where(passed, _verified_bound(c, factored, size), bound)
    todo = todo & ~passed
    source, position = A, torch.arange(batch, device=device)  # where each sample's matrix is
    if rebuild is not None and bool(todo.any()):  # A holds factors: the failed samples again
        failed = todo.nonzero()[:, 0]
        source = rebuild(failed).to(torch.float64) / unit[failed, None, None]
        if lower_only:
            mirror_lower_(source)
        position[failed] = torch.arange(len(failed), device=device)
    for attempt in range(MAX_DOUBLINGS + 1):
        if not bool(todo.any()):
            break
        rows = todo.nonzero()[:, 0]
        trial = source[position[rows]]  # (failing samples) a copy
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


def mirror_lower_(A: Tensor, blocks: int = 8) -> Tensor:
    """Copies the strict lower triangle of each matrix of A (B, N, N) onto its strict upper
    triangle, in place, and returns A: the matrices become the symmetric matrices of their lower
    triangles. Works in ``blocks`` column blocks, so the only temporary is a diagonal block's
    mirror: the whole-matrix form tril(A) + tril(A, -1)^T held three more copies of A at once
    (at 256 tokens, 24 of a 41 GiB peak on a GPU). Exact: entries are only copied."""
    size = A.shape[-1]
    edges = [size * i // blocks for i in range(blocks + 1)]
    for first, last in itertools.pairwise(edges):
        if last == first:
            continue
        diagonal = A[:, first:last, first:last]
        diagonal.copy_(torch.tril(diagonal) + torch.tril(diagonal, -1).mT)
        if last < size:  # the columns of this block below it -> its rows right of it
            A[:, first:last, last:] = A[:, last:, first:last].mT
    return A


def _top_eigenvalue(S: Tensor) -> Tensor:
    """Largest eigenvalue (B,) of the symmetric matrices of S's lower triangles (an estimate:
    LAPACK's, accurate to a few N u ||S||)."""
    return torch.linalg.eigvalsh(S, UPLO="L")[:, -1]


def _cholesky_passes(A: Tensor, in_place: bool = False) -> Tensor:
    """(B,) bool: float64 Cholesky of the symmetric matrix of A's lower triangle (B, N, N) ran
    to completion (cholesky_ex reads the lower triangle only, see
    ``verified_norm_from_negated_gram``). A is left as it was, or with ``in_place`` overwritten
    by the factors wherever it is in batched Fortran order (a copy is factored otherwise).

    On a CPU the factorisation runs in place on a copy of A in A's memory order: given a
    separate output, ATen's CPU cholesky_ex first writes tril(A) into it element by element
    across the columns of the Fortran-ordered factor, which at N = 4352 took longer than
    LAPACK's factorisation itself (one thread: 0.62-0.67 s against 0.02 s for the copy and
    0.40 s in place). The copy is made in the batched Fortran order LAPACK factors in place
    (each matrix column-major, the matrices one after another), whatever A's strides: a
    Fortran-ordered matrix given a batch dimension by indexing, A[None] with strides (N, 1, N),
    was factored through a second hidden copy (one thread, N = 8320: 7.9 s against 4.5 s).
    Accelerators copy A with a fast kernel and keep the plain call. In place, A's own memory
    is factored on either: no copy, which at N = 8320 saves 0.55 GB and a tenth of a second."""
    size = A.shape[-1]
    if in_place and A.shape[0] == 1 and A[0].mT.is_contiguous():
        A = A.as_strided(A.shape, (size * size, 1, size))  # the batch stride of a lone matrix
    in_place = in_place and A.stride() == (size * size, 1, size)
    if A.device.type != "cpu" and not in_place:
        return torch.linalg.cholesky_ex(A).info == 0
    factor = A if in_place else A.mT.clone(memory_format=torch.contiguous_format).mT
    info = torch.empty(A.shape[:-2], dtype=torch.int32, device=A.device)
    torch.linalg.cholesky_ex(factor, out=(factor, info))
    return info == 0


def smallest_eigenvalue_exceeds(A: Tensor, floor: Tensor) -> Tensor:
    """(B,) bool, True only where lambda_min(A_b) > floor_b is proved, for the symmetric matrices
    of A's lower triangles (B, k, k) float64 and floor (B,) >= 0: one float64 Cholesky
    factorisation of fl(A - mu I), about a tenth of the cost of a symmetric eigensolver.

    With mu = (floor + alpha tr+(A) + 2 u max+(A_ii) + underflow) (1 + 2^-30) (+: positive
    parts), Cholesky running to completion on B = fl(A - mu I) gives
    lambda_min(B) >= -alpha tr(B) - underflow (the theorem of ``verified_gram_norm``:
    Demmel 1989, Rump 2006, alpha from gamma_(2(k+2))). B differs from A - mu I only on its
    diagonal, by |D_ii| <= u |B_ii|, and B_ii <= (1 + u) A_ii, so lambda_min(A) >=
    mu - alpha tr(B) - 2 u max B_ii - underflow > floor; the check after the factorisation uses
    B's own diagonal. A is not modified."""
    batch, size = A.shape[0], A.shape[-1]
    if size == 0:
        return torch.ones(batch, dtype=torch.bool, device=A.device)
    alpha = gamma(2 * (size + 2))
    alpha = alpha / (1.0 - alpha)
    diagonal = A.diagonal(dim1=-2, dim2=-1).clamp_min(0.0)

    def margin(diagonal: Tensor) -> Tensor:  # alpha tr + 2 u max + underflow, rounded up
        largest = diagonal.amax(dim=1)
        return (alpha * diagonal.sum(dim=1) * (1.0 + 2.0 * gamma(size)) + 2.0 * UNIT_ROUNDOFF
                * largest + (2.0 * size * (size + 2.0 + largest) + size) * SUBNORMAL)

    shift = (floor + margin(diagonal * (1.0 + UNIT_ROUNDOFF))) * (1.0 + 2.0 ** -30)
    B = A.mT.clone(memory_format=torch.contiguous_format).mT  # batched Fortran order
    B.diagonal(dim1=-2, dim2=-1).sub_(shift[:, None])
    factored = B.diagonal(dim1=-2, dim2=-1).clamp_min(0.0)  # a copy, before the factorisation
    # factored in its own memory on a CPU; elsewhere into a new factor (k x k: cheap either way)
    passed = _cholesky_passes(B, in_place=B.device.type == "cpu")
    return passed & (shift >= (floor + margin(factored)) * (1.0 + 2.0 ** -30))


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


def power_of_two_above(x: Tensor) -> Tensor:
    """2^e with x < 2^e <= 2x for positive finite x (elementwise), 1 elsewhere."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa 2^exponent, mantissa in [0.5, 1)
    ok = (mantissa > 0) & torch.isfinite(x)
    return torch.where(ok, torch.ldexp(torch.ones_like(x), exponent), torch.ones_like(x))
