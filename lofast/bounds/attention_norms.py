"""The norm strategies of an attention block at clean tokens X.

An attention block's certificate (``bounds.attention``) needs, per sample, upper bounds on
zeta >= ||T_X||, on zeta_s >= ||D_X|| with the second-order refinement, and where one is
cheaper than their sum, on ||T_X + D_X|| directly (the block's Jacobian at X). Each
``NormStrategy`` below is one way to bound some of them; its docstring states its claim, with
the proof where the bound is computed. ``attention_norms`` runs the strategies that apply, in
the order of ``STRATEGIES`` (cheapest first), and keeps the minimum of every quantity:

- ``applies(block)``: whether the strategy's claim holds for this block and method at all;
- ``rows(block, bounds)``: the samples it runs on, given the bounds so far (an expensive norm
  only where the cheap ones are loose);
- ``bound(block, bounds, rows)``: a ``Candidate`` with upper bounds for those rows, which the
  driver merges by ``torch.minimum`` (a strategy never loosens a bound).

A sample is "loose" while its bounds are not within the method's slack of an estimate from
below (a Rayleigh quotient or Ritz value, which the exact norm is never under). The verified
and Lanczos methods start from the near-reference bounds and their looseness test
(``NEAR_REFERENCE_KINDS``); the other methods compute their own norms for every sample.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from lofast.bounds.attention_spec import AttentionSpec
from lofast.bounds.coordinate_jacobian import coordinate_first_order_norm, coordinate_jacobian_norm
from lofast.bounds.deflation import Deflation
from lofast.bounds.first_order import (
    along_or_default,
    as_float64,
    first_order_estimate,
    first_order_norm,
    near_reference_first_order_bound,
    reference_deviation_norms,
    verified_first_order_norm,
    within_slack,
)
from lofast.bounds.near_reference import (
    SOFTMAX_NEGLIGIBLE,
    JacobianData,
    ProjectedBasis,
    deflated_first_order_bound,
    head_deviation_bound,
    jacobian_apply,
    jacobian_rounding,
    softmax_first_order_bound,
)
from lofast.bounds.softmax_terms import softmax_first_order_norm
from lofast.bounds.spectral import SpectralMethod, matrix_norm_upper
from lofast.bounds.verified import gamma

# The methods that begin with the deterministic near-reference bounds and refine only the
# samples those leave loose (the others compute their own norm for every sample).
NEAR_REFERENCE_KINDS = ("verified", "lanczos")


@dataclass
class BlockAtX:
    """One attention block at clean tokens X: the per-sample products every strategy reads.

    X (B, n, d) float64; probs (B, h, n, n) P_l(X); x_query, x_key (B, h, n, dh) X Wq_l,
    X Wk_l; x_value (B, h, n, dv) X Wv_l; x_value_out (B, h, n, d) X B_l; score (B, h) >=
    ||M_l||; value_weight_norm (h,) >= ||B_l||. refine: the softmax refinement is wanted
    (zeta_s and the Jacobian's bound). Built per batch and dropped after it: its cached
    properties are per-batch quantities, never per-model ones (those live on the spec)."""

    X: Tensor
    w: AttentionSpec
    probs: Tensor
    x_query: Tensor
    x_key: Tensor
    x_value: Tensor
    x_value_out: Tensor
    score: Tensor
    value_weight_norm: Tensor
    method: SpectralMethod
    generator: torch.Generator | None
    refine: bool
    first_order: str = "lofast"

    def subset(self, rows: Tensor) -> BlockAtX:
        """The same block at the samples rows (B,) bool alone (its cached per-batch
        quantities made again, for those samples)."""
        return dataclasses.replace(
            self, X=self.X[rows], probs=self.probs[rows], x_query=self.x_query[rows],
            x_key=self.x_key[rows], x_value=self.x_value[rows],
            x_value_out=self.x_value_out[rows], score=self.score[rows])

    @property
    def lofast(self) -> bool:
        """zeta is LoFAST's ||T_X|| (Lemma 1), not the naive eq.-12 bound."""
        return self.first_order == "lofast"

    @property
    def near_reference(self) -> bool:
        """The method starts from the near-reference bounds (the spec's per-model proofs must
        be on the tokens' device)."""
        return (self.lofast and self.method.kind in NEAR_REFERENCE_KINDS
                and self.w.query.device == self.X.device)

    @property
    def coordinate_jacobian(self) -> bool:
        """The Jacobian's norm comes from ``coordinate_jacobian`` (scores and values on the
        heads' own coordinates), not from zeta_s."""
        return self.lofast and self.refine and self.w.coordinate_attention is not None

    @functools.cached_property
    def reference_norm(self) -> Tensor:
        """>= ||T_R|| on the tokens' device, with the method's guarantee for a position-biased
        reference under a Lanczos method, else deterministic (``AttentionSpec.reference_norm``)."""
        return self.w.reference_norm(self.method, self.generator).to(self.X.device)

    def deflation(self, large: bool = False) -> Deflation:
        """The reference's deflation for these tokens (``AttentionSpec.deflation``), with the
        guarantee of ``reference_norm``."""
        return self.w.deflation(self.X.shape[1], large, self.method, self.generator)

    def jacobian_data(self, rows: Tensor | None = None) -> JacobianData:
        """The per-sample products of T_X and D_X (``near_reference.JacobianData``), for the
        samples rows (B,) bool or all."""
        pick = slice(None) if rows is None else rows
        projections, output = self.w.jacobian_weights
        return JacobianData(probs=self.probs[pick], x_query=self.x_query[pick],
                            x_key=self.x_key[pick], x_value=self.x_value[pick],
                            projections=projections, output=output,
                            residual=1.0 if self.w.residual else 0.0, scale=float(self.w.scale))

    def deflation_products(self, large: bool = False) -> ProjectedBasis:
        """Its basis's products with the weights (``AttentionSpec.deflation_products``)."""
        return self.w.deflation_products(self.X.shape[1], large, self.method, self.generator)

    @functools.cached_property
    def deviation(self) -> Tensor:
        """(B, h) >= ||P_l - R_l|| for the spec's reference attention R_l."""
        reference = self.w.reference_probabilities
        return reference_deviation_norms(self.probs,
                                         None if reference is None else reference.to(self.X.device))

    @functools.cached_property
    def head_deviation(self) -> Tensor:
        """(B,) >= ||T_X - T_R|| by the head structure (``near_reference.head_deviation_bound``)."""
        _, _, value, output = self.w.stacked_norms
        return head_deviation_bound(self.deviation, self.w.weight_norms[1], value * output)

    @functools.cached_property
    def along(self) -> Tensor:
        """The unit vector (n d,) of the Rayleigh quotient that tests zeta's looseness."""
        return along_or_default(self.w.first_order_factors, self.probs,
                                self.w.reference_direction)


@dataclass
class NormBounds:
    """The bounds so far, (B,) float64 each: zeta >= ||T_X||; softmax >= ||D_X|| (None without
    the refinement); jacobian >= ||T_X + D_X|| where a strategy bounded it directly (None:
    zeta + softmax). loose (B,) bool: the samples the refining strategies still run on (None
    until the near-reference bounds are tested, and for methods that skip them); settled:
    zeta within the method's slack of its Rayleigh quotient; zeta_is_tight: zeta is in closed
    form, within rounding of the exact norm; deferred (B,) bool: the samples a per-sample proof
    would have refined, had it run (``attention_norms`` with cheap; None otherwise)."""

    zeta: Tensor
    softmax: Tensor | None
    jacobian: Tensor | None = None
    loose: Tensor | None = None
    settled: Tensor | None = None
    zeta_is_tight: bool = False
    deferred: Tensor | None = None


@dataclass(frozen=True)
class Candidate:
    """Upper bounds (rows.sum(),) on the quantities a strategy bounded, for the samples
    ``rows`` (B,) bool, and the rows' looseness and settled zeta after it (None: unchanged)."""

    rows: Tensor
    zeta: Tensor | None = None
    softmax: Tensor | None = None
    jacobian: Tensor | None = None
    loose: Tensor | None = None
    settled: Tensor | None = None


class NormStrategy:
    """One way to bound some of zeta, ||D_X|| and ||T_X + D_X||. The subclass docstring states
    the claim; ``bound`` returns values that hold it for every sample of ``rows``. A
    ``closed_form`` strategy's zeta is within rounding of the exact norm: the refining
    strategies then leave zeta alone. A ``per_sample_proof`` strategy factors or deflates a
    matrix of each sample it runs on: the costly refinements, which a cheap pass defers."""

    closed_form = False
    per_sample_proof = False

    def applies(self, block: BlockAtX) -> bool:
        return True

    def rows(self, block: BlockAtX, bounds: NormBounds) -> Tensor:
        return torch.ones_like(bounds.zeta, dtype=torch.bool)

    def bound(self, block: BlockAtX, bounds: NormBounds, rows: Tensor) -> Candidate:
        raise NotImplementedError


def _loose_rows(bounds: NormBounds) -> Tensor:
    """The loose samples (all before the looseness test), as a new mask: a candidate's rows
    must not change when the bounds' looseness is updated."""
    if bounds.loose is None:
        return torch.ones_like(bounds.zeta, dtype=torch.bool)
    return bounds.loose.clone()


class NearReference(NormStrategy):
    """zeta <= ||T_R|| + sum_l ||P_l - R_l|| ||B_l||
    (``first_order.near_reference_first_order_bound``: T_X - T_R = sum_l (P_l - R_l) (x) B_l^T),
    with ||T_R|| the spec's verified reference norm."""

    def applies(self, block):
        return block.lofast

    def bound(self, block, bounds, rows):
        reference = block.w.reference_probabilities
        return Candidate(rows, zeta=near_reference_first_order_bound(
            block.probs[rows], None if reference is None else reference.to(block.X.device),
            block.reference_norm, block.value_weight_norm, block.deviation[rows]))


class CoordinateFirstOrder(NormStrategy):
    """zeta within rounding of ||T_X||, in closed form from h (n x n) norms, for value paths on
    the heads' own coordinates (``coordinate_jacobian.coordinate_first_order_norm``)."""

    closed_form = True

    def applies(self, block):
        return block.lofast and block.w.coordinate_values is not None

    def bound(self, block, bounds, rows):
        return Candidate(rows, zeta=coordinate_first_order_norm(
            block.probs[rows], block.w.coordinate_values, block.w.residual))


class HeadDeviation(NormStrategy):
    """zeta <= ||T_R|| + ||Wv|| ||Wo|| max_l ||P_l - R_l|| where that is below the sum over heads
    (``near_reference.head_deviation_bound``, 1. of its module docstring)."""

    def applies(self, block):
        return block.near_reference

    def bound(self, block, bounds, rows):
        return Candidate(rows, zeta=block.reference_norm + block.head_deviation[rows])


class CentredSoftmax(NormStrategy):
    """zeta_s <= ||D1|| + ||D2||, the centred tokens' bound (``near_reference``, 2. of its module
    docstring), on the samples where the product bound sum_l m_l ||X B_l|| / (2 s) is not
    already negligible next to zeta."""

    def applies(self, block):
        return block.near_reference and block.refine and not block.coordinate_jacobian

    def rows(self, block, bounds):
        return bounds.softmax > SOFTMAX_NEGLIGIBLE * bounds.zeta

    def bound(self, block, bounds, rows):
        query, key, _, output = block.w.stacked_norms
        return Candidate(rows, softmax=softmax_first_order_bound(
            block.X[rows], block.probs[rows], block.x_query[rows], as_float64(block.w.key),
            as_float64(block.w.value), (query, key, output), block.w.scale))


class LoosenessTest(NormStrategy):
    """No new bound: marks loose the samples whose zeta is not within the method's slack of its
    Rayleigh quotient at ``BlockAtX.along`` (a lower estimate), or whose zeta_s is not
    negligible next to zeta; with the refinement it starts the Jacobian's bound at
    zeta + zeta_s (the triangle inequality)."""

    def applies(self, block):
        return block.near_reference

    def bound(self, block, bounds, rows):
        f = block.w.first_order_factors
        settled = (torch.ones_like(rows) if bounds.zeta_is_tight else
                   within_slack(bounds.zeta, first_order_estimate(block.probs, f, block.along, 1),
                                f, block.method.relative_slack))
        loose = ~settled
        uses_softmax = block.refine and not block.coordinate_jacobian
        if uses_softmax:
            loose = loose | (bounds.softmax > SOFTMAX_NEGLIGIBLE * bounds.zeta)
        return Candidate(rows, loose=loose, settled=settled,
                         jacobian=bounds.zeta + bounds.softmax if uses_softmax else None)


class DeflatedReference(NormStrategy):
    """||T_X|| (or ||T_X + D_X|| with the refinement) by the deflation of T_R
    (``near_reference.deflated_first_order_bound``, 3. of its module docstring); with the
    refinement also zeta <= ||T_X + D_X|| + zeta_s. ``large``: the larger deflation
    (``deflation.LARGE_DEFLATION_SIZES``, made once per model when first needed), only for
    samples the first left loose and only where it spares zeta the Gram matrix (not for a
    closed-form zeta); the first skips the samples it cannot settle (see ``rows``). A sample
    stays loose where the bound is not within
    the method's ``jacobian_slack`` (with the refinement) or its slack (without) of its
    Rayleigh-Ritz estimate."""

    per_sample_proof = True

    def __init__(self, large: bool) -> None:
        self.large = large

    def applies(self, block):
        return block.near_reference

    def rows(self, block, bounds):
        loose = _loose_rows(bounds)
        if not bool(loose.any()) or (self.large and bounds.zeta_is_tight):
            return torch.zeros_like(loose)
        if self.large:
            return loose
        # The bound is at least c + delta (c the deflation's complement, delta the deviation:
        # its condition needs t > (c + delta)^2). Where that exceeds ||T_R|| by more than the
        # slack, it cannot come within the slack of a Ritz value near ||T_R||: those samples,
        # typical of a reference with a flat top, go straight to the larger deflation. Where
        # the larger deflation follows (zeta not in closed form), so do the samples whose
        # c + delta exceeds ||T_R|| at all: t - c is then a sliver and the second-order term
        # large, so such a bound stays loose where the larger deflation settles the sample.
        # Only speed depends on this test.
        with_softmax = block.refine and not block.coordinate_jacobian
        deviation = block.head_deviation + (bounds.softmax if with_softmax else 0.0)
        slack = block.method.jacobian_slack if with_softmax else block.method.relative_slack
        margin = 1.0 if not bounds.zeta_is_tight else 1.0 + slack
        complement = block.deflation().complement.to(block.X.device)
        return loose & (complement + deviation <= block.reference_norm * margin)

    def bound(self, block, bounds, rows):
        data = block.jacobian_data(rows)
        with_softmax = block.refine and not block.coordinate_jacobian
        softmax = bounds.softmax[rows] if with_softmax else None
        bound, ritz = deflated_first_order_bound(
            data, block.deflation(self.large), block.reference_norm, block.head_deviation[rows],
            softmax, block.deflation_products(self.large))
        if softmax is None:
            zeta = torch.minimum(bounds.zeta[rows], bound)
            slack = 1.0 + block.method.relative_slack
            return Candidate(rows, zeta=zeta, loose=~bounds.settled[rows] & ~(zeta <= ritz * slack))
        return Candidate(rows, zeta=bound + softmax, jacobian=bound,
                         loose=~(bound <= ritz * (1.0 + block.method.jacobian_slack)))


class MethodFirstOrder(NormStrategy):
    """zeta from the method's own norm of T_X on the loose samples (all samples for methods
    without the near-reference start): verified, the Cholesky proof of the Kronecker Gram
    matrix (``first_order.verified_first_order_norm``, which keeps a known bound within its
    slack); Lanczos, an upper bound with its probability; dense, exact; power, an estimate."""

    per_sample_proof = True

    def applies(self, block):
        return block.lofast

    def rows(self, block, bounds):
        if bounds.zeta_is_tight and block.near_reference:
            return torch.zeros_like(bounds.zeta, dtype=torch.bool)
        return _loose_rows(bounds)

    def bound(self, block, bounds, rows):
        w = block.w
        if block.method.kind == "verified":
            direction = w.reference_direction
            along = block.along if block.near_reference else (
                None if direction is None else direction.to(block.X.device))
            return Candidate(rows, zeta=verified_first_order_norm(
                block.probs[rows], w.first_order_factors, block.method, known=bounds.zeta[rows],
                along=along))
        return Candidate(rows, zeta=first_order_norm(
            block.X[rows], block.probs[rows], as_float64(w.value, block.X.device),
            as_float64(w.output, block.X.device), w.residual, block.method, block.generator))


class MethodSoftmax(NormStrategy):
    """zeta_s from the method's own norm of D_X (``softmax_terms.softmax_first_order_norm``),
    on the loose samples, or (methods without the near-reference start) where the product
    bound is not negligible next to zeta; with the near-reference start the Jacobian's bound
    then becomes at most zeta + zeta_s there."""

    per_sample_proof = True

    def applies(self, block):
        return block.refine and not block.coordinate_jacobian

    def rows(self, block, bounds):
        if bounds.loose is not None:
            return _loose_rows(bounds)
        return bounds.softmax > SOFTMAX_NEGLIGIBLE * bounds.zeta

    def bound(self, block, bounds, rows):
        softmax = softmax_first_order_norm(
            block.probs[rows], block.x_query[rows], block.x_key[rows], block.x_value_out[rows],
            as_float64(block.w.query, block.X.device), as_float64(block.w.key, block.X.device),
            block.score[rows], block.w.scale, block.method, block.generator)
        softmax = torch.minimum(bounds.softmax[rows], softmax)
        jacobian = None if bounds.jacobian is None else bounds.zeta[rows] + softmax
        return Candidate(rows, softmax=softmax, jacobian=jacobian)


class CoordinateJacobian(NormStrategy):
    """||T_X + D_X|| <= max(zeta, max_l ||F_l||) for scores and values on the heads' own
    coordinates: one small operator per head (``bounds.coordinate_jacobian``)."""

    def applies(self, block):
        return block.coordinate_jacobian

    def bound(self, block, bounds, rows):
        w = block.w
        direct = coordinate_jacobian_norm(block.X[rows], block.probs[rows], w.coordinate_attention,
                                          w.residual, w.scale, block.method, block.generator)
        return Candidate(rows, jacobian=torch.maximum(bounds.zeta[rows], direct))


class NaiveFirstOrder(NormStrategy):
    """zeta <= ||H|| + sum_l ||B_l|| ||P_l|| (the LoFAST paper's eq. 12, the triangle inequality
    over T_X = H (x) I + sum_l P_l (x) B_l^T), for ``first_order="naive"``."""

    def applies(self, block):
        return not block.lofast

    def bound(self, block, bounds, rows):
        identity_norm = 1.0 if block.w.residual else 0.0
        mixing = block.value_weight_norm * matrix_norm_upper(block.probs[rows], per_sample=True)
        return Candidate(rows, zeta=identity_norm + mixing.sum(dim=1))


# cheapest first: the refining strategies read the looseness the cheap ones leave
STRATEGIES: tuple[NormStrategy, ...] = (
    NaiveFirstOrder(), NearReference(), CoordinateFirstOrder(), HeadDeviation(), CentredSoftmax(),
    LoosenessTest(),
    DeflatedReference(large=False), DeflatedReference(large=True), MethodFirstOrder(),
    MethodSoftmax(), CoordinateJacobian(),
)


def attention_norms(block: BlockAtX, softmax: Tensor | None, cheap: bool = False) -> NormBounds:
    """zeta, zeta_s and the Jacobian's bound (B,) each for one block: the minimum over the
    strategies that apply. softmax: the product bound on ||D_X|| (None without the
    refinement), tightened in place.

    cheap: skip the ``per_sample_proof`` strategies, and mark ``deferred`` the samples each
    would have run on. The bounds are as sound, and no smaller than the full walk's (which
    takes the minimum over these strategies and more); on a sample that is not deferred they
    are the full walk's exactly. Deferred rows are a superset of the full walk's: a strategy's
    rows only shrink as the bounds tighten (the looseness a proof leaves is within the
    looseness it found)."""
    bounds = NormBounds(zeta=torch.full_like(block.probs[:, 0, 0, 0], torch.inf),
                        softmax=softmax)
    if cheap:
        bounds.deferred = torch.zeros_like(bounds.zeta, dtype=torch.bool)
    for strategy in STRATEGIES:
        if not strategy.applies(block):
            continue
        rows = strategy.rows(block, bounds)
        if not bool(rows.any()):
            continue
        if cheap and strategy.per_sample_proof:
            bounds.deferred |= rows
            continue
        merge(bounds, strategy.bound(block, bounds, rows))
        bounds.zeta_is_tight = bounds.zeta_is_tight or strategy.closed_form
    return bounds


@dataclass
class DeferredProofs:
    """The per-sample proofs a cheap walk (``attention_norms`` with cheap) skipped, ready to
    be made for some of its samples: the block, the product bound on ||D_X|| the walk started
    from (None without the refinement), and rows (B,) bool, the samples they would run on.
    Holds the batch's per-sample products until dropped."""

    block: BlockAtX
    softmax: Tensor | None
    rows: Tensor

    def make(self, rows: Tensor) -> NormBounds:
        """The full walk's bounds for the samples rows (B,) bool, (rows.sum(),) each: the
        minimum over every strategy, proofs included, as if those samples were the batch."""
        softmax = None if self.softmax is None else self.softmax[rows].clone()
        return attention_norms(self.block.subset(rows), softmax)

    def lower_estimates(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Lower bounds (rows.sum(),) each on ||T_X|| and on the block's Jacobian norm
        ||T_X + D_X|| (||T_X|| again without the refinement) for the samples rows (B,) bool:
        no proof can bound a norm below them, so the full walk's zeta and its first-order
        coefficient min(zeta + zeta_s, jacobian) are at least these.

        Each is ||J g|| / ||g|| for the one vector g = ``BlockAtX.along`` (near the
        reference's top right singular vector), rounding included: with y = fl(J g) from
        ``jacobian_apply`` and r its rounding bound (``jacobian_rounding``:
        ||y - J g|| <= r ||g||), ||J g|| >= ||y|| - r ||g||, each computed norm inflated or
        deflated by gamma_(n d) for its own rounding. Zero where the spec's weights are not on
        the tokens' device (the trivial bound). Costs one product per sample and quantity, next
        to the proofs' hundreds."""
        block = self.block.subset(rows)
        count, n, d = block.X.shape
        zeros = block.X.new_zeros(count)
        if block.w.query.device != block.X.device:
            return zeros, zeros
        g = block.along.reshape(1, n, d)
        data = block.jacobian_data()
        r_first, r_jacobian = jacobian_rounding(data)
        slack = gamma(n * d + 2)
        g_norm = float(torch.linalg.vector_norm(g)) * (1.0 + slack)  # >= ||g||

        def lower(softmax: bool, rounding: Tensor) -> Tensor:
            image = jacobian_apply(g, data, softmax).reshape(count, n * d)
            image_norm = torch.linalg.vector_norm(image, dim=1) * (1.0 - slack)  # <= ||y||
            return ((image_norm - rounding * g_norm) / g_norm * (1.0 - slack)).clamp_min(0.0)

        zeta = lower(False, r_first)
        return zeta, (lower(True, r_jacobian) if self.softmax is not None else zeta)


def merge(bounds: NormBounds, candidate: Candidate) -> None:
    """Take the minimum of each bound and the candidate's on its rows; set their looseness."""
    rows = candidate.rows
    for name in ("zeta", "softmax", "jacobian"):
        value = getattr(candidate, name)
        if value is None:
            continue
        current = getattr(bounds, name)
        if current is None:  # first bound of this quantity
            current = torch.full_like(bounds.zeta, torch.inf)
            setattr(bounds, name, current)
        current[rows] = torch.minimum(current[rows], value)
    for name in ("loose", "settled"):
        value = getattr(candidate, name)
        if value is None:
            continue
        if getattr(bounds, name) is None:
            setattr(bounds, name, torch.zeros_like(rows))
        getattr(bounds, name)[rows] = value
