"""The weights of one attention block and what is computed from them once per block.

``AttentionSpec`` is the contract between the models and the bounds for attention: the models
build it from their parameters, the bounds read it (``bounds.attention``,
``bounds.near_reference``). Its cached properties are the per-block quantities of those bounds
(weight norms, the reference attention and its verified first-order norm, the deflations of
the reference Jacobian), computed once however many samples follow.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lofast.bounds.coordinate_jacobian import (
    CoordinateAttention,
    CoordinateValues,
    coordinate_attention,
    coordinate_values,
)
from lofast.bounds.deflation import (
    DEFLATION_SIZES,
    LARGE_DEFLATION_SIZES,
    Deflation,
    deflate_gram,
    probabilistic_deflation,
)
from lofast.bounds.first_order import (
    FirstOrderFactors,
    as_float64,
    first_order_factors,
    first_order_gram,
    first_order_maps,
    first_order_negated_gram,
    reference_top_pair,
    uniform_mix_norm,
    verified_reference_norm,
)
from lofast.bounds.krylov import LinearMap
from lofast.bounds.near_reference import ProjectedBasis, project_basis
from lofast.bounds.plain import PlainAttention
from lofast.bounds.spectral import (
    ProductFactor,
    SpectralMethod,
    matrix_norm_upper,
    operator_norm,
    product_factor,
    random_unit,
)
from lofast.bounds.stage import Stage, StageRules
from lofast.errors import CertificationError


@dataclass(frozen=True)
class ProductFactors:
    """``AttentionSpec.product_factors``: for X Wq_l (behind it Wk_l), X Wk_l (Wq_l) and
    X Wv_l (Wo_l^T), (h, d, r) factors each; None where r >= d (no smaller problem)."""

    behind_query: ProductFactor | None
    behind_key: ProductFactor | None
    behind_value: ProductFactor | None


def product_factors(query: Tensor, key: Tensor, output: Tensor) -> ProductFactors:
    """``ProductFactors`` of the weights Wq_l, Wk_l (h, d, dh) and Wo_l (h, dv, d), float64 on
    their device."""

    def factor(B: Tensor) -> ProductFactor | None:
        return product_factor(as_float64(B)) if B.shape[-1] < B.shape[-2] else None

    return ProductFactors(behind_query=factor(key), behind_key=factor(query),
                          behind_value=factor(output.mT))


@dataclass(frozen=True)
class AttentionSpec(Stage):
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
            # a bias being trained (with gradients) is not read back: that would wait for the
            # device at every block of every step and cut a compiled step's graph; its
            # non-finite values show in the loss, which training checks, and a certificate's
            # specs are checked again, all of them, by ``Stage.check``
            if not bias.requires_grad and not bool(torch.isfinite(bias).all()):
                raise ValueError("position bias contains NaN or infinity")

    def radius_map(self, index: int, tokens: Tensor, moving: slice, rules: StageRules):
        """The LoFAST local bound at the clean tokens, as the rules take it."""
        return rules.attention(index, tokens, self)

    def reach(self, moving: slice) -> slice:
        return slice(None)  # every token is mixed into every other

    def check(self, index: int) -> None:
        super().check(index)
        if not (self.residual and self.scale > 0):
            raise CertificationError(f"stage {index}: attention must be residual with scale > 0")

    def plain(self) -> nn.Module:
        return PlainAttention(self.query, self.key, self.value, self.output, self.residual,
                              self.scale, self.position_bias)

    @property
    def heads(self) -> int:
        return self.query.shape[0]

    @property
    def width(self) -> int:
        return self.query.shape[1]

    def score_matrices(self) -> Tensor:
        """A_l = Wq_l Wk_l^T, (h, d, d) float64."""
        return as_float64(self.query) @ as_float64(self.key).mT

    def value_matrices(self) -> Tensor:
        """B_l = Wv_l Wo_l, (h, d, d) float64 (matrix-vector products use the factors)."""
        return as_float64(self.value) @ as_float64(self.output)

    # Weights-only quantities, computed once per AttentionSpec (a certifier keeps one per
    # block, so once per model) on the weights' device. The tensors must not change afterwards.
    @functools.cached_property
    def weight_norms(self) -> tuple[Tensor, Tensor]:
        """Deterministic upper bounds (||A_l||, ||B_l||), (h,) float64 each."""
        return matrix_norm_upper(self.score_matrices()), matrix_norm_upper(self.value_matrices())

    @functools.cached_property
    def product_factors(self) -> ProductFactors:
        """The weights behind per-sample products X W_l W'_l: Wk_l behind X Wq_l (X A_l), Wq_l
        behind X Wk_l (X A_l^T), Wo_l^T behind X Wv_l (X B_l), as ``spectral.ProductFactor``s
        for their norms by r x r problems (``spectral.product_norm_upper``)."""
        return product_factors(self.query, self.key, self.output)

    @functools.cached_property
    def reference_probabilities(self) -> Tensor | None:
        """R_l = row_softmax(C_l) (h, n, n) float64, the attention of vanishing scores; None
        without a position bias (R_l = U then, whose n follows the tokens)."""
        if self.position_bias is None:
            return None
        return torch.softmax(as_float64(self.position_bias), dim=-1)

    @functools.cached_property
    def reference_first_order(self) -> tuple[Tensor, Tensor | None]:
        """A deterministic upper bound on ||T_R|| (module docstring), a float64 scalar tensor,
        and a unit vector (n d,) near T_R's top right singular vector (None for R = U, where
        the verified zeta's own start 1 (x) v / sqrt(n) is exact)."""
        if self.reference_probabilities is not None:
            estimate, direction = self.reference_top_pair
            return (verified_reference_norm(self.reference_probabilities,
                                            self.first_order_factors, estimate), direction)
        norm = uniform_mix_norm(as_float64(self.value), as_float64(self.output), self.residual)
        return torch.clamp(norm, min=1.0 if self.residual else 0.0), None

    @functools.cached_property
    def reference_top_pair(self) -> tuple[Tensor, Tensor]:
        """Lanczos estimates of T_R's top squared singular value (scaled, (1,)) and right
        singular vector (n d,), for a position-biased reference (``first_order.reference_top_pair``:
        no guarantee, no Gram matrix)."""
        return reference_top_pair(self.reference_probabilities, self.first_order_factors)

    @property
    def reference_direction(self) -> Tensor | None:
        """A unit vector near T_R's top right singular vector (n d,), None for the uniform
        reference (see ``reference_first_order``), without the deterministic proof."""
        if self.reference_probabilities is None:
            return None
        return self.reference_top_pair[1]

    @functools.cached_property
    def coordinate_values(self) -> CoordinateValues | None:
        """The value paths' structure when each is a scaled projection on the head's own
        coordinates (``coordinate_jacobian.coordinate_values``): zeta then has a closed form."""
        return coordinate_values(as_float64(self.value), as_float64(self.output))

    @functools.cached_property
    def coordinate_attention(self) -> CoordinateAttention | None:
        """Scores and values both on the heads' own coordinates (``query_key=identity`` with
        ``value_output=identity``): the block's Jacobian norm then comes from one small operator
        per head (``bounds.coordinate_jacobian``)."""
        scores = coordinate_values(as_float64(self.query), as_float64(self.key).mT)
        return coordinate_attention(scores, self.coordinate_values)

    @functools.cached_property
    def first_order_factors(self) -> FirstOrderFactors:
        """The weights-only part of the verified zeta computation."""
        return first_order_factors(as_float64(self.value), as_float64(self.output), self.residual)

    @functools.cached_property
    def stacked_norms(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Deterministic upper bounds (||Wq||, ||Wk||, ||Wv||, ||Wo||) on the whole matrices
        Wq = [Wq_1 ... Wq_h] (d, h dh), likewise Wk and Wv, and Wo = [Wo_1; ...; Wo_h]
        (h dv, d), float64 scalars."""
        d = self.width
        side = [matrix_norm_upper(as_float64(t).permute(1, 0, 2).reshape(d, -1))
                for t in (self.query, self.key, self.value)]
        return (*side, matrix_norm_upper(as_float64(self.output).reshape(-1, d)))

    @functools.cached_property
    def jacobian_weights(self) -> tuple[Tensor, Tensor]:
        """[Wv_1 .. Wv_h | Wq_1 .. Wq_h | Wk_1 .. Wk_h] (d, h (dv + 2 dh)) and
        Wo = [Wo_1; ...; Wo_h] (h dv, d), float64: the weights of ``near_reference``'s products."""
        d = self.value.shape[1]
        columns = [as_float64(t).permute(1, 0, 2).reshape(d, -1)
                   for t in (self.value, self.query, self.key)]
        return torch.cat(columns, dim=1).contiguous(), as_float64(self.output).reshape(-1, d)

    @functools.cached_property
    def _deflations(self) -> dict[tuple, Deflation]:
        return {}

    @functools.cached_property
    def _probabilistic_reference(self) -> dict[tuple, Tensor]:
        return {}

    def probabilistic_reference(self, method: SpectralMethod | None) -> bool:
        """Whether ``reference_norm`` and ``deflation`` take the probabilistic guarantee for
        ``method``: a Lanczos method and a position bias (the uniform reference's proofs are
        in closed form or d x d, cheap at any size) on at least PROBABILISTIC_REFERENCE_SIZE
        coordinates n d."""
        reference = self.reference_probabilities
        return (method is not None and method.kind == "lanczos" and reference is not None
                and reference.shape[-1] * self.width >= PROBABILISTIC_REFERENCE_SIZE)

    def reference_norm(self, method: SpectralMethod | None = None,
                       generator: torch.Generator | None = None) -> Tensor:
        """An upper bound on ||T_R||: ``reference_first_order``'s deterministic one, or where
        ``probabilistic_reference(method)``, randomized Lanczos on T_R without a Gram matrix
        (``reference_norms``), an upper bound with probability >= 1 -
        method.failure_probability over its random start (``_per_model_generator``). Once per
        method."""
        if not self.probabilistic_reference(method):
            return self.reference_first_order[0]
        reference_norms([self], method, generator)
        return self._probabilistic_reference[(method, _seed(generator))]

    def _reference_maps(self) -> tuple[LinearMap, LinearMap]:
        """T_R and its adjoint on (1, n, d) for the position-biased reference, matrix-free."""
        return first_order_maps(self.reference_probabilities[None], as_float64(self.value),
                                as_float64(self.output), self.residual)

    def deflation(self, tokens: int, large: bool = False, method: SpectralMethod | None = None,
                  generator: torch.Generator | None = None) -> Deflation:
        """``deflation.deflate_gram`` of the reference T_R for ``tokens`` tokens, complement in
        the units of T_R; with ``large``, its size from LARGE_DEFLATION_SIZES. Computed once
        per token count and size: from the Kronecker Gram of the verified zeta for R_l, and for
        U from the d x d Gram of its single-token reference (lifted: ``deflate_gram``'s
        tokens). Where ``probabilistic_reference(method)``, matrix-free instead
        (``deflation.probabilistic_deflation``): its complement holds with probability
        >= 1 - method.failure_probability over its random start (``_per_model_generator``)."""
        sizes = LARGE_DEFLATION_SIZES if large else DEFLATION_SIZES
        key = self._deflation_key(tokens, large, method, generator)
        if self.probabilistic_reference(method):
            if key not in self._deflations:
                reference = self.reference_probabilities
                apply, adjoint = self._reference_maps()
                self._deflations[key] = probabilistic_deflation(
                    first_order_gram(reference[None], self.first_order_factors), apply,
                    adjoint, (reference.shape[-1], self.width), _per_model(method),
                    _per_model_generator(generator, reference.device, 3 if large else 2),
                    reference.device, sizes)
            return self._deflations[key]
        if key not in self._deflations:
            f = self.first_order_factors
            reference = self.reference_probabilities
            lift = {}
            if reference is None:  # uniform: the d x d proof of the single-token reference
                reference = torch.ones((self.heads, 1, 1), dtype=torch.float64,
                                       device=self.value.device)
                lift = {"tokens": tokens, "rest": float(f.residual)}
            negated, error = first_order_negated_gram(reference[None], f)
            deflation = deflate_gram(
                negated[0], float(error[0]), first_order_gram(reference[None], f), sizes,
                overwrite=True,
                rebuild=lambda: first_order_negated_gram(reference[None], f)[0][0], **lift)
            self._deflations[key] = dataclasses.replace(
                deflation, complement=deflation.complement * f.unit)
        return self._deflations[key]

    def _deflation_key(self, tokens: int, large: bool, method: SpectralMethod | None,
                       generator: torch.Generator | None) -> tuple:
        """What a deflation depends on beyond the spec: the token count and size, and for a
        probabilistic one the method and the seed of its random start."""
        if self.probabilistic_reference(method):
            return (tokens, large, method, _seed(generator))
        return (tokens, large)

    @functools.cached_property
    def _deflation_products(self) -> dict[tuple, ProjectedBasis]:
        return {}

    def deflation_products(self, tokens: int, large: bool = False,
                           method: SpectralMethod | None = None,
                           generator: torch.Generator | None = None) -> ProjectedBasis:
        """The products of ``deflation``'s basis with the value, query and key weights that
        every sample's deflated bound reads (``near_reference.project_basis``), once per
        deflation: about as much work as one sample's products at the large size. Held with
        the model: 4 k n d float64 numbers (at most 75 MB a block for the shipped shapes)."""
        key = self._deflation_key(tokens, large, method, generator)
        if key not in self._deflation_products:
            deflation = self.deflation(tokens, large, method, generator)
            projections, _ = self.jacobian_weights
            self._deflation_products[key] = project_basis(
                deflation.basis.mT.reshape(deflation.size, tokens, self.width), projections,
                self.heads, self.value.shape[-1])
        return self._deflation_products[key]


def reference_norms(specs: list[AttentionSpec], method: SpectralMethod | None,
                    generator: torch.Generator | None = None) -> None:
    """Makes ``AttentionSpec.reference_norm`` for every spec that takes it by Lanczos
    (``probabilistic_reference(method)``) and lacks it: one randomized Lanczos run for all
    those of one shape (blocks of one model), each from the start a spec alone draws, so each
    norm is the one it would get alone, and its guarantee (the failure probability holds per
    spec, over that start). The runs are sequential in their steps: batched, the blocks share
    each step's products and its pass over the earlier vectors (six 65-token blocks, two CPU
    threads: 10.2 s one by one, 5.7 s together)."""
    waiting: dict[tuple, list[AttentionSpec]] = {}
    for spec in specs:
        if (spec.probabilistic_reference(method)
                and (method, _seed(generator)) not in spec._probabilistic_reference):
            reference = spec.reference_probabilities
            kind = (reference.shape, spec.value.shape, spec.output.shape, reference.device,
                    spec.residual)
            waiting.setdefault(kind, []).append(spec)
    for group in waiting.values():
        reference = group[0].reference_probabilities
        n, device = reference.shape[-1], reference.device
        apply, adjoint = first_order_maps(
            torch.stack([spec.reference_probabilities for spec in group]),
            torch.stack([as_float64(spec.value) for spec in group]),
            torch.stack([as_float64(spec.output) for spec in group]), group[0].residual)
        start = random_unit(1, n * group[0].width, device,
                            _per_model_generator(generator, device, 1))
        norms = operator_norm(apply, adjoint, (n, group[0].width), len(group),
                              _per_model(method), device=device,
                              start=start.expand(len(group), -1))
        for spec, norm in zip(group, norms):
            spec._probabilistic_reference[(method, _seed(generator))] = norm


def _per_model_generator(generator: torch.Generator | None, device: torch.device,
                         offset: int) -> torch.Generator:
    """A generator of its own for a per-model random start, seeded from the certifier's seed
    (``generator.initial_seed()``, 0 without one) plus ``offset``: the draw, and so every
    sample's certificate, does not depend on which batch first needs the quantity, and the
    certifier's own stream of per-sample starts is left as it was."""
    return torch.Generator(device=device).manual_seed(_seed(generator) + offset)


def _seed(generator: torch.Generator | None) -> int:
    """The seed the per-model draws derive from: the certifier's, 0 without a generator."""
    return generator.initial_seed() if generator is not None else 0


# From this many coordinates n d of a position-biased reference on, a Lanczos method draws the
# reference's per-model bounds by Lanczos instead of Cholesky proofs of (n d)^2 Gram matrices
# (two CPU threads: at n d = 4,352, the default, the proofs took 3.3 s per model and Lanczos
# 5.8; at 8,320, 65 tokens, 13.2 s against 8.1; the proofs grow as (n d)^3, Lanczos as (n d)).
PROBABILISTIC_REFERENCE_SIZE = 6144

# The relative slack of the per-model Lanczos bounds (at most the method's own): they enter every
# sample's bound, and a near-reference bound must come within the method's slack of its
# Rayleigh quotient to settle a sample. At the default's 1e-3 no sample of the 65-token model
# settled (219 ms a sample against 48); at 1e-4 the 912 Lanczos steps a bound (N = 8,320,
# failure probability 1e-9; their reorthogonalisation is memory-bound) took 20 s per model;
# 3e-4 takes 527 steps, 8 s.
PER_MODEL_SLACK = 3e-4


def _per_model(method: SpectralMethod) -> SpectralMethod:
    """``method`` with relative_slack at most PER_MODEL_SLACK, for the per-model bounds."""
    return dataclasses.replace(method, relative_slack=min(method.relative_slack,
                                                          PER_MODEL_SLACK))
