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
||R_l||_F <= gamma ||E_l||_F^2 with gamma = SOFTMAX_REMAINDER = sqrt(6) / 18 (about 0.136):

    Theorem (ours). For p = softmax(s) and every e in R^n,
    ||D^2 p(s)[e, e]||_2 <= (sqrt(6) / 9) ||C e||^2, C = I - 1 1^T / n, with equality for
    two tokens at p_1 = (3 - sqrt(3)) / 6.
    Proof. D^2 p[e, e]_i = p_i ((e_i - p.e)^2 - Var_p(e)), so w^T D^2 p[e, e] = T(e, e, w)
    with T(a, b, c) = E_p[(a - E_p a)(b - E_p b)(c - E_p c)], the third cumulant: symmetric
    trilinear, unchanged by adding constants to its arguments, so T(e, e, w) = T(Ce, Ce, Cw)
    and ||Cw|| <= ||w||. On the Hilbert space 1^perp the norm of a symmetric trilinear form
    equals sup |T(y, y, y)| over unit y (Banach, Studia Math. 7, 1938). T(y, y, y) is the third
    central moment of a variable with values y_i in an interval of length
    L <= sqrt(2) ||y||, and such a moment is at most L^3 / (6 sqrt(3)) in size: for a fixed
    mean the extremes are two-point laws (the concave envelope of (y - mu)^3), and a two-point
    law at distances a, b on either side of its mean has third moment a b (b - a) with
    a + b <= L, at most L^3 q (1 - q)(1 - 2 q) <= L^3 / (6 sqrt(3)). Hence
    ||D^2 p[e, e]|| <= 2 sqrt(2) / (6 sqrt(3)) ||Ce||^2 = (sqrt(6) / 9) ||Ce||^2.
    The integral remainder carries 1/2: ||R_r|| <= (sqrt(6) / 18) ||e_r C||^2 per row.

Over rows, sum ||e_r||^4 <= (sum ||e_r||^2)^2. With ||E_l||_F <= eps rho_l,
rho_l = (m_l + eps ||A_l||) / s, this gives

    ||F(X') - F(X)||_F <= (zeta + zeta_s) eps
                          + eps^2 sum_l (kappa ||A_l|| ||X B_l|| / s + gamma rho_l^2 ||X B_l||
                                         + kappa rho_l ||B_l||)

with zeta_s = ||D_X||, D_X(G) = sum_l J_l(G A_l X^T + X A_l G^T) X B_l / s. Two sharper
forms of these terms are used (``AttentionSensitivity.second_order_parts``): the rows of
J_l(.) and of R_l sum to zero, so ||X B_l|| in the first two may be that of the centred rows
(I - 1 1^T / n) X B_l; and sum ||e_r||^4 <= max_r ||e_r||^2 ||E_l||_F^2, where a row of the
score change is at most eps (||X A_l^T|| + max_r ||x_r A_l|| + eps ||A_l||) / s.

Centred scores. The row softmax does not see a change common to a row of scores:
p(s + e) = p(s + e - c 1) for every c, and J 1 = 0, so P_l(X'), J_l(E_l) and R_l are the same
for E_l and E_l C with C = I - 1 1^T / n acting on the keys' side. Every bound above that passes
E_l through the softmax may therefore use ||E_l C||_F <= eps (m_l^c + eps ||A_l||) / s with
m_l^c >= ||G -> M_l(G) C||, which is at most m_l (||C|| = 1) and at most ||C X A_l^T|| + ||X A_l||
(G A_l X^T C = G (C X A_l^T)^T, ||X A_l G^T C||_F <= ||X A_l|| ||G||_F), and a row of E_l C is
at most eps (||C X A_l^T|| + max_r ||x_r A_l|| + eps ||A_l||) / s. Tokens that share a common
vector (the usual case after a projection) have ||C X A_l^T|| below ||X A_l^T||. In the
Lipschitz form, (P_l(X') - P_l) X' B_l = (P_l(X') - P_l) C X' B_l likewise sees only the
centred values, ||C X' B_l|| <= ||C X B_l|| + eps ||B_l||. The refinement replaces the
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
``attention_sensitivity`` uses it wherever it is within the method's slack of the Rayleigh
quotient at T_R's top vector (verified and Lanczos methods), and the minimum of both elsewhere.

Live attention near the reference (ours; ``bounds.near_reference`` and ``bounds.deflation``).
When the scores depend on the input, the verified and Lanczos methods bound the first-order
operator of the refined bound, the block's Jacobian T_X + D_X, directly: ||T_X + D_X - T_R|| is
at most the head-structured deviation (a maximum over heads, not a sum) plus a cheap bound on
||D_X||, and with T_R's top right singular subspace and a Cholesky-verified bound on the rest
(both once per block), k products with the Jacobian and k with its adjoint per sample bound its
norm up to a term of second order in that deviation. The refinement's first-order coefficient is
then the smaller of zeta + zeta_s and this bound (``AttentionSensitivity.jacobian``); the
method's own norms of zeta and of D_X (Gram matrices, Lanczos) are computed only for samples
where the bound is not within the method's ``jacobian_slack`` of its Rayleigh-Ritz estimate.
When scores and values both act on the heads' own coordinates
(``AttentionSpec.coordinate_attention``), the Jacobian's norm comes from one small operator per
head and sample instead (``bounds.coordinate_jacobian``).

All quantities are float64 and computed once per sample; ``AttentionSensitivity.delta`` then
evaluates the bound for any radii.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lofast.bounds.attention_norms import BlockAtX, DeferredProofs, attention_norms
from lofast.bounds.attention_spec import AttentionSpec, product_factors
from lofast.bounds.first_order import as_float64, mix_heads
from lofast.bounds.softmax_terms import probabilities_from_projections, score_norm
from lofast.bounds.spectral import (
    ROUNDING_MARGIN,
    Guarantee,
    ProductFactor,
    SpectralMethod,
    matrix_norm_upper,
    product_norm_upper,
    takes_the_factors,
)
from lofast.bounds.verified import gamma

# The softmax Jacobian diag(p) - p p^T has spectral norm <= 1/2 (Gershgorin), so no kappa below
# 1/2 is a valid Lipschitz constant for every input.
TIGHT_KAPPA = 0.5

# The softmax's Taylor remainder: ||p(s + e) - p(s) - J(s) e|| <= SOFTMAX_REMAINDER ||C e||^2
# (module docstring; half of sup ||D^2 p[e, e]|| / ||C e||^2 = sqrt(6) / 9, which is attained).
SOFTMAX_REMAINDER = math.sqrt(6.0) / 18.0

DEFAULT_METHOD = SpectralMethod()  # randomized Lanczos (frozen, safe to share)

# Probabilistic norms of a block's position-biased reference that a Lanczos method draws once per
# model and every sample's certificate then uses: ||T_R|| and two deflations' complements.
PER_MODEL_NORMS = 3


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
    # (B, h) >= ||(I - 1 1^T / n) X B_l||: J_l(.) and the softmax remainder have rows summing to
    # zero, so they see X B_l only through its centred rows (value_norm where not given)
    centered_value_norm: Tensor | None = None
    # (B, h) >= ||C X A_l^T|| + max_r ||x_r A_l||: with eps ||A_l|| added and divided by s, a
    # bound on the largest centred row of a score change, max_r ||e_r C|| / eps (rho_l where not
    # given)
    row_score_sensitivity: Tensor | None = None
    # (B, h) m_l^c >= ||G -> M_l(G) C||, at most score_sensitivity: the softmax does not see a
    # change common to a row of scores, so every term that passes E_l through it may take the
    # centred change E_l C (score_sensitivity where not given; module docstring)
    centered_score_sensitivity: Tensor | None = None
    # from a cheap pass only (``attention_norms`` with cheap): the per-sample proofs skipped,
    # for ``with_proofs`` (None: every proof was made, or none was wanted)
    deferred: DeferredProofs | None = None

    def with_proofs(self, rows: Tensor) -> AttentionSensitivity:
        """These quantities with the deferred proofs made for the samples rows (B,) bool (those
        of them a proof would run on): on those samples the full walk's bounds (no larger than
        the cheap ones, the minimum taken), elsewhere unchanged; ``deferred`` dropped. The
        guarantee and failure probability already count the proofs' norms."""
        if self.deferred is None:
            return self
        rows = rows & self.deferred.rows
        changes: dict[str, Tensor | None] = {"deferred": None}
        if bool(rows.any()):
            norms = self.deferred.make(rows)
            for name, value in (("zeta", norms.zeta), ("softmax_first_order", norms.softmax),
                                ("jacobian", norms.jacobian)):
                current = getattr(self, name)
                if value is None or current is None:  # only a bound both walks made
                    continue
                current = current.clone()
                current[rows] = torch.minimum(current[rows], value)
                changes[name] = current
        return dataclasses.replace(self, **changes)

    def with_lower_estimates(self, rows: Tensor) -> AttentionSensitivity:
        """These quantities at the best the deferred proofs could make them on the samples rows
        (B,) bool (those of them a proof would run on): zeta and the first-order coefficient of
        the refinement lowered to lower bounds on the norms they bound
        (``DeferredProofs.lower_estimates``), elsewhere unchanged; ``deferred`` dropped.
        ``delta`` is nondecreasing in both, and the proofs of an exact or probabilistic
        guarantee bound neither below those norms, so ``with_proofs`` gives these rows a delta
        at least this one's: a sample these leave uncertified at some eps, the proofs leave
        uncertified there too. Not a certificate."""
        if self.deferred is None:
            return self
        rows = rows & self.deferred.rows
        changes: dict[str, Tensor | None] = {"deferred": None}
        if bool(rows.any()):
            first_order, jacobian = self.deferred.lower_estimates(rows)
            zeta = self.zeta.clone()
            zeta[rows] = torch.minimum(zeta[rows], first_order)
            changes["zeta"] = zeta
            if self.softmax_first_order is not None:  # min(zeta + zeta_s, jacobian) <= it
                current = self.refined_first_order.clone()
                current[rows] = torch.minimum(current[rows], jacobian)
                changes["jacobian"] = current
        return dataclasses.replace(self, **changes)

    def delta(self, eps: Tensor) -> Tensor:
        """Bound on ||F(X') - F(X)||_F over ||X' - X||_F <= eps.

        eps: (B,) or (B, E) radii >= 0. Returns the same shape:
        zeta eps + sum_l (kappa eps / s)(m_l^c + eps ||A_l||)(c_l + eps ||B_l||) (m_l^c the
        centred score sensitivity, c_l >= ||C X B_l||, each the uncentred norm where not given), a
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
        score = self._per_sample(self.centered_scores, extra)
        value = self._per_sample(self.centered_values, extra)
        e = eps[..., None]
        second = (score + e * self.score_weight_norm) * (value + e * self.value_weight_norm)
        lipschitz = zeta * eps + (self.kappa / self.scale) * eps * second.sum(dim=-1)
        linear = self.refined_first_order
        if linear is None:
            return lipschitz
        refined = linear[(slice(None), *extra)] * eps + self.second_order_terms(eps)
        return torch.minimum(lipschitz, refined)

    @property
    def refined_first_order(self) -> Tensor | None:
        """(B,) the refinement's first-order coefficient, >= ||T_X + D_X||: zeta + zeta_s, or
        the direct bound on the Jacobian where smaller; None without the refinement."""
        if self.softmax_first_order is None:
            return None
        linear = self.zeta + self.softmax_first_order
        return linear if self.jacobian is None else torch.minimum(linear, self.jacobian)

    @property
    def centered_scores(self) -> Tensor:
        """(B, h) m_l^c, the centred score sensitivity (m_l where not given)."""
        return (self.score_sensitivity if self.centered_score_sensitivity is None
                else self.centered_score_sensitivity)

    @property
    def centered_values(self) -> Tensor:
        """(B, h) c_l >= ||C X B_l|| (||X B_l|| where not given)."""
        return self.value_norm if self.centered_value_norm is None else self.centered_value_norm

    @staticmethod
    def _per_sample(values: Tensor, extra: tuple) -> Tensor:
        """(B, h) -> (B, *extra, h): broadcast over the radii of a (B, E) eps."""
        return values[(slice(None), *extra, slice(None))]

    def second_order_terms(self, eps: Tensor) -> Tensor:
        """A bound on ||F(X') - F(X) - J_X (X' - X)||_F with J_X the block's Jacobian at X
        (= T_X + D_X): the sum of ``second_order_parts``. eps (B,) or (B, E) float64 -> same
        shape."""
        return sum(self.second_order_parts(eps).values())

    def second_order_parts(self, eps: Tensor) -> dict[str, Tensor]:
        """The three second-order terms of the refinement, each summed over heads (same shape as
        eps), with rho_l = (m_l^c + eps ||A_l||) / s >= ||E_l C||_F / eps for the centring
        C = I - 1 1^T / n (the softmax, its Jacobian and its remainder see E_l only as E_l C),
        c_l = ||C X B_l|| (rows of J_l(.) and of the remainder sum to zero, so
        J_l(.) X B_l = J_l(.) C X B_l), and mu_l = min(rho_l, (||C X A_l^T|| + max_r ||x_r A_l||
        + eps ||A_l||) / s) >= max_r ||e_r C|| / eps (row r of E_l is
        (g_r A_l X^T + x_r A_l G^T + g_r A_l G^T) / s):

        - "scores": eps^2 kappa ||A_l|| c_l / s, the quadratic part G A_l G^T of the scores
          through the softmax Jacobian;
        - "remainder": eps^2 gamma rho_l mu_l c_l, the softmax's Taylor remainder R_l: per row
          ||R_r|| <= gamma ||e_r C||^2 (module docstring, gamma = SOFTMAX_REMAINDER), so
          ||R_l||_F <= gamma (sum_r ||e_r C||^4)^(1/2) <= gamma max_r ||e_r C|| ||E_l C||_F;
        - "values": eps^2 kappa rho_l ||B_l||, the change of attention times the change of
          the values.
        """
        extra = (None,) * (eps.dim() - 1)
        centered = self._per_sample(self.centered_values, extra)
        score = self._per_sample(self.centered_scores, extra)
        quadratic = eps[..., None] * self.score_weight_norm
        rate = (score + quadratic) / self.scale  # rho_l
        row_rate = rate
        if self.row_score_sensitivity is not None:
            rows = self._per_sample(self.row_score_sensitivity, extra)
            row_rate = torch.minimum(rate, (rows + quadratic) / self.scale)  # mu_l
        square = eps.square()
        return {"scores": square * (self.kappa * self.score_weight_norm / self.scale
                                    * centered).sum(dim=-1),
                "remainder": square * (SOFTMAX_REMAINDER * rate * row_rate * centered).sum(
                    dim=-1),
                "values": square * (self.kappa * rate * self.value_weight_norm).sum(dim=-1)}


def attention_probabilities(X: Tensor, w: AttentionSpec) -> Tensor:
    """P_l(X) = row_softmax(X Wq_l (X Wk_l)^T / s + C_l): (B, n, d) -> (B, h, n, n) float64."""
    X = _check_tokens(X, w)
    return _probabilities(X, w)


def attention_forward(X: Tensor, w: AttentionSpec) -> Tensor:
    """The exact block F(X) = H X + sum_l P_l(X) X Wv_l Wo_l: (B, n, d) -> (B, n, d) float64."""
    X = _check_tokens(X, w)
    probs = _probabilities(X, w)
    out = mix_heads(probs, X, as_float64(w.value, X.device), as_float64(w.output, X.device))
    return out + X if w.residual else out


def attention_sensitivity(X: Tensor, w: AttentionSpec, *, kappa: float = 0.5,
                          first_order: str = "lofast", score_bound: str = "exact",
                          softmax_jacobian: bool = False,
                          method: SpectralMethod = DEFAULT_METHOD,
                          generator: torch.Generator | None = None,
                          cheap: bool = False) -> AttentionSensitivity:
    """The LoFAST quantities of one block at clean tokens X (B, n, d).

    first_order: "lofast" (zeta = ||T_X||, exact by Lemma 1) or "naive" (eq. 12:
    ||H|| + sum_l ||B_l|| ||P_l(X)||). score_bound: "exact" (m_l = ||M_l||, delta_2^(1)) or
    "relaxed" (xi_l = ||A_l X^T|| + ||X A_l||, delta_2^(2)). kappa >= 1/2: the softmax constant.
    softmax_jacobian: also bound zeta_s = ||D_X|| (one more matrix-free norm per sample) for the
    second-order refinement of the module docstring.

    The matrix-free norms ||T_X|| and ||M_l|| use ``method``; every explicit matrix norm
    (||X B_l||, ||A_l X^T||, ||X A_l||, ||P_l||, ||A_l||, ||B_l||) is a deterministic upper bound
    (``matrix_norm_upper``; the products of rank dh or dv by their factors,
    ``head_product_norms``). The returned guarantee is the weakest involved. cheap: skip the
    per-sample proofs (``attention_norms``): bounds as sound and no smaller, with the samples
    they would have refined, and the means to make them, in ``deferred``.
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
    query, key = as_float64(w.query, device), as_float64(w.key, device)
    value, output = as_float64(w.value, device), as_float64(w.output, device)
    # einsum keeps these single matrix products; a broadcast (B, 1, n, d) @ (h, d, d) would copy
    # the weights once per sample. Its (B, h, n, d) results are views of (B, n, h, d) memory:
    # those read by two or more Gram products (the norms below) are made contiguous once, as
    # each product would copy them again.
    x_query = torch.einsum("bnd,hde->bhne", X, query)  # (B, h, n, dh) X Wq_l
    x_key = torch.einsum("bnd,hde->bhne", X, key)  # (B, h, n, dh) X Wk_l
    # X A_l and X A_l^T from the projections the scores are made of: (X Wq_l) Wk_l^T takes
    # dh / d of the work of X (Wq_l Wk_l^T), with rounding of the same order (the product
    # A_l itself rounds relative to |Wq_l| |Wk_l|^T)
    x_score = torch.einsum("bhne,hfe->bhnf", x_query, key).contiguous()  # (B, h, n, d) X A_l
    x_score_t = torch.einsum("bhne,hfe->bhnf", x_key, query).contiguous()  # ||X A_l^T|| = ||A_l X^T||
    probs = probabilities_from_projections(x_query, x_key, w.scale,
                                           _bias(w, device))  # (B, h, n, n)
    x_value = torch.einsum("bnd,hde->bhne", X, value)  # (B, h, n, dv) X Wv_l
    x_value_out = torch.einsum("bhne,hef->bhnf", x_value, output).contiguous()  # X B_l
    same_device = w.query.device == device
    factors = w.product_factors if same_device else product_factors(query, key, output)
    value_norm = head_product_norms(x_value, factors.behind_value, x_value_out)  # ||X B_l||
    score_norms = head_product_norms(x_query, factors.behind_query, x_score)  # ||X A_l||
    score_weight_norm, value_weight_norm = (
        w.weight_norms if same_device else (matrix_norm_upper(query @ key.mT),
                                            matrix_norm_upper(value @ output)))

    matrix_free = 0  # probabilistic / estimated norms per sample
    if score_bound == "exact":
        score = score_norm(x_score, x_score_t, method, generator)
        matrix_free += w.heads
    else:
        score = head_product_norms(x_key, factors.behind_key, x_score_t) + score_norms

    # ||D_X|| <= sum_l ||J_l|| m_l ||X B_l|| / s with ||J_l|| <= 1/2
    softmax = (score * value_norm).sum(dim=1) / (2.0 * w.scale) if softmax_jacobian else None
    block = BlockAtX(X=X, w=w, probs=probs, x_query=x_query, x_key=x_key, x_value=x_value,
                     x_value_out=x_value_out, score=score, value_weight_norm=value_weight_norm,
                     method=method, generator=generator, refine=softmax_jacobian,
                     first_order=first_order)
    start = softmax.clone() if cheap and softmax is not None else None  # tightened in place
    norms = attention_norms(block, softmax, cheap)
    deferred = (DeferredProofs(block, start, norms.deferred)
                if cheap and bool(norms.deferred.any()) else None)
    zeta, softmax, jacobian = norms.zeta, norms.softmax, norms.jacobian
    matrix_free += (first_order == "lofast") + softmax_jacobian
    if block.near_reference and w.probabilistic_reference(method):
        # ||T_R|| and the complements of its two deflations, each a Lanczos bound drawn once
        # per model (``AttentionSpec.reference_norm``, ``deflation``): counted, used or not
        matrix_free += PER_MODEL_NORMS

    guarantee = method.guarantee if matrix_free else Guarantee.EXACT
    failure = (matrix_free * method.failure_probability
               if guarantee is Guarantee.PROBABILISTIC else 0.0)
    # the centred norms of the module docstring's "centred scores"
    centered_scores_t = centered_product_norms(x_key, factors.behind_key, x_score_t)
    centered_score = torch.minimum(score, centered_scores_t + score_norms)
    rows_score = None
    if softmax is not None:
        rows_score = (centered_scores_t + torch.linalg.vector_norm(x_score, dim=-1).amax(dim=-1)
                      * (1.0 + ROUNDING_MARGIN))
    return AttentionSensitivity(zeta=zeta, score_sensitivity=score, value_norm=value_norm,
                                score_weight_norm=score_weight_norm,
                                value_weight_norm=value_weight_norm, scale=float(w.scale),
                                kappa=float(kappa), guarantee=guarantee,
                                failure_probability=failure, softmax_first_order=softmax,
                                jacobian=jacobian,
                                centered_value_norm=centered_product_norms(
                                    x_value, factors.behind_value, x_value_out),
                                row_score_sensitivity=rows_score,
                                centered_score_sensitivity=centered_score,
                                deferred=deferred)


def centered_rows(M: Tensor) -> Tensor:
    """C M for the centring C = I - 1 1^T / n and M (..., n, k): M less the mean of its rows."""
    return M - M.mean(dim=-2, keepdim=True)


def head_product_norms(left: Tensor, right: ProductFactor | None, product: Tensor) -> Tensor:
    """Upper bounds (B, h) on the norms of product = left right.factor^T (B, h, n, d), e.g.
    ||X A_l|| from left = X Wq_l (B, h, n, r) and Wk_l: by r x r problems
    (``spectral.product_norm_upper``) where ``spectral.takes_the_factors``, else by
    ``matrix_norm_upper`` of the product (right None: r >= d)."""
    if _smaller_by_factor(right, product):
        return product_norm_upper(left, right)
    return matrix_norm_upper(product, per_sample=True)


def centered_product_norms(left: Tensor, right: ProductFactor | None, product: Tensor) -> Tensor:
    """``head_product_norms`` of the centred product C product = (C left) right.factor^T, with
    the centring's rounding (``centered_norm``): the computed C left is within
    3 gamma_(n+1) sqrt(n) ||left||_F of the exact one (Frobenius), which the factor multiplies
    by at most ||B|| <= (||S||_F^2 + residual)^(1/2)."""
    if not _smaller_by_factor(right, product):
        return centered_norm(product)
    n = left.shape[-2]
    rounding = (3.0 * gamma(n + 1) * math.sqrt(n) * torch.linalg.vector_norm(left, dim=(-2, -1))
                * (right.root_square + right.residual).sqrt() * (1.0 + 2.0 ** -40))
    return product_norm_upper(centered_rows(left), right) + rounding


def _smaller_by_factor(right: ProductFactor | None, product: Tensor) -> bool:
    """Whether the product (B, h, n, d) goes by its factor (``spectral.takes_the_factors``)."""
    return right is not None and takes_the_factors(right.rank, product)


def centered_norm(Y: Tensor) -> Tensor:
    """Upper bounds on ||(I - 1 1^T / n) Y|| for matrices Y (..., n, k), float64: the norm of
    the computed centred matrix plus its rounding. Each computed entry is off by at most
    gamma_(n+1) (|y_ij| + 2 max_i |y_ij|) <= 3 gamma_(n+1) max_i |y_ij| (the column mean is a
    sum of n terms, then one subtraction), so the error matrix has Frobenius norm at most
    3 gamma_(n+1) sqrt(n) ||Y||_F."""
    n = Y.shape[-2]
    centered = centered_rows(Y)
    rounding = 3.0 * gamma(n + 1) * math.sqrt(n) * torch.linalg.vector_norm(Y, dim=(-2, -1))
    return matrix_norm_upper(centered, per_sample=True) + rounding


def _probabilities(X: Tensor, w: AttentionSpec) -> Tensor:
    """P_l(X) in float64 for float64 tokens X (B, n, d) -> (B, h, n, n)."""
    query, key = as_float64(w.query, X.device), as_float64(w.key, X.device)
    return probabilities_from_projections(torch.einsum("bnd,hde->bhne", X, query),
                                          torch.einsum("bnd,hde->bhne", X, key), w.scale,
                                          _bias(w, X.device))


def _bias(w: AttentionSpec, device: torch.device) -> Tensor | None:
    return None if w.position_bias is None else as_float64(w.position_bias, device)


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


