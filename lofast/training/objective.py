"""The loss of a training step: cross-entropy on logits worsened by a radius (the Lipschitz
margin, or the certified-training bound's per-sample radius), an optional attention reward, and
the step as a module (``TrainingObjective``), compiled when asked (``CompiledObjective``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lofast.config import Loss, TrainConfig
from lofast.models.vit import LipschitzViT
from lofast.training.bound import TrainingBound


def head_pair_norms(model: LipschitzViT, labels: Tensor) -> Tensor:
    """||w_y - w_j|| for every sample and class j, (B, C), with gradients; zero at j = y
    (``HeadSpec.pair_norms``, as the certificate takes them)."""
    return model.stages[-1].spec(differentiable=True).pair_norms(labels)


def training_loss(model: LipschitzViT, logits: Tensor, labels: Tensor, config: TrainConfig,
                  feature_radius: Tensor | None = None) -> Tensor:
    """Cross-entropy on logits whose non-true entries j are raised by r * ||w_y - w_j||, the
    amount the head certificate subtracts for a pooled-feature radius r: r = margin for the
    Lipschitz-margin loss, r = the per-sample LoFAST training bound (B,) for the certified loss
    (mixed with clean cross-entropy by clean_mix). With logit_annealing = gamma > 0 each
    sample's cross-entropy CE is weighted by (1 - exp(-CE))^gamma (``annealed_cross_entropy``)."""
    offset = {Loss.CE: None, Loss.MARGIN: config.margin if config.margin > 0 else None,
              Loss.CERTIFIED: None if feature_radius is None else feature_radius[:, None]
              }[config.loss]
    if offset is None:
        return annealed_cross_entropy(logits / config.temperature, labels, config.logit_annealing)
    raised = logits + offset * head_pair_norms(model, labels)
    loss = annealed_cross_entropy(raised / config.temperature, labels, config.logit_annealing)
    if config.loss is Loss.CERTIFIED and config.clean_mix > 0:
        clean = annealed_cross_entropy(logits / config.temperature, labels,
                                       config.logit_annealing)
        loss = (1.0 - config.clean_mix) * loss + config.clean_mix * clean
    return loss


def annealed_cross_entropy(logits: Tensor, labels: Tensor, gamma: float) -> Tensor:
    """Mean over the batch of (1 - p_y)^gamma CE, with CE = -log p_y each sample's
    cross-entropy on logits (B, K): plain cross-entropy for gamma = 0. The weight is part of
    the loss (differentiated), as in the logit-annealing loss of Lai et al. (ICML 2025)."""
    if gamma == 0:
        return F.cross_entropy(logits, labels)
    each = F.cross_entropy(logits, labels, reduction="none")
    return ((-torch.expm1(-each)).pow(gamma) * each).mean()


def attention_reward(model: LipschitzViT, x: Tensor, logits: Tensor, labels: Tensor,
                     config: TrainConfig) -> Tensor:
    """max(0, m - (CE_ablated - CE)) for images (B, C, H, W) and their logits (B, K): zero once
    replacing every block's attention by its mean over the batch (a constant of the step, as
    ``attention_report`` ablates with the mean over a data set) costs the batch at least m nats
    of cross-entropy (m = ablation_margin). Certified training otherwise switches attention
    off, since every unit of input-dependent attention costs radius; this term makes
    attention that does no work cost loss instead."""
    ablated = model(x, fixed_attention=model.batch_mean_attention(x)).to(logits.dtype)
    gap = (F.cross_entropy(ablated / config.temperature, labels)
           - F.cross_entropy(logits / config.temperature, labels))
    return torch.relu(config.ablation_margin - gap)


def scheduled_eps(config: TrainConfig, progress: float) -> float:
    """Training radius after `progress` epochs: linear ramp from 0 to train_eps."""
    if config.eps_ramp_epochs <= 0:
        return config.train_eps
    return config.train_eps * min(1.0, progress / config.eps_ramp_epochs)


class TrainingObjective(nn.Module):
    """The loss of a batch as one module (so DistributedDataParallel can wrap it): the training
    loss and the clean logits of images (B, C, H, W) with labels (B,), the logits worsened by
    the training bound's radius at eps for the certified loss."""

    def __init__(self, model: LipschitzViT, config: TrainConfig,
                 bound: TrainingBound | None) -> None:
        super().__init__()
        self.model = model
        self.config = config
        self.bound = bound

    def forward(self, x: Tensor, y: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        radius = None
        with self.model.reusing_effective_weights():  # effective weights once per step
            if self.bound is not None:
                logits, radius = self.bound(self.model, x, eps)
            else:
                logits = self.model(x)
            loss = training_loss(self.model, logits.float(), y, self.config, radius)
            if self.config.ablation_margin > 0:
                loss = loss + self.config.ablation_weight * attention_reward(
                    self.model, x, logits.float(), y, self.config)
        return loss, logits


class CompiledObjective(nn.Module):
    """A ``TrainingObjective`` under torch.compile, called once per training step. ``mode``:
    "cudagraphs" (the step's kernels captured in CUDA graphs and replayed, without code
    generation: a certified step on a GPU otherwise waits for thousands of kernel launches) or
    one of Inductor's modes ("default", "reduce-overhead", "max-autotune"). On a CPU the
    cudagraphs backend runs the traced graph without capturing it.

    The step's radius goes in as a tensor on the device (a float would be a constant of the
    graph, compiled anew at every step of the radius ramp), and the warm-start vectors that the
    bound hands to the next step are copied out of the graph's memory, which its next replay
    overwrites (as it does the loss and logits returned: read them before the next step)."""

    def __init__(self, objective: TrainingObjective, mode: str) -> None:
        super().__init__()
        self.bound = objective.bound
        # dynamic=False: an epoch's last, smaller batch gets a graph of its own with fixed
        # shapes (as CUDA graphs have), not a second graph with a symbolic batch size
        self.compiled = (torch.compile(objective, backend="cudagraphs", dynamic=False)
                         if mode == "cudagraphs"
                         else torch.compile(objective, mode=mode, dynamic=False))
        self.eager = [objective]  # in a list: not a second registration of its parameters

    def forward(self, x: Tensor, y: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        if self.bound is not None and not self.bound.vectors:
            # the first step of a fresh run, eager: its power iterations start from random
            # vectors of the run's generator, which a graph cannot draw from
            return self.eager[0](x, y, eps)
        torch.compiler.cudagraph_mark_step_begin()
        # filled on the device: a host tensor copied in would wait for the queued work
        eps_on_device = torch.full((1,), eps, dtype=torch.float64, device=x.device)
        loss, logits = self.compiled(x, y, eps_on_device)
        if self.bound is not None:
            self.bound.vectors = {k: v.clone() for k, v in self.bound.vectors.items()}
        return loss, logits
