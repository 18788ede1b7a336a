"""The Lipschitz ViT: a flat list of stages, each either L-Lipschitz or a LoFAST attention block."""

from __future__ import annotations

import contextlib
import copy as copy_module
import dataclasses
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor, nn

from lofast.bounds.stages import StageSpec
from lofast.config import INIT_OPTIONS, ModelConfig, Weights
from lofast.errors import LofastError
from lofast.models.layers import (
    SLL,
    Attention,
    Head,
    HoldsCappedWeights,
    LayerProject,
    PatchEmbed,
    Pool,
    hold_capped_weights,
)


class LipschitzViT(nn.Module):
    """Maps images (B, C, H, W) in [0,1] to logits (B, num_classes).

    The forward pass is the composition of `self.stages`; `structure()` lists their specs in the
    same order, and `forward_with_activations` returns the clean input of every stage, which is
    exactly what the certifier composes.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        stages: list[nn.Module] = [
            PatchEmbed(c.image_size, c.channels, c.patch_size, c.width, c.embed_cap,
                       c.input_center)
        ]
        for block in range(c.depth):
            live = c.is_live(block)
            stages.append(LayerProject(c.attn_radius))
            stages.append(Attention(c.width, c.heads, c.query_key_cap, c.value_cap,
                                    c.output_cap, c.num_tokens if c.position_bias else None,
                                    c.score_norm if live else None,
                                    c.learned_query_key(block),
                                    c.value_norm if live else None,
                                    c.learned_value_output(block)))
            if c.mlp_radius is not None:
                stages.append(LayerProject(c.mlp_radius))
            stages.append(SLL(c.width, c.width * c.mlp_ratio))
        if c.final_radius is not None:
            stages.append(LayerProject(c.final_radius))
        stages.append(Pool(c.pool, c.num_tokens))
        stages.append(Head(c.width, c.num_classes, c.normalized_head))
        self.stages = nn.ModuleList(stages)
        self._held = False  # hold_effective_weights(True) in force

    def forward(self, x: Tensor, fixed_attention: Mapping[int, Tensor] | None = None) -> Tensor:
        """Logits (B, num_classes). ``fixed_attention`` maps attention stage indices to
        row-stochastic (h, n, n) matrices that replace those stages' P_l(X) (the ablation)."""
        for i, stage in enumerate(self.stages):
            fixed = None if fixed_attention is None else fixed_attention.get(i)
            x = stage(x) if fixed is None else stage(x, fixed)
        return x

    @torch.no_grad()
    def batch_mean_attention(self, x: Tensor) -> dict[int, Tensor]:
        """The mean of P_l(X) over the images x (B, C, H, W), (h, n, n) per attention stage,
        each P_l on the model's own input to its block; no gradients."""
        means = {}
        for i, stage in enumerate(self.stages):
            if isinstance(stage, Attention):
                probs = stage.probabilities(x)
                means[i] = probs.mean(dim=0)
                x = stage(x, probs)  # the real block, its P_l(X) computed once
            else:
                x = stage(x)
        return means

    def forward_with_activations(self, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Logits and the list of clean stage inputs (stage k's input is element k)."""
        activations = []
        for stage in self.stages:
            activations.append(x)
            x = stage(x)
        return x, activations

    @contextlib.contextmanager
    def reusing_effective_weights(self) -> Iterator[None]:
        """Within the block, the capped stages (patch embedding, attention) compute their
        effective weights (an SVD each in eval mode, a norm estimate in training mode) once and
        reuse them, for a training step that evaluates them more than once (forward pass,
        training bound, attention reward). The weights must not change inside.
        Re-entrant: inside an outer block, or in a model whose weights are held already (a
        ``frozen`` copy), it reuses those weights and releases nothing."""
        if self._held:
            yield
            return
        self.hold_effective_weights(True)
        try:
            yield
        finally:
            self.hold_effective_weights(False)

    def frozen(self, device: torch.device | str,
               dtype: torch.dtype = torch.float64) -> LipschitzViT:
        """A private copy on ``device`` in ``dtype``, in eval mode, for a certifier, an attack or
        a report that never changes its weights: its capped stages hold their effective weights
        and its SLL layers their rescaling (no SVD on any forward pass). In float64 (the
        default) the copy is the model that certificates and counterexamples are about; a
        float32 copy only searches for counterexamples faster (``attack``'s ``search``)."""
        copy = copy_module.deepcopy(self).to(torch.device(device), dtype).eval()
        with torch.no_grad():
            copy.hold_effective_weights(True)
        return copy

    def hold_effective_weights(self, hold: bool) -> None:
        """hold=True: from now on the capped stages reuse their current effective weights and
        the SLL layers their rescaling, for a model whose weights stay fixed (the certifier's
        private copy, a training step); False releases them."""
        hold_capped_weights([stage for stage in self.stages
                             if isinstance(stage, HoldsCappedWeights)], hold, self.training)
        for stage in self.stages:
            if isinstance(stage, SLL):
                stage.hold_rescaling(hold)
        self._held = hold

    def structure(self, differentiable: bool = False) -> list[StageSpec]:
        """The specs of all stages, in forward order: detached float64 copies of the effective
        weights, or with ``differentiable`` the effective weights themselves (gradients flow)."""
        with torch.set_grad_enabled(differentiable and torch.is_grad_enabled()):
            return [stage.spec(differentiable) for stage in self.stages]


def foreign_part(model: nn.Module) -> str | None:
    """Where ``model`` may compute something other than what its stages' specs describe, in
    one line, or None. A certifier bounds every stage through its ``spec()`` and measures the
    margins through the stages' forward passes, so each stage's class must define its
    ``spec`` where it defines its ``forward`` or below (the stage protocol: a stage of a new
    class brings its spec; a subclass that changes a lofast stage's forward pass and keeps its
    spec does not). Named here: a model that is not a LipschitzViT, a stage without a spec or
    with a forward pass newer than its spec, a ``forward`` or ``spec`` set on one module, and a
    forward hook (on any module, or registered for all modules; a hook that changes nothing
    is named too, as nothing tells it from one that does)."""
    if type(model) is not LipschitzViT:
        return f"the model is of type {type(model).__name__}, not LipschitzViT"
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return "a forward hook registered for every module (register_module_forward_hook)"
    for index, stage in enumerate(model.stages):
        kind = type(stage)
        defines = [owner for owner in kind.__mro__ if "spec" in vars(owner)]
        if not defines:
            return f"stage {index} ({kind.__name__}) has no spec() to bound it by"
        forward = next(owner for owner in kind.__mro__ if "forward" in vars(owner))
        if kind.__mro__.index(forward) < kind.__mro__.index(defines[0]):
            return (f"stage {index} ({kind.__name__}) defines its forward pass without a "
                    f"spec() of its own")
    for name, module in model.named_modules():
        where = f"module {name}" if name else "the model"
        if module._forward_hooks or module._forward_pre_hooks:
            return f"{where} has a forward hook"
        replaced = sorted({"forward", "spec"} & vars(module).keys())
        if replaced:
            return f"{where} has a {replaced[0]} method of its own"
    return None


def with_options(model: LipschitzViT, **changes) -> LipschitzViT:
    """A copy of ``model`` with config fields from INIT_OPTIONS changed: position_bias=True adds
    zero biases (the same function); score_norm rescales every head's scores to that norm;
    query_key='identity' replaces the learned Wq, Wk by the identity; value_norm rescales every
    head's value path to that norm; live_blocks limits these to the last blocks;
    normalized_head=False frees the head's rows, starting from the unit rows (the same
    function)."""
    unknown = sorted(set(changes) - set(INIT_OPTIONS))
    if (unknown or changes.get("position_bias", True) is not True
            or changes.get("query_key", Weights.IDENTITY) != Weights.IDENTITY
            or changes.get("normalized_head", False) is not False):
        raise LofastError(f"a trained model can take on only: "
                          f"{', '.join(f'{k} ({v})' for k, v in INIT_OPTIONS.items())}")
    like = next(model.parameters())
    extended = LipschitzViT(dataclasses.replace(model.config, **changes)).to(like)
    kept = {k: v for k, v in model.state_dict().items() if k in extended.state_dict()}
    if model.config.normalized_head and not extended.config.normalized_head:
        kept[f"stages.{len(model.stages) - 1}.weight"] = model.stages[-1].effective_weight().detach()
    dropped = set(model.state_dict()) - set(kept)
    assert all(k.endswith((".weights.query", ".weights.key")) for k in dropped)
    missing, unexpected = extended.load_state_dict(kept, strict=False)
    assert not unexpected and all(key.endswith(".position_bias") for key in missing)
    return extended


def create_model(config: ModelConfig, seed: int | None = None) -> LipschitzViT:
    """A freshly initialised model (deterministic for a given seed)."""
    if seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return LipschitzViT(config)
    return LipschitzViT(config)
