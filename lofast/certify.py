"""Clean activations + per-stage bounds -> certificates. No printing, no files.

The certificate is for the model evaluated in float64: the forward pass, the margins and
every bound are computed in float64 from the effective weights the model reports.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lofast.bounds.attention import AttentionSensitivity, AttentionWeights, attention_sensitivity
from lofast.bounds.compose import (
    LipschitzStep,
    ProjectionStep,
    RadiusMap,
    certified_radius,
    head_certified,
    propagate,
)
from lofast.bounds.spectral import (
    Guarantee,
    SpectralMethod,
    matrix_norm_upper,
    weakest_guarantee,
)
from lofast.errors import CertificationError
from lofast.models.structure import (
    AttentionSpec,
    EmbedSpec,
    HeadSpec,
    PoolSpec,
    ProjectSpec,
    SLLSpec,
    StageSpec,
)
from lofast.models.vit import LipschitzViT

BOUNDS = {
    # name: (first-order term, score term); "lofast" is the paper's practical bound delta_2^(2)
    "lofast": ("lofast", "relaxed"),
    "lofast-tight": ("lofast", "exact"),
    "naive": ("naive", "relaxed"),
}


@dataclass(frozen=True)
class CertifySettings:
    bound: str = "lofast"
    kappa: float = 0.5  # softmax Lipschitz constant: 1/2 is tight and sound, 1 is the paper's
    method: SpectralMethod = field(default_factory=SpectralMethod)
    local_projection: bool = True  # LayerProject's local contraction (else 1-Lipschitz)
    softmax_jacobian: bool = True  # the second-order refinement of ``bounds.attention``
    seed: int = 0

    def __post_init__(self) -> None:
        if self.bound not in BOUNDS:
            raise CertificationError(f"unknown bound {self.bound!r}; choose from {', '.join(BOUNDS)}")
        if self.kappa not in (0.5, 1.0):
            raise CertificationError("kappa must be 0.5 (tight) or 1 (the paper's)")

    def describe(self) -> str:
        """The bound's name, as summaries report it."""
        return f"{self.bound} + softmax Jacobian" if self.softmax_jacobian else self.bound


@dataclass
class BatchCertificate:
    """Certificates of a batch; every per-stage quantity is eps-independent.

    margins (B, C): z_y - z_j, +inf at j = y; pair_norms (B, C): ||w_y - w_j||; steps: the radius
    maps from the image to the pooled features.
    """

    labels: Tensor
    predictions: Tensor
    margins: Tensor
    pair_norms: Tensor
    steps: list[RadiusMap]
    guarantee: Guarantee
    failure_probability: float  # per sample: union bound over its probabilistic norms
    seconds: float  # wall time to compute this batch's quantities

    @property
    def margin(self) -> Tensor:
        """min_j (z_y - z_j), (B,); negative when misclassified."""
        return self.margins.min(dim=1).values

    def feature_radius(self, eps: Tensor) -> Tensor:
        """Bound on the change of the pooled features, (B, E), for image radii eps (E,)."""
        eps = eps.to(self.margins)
        return propagate(self.steps, eps[None, :].expand(len(self.labels), -1))

    def certified(self, eps: Tensor) -> Tensor:
        """(B, E) bool: label kept for every image within l2 distance eps."""
        return head_certified(self.margins, self.pair_norms, self.feature_radius(eps))

    def radius(self) -> Tensor:
        """Largest certified radius per sample, (B,) (0 when misclassified)."""
        return certified_radius(self.steps, self.margins, self.pair_norms)


def stage_lipschitz(spec: StageSpec) -> float | None:
    """Global Lipschitz constant of a stage (None for attention, which has none)."""
    if isinstance(spec, EmbedSpec):
        return float(matrix_norm_upper(spec.weight))
    if isinstance(spec, (ProjectSpec, SLLSpec)):
        return 1.0
    if isinstance(spec, PoolSpec):
        return 1.0 / math.sqrt(spec.num_tokens) if spec.kind == "mean" else 1.0
    if isinstance(spec, HeadSpec):
        w = spec.weight
        return float(torch.cdist(w, w).max())  # the largest ||w_i - w_j||
    return None


def check_stage(spec: StageSpec, index: int) -> None:
    """Refuse a stage whose Lipschitz accounting would not hold for the function it computes.

    The model validates its config, but the certificate must not rest on that alone: every
    constant the bounds use is checked here on the spec the forward pass was built from.
    """
    tensors = [value for value in vars(spec).values() if isinstance(value, torch.Tensor)]
    if not all(torch.isfinite(t).all() for t in tensors):
        raise CertificationError(f"stage {index}: weights contain NaN or infinity")
    if isinstance(spec, ProjectSpec) and not spec.radius > 0:
        raise CertificationError(f"stage {index}: projection radius {spec.radius} is not positive")
    if isinstance(spec, PoolSpec) and spec.kind not in ("mean", "cls"):
        raise CertificationError(f"stage {index}: unknown pooling {spec.kind!r}")
    if isinstance(spec, AttentionSpec) and not (spec.residual and spec.scale > 0):
        raise CertificationError(f"stage {index}: attention must be residual with scale > 0")
    if isinstance(spec, SLLSpec):
        if not (spec.t > 0).all():
            raise CertificationError(f"stage {index}: SLL layer has a zero column "
                                     "(its rescaling divides by zero)")
        gram = spec.weight.T @ spec.weight
        lowest = torch.linalg.eigvalsh(torch.diag(spec.t) - gram)[0].item()
        if lowest < 0:
            raise CertificationError(f"stage {index}: SLL layer is not provably 1-Lipschitz "
                                     f"(min eigenvalue {lowest:.3g})")


def attention_weights(spec: AttentionSpec, device: torch.device) -> AttentionWeights:
    return AttentionWeights(query=spec.query.to(device), key=spec.key.to(device),
                            value=spec.value.to(device), output=spec.output.to(device),
                            residual=spec.residual, scale=spec.scale,
                            position_bias=None if spec.position_bias is None
                            else spec.position_bias.to(device))


class Certifier:
    """Certifies batches of images for one model; per-model quantities are computed once."""

    def __init__(self, model: LipschitzViT, settings: CertifySettings | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.settings = settings or CertifySettings()
        self.device = torch.device(device)
        self.model = copy.deepcopy(model).to(self.device, torch.float64).eval()
        with torch.no_grad():
            self.model.hold_effective_weights(True)  # the copy's weights never change
        self.structure = self.model.structure()
        if not isinstance(self.structure[0], EmbedSpec) or not isinstance(self.structure[-1], HeadSpec):
            raise CertificationError("model must start with a patch embedding and end with a head")
        for i, spec in enumerate(self.structure):
            check_stage(spec, i)
        self.lipschitz = [stage_lipschitz(s) for s in self.structure]
        self.attention = {i: attention_weights(s, self.device)
                          for i, s in enumerate(self.structure) if isinstance(s, AttentionSpec)}
        self.generator = torch.Generator(device=self.device).manual_seed(self.settings.seed)

    @torch.no_grad()
    def certify(self, images: Tensor, labels: Tensor) -> BatchCertificate:
        """images (B, C, H, W) in [0, 1], labels (B,) -> certificates."""
        started = time.perf_counter()
        x = images.to(self.device, torch.float64)
        if not torch.isfinite(x).all():
            raise CertificationError("input images contain NaN or infinity")
        if x.min() < 0 or x.max() > 1:
            raise CertificationError("pixel values must lie in [0, 1]")
        labels = labels.to(self.device)
        logits, activations = self.model.forward_with_activations(x)
        if not torch.isfinite(logits).all():
            raise CertificationError("the model's output is not finite on these images")
        first_order, score_bound = BOUNDS[self.settings.bound]
        steps: list[RadiusMap] = []
        guarantee, failure = Guarantee.DETERMINISTIC, 0.0
        moving = slice(None)  # the tokens of `act` that a perturbation of the image can reach
        for i, (spec, act) in enumerate(zip(self.structure[:-1], activations[:-1])):
            if isinstance(spec, AttentionSpec):
                sens: AttentionSensitivity = attention_sensitivity(
                    act, self.attention[i], kappa=self.settings.kappa, first_order=first_order,
                    score_bound=score_bound, softmax_jacobian=self.settings.softmax_jacobian,
                    method=self.settings.method, generator=self.generator)
                steps.append(sens)
                guarantee = weakest_guarantee(guarantee, sens.guarantee)
                failure += sens.failure_probability
            elif isinstance(spec, PoolSpec) and act.shape[1] != spec.num_tokens:
                raise CertificationError(f"stage {i}: pooling over {spec.num_tokens} tokens, "
                                         f"the model computes {act.shape[1]}")
            elif isinstance(spec, ProjectSpec) and self.settings.local_projection:
                steps.append(ProjectionStep.around(act, spec.radius, moving))
            else:
                steps.append(LipschitzStep(self.lipschitz[i]))
            if isinstance(spec, EmbedSpec):
                moving = slice(spec.constant_tokens, None)
            elif isinstance(spec, AttentionSpec):
                moving = slice(None)  # attention mixes every token into every other
        head: HeadSpec = self.structure[-1]
        weight = head.weight.to(self.device)
        true_logit = logits.gather(1, labels[:, None])
        margins = true_logit - logits
        margins.scatter_(1, labels[:, None], math.inf)
        pair_norms = torch.linalg.vector_norm(weight[labels][:, None, :] - weight[None], dim=-1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return BatchCertificate(labels=labels, predictions=logits.argmax(dim=1), margins=margins,
                                pair_norms=pair_norms, steps=steps, guarantee=guarantee,
                                failure_probability=failure,
                                seconds=time.perf_counter() - started)

