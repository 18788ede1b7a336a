"""LoFAST local sensitivity of one dot-product attention block (Theorem 1, Lemmas 1 and 2).

The block is F(X) = H X + sum_l P_l(X) X B_l with P_l(X) = row_softmax(X A_l X^T / s + C_l),
A_l = Wq_l Wk_l^T, B_l = Wv_l Wo_l, C_l a fixed (n, n) position bias (0 in the paper's form),
and H = I (residual) or H = 0. For every X' with ||X' - X||_F <= eps:

    ||F(X') - F(X)||_F <= zeta(X) eps
                          + sum_l (kappa eps / s) (m_l(X) + eps ||A_l||) (||X B_l|| + eps ||B_l||)

with zeta = ||T_X||, T_X(G) = H G + sum_l P_l G B_l (Lemma 1), m_l = ||M_l||,
M_l(G) = G A_l X^T + X A_l G^T (Lemma 2) or its relaxation xi_l = ||A_l X^T|| + ||X A_l||, and
kappa a Lipschitz constant of the row softmax (1 in the paper; 1/2 is tight and sound).
The bias changes none of this: the proof bounds ||P_l(X') - P_l(X)||_F by kappa times the change
of the scores, in which C_l cancels, and zeta is the norm of T_X at the biased P_l(X).

Second-order refinement (ours, optional). Expanding the softmax to first order exactly, with
E_l = (G A_l X^T + X A_l G^T + G A_l G^T) / s the change of the scaled scores and J_l the
row-wise softmax Jacobian at X,

    P_l(X') X' B_l - P_l X B_l = P_l G B_l + J_l(E1_l) X B_l              (linear in G)
                                 + J_l(G A_l G^T / s) X B_l + R_l X B_l + (P_l(X') - P_l) G B_l

(E1_l the part of E_l linear in G), where the Taylor remainder of the softmax obeys
||R_l||_F <= ||E_l||_F^2 / 2: per row, D^2 p[e, e]_i = p_i ((e_i - p.e)^2 - Var_p(e)), so
||D^2 p[e, e]||_2 <= sum_i p_i |...| <= 2 Var_p(e) <= ||e||^2 (Popoviciu), and the integral
remainder carries 1/2; over rows, sum ||e_r||^4 <= (sum ||e_r||^2)^2. With
||E_l||_F <= eps rho_l, rho_l = (m_l + eps ||A_l||) / s, this gives

    ||F(X') - F(X)||_F <= (zeta + zeta_s) eps
                          + eps^2 sum_l (kappa ||A_l|| ||X B_l|| / s + rho_l^2 ||X B_l|| / 2
                                         + kappa rho_l ||B_l||)

with zeta_s = ||D_X||, D_X(G) = sum_l J_l(G A_l X^T + X A_l G^T) X B_l / s. It replaces the
first-order part (kappa eps / s) sum_l m_l ||X B_l|| of delta_2, a product of norms, by the norm
of the operator it bounds (often 10x smaller), at the price of terms in eps^2. Both bounds hold,
so ``AttentionSensitivity.delta`` takes their minimum (still nondecreasing in eps).

Near-reference attention (ours). For any fixed reference attention R_l and E_l = P_l - R_l,
T_X = T_R + sum_l E_l (x) B_l with T_R(G) = H G + sum_l R_l G B_l, so

    zeta <= ||T_R|| + sum_l ||E_l|| ||B_l||,

a few n x n norms per sample next to the nd x nd Gram matrix of the verified zeta, with ||T_R||
computed once per block. Certified training drives the scores X A_l X^T to near zero, so the
reference is what attention becomes there: R_l = softmax(C_l) with a position bias, whose
||T_R|| is verified once (Gram matrix and Cholesky, as for zeta), and R_l = U = 1 1^T / n
without one. U is a symmetric projection, and T_U(G) = [H G + U G B] with B = sum_l B_l maps
the orthogonal parts U G and (I - U) G of G to orthogonal parts, U G (H + B) and H (I - U) G,
so ||T_U|| = max(||H||, ||H + B||) in closed form. Near the reference the bound is within
sum_l ||E_l|| ||B_l|| of zeta (zeta >= ||T_R|| - sum_l ||E_l|| ||B_l||);
``attention_sensitivity`` uses it wherever it is within the verified method's slack of the
Lanczos estimate, and the minimum of both elsewhere.

Live attention near the reference (ours; ``bounds.near_reference`` and ``bounds.deflation``).
When the scores depend on the input, the verified method bounds the first-order operator of the
refined bound, the block's Jacobian T_X + D_X, directly: ||T_X + D_X - T_R|| is at most the
head-structured deviation (a maximum over heads, not a sum) plus a cheap bound on ||D_X||, and
with T_R's top right singular subspace and a Cholesky-verified bound on the rest (both once per
block), k products with the Jacobian and k with its adjoint per sample bound its norm up to a
term of second order in that deviation. The refinement's first-order coefficient is then the
smaller of zeta + zeta_s and this bound (``AttentionSensitivity.jacobian``); the Gram matrices
of zeta and of D_X are formed only for samples where the bound is not within JACOBIAN_SLACK of
its Rayleigh-Ritz estimate.

All quantities are float64 and computed once per sample; ``AttentionSensitivity.delta`` then
evaluates the bound for any radii.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lofast.bounds.deflation import LARGE_DEFLATION, Deflation, deflate_gram
from lofast.bounds.near_reference import (
    JacobianData,
    deflated_first_order_bound,
    head_deviation_bound,
    softmax_first_order_bound,
)
from lofast.bounds.spectral import (
    Guarantee,
    LinearMap,
    SpectralMethod,
    fixed_unit_vector,
    gamma,
    lanczos_ritz,
    lanczos_ritz_pair,
    matrix_norm_upper,
    operator_norm,
    verified_norm_from_negated_gram,
    working_elements,
)

# Working memory (float64 elements) for one chunk of samples in a matrix-free norm computation.
# On a CPU the Lanczos basis of a chunk should stay in the last-level cache (2^21 = 16 MiB): the
# reorthogonalisation is memory-bound and runs ~2.5x faster than from main memory. On an
# accelerator larger chunks (2^26 = 512 MiB) keep it busy.
CPU_WORKSPACE_ELEMENTS = 1 << 21
DEVICE_WORKSPACE_ELEMENTS = 1 << 26

# The softmax Jacobian diag(p) - p p^T has spectral norm <= 1/2 (Gershgorin), so no kappa below
# 1/2 is a valid Lipschitz constant for every input.
TIGHT_KAPPA = 0.5

DEFAULT_METHOD = SpectralMethod()  # randomized Lanczos (frozen, safe to share)

# The second-order refinement computes ||D_X|| only where its cheap upper bound exceeds this
# fraction of zeta (below it, the refinement could change the bound by less than that fraction).
SOFTMAX_NEGLIGIBLE = 1e-3

# The verified method keeps the deflated bound on the Jacobian's norm (``near_reference``) where
# it is within this relative slack of its Rayleigh-Ritz estimate, a lower estimate of that norm,
# which is at most zeta + ||D_X||; elsewhere it computes both of those with Gram matrices.
JACOBIAN_SLACK = 1e-2

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
# this relative slack, from a Lanczos estimate with this many steps.
REFERENCE_SLACK = 1e-5
REFERENCE_LANCZOS_STEPS = 60

# Lanczos start for the zeta estimate: this weight of a fixed random direction is added to the
# direction 1 (x) v (v the top left singular vector of Z = H + sum_l B_l: T_X(1 g^T) =
# 1 (Z^T g)^T, see ``_top_direction``), so that the start is never orthogonal to the top
# eigenvector. Only speed and tightness depend on it, never soundness.
START_NOISE = 0.3


@dataclass(frozen=True)
class AttentionSpec:
    """Weights of one attention block, per head l = 1..h.

    query, key: (h, d, dh) Wq_l, Wk_l; value: (h, d, dv) Wv_l; output: (h, dv, d) Wo_l;
    residual: H = I if True else H = 0; scale: s, the score divisor (sqrt(d/h) usually);
    position_bias: None or (h, n, n) C_l, added to the scaled scores (the block then takes
    exactly n tokens).
    """

    query: Tensor
    key: Tensor
    value: Tensor
    output: Tensor
    residual: bool
    scale: float
    position_bias: Tensor | None = None

    def __post_init__(self) -> None:
        shapes = {name: tuple(getattr(self, name).shape)
                  for name in ("query", "key", "value", "output")}
        if any(len(shape) != 3 for shape in shapes.values()):
            raise ValueError(f"attention weights must be 3-d (h, ., .), got {shapes}")
        h, d, dh = shapes["query"]
        dv = shapes["value"][2]
        expected = {"query": (h, d, dh), "key": (h, d, dh), "value": (h, d, dv),
                    "output": (h, dv, d)}
        if shapes != expected or min(h, d, dh, dv) < 1:
            raise ValueError(f"inconsistent attention weight shapes {shapes}; expected "
                             "query, key (h, d, dh), value (h, d, dv), output (h, dv, d)")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"attention scale must be positive and finite, got {self.scale}")
        bias = self.position_bias
        if bias is not None:
            if bias.dim() != 3 or bias.shape[0] != h or bias.shape[1] != bias.shape[2]:
                raise ValueError(f"position bias must be (h, n, n) with h = {h}, got "
                                 f"{tuple(bias.shape)}")
            if not bool(torch.isfinite(bias).all()):
                raise ValueError("position bias contains NaN or infinity")

    @property
    def heads(self) -> int:
        return self.query.shape[0]

    @property
    def width(self) -> int:
        return self.query.shape[1]

    def score_matrices(self) -> Tensor:
        """A_l = Wq_l Wk_l^T, (h, d, d) float64."""
        return _f64(self.query) @ _f64(self.key).mT

    def value_matrices(self) -> Tensor:
        """B_l = Wv_l Wo_l, (h, d, d) float64 (matrix-vector products use the factors)."""
        return _f64(self.value) @ _f64(self.output)

    # Weights-only quantities, computed once per AttentionSpec (a certifier keeps one per
    # block, so once per model) on the weights' device. The tensors must not change afterwards.
    @functools.cached_property
    def weight_norms(self) -> tuple[Tensor, Tensor]:
        """Deterministic upper bounds (||A_l||, ||B_l||), (h,) float64 each."""
        return matrix_norm_upper(self.score_matrices()), matrix_norm_upper(self.value_matrices())

    @functools.cached_property
    def reference_probabilities(self) -> Tensor | None:
        """R_l = row_softmax(C_l) (h, n, n) float64, the attention of vanishing scores; None
        without a position bias (R_l = U then, whose n follows the tokens)."""
        if self.position_bias is None:
            return None
        return torch.softmax(_f64(self.position_bias), dim=-1)

    @functools.cached_property
    def reference_first_order(self) -> tuple[Tensor, Tensor | None]:
        """A deterministic upper bound on ||T_R|| (module docstring), a float64 scalar tensor,
        and a unit vector (n d,) near T_R's top right singular vector (None for R = U, where
        the verified zeta's own start 1 (x) v / sqrt(n) is exact)."""
        if self.reference_probabilities is not None:
            return verified_reference_norm(self.reference_probabilities,
                                           self.first_order_factors)
        norm = uniform_mix_norm(_f64(self.value), _f64(self.output), self.residual)
        return torch.clamp(norm, min=1.0 if self.residual else 0.0), None

    @functools.cached_property
    def first_order_factors(self) -> FirstOrderFactors:
        """The weights-only part of the verified zeta computation."""
        return first_order_factors(_f64(self.value), _f64(self.output), self.residual)

    @functools.cached_property
    def stacked_norms(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Deterministic upper bounds (||Wq||, ||Wk||, ||Wv||, ||Wo||) on the whole matrices
        Wq = [Wq_1 ... Wq_h] (d, h dh), likewise Wk and Wv, and Wo = [Wo_1; ...; Wo_h]
        (h dv, d), float64 scalars."""
        d = self.width
        side = [matrix_norm_upper(_f64(t).permute(1, 0, 2).reshape(d, -1))
                for t in (self.query, self.key, self.value)]
        return (*side, matrix_norm_upper(_f64(self.output).reshape(-1, d)))

    @functools.cached_property
    def jacobian_weights(self) -> tuple[Tensor, Tensor]:
        """[Wv_1 .. Wv_h | Wq_1 .. Wq_h | Wk_1 .. Wk_h] (d, h (dv + 2 dh)) and
        Wo = [Wo_1; ...; Wo_h] (h dv, d), float64: the weights of ``near_reference``'s products."""
        d = self.value.shape[1]
        columns = [_f64(t).permute(1, 0, 2).reshape(d, -1)
                   for t in (self.value, self.query, self.key)]
        return torch.cat(columns, dim=1).contiguous(), _f64(self.output).reshape(-1, d)

    @functools.cached_property
    def _deflations(self) -> dict[tuple[int, bool], Deflation]:
        return {}

    def deflation(self, tokens: int, large: bool = False) -> Deflation:
        """``deflation.deflate_gram`` of the reference T_R for ``tokens`` tokens (R_l, or
        fl(1/n) for U, whose rounding the deviation bound covers), complement in the units of
        T_R; with ``large``, of size LARGE_DEFLATION. Computed once per token count and size
        (from the Kronecker Gram of the verified zeta)."""
        if (tokens, large) not in self._deflations:
            f = self.first_order_factors
            reference = self.reference_probabilities
            if reference is None:
                reference = torch.full((self.heads, tokens, tokens), 1.0 / tokens,
                                       dtype=torch.float64, device=self.value.device)
            negated, error = first_order_negated_gram(reference[None], f)
            deflation = deflate_gram(negated[0], float(error[0]),
                                     _first_order_gram(reference[None], f),
                                     LARGE_DEFLATION if large else None)
            self._deflations[tokens, large] = dataclasses.replace(
                deflation, complement=deflation.complement * f.unit)
        return self._deflations[tokens, large]


@dataclass(frozen=True)
class AttentionSensitivity:
    """Per-sample, eps-independent quantities of one block; delta(eps) is a scalar formula.

    guarantee: the weakest guarantee of the norms (see ``spectral.Guarantee``);
    failure_probability: per sample, a union bound over its probabilistic norms (0 unless the
    guarantee is PROBABILISTIC).
    """

    zeta: Tensor  # (B,) first-order sensitivity ||T_X|| (or the naive eq.-12 value)
    score_sensitivity: Tensor  # (B, h) m_l(X) = ||M_l|| or its relaxation xi_l(X)
    value_norm: Tensor  # (B, h) ||X B_l||
    score_weight_norm: Tensor  # (h,) ||A_l||
    value_weight_norm: Tensor  # (h,) ||B_l||
    scale: float  # s
    kappa: float  # softmax Lipschitz constant used (1 = paper, 0.5 = tight)
    guarantee: Guarantee = Guarantee.EXACT
    failure_probability: float = 0.0
    softmax_first_order: Tensor | None = None  # (B,) zeta_s >= ||D_X||: enables the refinement
    jacobian: Tensor | None = None  # (B,) >= ||T_X + D_X||, used by the refinement if given

    def delta(self, eps: Tensor) -> Tensor:
        """Bound on ||F(X') - F(X)||_F over ||X' - X||_F <= eps.

        eps: (B,) or (B, E) radii >= 0. Returns the same shape:
        zeta eps + sum_l (kappa eps / s)(m_l + eps ||A_l||)(||X B_l|| + eps ||B_l||), a
        polynomial in eps with nonnegative coefficients, hence nondecreasing in eps; with
        ``softmax_first_order`` set, the minimum of that and the second-order refinement (see
        the module docstring), also nondecreasing.
        """
        if eps.dim() not in (1, 2) or eps.shape[0] != self.zeta.shape[0]:
            raise ValueError(f"eps must have shape (B,) or (B, E) with B = {self.zeta.shape[0]}, "
                             f"got {tuple(eps.shape)}")
        eps = eps.to(device=self.zeta.device, dtype=torch.float64)  # float64 whatever the inputs
        extra = (None,) * (eps.dim() - 1)  # broadcast the per-sample quantities over E
        zeta = self.zeta[(slice(None), *extra)]
        score = self.score_sensitivity[(slice(None), *extra, slice(None))]
        value = self.value_norm[(slice(None), *extra, slice(None))]
        e = eps[..., None]
        second = (score + e * self.score_weight_norm) * (value + e * self.value_weight_norm)
        lipschitz = zeta * eps + (self.kappa / self.scale) * eps * second.sum(dim=-1)
        if self.softmax_first_order is None:
            return lipschitz
        linear = zeta + self.softmax_first_order[(slice(None), *extra)]  # >= ||T_X + D_X||
        if self.jacobian is not None:
            linear = torch.minimum(linear, self.jacobian[(slice(None), *extra)])
        refined = linear * eps + self.second_order_terms(eps)
        return torch.minimum(lipschitz, refined)

    def second_order_terms(self, eps: Tensor) -> Tensor:
        """eps^2 sum_l (kappa ||A_l|| ||X B_l|| / s + rho_l^2 ||X B_l|| / 2 + kappa rho_l ||B_l||),
        rho_l = (m_l + eps ||A_l||) / s: a bound on ||F(X') - F(X) - J_X (X' - X)||_F with J_X
        the block's Jacobian at X (= T_X + D_X). eps (B,) or (B, E) float64 -> same shape."""
        extra = (None,) * (eps.dim() - 1)
        score = self.score_sensitivity[(slice(None), *extra, slice(None))]
        value = self.value_norm[(slice(None), *extra, slice(None))]
        rate = (score + eps[..., None] * self.score_weight_norm) / self.scale  # rho_l
        quadratic = (self.kappa * self.score_weight_norm / self.scale * value
                     + 0.5 * rate.square() * value + self.kappa * rate * self.value_weight_norm)
        return eps.square() * quadratic.sum(dim=-1)


def attention_probabilities(X: Tensor, w: AttentionSpec) -> Tensor:
    """P_l(X) = row_softmax(X Wq_l (X Wk_l)^T / s + C_l): (B, n, d) -> (B, h, n, n) float64."""
    X = _check_tokens(X, w)
    return _probabilities(X, w)


def attention_forward(X: Tensor, w: AttentionSpec) -> Tensor:
    """The exact block F(X) = H X + sum_l P_l(X) X Wv_l Wo_l: (B, n, d) -> (B, n, d) float64."""
    X = _check_tokens(X, w)
    probs = _probabilities(X, w)
    out = _mix(probs, X, _f64(w.value, X.device), _f64(w.output, X.device))
    return out + X if w.residual else out


def attention_sensitivity(X: Tensor, w: AttentionSpec, *, kappa: float = 0.5,
                          first_order: str = "lofast", score_bound: str = "exact",
                          softmax_jacobian: bool = False,
                          method: SpectralMethod = DEFAULT_METHOD,
                          generator: torch.Generator | None = None) -> AttentionSensitivity:
    """The LoFAST quantities of one block at clean tokens X (B, n, d).

    first_order: "lofast" (zeta = ||T_X||, exact by Lemma 1) or "naive" (eq. 12:
    ||H|| + sum_l ||B_l|| ||P_l(X)||). score_bound: "exact" (m_l = ||M_l||, delta_2^(1)) or
    "relaxed" (xi_l = ||A_l X^T|| + ||X A_l||, delta_2^(2)). kappa >= 1/2: the softmax constant.
    softmax_jacobian: also bound zeta_s = ||D_X|| (one more matrix-free norm per sample) for the
    second-order refinement of the module docstring.

    The matrix-free norms ||T_X|| and ||M_l|| use ``method``; every explicit matrix norm
    (||X B_l||, ||A_l X^T||, ||X A_l||, ||P_l||, ||A_l||, ||B_l||) is a deterministic upper bound
    (``matrix_norm_upper``). The returned guarantee is the weakest involved.
    """
    if first_order not in ("lofast", "naive"):
        raise ValueError(f"first_order must be 'lofast' or 'naive', got {first_order!r}")
    if score_bound not in ("exact", "relaxed"):
        raise ValueError(f"score_bound must be 'exact' or 'relaxed', got {score_bound!r}")
    if not (math.isfinite(kappa) and kappa >= TIGHT_KAPPA):
        raise ValueError(f"kappa must be >= {TIGHT_KAPPA} (the softmax's tight Lipschitz "
                         f"constant), got {kappa}")
    X = _check_tokens(X, w)
    device = X.device
    query, key = _f64(w.query, device), _f64(w.key, device)
    value, output = _f64(w.value, device), _f64(w.output, device)
    score_weights = query @ key.mT  # (h, d, d) A_l
    # einsum keeps these single matrix products; a broadcast (B, 1, n, d) @ (h, d, d) would copy
    # the weights once per sample
    x_score = torch.einsum("bnd,hde->bhne", X, score_weights)  # (B, h, n, d) X A_l
    x_query = torch.einsum("bnd,hde->bhne", X, query)  # (B, h, n, dh) X Wq_l
    x_key = torch.einsum("bnd,hde->bhne", X, key)  # (B, h, n, dh) X Wk_l
    probs = probabilities_from_projections(x_query, x_key, w.scale,
                                           _bias(w, device))  # (B, h, n, n)
    x_value = torch.einsum("bnd,hde->bhne", X, value)  # (B, h, n, dv) X Wv_l
    x_value_out = torch.einsum("bhne,hef->bhnf", x_value, output)  # (B, h, n, d) X B_l
    value_norm = matrix_norm_upper(x_value_out)  # ||X B_l||
    same_device = w.query.device == device
    score_weight_norm, value_weight_norm = (
        w.weight_norms if same_device else (matrix_norm_upper(score_weights),
                                            matrix_norm_upper(value @ output)))
    x_score_t = torch.einsum("bnd,hed->bhne", X, score_weights)  # X A_l^T; = ||A_l X^T||

    matrix_free = 0  # probabilistic / estimated norms per sample
    if score_bound == "exact":
        score = _score_norm(x_score, x_score_t, method, generator)
        matrix_free += w.heads
    else:
        score = matrix_norm_upper(x_score_t) + matrix_norm_upper(x_score)

    # ||D_X|| <= sum_l ||J_l|| m_l ||X B_l|| / s with ||J_l|| <= 1/2
    softmax = (score * value_norm).sum(dim=1) / (2.0 * w.scale) if softmax_jacobian else None
    jacobian = None
    if first_order == "lofast":
        reference = w.reference_probabilities
        reference_norm, reference_direction = w.reference_first_order
        reference = None if reference is None else reference.to(device)
        deviation = reference_deviation_norms(probs, reference)  # >= ||P_l - R_l||
        near = near_reference_first_order_bound(probs, reference, reference_norm.to(device),
                                                value_weight_norm, deviation)
        if method.kind == "verified" and same_device:
            zeta, softmax, jacobian = _verified_near_reference(
                X, probs, x_query, x_key, x_value, x_value_out, score, w, method, near,
                deviation, softmax)
        elif method.kind == "verified":
            zeta = verified_first_order_norm(
                probs, first_order_factors(value, output, w.residual), method, known=near,
                along=None if reference_direction is None else reference_direction.to(device))
        else:
            zeta = torch.minimum(near, _first_order_norm(X, probs, value, output, w.residual,
                                                         method, generator))
        matrix_free += 1
    else:
        identity_norm = 1.0 if w.residual else 0.0
        zeta = identity_norm + (value_weight_norm * matrix_norm_upper(probs)).sum(dim=1)

    if softmax is not None:
        # the operator norm is computed only where the cheap bound is not already negligible
        # next to zeta, and not at all where the Jacobian's norm was bounded directly
        rows = softmax > SOFTMAX_NEGLIGIBLE * zeta
        if jacobian is None and rows.any():
            exact = _softmax_first_order_norm(probs[rows], x_query[rows], x_key[rows],
                                              x_value_out[rows], query, key, score[rows],
                                              w.scale, method, generator)
            softmax[rows] = torch.minimum(softmax[rows], exact)
        matrix_free += 1

    guarantee = method.guarantee if matrix_free else Guarantee.EXACT
    failure = (matrix_free * method.failure_probability
               if guarantee is Guarantee.PROBABILISTIC else 0.0)
    return AttentionSensitivity(zeta=zeta, score_sensitivity=score, value_norm=value_norm,
                                score_weight_norm=score_weight_norm,
                                value_weight_norm=value_weight_norm, scale=float(w.scale),
                                kappa=float(kappa), guarantee=guarantee,
                                failure_probability=failure, softmax_first_order=softmax,
                                jacobian=jacobian)


def _verified_near_reference(X: Tensor, probs: Tensor, x_query: Tensor, x_key: Tensor,
                             x_value: Tensor, x_value_out: Tensor, score: Tensor,
                             w: AttentionSpec, method: SpectralMethod, near: Tensor,
                             deviation: Tensor,
                             softmax: Tensor | None) -> tuple[Tensor, Tensor | None,
                                                               Tensor | None]:
    """zeta, zeta_s and the Jacobian bound (B,) each (the last two None without the
    refinement) of the verified method, deterministic upper bounds.

    First the bounds near the reference (``bounds.near_reference``): zeta <= ||T_R|| plus the
    head-structured deviation, and the cheap ||D_X|| bound. Samples where zeta is not within the
    method's slack of the Rayleigh quotient at ``reference_first_order``'s direction, or where
    the cheap ||D_X|| is not negligible (SOFTMAX_NEGLIGIBLE), get the deflated bound: on
    ||T_X + D_X|| with the refinement (which also bounds zeta <= ||T_X + D_X|| + ||D_X||), on
    ||T_X|| without. Where that bound is not within JACOBIAN_SLACK (with the refinement) or the
    method's slack (without) of its Rayleigh-Ritz estimate, the deflation of size
    LARGE_DEFLATION is tried; only where that one is not either, the Kronecker Gram's Cholesky
    proof (``verified_first_order_norm``) and, with the refinement, the verified ||D_X||
    follow, as without the near-reference bounds. near: the near-reference bound; deviation
    (B, h): upper bounds on ||P_l - R_l||; softmax: the product bound on ||D_X|| or None."""
    n = X.shape[1]
    f = w.first_order_factors
    reference_norm, direction = w.reference_first_order
    query_stacked, key_stacked, value_stacked, output_stacked = w.stacked_norms
    deviation = head_deviation_bound(deviation, w.weight_norms[1],
                                     value_stacked * output_stacked)
    zeta = torch.minimum(near, reference_norm + deviation)
    query, key = _f64(w.query), _f64(w.key)
    if softmax is not None:
        # the centred bound only where the product bound is not already negligible
        rows = softmax > SOFTMAX_NEGLIGIBLE * zeta
        if bool(rows.any()):
            softmax[rows] = torch.minimum(softmax[rows], softmax_first_order_bound(
                X[rows], probs[rows], x_query[rows], key, _f64(w.value),
                (query_stacked, key_stacked, output_stacked), w.scale))
    along = (f.direction / math.sqrt(n)).repeat(n) if direction is None else direction
    slack = 1.0 + method.relative_slack
    settled = zeta <= _first_order_estimate(probs, f, along, 1).clamp_min(0.0).sqrt() * (
        slack * f.unit)
    rows = ~settled
    if softmax is not None:
        rows = rows | (softmax > SOFTMAX_NEGLIGIBLE * zeta)
    jacobian = None if softmax is None else zeta + softmax
    if not bool(rows.any()):
        return zeta, softmax, jacobian
    projections, output = w.jacobian_weights
    loose = rows.clone()
    for large in (False, True):  # the larger deflation only for samples the first leaves loose
        if large and (not bool(loose.any()) or w.deflation(n).size >= LARGE_DEFLATION):
            break
        data = JacobianData(probs=probs[loose], x_query=x_query[loose], x_key=x_key[loose],
                            x_value=x_value[loose], projections=projections, output=output,
                            residual=1.0 if w.residual else 0.0, scale=float(w.scale))
        bound, ritz = deflated_first_order_bound(data, w.deflation(n, large), reference_norm,
                                                 deviation[loose],
                                                 None if softmax is None else softmax[loose])
        if softmax is None:
            zeta[loose] = torch.minimum(zeta[loose], bound)
            loose[loose.clone()] = ~settled[loose] & ~(zeta[loose] <= ritz * slack)
        else:
            # ||T_X|| <= ||T_X + D_X|| + ||D_X||
            zeta[loose] = torch.minimum(zeta[loose], bound + softmax[loose])
            jacobian[loose] = torch.minimum(jacobian[loose], bound)
            loose[loose.clone()] = ~(bound <= ritz * (1.0 + JACOBIAN_SLACK))
    if bool(loose.any()):
        zeta[loose] = verified_first_order_norm(probs[loose], f, method, known=zeta[loose],
                                                along=along)
        if softmax is not None:
            softmax[loose] = torch.minimum(softmax[loose], _softmax_first_order_norm(
                probs[loose], x_query[loose], x_key[loose], x_value_out[loose], query, key,
                score[loose], w.scale, method, None))
            jacobian[loose] = torch.minimum(jacobian[loose], zeta[loose] + softmax[loose])
    return zeta, softmax, jacobian


def _softmax_first_order_norm(probs: Tensor, x_query: Tensor, x_key: Tensor, x_value_out: Tensor,
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
    for rows in _chunks(batch, working_elements(method, n * d, n * k), probs.device):
        p = probs[rows]
        apply, adjoint = softmax_first_order_maps(p, x_query[rows], x_key[rows], query, key,
                                                  factor[rows], scale)
        parts.append(operator_norm(apply, adjoint, (n, d), p.shape[0], method,
                                   device=probs.device, generator=generator))
    qr_error = (gamma(64 * d * heads * n) * torch.linalg.vector_norm(stacked, dim=(1, 2))
                * torch.linalg.vector_norm(score / 2, dim=1) / scale)
    return (torch.cat(parts) + qr_error) * (1.0 + 2.0 ** -40)


def _first_order_norm(X: Tensor, probs: Tensor, value: Tensor, output: Tensor, residual: bool,
                      method: SpectralMethod, generator: torch.Generator | None) -> Tensor:
    """zeta = ||T_X|| per sample, T_X(G) = H G + sum_l P_l G Wv_l Wo_l (n x d -> n x d), with
    adjoint T_X*(Y) = H^T Y + sum_l P_l^T Y Wo_l^T Wv_l^T. Returns (B,)."""
    batch, n, d = X.shape
    parts = []
    for rows in _chunks(batch, working_elements(method, n * d, n * d), X.device):
        apply, adjoint = first_order_maps(probs[rows], value, output, residual)
        parts.append(operator_norm(apply, adjoint, (n, d), rows.stop - rows.start, method,
                                   device=X.device, generator=generator))
    return torch.cat(parts)


def first_order_maps(probs: Tensor, value: Tensor, output: Tensor,
                     residual: bool) -> tuple[LinearMap, LinearMap]:
    """T_X(G) = H G + sum_l P_l G Wv_l Wo_l and its adjoint
    T_X*(Y) = H^T Y + sum_l P_l^T Y Wo_l^T Wv_l^T, on (B, n, d), for probs (B, h, n, n)."""

    def apply(G: Tensor) -> Tensor:
        out = _mix(probs, G, value, output)
        return out + G if residual else out

    def adjoint(Y: Tensor) -> Tensor:
        out = _mix(probs.mT, Y, output.mT, value.mT)
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

    weights: Tensor  # (Q, d * d): -F_l F_m^T, one row per pair (left[q], right[q])
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
    triangle (T' from ``FirstOrderFactors``). The blocks come from one GEMM
    (B n(n+1)/2, Q) @ (Q, d^2) with rows (P_l^T P_m)[i, j] and columns F_l F_m^T (Q = L^2
    pairs (l, m), L = h + residual). ``out``:
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
    blocks = (coefficients.reshape(-1, len(f.left)) @ f.weights).reshape(batch, -1, d, d)
    buffer = (torch.empty(batch, n * d, n * d, dtype=torch.float64, device=probs.device)
              if out is None else out)
    view = buffer.view(batch, n, d, n, d)
    for k, (i, j) in enumerate(zip(rows.tolist(), cols.tolist())):
        view[:, i, :, j, :] = blocks[:, k]
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
    budget = VERIFIED_CPU_ELEMENTS if probs.device.type == "cpu" else DEVICE_WORKSPACE_ELEMENTS
    size = min(batch, max(1, budget // (3 * dim * dim + method.estimate_steps * dim)))
    noise = fixed_unit_vector(dim, probs.device)
    if along is None:
        along = (f.direction / math.sqrt(n)).repeat(n)  # 1_n (x) v / sqrt(n), row-major vec
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
            estimate = _first_order_estimate(p[todo], f, vector, steps)
            # the first bound the verification would try (in units of f.unit); NaN: verify
            tried = estimate.clamp_min(0.0).sqrt() * (1.0 + method.relative_slack)
            unsettled = ~(chunk[todo] <= tried * f.unit)
            todo, estimate = todo[unsettled], estimate[unsettled]
        if len(todo) == 0:
            continue
        negated, error = first_order_negated_gram(p[todo], f, workspace[: len(todo)])
        verified = verified_norm_from_negated_gram(
            negated, relative_slack=method.relative_slack, gram_error=error,
            estimate=estimate, lower_only=True) * f.unit
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
    return matrix_norm_upper(deviation) + rounding


def verified_reference_norm(reference: Tensor, f: FirstOrderFactors) -> tuple[Tensor, Tensor]:
    """For one fixed attention R (h, n, n) float64 and T_R(G) = H G + sum_l R_l G Wv_l Wo_l: a
    deterministic upper bound on ||T_R|| (a float64 scalar tensor) by the verified zeta's Gram
    matrix and Cholesky proof, at a small slack (it is computed once per block and enters every
    sample's bound), and an estimate of T_R's top right singular vector (n d,) by Lanczos, the
    start of the verified zeta near R."""
    n, d = reference.shape[-1], f.value.shape[1]
    start = (f.direction / math.sqrt(n)).repeat(n) + START_NOISE * fixed_unit_vector(n * d,
                                                                                   f.value.device)
    start = start / torch.linalg.vector_norm(start)
    estimate, direction = lanczos_ritz_pair(_first_order_gram(reference[None], f), start[None],
                                            min(REFERENCE_LANCZOS_STEPS, n * d))
    negated, error = first_order_negated_gram(reference[None], f)
    verified = verified_norm_from_negated_gram(negated, relative_slack=REFERENCE_SLACK,
                                               gram_error=error, estimate=estimate,
                                               lower_only=True)
    return verified[0] * f.unit, direction[0]


def _first_order_estimate(probs: Tensor, f: FirstOrderFactors, start: Tensor,
                          steps: int) -> Tensor:
    """Lanczos estimate (from below, in exact arithmetic) of lambda_max(T'^T T'), matrix-free.
    probs (B, h, n, n), start (n d,) unit -> (B,)."""
    batch, _, n, _ = probs.shape
    dim = n * f.value.shape[1]
    return lanczos_ritz(_first_order_gram(probs, f), start.expand(batch, dim), min(steps, dim))


def _first_order_gram(probs: Tensor, f: FirstOrderFactors) -> LinearMap:
    """q -> T'^T T' q on row-major vectors (B, n d), matrix-free, for probs (B, h, n, n)."""
    batch, _, n, _ = probs.shape
    d = f.value.shape[1]
    value_t, output_t, probs_t = f.value.mT, f.output.mT, probs.mT

    def gram(q: Tensor) -> Tensor:
        G = q.reshape(batch, n, d)
        Y = _mix(probs, G, f.value, f.output) + f.residual * G
        return (_mix(probs_t, Y, output_t, value_t) + f.residual * Y).reshape(batch, n * d)

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


def _score_norm(x_score: Tensor, x_score_t: Tensor, method: SpectralMethod,
                generator: torch.Generator | None) -> Tensor:
    """m_l = ||M_l|| per (sample, head), M_l(G) = G A_l X^T + X A_l G^T (n x d -> n x n), with
    adjoint M_l*(Y) = Y X A_l^T + Y^T X A_l. Heads are folded into the batch. Returns (B, h)."""
    batch, heads, n, d = x_score.shape
    xa = x_score.reshape(batch * heads, n, d)
    xat = x_score_t.reshape(batch * heads, n, d)
    parts = []
    for rows in _chunks(batch * heads, working_elements(method, n * d, n * n), xa.device):
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


def _probabilities(X: Tensor, w: AttentionSpec) -> Tensor:
    """P_l(X) in float64 for float64 tokens X (B, n, d) -> (B, h, n, n)."""
    query, key = _f64(w.query, X.device), _f64(w.key, X.device)
    return probabilities_from_projections(torch.einsum("bnd,hde->bhne", X, query),
                                          torch.einsum("bnd,hde->bhne", X, key), w.scale,
                                          _bias(w, X.device))


def probabilities_from_projections(x_query: Tensor, x_key: Tensor, scale: float,
                                   bias: Tensor | None = None) -> Tensor:
    """row_softmax(Q_l K_l^T / s + C_l) for Q_l = X Wq_l, K_l = X Wk_l (B, h, n, dh) and an
    optional position bias C_l (h, n, n) -> (B, h, n, n), in the projections' dtype."""
    scores = x_query @ x_key.mT / scale
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    return torch.softmax(scores, dim=-1)


def _bias(w: AttentionSpec, device: torch.device) -> Tensor | None:
    return None if w.position_bias is None else _f64(w.position_bias, device)


def _mix(probs: Tensor, G: Tensor, first: Tensor, second: Tensor) -> Tensor:
    """sum_l probs_l G first_l second_l: probs (B, h, n, n), G (B, n, d), first (h, d, e),
    second (h, e, d) -> (B, n, d). The head matrices stay factored (d x e, e x d)."""
    mixed = probs @ torch.einsum("bnd,hde->bhne", G, first)  # (B, h, n, e)
    return torch.einsum("bhne,hef->bnf", mixed, second)


def _chunks(total: int, per_item: int, device: torch.device) -> list[slice]:
    """Consecutive slices of range(total) whose working memory (per_item float64 elements each)
    fits the device's workspace (at least one item per slice)."""
    budget = CPU_WORKSPACE_ELEMENTS if device.type == "cpu" else DEVICE_WORKSPACE_ELEMENTS
    size = max(1, budget // max(1, per_item))
    return [slice(start, min(start + size, total)) for start in range(0, total, size)]


def _check_tokens(X: Tensor, w: AttentionSpec) -> Tensor:
    """Validate clean tokens (B, n, d) and return them as float64."""
    if not isinstance(X, Tensor) or X.dim() != 3:
        raise ValueError(f"tokens must be a tensor (B, n, d), got "
                         f"{tuple(X.shape) if isinstance(X, Tensor) else type(X).__name__}")
    if X.shape[2] != w.width:
        raise ValueError(f"tokens have width {X.shape[2]}, the attention weights expect {w.width}")
    if w.position_bias is not None and X.shape[1] != w.position_bias.shape[-1]:
        raise ValueError(f"{X.shape[1]} tokens, the position bias expects "
                         f"{w.position_bias.shape[-1]}")
    if X.shape[0] < 1 or X.shape[1] < 1:
        raise ValueError(f"tokens must have at least one sample and one token, got {tuple(X.shape)}")
    X = X.to(torch.float64)
    if not torch.isfinite(X).all():
        raise ValueError("tokens contain NaN or infinity")
    return X


def _f64(t: Tensor, device: torch.device | None = None) -> Tensor:
    return t.to(device=device if device is not None else t.device, dtype=torch.float64)
