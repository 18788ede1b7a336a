"""zeta = ||T_X||, the first-order operator of an attention block, and the reference attention.

T_X(G) = H G + sum_l P_l G Wv_l Wo_l (n x d -> n x d) is the block's Jacobian with the
attention matrices P_l held fixed (Lemma 1 of the LoFAST paper; ``bounds.attention`` states
the whole bound). This module bounds its norm: matrix-free (``first_order_maps``), verified by
the Cholesky proof of its Kronecker Gram matrix (``verified_first_order_norm``), in closed form
for uniform attention (``uniform_mix_norm``), and near a fixed reference attention R_l
(``near_reference_first_order_bound``, ``verified_reference_norm``). Every function takes the
attention matrices (B, h, n, n) and weights, never a model. All deterministic bounds are
float64 with their rounding errors bounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lofast.bounds.krylov import LinearMap, fixed_unit_vector, lanczos_ritz, lanczos_ritz_pair
from lofast.bounds.spectral import (
    SpectralMethod,
    matrix_norm_upper,
    operator_norm,
    working_elements,
)
from lofast.bounds.verified import gamma, verified_norm_from_negated_gram

# Working memory (float64 elements) for one chunk of samples in a matrix-free norm computation.
# On a CPU the Lanczos basis of a chunk should stay in the last-level cache (2^21 = 16 MiB): the
# reorthogonalisation is memory-bound and runs ~2.5x faster than from main memory.
CPU_WORKSPACE_ELEMENTS = 1 << 21


# On an accelerator every chunk costs a fixed number of kernel launches, whatever its size: at
# 257 tokens a chunk of one sample (512 MiB holds one sample's Jacobian products there) runs
# about 730 operators a sample a block, a chunk of 12 samples 44 a sample (counted at width
# 128, 8 heads, on the accelerator's code path). So the workspace grows with the device's memory:
# 1/16 of it, from 512 MiB (2^26 elements) to 4 GiB (2^29), or DEVICE_WORKSPACE_ELEMENTS if set.
DEVICE_WORKSPACE_ELEMENTS: int | None = None
DEVICE_WORKSPACE_SHARE = 16
DEVICE_WORKSPACE_RANGE = (1 << 26, 1 << 29)


def workspace_elements(device: torch.device, cpu: int | None = None) -> int:
    """Float64 elements a chunk of samples may hold on ``device``: on a CPU ``cpu``, by default
    CPU_WORKSPACE_ELEMENTS (read at the call, so that a benchmark may set it);
    DEVICE_WORKSPACE_ELEMENTS where set, else 1/DEVICE_WORKSPACE_SHARE of a CUDA device's
    memory clamped to DEVICE_WORKSPACE_RANGE, and the range's low end on other devices."""
    if device.type == "cpu":
        return CPU_WORKSPACE_ELEMENTS if cpu is None else cpu
    if DEVICE_WORKSPACE_ELEMENTS is not None:
        return DEVICE_WORKSPACE_ELEMENTS
    low, high = DEVICE_WORKSPACE_RANGE
    if device.type != "cuda":
        return low
    total = torch.cuda.get_device_properties(device).total_memory
    return min(max(total // (8 * DEVICE_WORKSPACE_SHARE), low), high)


# The verified zeta works on explicit nd x nd Gram matrices (3.3 MB each for nd = 640). On a CPU
# a chunk of samples should keep them in the last-level cache (2^22 elements = 32 MiB): the
# assembly is memory-bound and the Cholesky factorisations run faster from cache.
VERIFIED_CPU_ELEMENTS = 1 << 22


# Scale range of the verified Gram assembly: the residual weight r = 1 / (s_v s_o) after
# rescaling W_v, W_o by powers of two s_v, s_o (|Wv'|, |Wo'| < 1) must lie in [2^-R, 2^R]
# (R = WEIGHT_RANGE), so that no intermediate comes near overflow and r^2 is exact. Under
# gradual underflow each product carries an extra absolute error <= SUBNORMAL / 2 (sums none);
# following them through Wo'Wo'^T, Wv' (.), (.) Wv'^T, P^T P and the GEMM, an entry of the Gram
# matrix collects at most Q n (2 d dv^2 + 2^(2R) + 1) SUBNORMAL, which GRAM_UNDERFLOW covers
# while that factor is below 2^270 (checked; true for any realistic size).
WEIGHT_RANGE = 60


GRAM_UNDERFLOW = 2.0 ** -800


# The reference attention's ||T_R|| (a position bias's softmax) is verified once per block, at
# this relative slack, from a Lanczos estimate with this many steps. An estimate short of the
# slack fails the Cholesky proof and costs a dense eigvalsh and a second factorisation of the
# (n d)^2 Gram matrix: 11 s on one CPU thread at width 256 (n d = 4,352), where 60 steps left
# two of the default's six blocks 1e-4 short and 150 steps come within 1e-8 (0.3 s each).
REFERENCE_SLACK = 1e-5


REFERENCE_LANCZOS_STEPS = 150


# Lanczos start for the zeta estimate: this weight of a fixed random direction is added to the
# direction 1 (x) v (v the top left singular vector of Z = H + sum_l B_l: T_X(1 g^T) =
# 1 (Z^T g)^T, see ``_top_direction``), so that the start is never orthogonal to the top
# eigenvector. Only speed and tightness depend on it, never soundness.
START_NOISE = 0.3


def first_order_norm(X: Tensor, probs: Tensor, value: Tensor, output: Tensor, residual: bool,
                      method: SpectralMethod, generator: torch.Generator | None) -> Tensor:
    """zeta = ||T_X|| per sample, T_X(G) = H G + sum_l P_l G Wv_l Wo_l (n x d -> n x d), with
    adjoint T_X*(Y) = H^T Y + sum_l P_l^T Y Wo_l^T Wv_l^T. Returns (B,)."""
    batch, n, d = X.shape
    parts = []
    for rows in sample_chunks(batch, working_elements(method, n * d, n * d), X.device):
        apply, adjoint = first_order_maps(probs[rows], value, output, residual)
        parts.append(operator_norm(apply, adjoint, (n, d), rows.stop - rows.start, method,
                                   device=X.device, generator=generator))
    return torch.cat(parts)


def along_or_default(f: FirstOrderFactors, probs: Tensor, along: Tensor | None) -> Tensor:
    """The unit vector (n d,) for the Rayleigh quotient check: ``along``, or 1_n (x) v / sqrt(n)
    (row-major vec) with v = f.direction."""
    n = probs.shape[-1]
    return along if along is not None else (f.direction / math.sqrt(n)).repeat(n)


def within_slack(known: Tensor, estimate: Tensor, f: FirstOrderFactors,
                 relative_slack: float) -> Tensor:
    """(B,) bool: known <= (1 + relative_slack) sqrt(estimate) f.unit, for an estimate (B,)
    from below of lambda_max(T'^T T') (False where it is NaN): an upper bound ``known`` on
    zeta that is already as close as a computed norm is made to come."""
    return known <= estimate.clamp_min(0.0).sqrt() * (1.0 + relative_slack) * f.unit


def first_order_maps(probs: Tensor, value: Tensor, output: Tensor,
                     residual: bool) -> tuple[LinearMap, LinearMap]:
    """T_X(G) = H G + sum_l P_l G Wv_l Wo_l and its adjoint
    T_X*(Y) = H^T Y + sum_l P_l^T Y Wo_l^T Wv_l^T, on (B, n, d), for probs (B, h, n, n), value
    (h, d, e) and output (h, e, d), or (B, h, ...) each: a block of its own per batch item; or
    on (L, B, n, d) for L stacked blocks (``mix_heads``)."""

    def apply(G: Tensor) -> Tensor:
        out = mix_heads(probs, G, value, output)
        return out + G if residual else out

    def adjoint(Y: Tensor) -> Tensor:
        out = mix_heads(probs.mT, Y, output.mT, value.mT)
        return out + Y if residual else out

    return apply, adjoint


@dataclass(frozen=True)
class FirstOrderFactors:
    """Weights-only parts of the Gram matrix of T_X (Kronecker form), rescaled exactly.

    With s = value_unit * output_unit (powers of two), T_X = s T' where
    T' = r I + sum_l P_l (x) B'_l^T, B'_l = Wv'_l Wo'_l, Wv' = Wv / value_unit,
    Wo' = Wo / output_unit and r = 1/s (residual) or 0. Index the heads l = 0..h-1 and, with a
    residual, put F_h = r I_d, P_h = I_n next to F_l = B'_l, P_l; the Gram matrix is
    T'^T T' = sum_{l,m} (P_l^T P_m) (x) (F_l F_m^T) (row-major vec: vec(P G B) = (P (x) B^T)
    vec(G)).
    """

    weights: Tensor  # (d, Q, d): [:, q, :] = -F_l F_m^T for the pair (left[q], right[q])
    left: Tensor  # (Q,) int64 l of each row
    right: Tensor  # (Q,) int64 m of each row
    value: Tensor  # (h, d, dv) Wv'
    output: Tensor  # (h, dv, d) Wo'
    residual: float  # r (0 without residual)
    unit: float  # s
    abs_norms: Tensor  # (h,) upper bounds on || |Wv'_l| |Wo'_l| ||_2 (Frobenius products)
    direction: Tensor  # (d,) unit vector, roughly the top left singular vector of r I + sum B'


def first_order_factors(value: Tensor, output: Tensor, residual: bool) -> FirstOrderFactors:
    """The weights-only part of the verified zeta (computed once per block and call).

    F_l F_m^T for heads l, m is formed as Wv'_l (Wo'_l Wo'_m^T) Wv'_m^T: h^2 d^2 dv products
    instead of h^2 d^3 (dv < d). The rows are ordered (head pairs, m major; then the residual
    pairs) so that every product lands in place. value (h, d, dv), output (h, dv, d), float64.
    """
    heads, d, dv = value.shape
    device = value.device
    value_unit = _power_of_two(value)
    output_unit = _power_of_two(output)
    wv, wo = value / value_unit, output / output_unit  # exact (up to subnormal spill)
    unit = value_unit * output_unit
    r = 1.0 / unit if residual else 0.0
    if residual and not 2.0 ** -WEIGHT_RANGE <= r <= 2.0 ** WEIGHT_RANGE:
        raise ValueError("attention value/output weights are too large or too small for the "
                         "verified method")
    products = wv @ wo  # (h, d, d) B'_l
    outputs = wo.reshape(heads * dv, d)
    inner = (outputs @ outputs.mT).reshape(heads, dv, heads, dv)  # Wo'_l Wo'_m^T
    count = heads * heads + (2 * heads + 1 if residual else 0)
    weights = torch.empty(count, d * d, dtype=torch.float64, device=device)
    # row m h + l: -B'_l B'_m^T = (-Wv'_l) (Wo'_l Wo'_m^T) Wv'_m^T (negation is exact)
    left_factor = torch.einsum("lae,lemf->mlaf", -wv, inner).reshape(heads, heads * d, dv)
    torch.bmm(left_factor, wv.mT, out=weights[: heads * heads].view(heads, heads * d, d))
    m_index, l_index = torch.meshgrid(torch.arange(heads, device=device),
                                      torch.arange(heads, device=device), indexing="ij")
    left, right = [l_index.reshape(-1)], [m_index.reshape(-1)]
    if residual:
        rows = weights[heads * heads:].view(2 * heads + 1, d, d)
        rows[0] = torch.eye(d, dtype=torch.float64, device=device) * -(r * r)  # (h, h)
        rows[1: heads + 1] = products.mT * -r  # (h, m): -F_h F_m^T = -r B'_m^T
        rows[heads + 1:] = products * -r  # (l, h): -F_l F_h^T = -r B'_l
        everyone = torch.arange(heads, device=device)
        res = torch.full((heads,), heads, device=device)
        left += [torch.tensor([heads], device=device), res, everyone]
        right += [torch.tensor([heads], device=device), everyone, res]
    abs_norms = (torch.linalg.vector_norm(wv, dim=(1, 2))
                 * torch.linalg.vector_norm(wo, dim=(1, 2)))  # || |Wv'| |Wo'| ||_2 <= product
    # rows of each pair's matrix outermost: a block row of the Gram matrix is then one batched
    # product written row by row (``first_order_negated_gram``)
    weights = weights.view(count, d, d).permute(1, 0, 2).contiguous()
    return FirstOrderFactors(weights=weights, left=torch.cat(left), right=torch.cat(right),
                             value=wv, output=wo, residual=r, unit=unit, abs_norms=abs_norms,
                             direction=_top_direction(products, r))


def first_order_negated_gram(probs: Tensor, f: FirstOrderFactors,
                             out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """-T'^T T' for every sample, one triangle only, and a bound on its rounding error.

    probs (B, h, n, n). Returns (negated (B, nd, nd), error (B,)). negated is the transpose
    (a Fortran-ordered view) of a buffer whose n x n blocks (i, j), i <= j, of d x d entries
    hold -fl(T'^T T'); its lower triangle is therefore -fl(T'^T T') mirrored from the computed
    upper block triangle, its strict upper triangle is unset (the Cholesky factorisation and
    eigvalsh read only the lower triangle, and the Fortran order spares cholesky_ex a
    transposing copy). error bounds ||S - T'^T T'||_2 for the symmetric S of that lower
    triangle (T' from ``FirstOrderFactors``). Block (i, j) is sum_q (P_l^T P_m)[i, j] F_l F_m^T over
    the Q = L^2 pairs (l, m), L = h + residual: one batched product per block row, (B, n - i, Q)
    coefficients against the (d, Q, d) weights. ``out``:
    optional (B, nd, nd) float64 contiguous workspace to fill (saves fresh memory per chunk).

    Rounding: every elementary term Wv Wo Wo Wv P P of an entry passes through at most
    k = d + 2 dv (F_l F_m^T) + n (P_l^T P_m) + Q (GEMM, Q = L^2) roundings, so |fl - exact| <=
    gamma_k sum |terms| (Higham, Lemma 3.3 and eq. 3.5) = gamma_k times the entry of
    |T'|^T |T'|, |T'| = r I + sum_l P_l (x) (|Wv'_l| |Wo'_l|)^T (P_l >= 0). Its norm is at most
    (r + sum_l ||P_l||_2 || |Wv'_l| |Wo'_l| ||_2)^2 with ||P_l||_2 <= sqrt(||P_l||_1 ||P_l||_inf);
    we use gamma_2k for room. Underflow adds at most nd GRAM_UNDERFLOW (see WEIGHT_RANGE).
    """
    batch, _, n, _ = probs.shape
    d = f.value.shape[1]
    stacked = probs
    if f.residual:
        eye = torch.eye(n, dtype=torch.float64, device=probs.device).expand(batch, 1, n, n)
        stacked = torch.cat([probs, eye], dim=1)  # P_h = I_n after the heads
    count = stacked.shape[1]
    # (P_l^T P_m)[i, j] for all l, m: one (B, L n, n) x (B, n, L n) product
    columns = stacked.permute(0, 2, 1, 3).reshape(batch, n, count * n)
    products = (columns.mT @ columns).reshape(batch, count, n, count, n)
    rows, cols = torch.triu_indices(n, n, device=probs.device)  # upper blocks i <= j
    coefficients = products.permute(0, 2, 4, 1, 3)[:, rows, cols][..., f.left, f.right]
    buffer = (torch.empty(batch, n * d, n * d, dtype=torch.float64, device=probs.device)
              if out is None else out)
    view = buffer.view(batch, n, d, n, d)
    start = 0
    for i in range(n):  # block row i: blocks (i, i..n-1), consecutive in triu_indices' order
        stop = start + n - i
        # (B, 1, n - i, Q) @ (d, Q, d) -> (B, d, n - i, d): row a of blocks (i, j) for every j,
        # in the buffer's own order, so each row is one contiguous copy
        view[:, i, :, i:, :] = coefficients[:, None, start:stop] @ f.weights
        start = stop
    negated = buffer.mT
    dv, pairs = f.value.shape[2], len(f.left)
    if pairs * n * (2.0 * d * dv * dv + 2.0 ** (2 * WEIGHT_RANGE) + 1) > 2.0 ** 270:
        raise ValueError("attention block too large for the verified rounding analysis")
    rounding = 2 * (d + 2 * dv + n + pairs)
    spread = torch.sqrt(probs.sum(dim=-2).amax(dim=-1) * probs.sum(dim=-1).amax(dim=-1))
    absolute = f.residual + (spread * f.abs_norms).sum(dim=1)  # (B,) >= || |T'| ||_2
    error = gamma(rounding) * absolute.square() + n * d * GRAM_UNDERFLOW
    return negated, error * (1.0 + 2.0 ** -30)


def verified_first_order_norm(probs: Tensor, f: FirstOrderFactors, method: SpectralMethod,
                              known: Tensor, along: Tensor | None = None) -> Tensor:
    """Deterministic upper bound on zeta = ||T_X|| (B,), T_X(G) = H G + sum_l P_l G Wv_l Wo_l.

    Per chunk of samples: an estimate of the top eigenvalue of the Gram matrix T'^T T' by
    ``method.estimate_steps`` matrix-free Lanczos steps, then the Kronecker Gram matrix
    (``first_order_negated_gram``) and its verification by Cholesky
    (``spectral.verified_norm_from_negated_gram``). ``known`` (B,): deterministic upper bounds
    already at hand; a sample whose bound lies within (1 + relative_slack) of the estimate keeps
    it (the verification would try no lower value), the others get the minimum of both. The
    Rayleigh quotient at ``along`` (a unit vector (n d,); by default 1 (x) v / sqrt(n), see
    ``_top_direction``, where T' takes its norm when attention is uniform) is checked first: it
    is a lower estimate of the top eigenvalue too, so a sample whose bound lies within the slack
    of it keeps the bound without Lanczos."""
    batch, _, n, _ = probs.shape
    dim = n * f.direction.shape[0]
    budget = workspace_elements(probs.device, cpu=VERIFIED_CPU_ELEMENTS)
    size = min(batch, max(1, budget // (3 * dim * dim + method.estimate_steps * dim)))
    noise = fixed_unit_vector(dim, probs.device)
    along = along_or_default(f, probs, along)
    start = along + START_NOISE * noise
    start = start / torch.linalg.vector_norm(start)
    workspace = torch.empty(size, dim, dim, dtype=torch.float64, device=probs.device)
    zeta = known.clone()
    for first in range(0, batch, size):
        chunk = zeta[first: first + size]  # a view: written in place
        p = probs[first: first + size]
        todo = torch.arange(len(p), device=probs.device)
        for vector, steps in ((along, 1), (start, method.estimate_steps)):
            if len(todo) == 0:
                break
            estimate = first_order_estimate(p[todo], f, vector, steps)
            # at most the first bound the verification would try; NaN: verify
            unsettled = ~within_slack(chunk[todo], estimate, f, method.relative_slack)
            todo, estimate = todo[unsettled], estimate[unsettled]
        if len(todo) == 0:
            continue
        negated, error = first_order_negated_gram(p[todo], f, workspace[: len(todo)])
        verified = verified_norm_from_negated_gram(
            negated, relative_slack=method.relative_slack, gram_error=error,
            estimate=estimate, lower_only=True,
            rebuild=lambda rows, p=p[todo]: first_order_negated_gram(p[rows], f)[0]) * f.unit
        chunk[todo] = torch.minimum(chunk[todo], verified)
    return zeta


def uniform_mix_norm(value: Tensor, output: Tensor, residual: bool) -> Tensor:
    """Deterministic upper bound on ||r I + sum_l Wv_l Wo_l|| (r = 1 with a residual, else 0),
    a float64 scalar. value (h, d, dv), output (h, dv, d), float64.

    The sum is one product of length k = h dv, so the computed matrix is off by at most
    gamma_k |Wv| |Wo| entrywise (Higham, eq. 3.5), whose norm is <= ||Wv||_F ||Wo||_F."""
    heads, d, dv = value.shape
    wide = value.permute(1, 0, 2).reshape(d, heads * dv)  # [Wv_1 ... Wv_h]
    tall = output.reshape(heads * dv, d)  # [Wo_1; ...; Wo_h]
    mixed = wide @ tall
    if residual:
        mixed = mixed + torch.eye(d, dtype=torch.float64, device=value.device)
    rounding = (gamma(heads * dv + 1) * torch.linalg.vector_norm(wide)
                * torch.linalg.vector_norm(tall) * (1.0 + 2.0 ** -30))
    return matrix_norm_upper(mixed) + rounding


def near_reference_first_order_bound(probs: Tensor, reference: Tensor | None,
                                     reference_norm: Tensor, value_weight_norm: Tensor,
                                     deviation: Tensor | None = None) -> Tensor:
    """Deterministic upper bound on zeta = ||T_X|| (B,) from the split P_l = R_l + E_l (module
    docstring): ||T_R|| + sum_l ||E_l|| ||B_l||. probs (B, h, n, n); reference: R_l (h, n, n)
    float64, or None for U = 1 1^T / n; reference_norm >= ||T_R|| for exactly that R
    (``AttentionSpec.reference_first_order``); value_weight_norm (h,) >= ||B_l||;
    deviation: ``reference_deviation_norms(probs, reference)`` if already at hand.

    E_l is computed as fl(P_l - R_l) (R_l = fl(1/n) for U), off by at most u |E_l| + u (1 + u) / n
    per entry, so by at most gamma_2 (||E_l||_F + 1) in norm."""
    if deviation is None:
        deviation = reference_deviation_norms(probs, reference)
    return reference_norm + (deviation * value_weight_norm).sum(dim=1)


def reference_deviation_norms(probs: Tensor, reference: Tensor | None) -> Tensor:
    """Deterministic upper bounds (B, h) on ||P_l - R_l||_2 for probs (B, h, n, n) and
    reference R_l (h, n, n), or U = 1 1^T / n for None (see ``near_reference_first_order_bound``
    for the rounding); they also bound ||P_l - fl(1/n)|| for U."""
    deviation = probs - (1.0 / probs.shape[-1] if reference is None else reference)
    rounding = gamma(2) * (torch.linalg.matrix_norm(deviation) * (1.0 + 2.0 ** -30) + 1.0)
    return matrix_norm_upper(deviation, per_sample=True) + rounding


def reference_top_pair(reference: Tensor, f: FirstOrderFactors) -> tuple[Tensor, Tensor]:
    """For one fixed attention R (h, n, n) float64: Lanczos estimates (no guarantee) of
    lambda_max(T'^T T') (1,) (``FirstOrderFactors``' scaled T_R) and of T_R's top right singular
    vector (n d,), the start of the verified zeta near R and of its Rayleigh quotient test."""
    n, d = reference.shape[-1], f.value.shape[1]
    start = (f.direction / math.sqrt(n)).repeat(n) + START_NOISE * fixed_unit_vector(n * d,
                                                                                   f.value.device)
    start = start / torch.linalg.vector_norm(start)
    estimate, direction = lanczos_ritz_pair(first_order_gram(reference[None], f), start[None],
                                            min(REFERENCE_LANCZOS_STEPS, n * d))
    return estimate, direction[0]


def verified_reference_norm(reference: Tensor, f: FirstOrderFactors,
                            estimate: Tensor) -> Tensor:
    """For one fixed attention R (h, n, n) float64 and T_R(G) = H G + sum_l R_l G Wv_l Wo_l: a
    deterministic upper bound on ||T_R|| (a float64 scalar tensor) by the verified zeta's Gram
    matrix and Cholesky proof, at a small slack (it is computed once per block and enters every
    sample's bound); estimate (1,): ``reference_top_pair``'s."""
    negated, error = first_order_negated_gram(reference[None], f)
    verified = verified_norm_from_negated_gram(
        negated, relative_slack=REFERENCE_SLACK, gram_error=error, estimate=estimate,
        lower_only=True, rebuild=lambda rows: first_order_negated_gram(reference[None], f)[0])
    return verified[0] * f.unit


def first_order_estimate(probs: Tensor, f: FirstOrderFactors, start: Tensor,
                          steps: int) -> Tensor:
    """Lanczos estimate (from below, in exact arithmetic) of lambda_max(T'^T T'), matrix-free.
    probs (B, h, n, n), start (n d,) unit -> (B,)."""
    batch, _, n, _ = probs.shape
    dim = n * f.value.shape[1]
    return lanczos_ritz(first_order_gram(probs, f), start.expand(batch, dim), min(steps, dim))


def first_order_gram(probs: Tensor, f: FirstOrderFactors) -> LinearMap:
    """q -> T'^T T' q on row-major vectors (B, n d), matrix-free, for probs (B, h, n, n)."""
    batch, _, n, _ = probs.shape
    d = f.value.shape[1]
    value_t, output_t, probs_t = f.value.mT, f.output.mT, probs.mT

    def gram(q: Tensor) -> Tensor:
        G = q.reshape(batch, n, d)
        Y = mix_heads(probs, G, f.value, f.output) + f.residual * G
        return (mix_heads(probs_t, Y, output_t, value_t) + f.residual * Y).reshape(batch, n * d)

    return gram


def _top_direction(products: Tensor, residual: float) -> Tensor:
    """Unit v (d,) maximising ||v^T Z||, Z = r I + sum_l B'_l: the top left singular vector
    (top eigenvector of Z Z^T; computed once per block). T'(1 g^T) = 1 g^T Z since every softmax
    row sums to 1, so the top right singular vector of T' is often near 1 (x) v."""
    Z = products.sum(dim=0)
    Z = Z + residual * torch.eye(Z.shape[0], dtype=Z.dtype, device=Z.device)
    v = torch.linalg.eigh(Z @ Z.mT).eigenvectors[:, -1]
    norm = torch.linalg.vector_norm(v)
    fallback = fixed_unit_vector(Z.shape[0], Z.device)
    return torch.where(torch.isfinite(norm) & (norm > 0), v / norm.clamp_min(1e-300), fallback)


def _power_of_two(t: Tensor) -> float:
    """2^e with max |t| < 2^e <= 2 max |t| (1 for a zero tensor)."""
    peak = float(t.abs().max()) if t.numel() else 0.0
    if not math.isfinite(peak):
        raise ValueError("attention weights contain NaN or infinity")
    if peak == 0.0:
        return 1.0
    return math.ldexp(1.0, math.frexp(peak)[1])


def mix_heads(probs: Tensor, G: Tensor, first: Tensor, second: Tensor) -> Tensor:
    """sum_l probs_l G first_l second_l: probs (B, h, n, n), G (B, n, d), first (h, d, e),
    second (h, e, d), or each (B, h, ...) for maps of their own per batch item -> (B, n, d);
    or L blocks stacked, probs (L, B, h, n, n), G (L, B, n, d), first (L, h, d, e), second
    (L, h, e, d) -> (L, B, n, d), each block's samples in one product with its own weights.
    The head matrices stay factored (d x e, e x d)."""
    if G.dim() == 4:
        mixed = probs @ torch.einsum("lbnd,lhde->lbhne", G, first)
        return torch.einsum("lbhne,lhef->lbnf", mixed, second)
    if first.dim() == 4:
        mixed = probs @ torch.einsum("bnd,bhde->bhne", G, first)
        return torch.einsum("bhne,bhef->bnf", mixed, second)
    mixed = probs @ torch.einsum("bnd,hde->bhne", G, first)  # (B, h, n, e)
    return torch.einsum("bhne,hef->bnf", mixed, second)


def sample_chunks(total: int, per_item: int, device: torch.device) -> list[slice]:
    """Consecutive slices of range(total) whose working memory (per_item float64 elements each)
    fits the device's workspace (at least one item per slice)."""
    size = max(1, workspace_elements(device) // max(1, per_item))
    return [slice(start, min(start + size, total)) for start in range(0, total, size)]


def as_float64(t: Tensor, device: torch.device | None = None) -> Tensor:
    return t.to(device=device if device is not None else t.device, dtype=torch.float64)
