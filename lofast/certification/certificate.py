"""Clean activations + per-stage bounds -> certificates. No printing, no files.

The certificate is for the model evaluated in float64: the forward pass, the margins and
every bound are computed in float64 from the effective weights the model reports.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from lofast.bounds.attention import AttentionSensitivity, attention_sensitivity
from lofast.bounds.attention_spec import (
    PROBABILISTIC_REFERENCE_SIZE,
    AttentionSpec,
    reference_norms,
)
from lofast.bounds.compose import RadiusMap, certified_radius, head_certified, propagate
from lofast.bounds.spectral import (
    JACOBIAN_SLACK,
    Guarantee,
    SpectralMethod,
    matrix_norm_upper,
    weakest_guarantee,
)
from lofast.bounds.stages import EmbedSpec, HeadSpec, StageSpec, radius_maps
from lofast.config import (
    AUTOMATIC_GUARANTEE,
    CERTIFY_DEFAULTS,
    GUARANTEE_CHOICES,
    GUARANTEES,
    KAPPAS,
    MAX_SEED,
    Bound,
    check_flags,
    check_int,
    parse_radii,
)
from lofast.errors import CertificationError, ConfigError, LofastError
from lofast.models.layers import StateSnapshot
from lofast.models.vit import LipschitzViT, foreign_part
from lofast.runtime import resolve_device

# Each bound's first-order term and score term; "lofast" is the paper's practical bound
# delta_2^(2), "lofast-tight" its delta_2^(1), "naive" the first-order term of eq. (12).
BOUND_TERMS = {
    Bound.LOFAST: ("lofast", "relaxed"),
    Bound.LOFAST_TIGHT: ("lofast", "exact"),
    Bound.NAIVE: ("naive", "relaxed"),
}
assert tuple(BOUND_TERMS) == tuple(Bound)


def automatic_guarantee(model: LipschitzViT) -> tuple[str, str]:
    """The guarantee "auto" takes for ``model``, and why in words: "exact" while its attention
    blocks act on fewer than PROBABILISTIC_REFERENCE_SIZE coordinates (n tokens x width d),
    "probabilistic" from there on. The exact guarantee's proofs factor (n d)^2 Gram matrices, in (n d)^3 / 3
    flops and 8 (n d)^2 bytes: once per model for a position-biased reference, and per sample
    where the cheap bounds are loose (two CPU threads: 3 s per model at 17 tokens of width 256;
    12 s at 65 tokens of width 128, against 8 s by Lanczos; at 256 tokens of width 128, 8.6 GB
    a matrix). The probabilistic guarantee keeps the deterministic bounds where they are tight
    and replaces each such proof by randomized Lanczos, whose cost grows as n d."""
    config = model.config
    size = config.num_tokens * config.width
    large = size >= PROBABILISTIC_REFERENCE_SIZE
    reason = (f"auto: {config.num_tokens} tokens x width {config.width} = {size:,} coordinates "
              f"a block, {'at least' if large else 'below'} {PROBABILISTIC_REFERENCE_SIZE:,}")
    return ("probabilistic" if large else "exact"), reason


def guarantee_name(method: SpectralMethod) -> str:
    """The guarantee a spectral method delivers, by its user-facing name (``config.GUARANTEES``)."""
    return method.guarantee.value


@dataclass(frozen=True)
class CertifySettings:
    """How to certify; the defaults are the CLI's (``config.CERTIFY_DEFAULTS``).

    guarantee names what the norms are ("exact", "probabilistic" or "estimate") and picks the
    spectral method; "auto" (the default) leaves the choice to ``for_model``, which the
    ``Certifier`` calls: exact unless the model's blocks are too large for its proofs
    (``automatic_guarantee``); method is None until then. A ``method`` given instead (e.g.
    dense norms in tests) sets the guarantee. jacobian_slack: the method's
    (``spectral.SpectralMethod``), how far above its estimate the cheap deflated bound on a live
    attention block's Jacobian may lie before per-sample proofs are made; None keeps the
    method's (by default 0.01). automatic: set by ``for_model`` when "auto" chose the
    guarantee, the reason in words.

    verdicts_at: radii > 0 (one or a sequence, kept distinct and ascending) for verdicts-only
    certificates (``Certifier.certify``): at each of them a sample is certified exactly when
    the full certificate certifies it, but the per-sample proofs run only for the samples
    whose verdict there needs them, so radii may be smaller (each still certified), and
    verdicts at other eps may be fewer. None: every radius as large as the bounds allow.
    """

    bound: Bound = CERTIFY_DEFAULTS.bound
    kappa: float = CERTIFY_DEFAULTS.kappa
    guarantee: str | None = None  # None: the method's, else CERTIFY_DEFAULTS.guarantee
    method: SpectralMethod | None = None  # None: the guarantee's (config.GUARANTEES)
    local_projection: bool = CERTIFY_DEFAULTS.local_projection
    softmax_jacobian: bool = CERTIFY_DEFAULTS.softmax_jacobian
    seed: int = CERTIFY_DEFAULTS.seed
    jacobian_slack: float | None = None
    automatic: str | None = None
    verdicts_at: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "bound", Bound.parse("bound", self.bound, CertificationError))
        if self.kappa not in KAPPAS:
            raise CertificationError("kappa must be 0.5 (tight) or 1 (the paper's)")
        check_flags(self, ("local_projection", "softmax_jacobian"), CertificationError)
        object.__setattr__(self, "seed", check_int("seed", self.seed, 0, MAX_SEED,
                                                   CertificationError))
        if self.verdicts_at is not None:
            try:
                object.__setattr__(self, "verdicts_at", parse_radii(self.verdicts_at,
                                                                    "verdicts_at"))
            except ConfigError as error:
                raise CertificationError(str(error)) from None
        if self.guarantee is not None and self.guarantee not in GUARANTEE_CHOICES:
            raise CertificationError(f"unknown guarantee {self.guarantee!r}; choose from "
                                     f"{', '.join(GUARANTEE_CHOICES)}")
        slack = self.jacobian_slack
        if self.method is None:  # frozen: fill in the derived fields once
            guarantee = self.guarantee or CERTIFY_DEFAULTS.guarantee
            object.__setattr__(self, "guarantee", guarantee)
            # the method checks the slack (one check for the CLI and the API); under "auto"
            # an exact one checks it, and ``for_model`` makes the method
            try:
                method = SpectralMethod(kind=GUARANTEES.get(guarantee, "verified"), **(
                    {} if slack is None else {"jacobian_slack": slack}))
            except ValueError as error:
                raise CertificationError(str(error)) from None
            if guarantee != AUTOMATIC_GUARANTEE:
                object.__setattr__(self, "method", method)
        elif slack is not None and slack != self.method.jacobian_slack:
            raise CertificationError(f"jacobian_slack {slack!r} differs from the given method's "
                                     f"{self.method.jacobian_slack!r}")
        elif self.guarantee not in (None, guarantee_name(self.method)):
            raise CertificationError(f"a {self.method.kind} method gives the "
                                     f"{guarantee_name(self.method)} guarantee, not "
                                     f"{self.guarantee}")
        else:
            object.__setattr__(self, "guarantee", guarantee_name(self.method))

    def for_model(self, model: LipschitzViT) -> CertifySettings:
        """These settings with "auto" resolved for ``model`` (``automatic_guarantee``); settings
        with a guarantee of their own are returned as they are."""
        if self.guarantee != AUTOMATIC_GUARANTEE:
            return self
        guarantee, reason = automatic_guarantee(model)
        return dataclasses.replace(self, guarantee=guarantee, automatic=reason)

    def describe(self) -> str:
        """The bound's name, as summaries report it (and records: a run resumes only with the
        same), with a Jacobian slack other than the default."""
        name = f"{self.bound} + softmax Jacobian" if self.softmax_jacobian else str(self.bound)
        slack = (self.method.jacobian_slack if self.method is not None  # None: "auto"
                 else self.jacobian_slack if self.jacobian_slack is not None else JACOBIAN_SLACK)
        if slack != JACOBIAN_SLACK:
            name += f", Jacobian slack {slack:g}"
        if self.verdicts_at is not None:
            name += (", radii for the verdicts at eps "
                     + ", ".join(f"{eps:g}" for eps in self.verdicts_at))
        return name


@dataclass
class BatchCertificate:
    """Certificates of a batch; every per-stage quantity is eps-independent.

    margins (B, C): z_y - z_j, +inf at j = y; pair_norms (B, C): ||w_y - w_j||; bounded (B,)
    bool: the samples with every margin positive, the only ones a radius can certify; steps:
    the radius maps from the image to the pooled features of those samples alone (their
    per-sample quantities have ``bounded.sum()`` rows, in batch order). A misclassified
    sample, or one tied with another class, gets no bounds: its radius is 0 whatever they are.
    """

    labels: Tensor
    predictions: Tensor
    margins: Tensor
    pair_norms: Tensor
    bounded: Tensor
    steps: list[RadiusMap]
    guarantee: Guarantee
    failure_probability: float  # per sample: union bound over its probabilistic norms
    seconds: float  # wall time to compute this batch's quantities

    @property
    def margin(self) -> Tensor:
        """min_j (z_y - z_j), (B,); negative when misclassified."""
        return self.margins.min(dim=1).values

    def feature_radius(self, eps: Tensor) -> Tensor:
        """Bound on the change of the pooled features, (B, E), for image radii eps (E,), each
        finite and >= 0 (CertificationError otherwise: the bounds hold for no other radius);
        +inf for the samples that are not ``bounded``."""
        eps = torch.as_tensor(eps).to(self.margins)
        if eps.dim() != 1 or not bool((torch.isfinite(eps) & (eps >= 0)).all()):
            raise CertificationError(f"eps must be a 1-d tensor of finite radii >= 0, not "
                                     f"{eps.tolist()}")
        radius = eps.new_full((len(self.labels), len(eps)), math.inf)
        count = int(self.bounded.sum())
        if count:
            radius[self.bounded] = propagate(self.steps, eps[None, :].expand(count, -1))
        return radius

    def certified(self, eps: Tensor) -> Tensor:
        """(B, E) bool: label kept for every image within l2 distance eps (never for a sample
        that is not ``bounded``)."""
        radius = self.feature_radius(eps)
        verdicts = torch.zeros(radius.shape, dtype=torch.bool, device=radius.device)
        rows = self.bounded
        verdicts[rows] = head_certified(self.margins[rows], self.pair_norms[rows], radius[rows])
        return verdicts

    def radius(self) -> Tensor:
        """Largest certified radius per sample, (B,) (0 when not ``bounded``)."""
        radius = torch.zeros_like(self.margin)
        rows = self.bounded
        if bool(rows.any()):
            radius[rows] = certified_radius(self.steps, self.margins[rows], self.pair_norms[rows])
        return radius


class VerifiedNorms:
    """The certificate's ``bounds.stage.StageRules``: sound float64 upper bounds (or, with a
    weaker guarantee, the method's norms); per-model quantities computed once. cheap: without
    the attention blocks' per-sample proofs (``attention_sensitivity``), each block's samples
    that a proof could tighten in its ``deferred``."""

    def __init__(self, settings: CertifySettings, generator: torch.Generator,
                 cheap: bool = False) -> None:
        self.settings = settings
        self.cheap = cheap
        self.local_projection = settings.local_projection
        self.generator = generator
        self.embedding_norms: dict[int, float] = {}

    def prepare(self, structure: list[StageSpec]) -> None:
        """The per-model quantities cheaper made for all blocks at once: where the LoFAST
        first-order bound reads every block's reference norm, those taken by Lanczos in one run
        (``attention_spec.reference_norms``; each the same as made alone)."""
        if BOUND_TERMS[self.settings.bound][0] == "lofast":
            reference_norms([spec for spec in structure if isinstance(spec, AttentionSpec)],
                            self.settings.method, self.generator)

    def embedding_norm(self, index: int, weight: Tensor) -> float:
        if index not in self.embedding_norms:
            self.embedding_norms[index] = float(matrix_norm_upper(weight))
        return self.embedding_norms[index]

    def attention(self, index: int, tokens: Tensor, spec: AttentionSpec) -> RadiusMap:
        first_order, score_bound = BOUND_TERMS[self.settings.bound]
        return attention_sensitivity(
            tokens, spec, kappa=self.settings.kappa, first_order=first_order,
            score_bound=score_bound, softmax_jacobian=self.settings.softmax_jacobian,
            method=self.settings.method, generator=self.generator, cheap=self.cheap)


class Certifier:
    """Certifies batches of images for one model; per-model quantities are computed once.

    ``Certifier(model)`` certifies as ``lofast certify`` does by default: the LoFAST bound with
    the softmax refinement, kappa 1/2, and the guarantee "auto" resolved for the model
    (``CertifySettings.for_model``: deterministic upper bounds unless the model is too large
    for their proofs); ``settings`` holds the resolved settings. The certificates are of the
    model as it is when the certifier is made: ``certify`` raises CertificationError once the
    model (a weight or a setting), or the certifier's own copy ``model``, has changed.
    """

    def __init__(self, model: LipschitzViT, settings: CertifySettings | None = None,
                 device: torch.device | str = "cpu") -> None:
        if not isinstance(model, LipschitzViT):
            raise CertificationError(f"a Certifier takes a LipschitzViT (lofast.load_model or "
                                     f"lofast.train gives one), not {type(model).__name__}")
        if settings is not None and not isinstance(settings, CertifySettings):
            raise CertificationError(f"settings must be a CertifySettings, not "
                                     f"{type(settings).__name__}")
        self._refuse_foreign_parts(model, "")
        for name, value in model.state_dict().items():  # a model given in memory is unchecked
            if value.device.type == "meta":
                raise CertificationError(f"the model's weight {name} has no values (meta device)")
            if value.is_floating_point() and not torch.isfinite(value).all():
                raise CertificationError(f"the model's weight {name} contains NaN or infinity")
        self.settings = (settings or CertifySettings()).for_model(model)
        try:
            self.device = resolve_device(str(device))
        except LofastError as error:
            raise CertificationError(str(error)) from None
        self.model = model.frozen(self.device)
        # the proofs below are about the weights as they are now: ``certify`` refuses once the
        # caller's model or this private copy of it has changed
        self._source, self._source_state = model, StateSnapshot(model)
        self._model_state = StateSnapshot(self.model)
        # specs on the certifier's device. They hold the per-model proofs (an attention spec's
        # verified reference norm and deflations, computed on first use): these live and die
        # with this certifier; certify many batches with one Certifier to pay them once.
        self.structure = self.model.structure()
        if not isinstance(self.structure[0], EmbedSpec) or not isinstance(self.structure[-1], HeadSpec):
            raise CertificationError("model must start with a patch embedding and end with a head")
        for i, spec in enumerate(self.structure):
            spec.check(i)
        generator = torch.Generator(device=self.device).manual_seed(self.settings.seed)
        # verdicts only: the walk defers the per-sample proofs, ``_radius_maps`` makes them
        self.norms = VerifiedNorms(self.settings, generator,
                                   cheap=self.settings.verdicts_at is not None)
        # one batch at a time: the per-model proofs are made on first use and then shared, and
        # the random starts are one stream, so calls from several threads take turns
        self._turn = threading.RLock()

    def certify(self, images: Tensor, labels: Tensor) -> BatchCertificate:
        """images (B, C, H, W) in [0, 1] of the model's shape, labels (B,) integer classes of
        the model -> certificates. CertificationError for anything else. Calls from several
        threads run one after another."""
        with self._turn:
            return self._certify(images, labels)

    @torch.no_grad()
    def _certify(self, images: Tensor, labels: Tensor, screen: bool = True) -> BatchCertificate:
        """``certify``; with ``screen`` False the verdicts-only walk makes every deferred proof
        (``_radius_maps``)."""
        started = time.perf_counter()
        self._check_unchanged()
        self._check_inputs(images, labels)
        x = images.to(self.device, torch.float64)
        if not torch.isfinite(x).all():
            raise CertificationError("input images contain NaN or infinity")
        if x.min() < 0 or x.max() > 1:
            raise CertificationError("pixel values must lie in [0, 1]")
        labels = labels.to(self.device, torch.long)  # any integer type names a class
        logits, activations = self.model.forward_with_activations(x)
        if not torch.isfinite(logits).all():
            raise CertificationError("the model's output is not finite on these images")
        true_logit = logits.gather(1, labels[:, None])
        margins = true_logit - logits
        margins.scatter_(1, labels[:, None], math.inf)
        # the bounds only for samples a radius can certify: the per-sample work of a model
        # that gets half the test set wrong halves
        bounded = (margins > 0).all(dim=1)
        head: HeadSpec = self.structure[-1]
        pair_norms = head.pair_norms(labels)
        steps, guarantee, failure = [], Guarantee.EXACT, 0.0
        if bool(bounded.any()):
            self.norms.prepare(self.structure)
            steps, guarantee, failure = self._radius_maps(
                activations if bool(bounded.all()) else [a[bounded] for a in activations],
                margins[bounded], pair_norms[bounded], screen)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return BatchCertificate(labels=labels, predictions=logits.argmax(dim=1), margins=margins,
                                pair_norms=pair_norms, bounded=bounded, steps=steps,
                                guarantee=guarantee, failure_probability=failure,
                                seconds=time.perf_counter() - started)

    def _radius_maps(self, activations: list[Tensor], margins: Tensor, pair_norms: Tensor,
                     screen: bool = True) -> tuple[list[RadiusMap], Guarantee, float]:
        """The radius maps of samples that all get bounds (activations, margins and pair norms
        of those samples alone), their weakest guarantee and per-sample failure probability.

        With ``settings.verdicts_at``, the walk skips the attention blocks' per-sample proofs;
        then they are made (``AttentionSensitivity.with_proofs``) for the samples whose verdict
        at some eps of verdicts_at they could change: not certified there by the cheap bounds,
        and certified there with every deferred norm at a lower bound
        (``AttentionSensitivity.with_lower_estimates``), which no proof goes below (with the
        estimate guarantee, where norms are not upper bounds, every such sample). The cheap
        bounds are no tighter than the full walk's, and the same where no proof was deferred,
        so at every eps of verdicts_at both certificates certify the same samples. Without
        ``screen`` every deferred sample gets its proofs, as in the full walk."""
        steps = radius_maps(self.structure, activations, self.norms)
        if self.settings.verdicts_at is not None:
            deferred = torch.zeros_like(margins[:, 0], dtype=torch.bool)
            for step in steps:
                if isinstance(step, AttentionSensitivity) and step.deferred is not None:
                    deferred |= step.deferred.rows
            refine = deferred
            if screen:
                eps = margins.new_tensor(self.settings.verdicts_at)[None].expand(len(margins), -1)
                cheap = head_certified(margins, pair_norms, propagate(steps, eps))  # (B, E)
                refine = deferred & ~cheap.all(dim=1)
                # estimated norms (power iteration) may lie below a lower bound: no screen there
                if bool(refine.any()) and self.settings.method.guarantee is not Guarantee.ESTIMATE:
                    best = [step.with_lower_estimates(refine)
                            if isinstance(step, AttentionSensitivity) else step for step in steps]
                    reachable = head_certified(margins, pair_norms, propagate(best, eps))
                    refine = refine & (reachable & ~cheap).any(dim=1)
            steps = [step.with_proofs(refine) if isinstance(step, AttentionSensitivity) else step
                     for step in steps]
        attention = [step for step in steps if isinstance(step, AttentionSensitivity)]
        return (steps, weakest_guarantee(*(step.guarantee for step in attention)),
                sum(step.failure_probability for step in attention))

    def make_proofs(self, images: Tensor, labels: Tensor) -> bool:
        """Make the once-per-model proofs that these samples need by certifying them, the
        certificate dropped, without advancing the stream of per-sample random starts: later
        batches certify as if this had not run (the per-model draws have generators of their
        own). With ``verdicts_at`` these samples get every deferred proof, as in the full
        certificate: the screen could skip them and so leave the per-model proofs they need (a
        block's larger deflation) to the first batch. Whether every sample got bounds (a
        misclassified one gets none, and needs no proof). Arguments as for ``certify``."""
        with self._turn:
            state = self.norms.generator.get_state()
            try:  # every deferred proof: the per-model proofs the full walk would make here
                return bool(self._certify(images, labels, screen=False).bounded.all())
            finally:
                self.norms.generator.set_state(state)

    def _check_unchanged(self) -> None:
        """Refuse to certify once the model differs from the one this certifier was made for (a
        weight, a setting, a hook): its copy, its specs and its per-model proofs are of the old
        model, so it would certify one the caller no longer has (or, where its own copy was
        edited, mix two)."""
        self._refuse_foreign_parts(self._source, " now")
        self._refuse_foreign_parts(self.model, " (Certifier.model, the certificate's own copy)")
        changed = self._source_state.changed(self._source)
        if changed is not None:
            raise CertificationError(
                f"the model changed after this Certifier was made (first: {changed}); its "
                f"proofs are of the model as it was: make a new Certifier for the changed one")
        changed = self._model_state.changed(self.model)
        if changed is not None:
            raise CertificationError(
                f"Certifier.model, the certificate's own copy of the model, was changed "
                f"(first: {changed}); make a new Certifier from the model instead")

    @staticmethod
    def _refuse_foreign_parts(model: LipschitzViT, when: str) -> None:
        """CertificationError where the model's forward pass may differ from its specs
        (``foreign_part``: a hook, a forward method set on a module, a foreign module)."""
        foreign = foreign_part(model)
        if foreign is not None:
            raise CertificationError(f"cannot certify this model{when}: {foreign} (its "
                                     f"forward pass may not be the function its specs bound)")

    def _check_inputs(self, images: Tensor, labels: Tensor) -> None:
        """Refuse images that are not a (B, C, H, W) batch of the model's shape, and labels
        that are not B integer classes of the model: a label outside them, or a wrong image
        shape broadcast by the forward pass, would certify a question nobody asked."""
        config = self.model.config
        shape = (config.channels, config.image_size, config.image_size)
        if not isinstance(images, Tensor) or images.dim() != 4 or tuple(images.shape[1:]) != shape \
                or images.shape[0] < 1:
            got = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
            raise CertificationError(f"images must be a tensor (B, {', '.join(map(str, shape))}) "
                                     f"with B >= 1, not {got}")
        if not images.dtype.is_floating_point:  # uint8 pixels 0 .. 255 are not in [0, 1]
            raise CertificationError(f"images must be floating point, in [0, 1], not "
                                     f"{images.dtype} (uint8 images: divide by 255)")
        if (not isinstance(labels, Tensor) or labels.dtype.is_floating_point
                or labels.dtype.is_complex or labels.dtype == torch.bool
                or tuple(labels.shape) != (images.shape[0],)):
            got = (f"{tuple(labels.shape)} {labels.dtype}" if isinstance(labels, Tensor)
                   else type(labels).__name__)
            raise CertificationError(f"labels must be an integer tensor ({images.shape[0]},), "
                                     f"not {got}")
        if bool(((labels < 0) | (labels >= config.num_classes)).any()):
            raise CertificationError(f"labels must lie in 0 .. {config.num_classes - 1}")

