"""Does attention do input-dependent work? Measure it, and ablate it. No printing, no files.

Certified training can drive ||A_l|| = ||Wq_l Wk_l^T|| to about 0, and then P_l(X) no longer
depends on the image. This module measures, for a model and a data set, per attention block
and head:

- an upper bound on ||A_l|| (``matrix_norm_upper``) and ||A_l|| / s;
- how far P_l(X) strays from its data mean Pbar_l: the total variation TV(p, q) =
  0.5 sum_j |p_j - q_j| between each row of P_l(X) and the same row of Pbar_l, its mean and
  maximum over samples and rows;
- the attention ablation: the model in which every block's P_l(X) is replaced by Pbar_l, its
  clean and certified accuracy against the real model's, and the share of predictions that
  change.

The ablated model needs no bound code of its own. A block whose attention is the fixed matrix
Pbar_l is exactly a block with Wq_l = Wk_l = 0 (scores 0) and position bias C_l = log Pbar_l:
every row of Pbar_l is positive and sums to 1, so row_softmax(log Pbar_l) = Pbar_l. The
ablation is therefore an ordinary ``LipschitzViT`` with position biases, and the sound
``Certifier`` certifies it unchanged.

Pbar_l is the mean of the real model's P_l(X) at block l on the real model's own activations
(one forward pass per batch, block by block). The ablated model then propagates its own
activations through the fixed matrices: that is "replace every block's attention by its mean".

Everything is evaluated in float64, like the certifier's forward pass, so the real model's
predictions here are the ones ``lofast certify`` reports.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from lofast.bounds.attention import attention_probabilities
from lofast.bounds.attention_spec import AttentionSpec
from lofast.certification.certificate import Certifier, CertifySettings
from lofast.certification.records import eps_key
from lofast.config import Weights
from lofast.errors import CertificationError
from lofast.models.layers import Attention
from lofast.models.vit import LipschitzViT

# log Pbar_l would be -inf where a mean attention weight underflowed to exactly 0 (a position
# bias that spreads its row over more than ~745 nats); a non-finite bias is no model. Clamping
# to the smallest normal float64 changes such an entry's softmax weight from 0 to at most
# n * 2.2e-308 relative to its row: far below every rounding error of the forward pass. Entries
# that are positive, which is all of them in practice, are left exactly as they are.
LOG_FLOOR = torch.finfo(torch.float64).tiny

# progress(phase, done, total): phase names the pass ("mean attention", "ablation").
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class HeadAttention:
    """One head l of one attention block."""

    block: int  # the block's position among the attention blocks, from 0
    stage: int  # its index in ``model.stages``
    head: int
    score_norm: float  # a deterministic upper bound on ||A_l|| = ||Wq_l Wk_l^T||
    score_norm_over_scale: float  # the same divided by the score divisor s
    tv_mean: float  # mean over samples and rows of TV(P_l(X)_i, Pbar_l,i), in [0, 1]
    tv_max: float  # the maximum over samples and rows


@dataclass
class AttentionReport:
    """What attention does on a data set, and what replacing it by its mean costs.

    Accuracies are fractions in [0, 1] (as in the certify summary); the drops are percentage
    points, real minus ablated (positive: the real attention helps). Certified figures are
    keyed by ``eps_key(eps)`` and are empty when no eps was asked for.
    """

    samples: int
    heads: list[HeadAttention]
    clean_accuracy: float
    ablated_clean_accuracy: float
    changed_predictions: float  # share of samples whose predicted class changes
    attention_ablation_drop: float
    certified_accuracy: dict[str, float]
    ablated_certified_accuracy: dict[str, float]
    certified_ablation_drop: dict[str, float]
    seconds: float  # wall time of the whole report (both passes and the certificates)

    @property
    def max_score_norm(self) -> float:
        return max((h.score_norm for h in self.heads), default=0.0)

    @property
    def max_score_norm_over_scale(self) -> float:
        return max((h.score_norm_over_scale for h in self.heads), default=0.0)

    @property
    def max_tv(self) -> float:
        return max((h.tv_max for h in self.heads), default=0.0)

    @property
    def max_mean_tv(self) -> float:
        """The largest per-head mean TV."""
        return max((h.tv_mean for h in self.heads), default=0.0)

    def to_dict(self) -> dict:
        """Plain JSON-ready values, with the maxima over heads added."""
        out = asdict(self)
        out.update(max_score_norm=self.max_score_norm,
                   max_score_norm_over_scale=self.max_score_norm_over_scale,
                   max_tv=self.max_tv, max_mean_tv=self.max_mean_tv)
        return out


def ablate_attention(model: LipschitzViT, means: dict[int, Tensor]) -> LipschitzViT:
    """The model with every attention block's P_l(X) fixed to means[stage] (h, n, n).

    A new float64 model with position biases (``model`` is not changed): at every attention
    stage Wq = Wk = 0 and C_l = log means[stage]_l, so that P_l = row_softmax(C_l) = means_l
    for every input. ``means`` must hold one row-stochastic (h, n, n) matrix per attention
    stage index (``mean_attention`` returns that). Kept in float64 so that C_l holds log Pbar_l
    to float64 precision (float32 would round it by ~6e-8 relative).
    """
    stages = [i for i, stage in enumerate(model.stages) if isinstance(stage, Attention)]
    if sorted(means) != stages:
        raise ValueError(f"means are for stages {sorted(means)}, the model's attention "
                         f"stages are {stages}")
    # learned (then zeroed) query and key weights without a fixed score norm, whatever the
    # model had: every score is then 0 and only the bias C_l remains
    config = dataclasses.replace(model.config, position_bias=True, score_norm=None,
                                 query_key=Weights.LEARNED)
    with torch.random.fork_rng(devices=[]):  # the fresh model's initialisation is overwritten
        ablated = LipschitzViT(config)
    missing, unexpected = ablated.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(
        k.endswith((".position_bias", ".weights.query", ".weights.key")) for k in missing)
    ablated = ablated.to(torch.float64).eval()
    ablated.hold_effective_weights(False)  # a copy of a held model would keep stale weights
    with torch.no_grad():
        for i in stages:
            stage = ablated.stages[i]
            mean = means[i].to(stage.position_bias.device, torch.float64)
            if mean.shape != stage.position_bias.shape:
                raise ValueError(f"stage {i}: mean attention has shape {tuple(mean.shape)}, "
                                 f"the block needs {tuple(stage.position_bias.shape)}")
            # the spectral cap maps a zero matrix to zero (0 * cap / max(0, cap)): scores vanish
            stage.weights["query"].zero_()
            stage.weights["key"].zero_()
            stage.position_bias.copy_(torch.log(mean.clamp_min(LOG_FLOOR)))
    return ablated


def mean_attention(model: LipschitzViT, images: Tensor, *, batch_size: int = 256,
                   device: torch.device | str = "cpu") -> dict[int, Tensor]:
    """Pbar_l per attention stage: the mean of P_l(X) (h, n, n) float64 over images
    (N, C, H, W) in [0, 1], each P_l taken on the real model's own activations at that block."""
    real = _Float64Model(model, device)
    return real.mean_attention(_checked(images), batch_size)[0]


def attention_report(model: LipschitzViT, images: Tensor, labels: Tensor, *,
                     eps: Sequence[float] = (), settings: CertifySettings | None = None,
                     certified: Tensor | None = None, batch_size: int = 256,
                     device: torch.device | str = "cpu",
                     progress: Progress | None = None) -> AttentionReport:
    """Measure attention and its ablation on images (N, C, H, W) in [0, 1] with labels (N,).

    eps: image radii at which both models are certified with ``Certifier(., settings)`` (the
    default settings when None). certified: the real model's verdicts (N, len(eps)) bool in the
    order of ``eps``, when the caller already has them (``lofast certify``); they must come from
    the same settings. Otherwise the real model is certified here too. batch_size: samples per
    forward pass and per certified batch.
    """
    started = time.perf_counter()
    images = _checked(images)
    labels = torch.as_tensor(labels).reshape(-1).cpu()
    if labels.shape[0] != images.shape[0]:
        raise CertificationError(f"{images.shape[0]} images but {labels.shape[0]} labels")
    eps = [float(e) for e in eps]
    if certified is not None and tuple(certified.shape) != (len(labels), len(eps)):
        raise ValueError(f"certified must be ({len(labels)}, {len(eps)}), got "
                         f"{tuple(certified.shape)}")
    settings = settings or CertifySettings()
    n = len(labels)
    real = _Float64Model(model, device)
    means, real_predictions = real.mean_attention(images, batch_size, progress)
    ablated = ablate_attention(real.model, means).to(real.device)
    eps_tensor = torch.tensor(eps, dtype=torch.float64)
    certifiers = {}
    if eps:
        certifiers["ablated"] = Certifier(ablated, settings, real.device)
        if certified is None:
            certifiers["real"] = Certifier(model, settings, real.device)
    with torch.no_grad():
        ablated.hold_effective_weights(True)  # its weights never change from here
    verdicts = {name: torch.zeros(len(eps), dtype=torch.long) for name in ("real", "ablated")}
    if certified is not None:
        verdicts["real"] = certified.to(torch.long).sum(dim=0).cpu()
    ablated_predictions = torch.empty(n, dtype=torch.long)
    tv = {i: _TotalVariation() for i in means}
    with torch.no_grad():
        for start in range(0, n, batch_size):
            x = images[start:start + batch_size].to(real.device, torch.float64)
            y = labels[start:start + batch_size]
            _, probs = real.forward_with_attention(x)
            for i, p in probs.items():
                tv[i].add(0.5 * (p - means[i]).abs().sum(dim=-1))  # (B, h, n)
            ablated_predictions[start:start + len(y)] = ablated(x).argmax(dim=1).cpu()
            for name, certifier in certifiers.items():
                verdicts[name] += certifier.certify(x, y).certified(eps_tensor).sum(dim=0).cpu()
            if progress is not None:
                progress("ablation", start + len(y), n)
    real_correct = int((real_predictions == labels).sum())
    ablated_correct = int((ablated_predictions == labels).sum())
    certified_real = {eps_key(e): int(verdicts["real"][k]) for k, e in enumerate(eps)}
    certified_ablated = {eps_key(e): int(verdicts["ablated"][k]) for k, e in enumerate(eps)}
    return AttentionReport(
        samples=n,
        heads=_head_rows(real, tv),
        clean_accuracy=real_correct / n,
        ablated_clean_accuracy=ablated_correct / n,
        changed_predictions=int((real_predictions != ablated_predictions).sum()) / n,
        attention_ablation_drop=100.0 * (real_correct - ablated_correct) / n,
        certified_accuracy={k: v / n for k, v in certified_real.items()},
        ablated_certified_accuracy={k: v / n for k, v in certified_ablated.items()},
        certified_ablation_drop={k: 100.0 * (certified_real[k] - certified_ablated[k]) / n
                                 for k in certified_real},
        seconds=time.perf_counter() - started,
    )


class _Float64Model:
    """A private float64 copy of a model (weights held: they never change) with the weights of
    its attention blocks as the bound code reads them."""

    def __init__(self, model: LipschitzViT, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.model = model.frozen(self.device)
        with torch.no_grad():
            structure = self.model.structure()
        self.weights: dict[int, AttentionSpec] = {
            i: spec for i, spec in enumerate(structure) if isinstance(spec, AttentionSpec)}

    @torch.no_grad()
    def forward_with_attention(self, x: Tensor) -> tuple[Tensor, dict[int, Tensor]]:
        """Logits (B, K) and P_l(X) (B, h, n, n) float64 at every attention stage, each on the
        model's own input to that stage."""
        probs = {}
        for i, stage in enumerate(self.model.stages):
            if i in self.weights:
                probs[i] = attention_probabilities(x, self.weights[i])
            x = stage(x)
        return x, probs

    @torch.no_grad()
    def mean_attention(self, images: Tensor, batch_size: int, progress: Progress | None = None
                       ) -> tuple[dict[int, Tensor], Tensor]:
        """Pbar_l per attention stage (h, n, n) and the predictions (N,) on the images."""
        n = images.shape[0]
        sums: dict[int, Tensor] = {}
        predictions = torch.empty(n, dtype=torch.long)
        for start in range(0, n, batch_size):
            x = images[start:start + batch_size].to(self.device, torch.float64)
            logits, probs = self.forward_with_attention(x)
            predictions[start:start + len(x)] = logits.argmax(dim=1).cpu()
            for i, p in probs.items():
                sums[i] = p.sum(dim=0) + sums[i] if i in sums else p.sum(dim=0)
            if progress is not None:
                progress("mean attention", start + len(x), n)
        return {i: s / n for i, s in sums.items()}, predictions


class _TotalVariation:
    """Running mean and maximum per head of row-wise total variations (B, h, n)."""

    def __init__(self) -> None:
        self.total: Tensor | None = None
        self.max: Tensor | None = None
        self.count = 0

    def add(self, tv: Tensor) -> None:
        total, largest = tv.sum(dim=(0, 2)), tv.amax(dim=(0, 2))
        self.total = total if self.total is None else self.total + total
        self.max = largest if self.max is None else torch.maximum(self.max, largest)
        self.count += tv.shape[0] * tv.shape[2]


def _head_rows(real: _Float64Model, tv: dict[int, _TotalVariation]) -> list[HeadAttention]:
    rows = []
    for block, (i, weights) in enumerate(sorted(real.weights.items())):
        score_norm = weights.weight_norms[0]  # (h,) upper bounds via matrix_norm_upper
        for head in range(weights.heads):
            rows.append(HeadAttention(
                block=block, stage=i, head=head, score_norm=float(score_norm[head]),
                score_norm_over_scale=float(score_norm[head]) / weights.scale,
                tv_mean=float(tv[i].total[head]) / tv[i].count, tv_max=float(tv[i].max[head])))
    return rows


def _checked(images: Tensor) -> Tensor:
    """images (N, C, H, W), N >= 1, finite, in [0, 1]: the certifier's input contract."""
    if images.dim() != 4 or images.shape[0] == 0:
        raise CertificationError(f"expected images (N, C, H, W) with N >= 1, got "
                                 f"{tuple(images.shape)}")
    if not torch.isfinite(images).all():
        raise CertificationError("input images contain NaN or infinity")
    if images.min() < 0 or images.max() > 1:
        raise CertificationError("pixel values must lie in [0, 1]")
    return images
