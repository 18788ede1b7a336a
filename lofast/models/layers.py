"""Lipschitz building blocks of the ViT. Each stage module reports its exact structure via spec().

``spec()`` gives detached float64 copies of the effective weights (what a certificate reads);
``spec(differentiable=True)`` the effective weights themselves, in the working precision and
with gradients (what the certified-training bound reads). Both describe the same function.

Weights are kept raw and made effective in every forward pass (a spectral cap, SLL's
rescaling, row normalisation), so training, certification and export all see one function.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lofast.bounds.attention_spec import AttentionSpec
from lofast.bounds.estimate import top_singular_value_estimate
from lofast.bounds.stages import EmbedSpec, HeadSpec, PoolSpec, ProjectSpec, SLLSpec
from lofast.config import Pooling
from lofast.errors import LofastError

# SLL's rescaling t is inflated by this factor so that diag(t) - W^T W stays positive
# semidefinite with room to spare after floating-point rounding (the certifier re-checks it).
SLL_SAFETY = 1e-4


def spectral_cap(weight: Tensor, cap: float | None, exact: bool = True) -> Tensor:
    """weight * min(1, cap / ||weight||): the spectral norm of the result is at most cap.

    exact=False (a module in training mode) takes ||weight|| from ``spectral_norm`` instead of
    an SVD: no host synchronisation and no solver per step. The estimate is from below, so the
    result may exceed the cap by the estimate's error (at most 0.11 % on the weights of the
    shipped default, whose capped spectra are flat at the top). The certifier, the attention
    report and the CROWN export use a model in eval mode, whose caps are exact, and certify
    the weights they hold, whatever they are.
    """
    if cap is None:
        return weight
    return _scaled_to_cap(weight, cap, spectral_norm(weight, exact))


def spectral_caps(weights: Mapping[str, Tensor], caps: Mapping[str, float | None],
                  exact: bool = True, capped: Mapping[str, Tensor] | None = None,
                  ) -> dict[str, Tensor]:
    """``spectral_cap`` of every weight named in caps. Training estimates (exact=False): by
    ``estimated_caps``, or given as ``capped`` (name -> the capped weight)."""
    if exact:
        return {name: spectral_cap(weights[name], cap, exact) for name, cap in caps.items()}
    if capped is None:
        names = [name for name, cap in caps.items() if cap is not None]
        capped = dict(zip(names, estimated_caps([(weights[n], caps[n]) for n in names])))
    return {name: weights[name] if cap is None else capped[name] for name, cap in caps.items()}


def estimated_caps(weights: list[tuple[Tensor, float]]) -> list[Tensor]:
    """``spectral_cap(weight, cap, exact=False)`` of each (weight, cap), differentiable, batched
    per weight shape (one norm estimate, one rescaling): a training step on a GPU waits for
    kernel launches, and many weights then cost the launches of one."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, (weight, _) in enumerate(weights):
        by_shape.setdefault(tuple(weight.shape), []).append(i)
    result: list[Tensor | None] = [None] * len(weights)
    for indices in by_shape.values():
        indices.sort(key=lambda i: weights[i][1])  # equal caps side by side
        stacked = torch.stack([weights[i][0] for i in indices])
        sigma = spectral_norm(stacked)  # (g,)
        # the caps as a device tensor, one fill per distinct cap (a list copied in would wait
        # for the device)
        runs = itertools.groupby(weights[i][1] for i in indices)
        cap = torch.cat([sigma.new_full((len(list(run)),), value) for value, run in runs])
        scaled = _scaled_to_cap(stacked, cap[:, None, None], sigma[:, None, None])
        for i, weight in zip(indices, scaled.unbind(0)):
            result[i] = weight
    return result


def hold_capped_weights(stages: list[HoldsCappedWeights], hold: bool, training: bool) -> None:
    """``hold_effective_weights`` of each stage; in training mode with the capped weights of
    all stages estimated together (``estimated_caps``)."""
    given: list[dict[str, Tensor] | None] = [None] * len(stages)
    if hold and training:
        named = [(k, name, weight, cap) for k, stage in enumerate(stages)
                 for name, (weight, cap) in stage.capped_weights().items()]
        given = [{} for _ in stages]
        for (k, name, _, _), weight in zip(named, estimated_caps([(w, c) for _, _, w, c in named])):
            given[k][name] = weight
    for stage, capped in zip(stages, given):
        stage.hold_effective_weights(hold, capped)


def _scaled_to_cap(weight: Tensor, cap: float | Tensor, sigma: Tensor) -> Tensor:
    """weight * min(1, cap / sigma) for sigma = ||weight|| (or its estimate); cap and sigma
    may be tensors broadcast against weight (a stack of weights)."""
    return weight * (cap / torch.clamp(sigma, min=cap))


def spectral_norm(weight: Tensor, exact: bool = False) -> Tensor:
    """||weight|| of (..., m, k): exact (an SVD) or the training estimate (matrix products)."""
    if exact:
        return torch.linalg.matrix_norm(weight, ord=2)
    return top_singular_value_estimate(weight)


def _frozen(t: Tensor) -> Tensor:
    return t.detach().to(torch.float64).clone(memory_format=torch.contiguous_format)


def _spec_tensor(t: Tensor, differentiable: bool) -> Tensor:
    return t if differentiable else _frozen(t)


class KeepsWhileFrozen:
    """A module's derived quantities (capped weights, SLL rescaling) kept while its tensors do
    not change: a module in eval mode computes each once and keeps it until a parameter or
    buffer changes (in place, replaced, or moved). A loaded model pays its SVDs and Gram
    matrices on the first forward pass only, with or without autograd: where gradients are
    recorded, the kept value takes part in the graph through ``_KeptValue``, which recomputes
    it only if a backward pass asks for the module's own gradients (an attack's gradient with
    respect to the input never does).

    PyTorch counts no change made through ``.data`` (``p.data.mul_(2)`` leaves ``p._version``
    as it was), so the version alone misses one: each kept value keeps a copy of the tensors
    it was computed from, and ``eval()`` or ``train()`` (a switch of mode, or the same mode
    again) forgets a value whose tensors no longer equal that copy (one comparison, no SVD)."""

    def train(self, mode: bool = True):
        kept = self.__dict__.get("_kept_values", {})
        tensors = [*self.parameters(), *self.buffers()]
        for name, (_, _, copies) in list(kept.items()):
            if not _all_equal(tensors, copies):
                del kept[name]
        return super().train(mode)

    def _kept(self, name: str, compute):
        """compute(), or its value kept from an earlier call while the tensors are unchanged;
        a Tensor or a dict of them."""
        if self.training:
            return compute()
        tensors = [*self.parameters(), *self.buffers()]
        # every in-place change bumps a tensor's version; a new tensor has a new address
        key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in tensors)
        kept = self.__dict__.setdefault("_kept_values", {})
        if name not in kept or kept[name][0] != key:
            with torch.no_grad():
                kept[name] = (key, compute(), [t.detach().clone() for t in tensors])
        value = kept[name][1]
        differentiable = [t for t in tensors if t.requires_grad]
        if not (torch.is_grad_enabled() and differentiable):
            return value
        names = sorted(value) if isinstance(value, dict) else None
        leaves = [value[n] for n in names] if names is not None else [value]
        out = _KeptValue.apply(compute, names, len(differentiable), *differentiable, *leaves)
        return dict(zip(names, out)) if names is not None else out[0]


def _all_equal(tensors: list[Tensor], copies: list[Tensor]) -> bool:
    """Whether every tensor still equals its copy: the same shape, dtype, device and values."""
    return len(tensors) == len(copies) and all(
        t.shape == c.shape and t.dtype == c.dtype and t.device == c.device and torch.equal(t, c)
        for t, c in zip(tensors, copies))


# what a hold keeps (``hold_effective_weights``, ``hold_rescaling``): tensors computed from
# the weights, not settings of the module
HELD_ATTRIBUTES = frozenset({"held", "held_rescaling"})


class StateSnapshot:
    """A module's parameters and buffers (its ``state_dict``) and the settings of each of its
    modules (public attributes that are neither tensors, modules, methods, the mode nor what a
    hold keeps: a projection's radius, a head's caps) as they were when the snapshot was taken, to
    tell later whether the module still computes the same function: an object that keeps
    proofs about a model (a ``Certifier``) refuses to go on once its model changed. A copy of
    every tensor is kept, because PyTorch counts no change made through ``.data``."""

    def __init__(self, module: nn.Module) -> None:
        self._tensors = {name: t.detach().clone() for name, t in module.state_dict().items()}
        self._settings = {name: copy.deepcopy(_settings(part))
                          for name, part in module.named_modules()}

    def changed(self, module: nn.Module) -> str | None:
        """The name of the first tensor or setting of ``module`` that differs from the snapshot
        (a tensor in shape or in any value, either added or removed), or None if none does.
        Values are compared in float64 where the dtype changed: a model moved to float64 or to
        another device, every value kept, is unchanged; one rounded to a lower precision is
        changed."""
        now = module.state_dict()
        for name in sorted(now.keys() ^ self._tensors.keys()):
            return name
        for name, tensor in now.items():
            kept = self._tensors[name]
            if tensor.shape != kept.shape:
                return name
            tensor = tensor.detach().to(kept.device)
            if tensor.dtype != kept.dtype:
                tensor, kept = tensor.to(torch.float64), kept.to(torch.float64)
            if not torch.equal(tensor, kept):
                return name
        for name, part in module.named_modules():
            settings = _settings(part)
            kept = self._settings.get(name, {})
            for attribute in sorted(settings.keys() | kept.keys()):
                if attribute not in settings or attribute not in kept \
                        or settings[attribute] != kept[attribute]:
                    return f"{name}.{attribute}" if name else attribute
        return None


def _settings(module: nn.Module) -> dict:
    return {name: value for name, value in vars(module).items()
            if not name.startswith("_") and name != "training" and name not in HELD_ATTRIBUTES
            and not isinstance(value, (Tensor, nn.Module)) and not callable(value)}


class _KeptValue(torch.autograd.Function):
    """Kept values as they are in the forward pass; their gradient with respect to the module's
    tensors (the inputs) by recomputing them with autograd, only when a backward pass reaches
    them. The inputs are saved, so a backward pass after an in-place change of one of them
    fails (autograd's version check) instead of differentiating other weights."""

    generate_vmap_rule = True  # torch.func's transforms (vmap, jacrev) take it as it is

    @staticmethod
    def forward(compute, names, count, *inputs_and_leaves):
        return tuple(leaf.view_as(leaf) for leaf in inputs_and_leaves[count:])

    @staticmethod
    def setup_context(ctx, inputs, output):
        compute, names, count, *inputs_and_leaves = inputs
        ctx.compute, ctx.names, ctx.inputs = compute, names, tuple(inputs_and_leaves[:count])
        ctx.save_for_backward(*ctx.inputs)  # for the version check only

    @staticmethod
    def backward(ctx, *grads):
        ctx.saved_tensors  # noqa: B018  (raises if an input changed in place since the forward)
        inputs = ctx.inputs
        create_graph = torch.is_grad_enabled()  # a double backward differentiates this too
        with torch.enable_grad():
            value = ctx.compute()
        leaves = [value[n] for n in ctx.names] if ctx.names is not None else [value]
        pairs = [(leaf, g) for leaf, g in zip(leaves, grads)
                 if g is not None and leaf.requires_grad]
        input_grads = torch.autograd.grad([leaf for leaf, _ in pairs], inputs,
                                          [g for _, g in pairs], allow_unused=True,
                                          create_graph=create_graph) if pairs else \
            [None] * len(inputs)
        return (None, None, None, *input_grads, *[None] * len(leaves))


class HoldsCappedWeights(KeepsWhileFrozen):
    """For stages whose effective weights cost an SVD each (``_capped``): hold them once and
    reuse them until released. The raw weights must not change or move meanwhile.
    ``capped_weights``: the raw weights under a cap and their caps, by name; ``_capped`` may
    be given their training estimates capped (name -> weight), taken with other stages'.
    Without a hold, eval mode keeps them while the weights are unchanged (``KeepsWhileFrozen``)."""

    held = None

    def hold_effective_weights(self, hold: bool,
                               given: Mapping[str, Tensor] | None = None) -> None:
        """hold=True: from now on the given capped weights, else the current effective ones
        (in eval mode the kept ones: an attack's hold on a loaded model pays no SVD)."""
        self.held = None
        if hold:
            self.held = self._capped(given) if given is not None else self._effective()

    def _effective(self):
        """The effective weights now: held, kept (above), or computed afresh."""
        if self.held is not None:
            return self.held
        return self._kept("capped", self._capped)


class PatchEmbed(HoldsCappedWeights, nn.Module):
    """Images (B, C, H, W) in [0,1] -> tokens (B, 1 + n_patches, d), class token first."""

    constant_tokens = 1  # the class token: the same for every image

    def __init__(self, image_size: int, channels: int, patch_size: int, width: int,
                 cap: float, center: float) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.cap = cap
        self.center = center
        num_patches = (image_size // patch_size) ** 2
        self.weight = nn.Parameter(torch.empty(width, channels * patch_size**2))
        nn.init.orthogonal_(self.weight)
        self.bias = nn.Parameter(torch.zeros(width))
        self.position = nn.Parameter(0.02 * torch.randn(num_patches, width))
        self.cls_token = nn.Parameter(torch.zeros(width))

    def capped_weights(self) -> dict[str, tuple[Tensor, float]]:
        return {} if self.cap is None else {"weight": (self.weight, self.cap)}

    def _capped(self, given: Mapping[str, Tensor] | None = None) -> Tensor:
        return spectral_caps({"weight": self.weight}, {"weight": self.cap},
                             exact=not self.training, capped=given)["weight"]

    def effective_weight(self) -> Tensor:
        return self._effective()

    def patchify(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, n_patches, C*p*p), row-major patches; an isometry."""
        b, c, h, w = x.shape
        p = self.patch_size
        x = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // p) * (w // p), c * p * p)

    def forward(self, x: Tensor) -> Tensor:
        tokens = F.linear(self.patchify(x - self.center), self.effective_weight(), self.bias)
        tokens = tokens + self.position
        cls = self.cls_token.expand(tokens.shape[0], 1, -1)
        return torch.cat([cls, tokens], dim=1)

    def spec(self, differentiable: bool = False) -> EmbedSpec:
        return EmbedSpec(weight=_spec_tensor(self.effective_weight(), differentiable),
                         bias=_spec_tensor(self.bias, differentiable),
                         position=_spec_tensor(self.position, differentiable),
                         class_token=_spec_tensor(self.cls_token, differentiable),
                         center=float(self.center), patch_size=self.patch_size,
                         constant_tokens=self.constant_tokens)


class LayerProject(nn.Module):
    """Project every token (last dim) onto the l2 ball of radius R: 1-Lipschitz (convex set)."""

    def __init__(self, radius: float) -> None:
        super().__init__()
        self.radius = float(radius)
        # A radius <= 0 (or NaN) makes the map x -> radius * x / ||x||, which is neither a
        # projection nor Lipschitz: refuse it here, whatever built the module.
        if not self.radius > 0:
            raise LofastError(f"LayerProject radius must be positive, not {radius!r}")

    def forward(self, x: Tensor) -> Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return x * torch.clamp(self.radius / torch.clamp(norm, min=1e-30), max=1.0)

    def spec(self, differentiable: bool = False) -> ProjectSpec:
        return ProjectSpec(radius=self.radius)


class Attention(HoldsCappedWeights, nn.Module):
    """Residual multi-head dot-product attention X + sum_l P_l(X) X Wv_l Wo_l, no biases.

    P_l(X) = softmax(X Wq_l (X Wk_l)^T / s + C_l), with C_l a learned (n, n) position bias when
    ``num_tokens`` is given (zero at initialisation) and C_l = 0 otherwise. With ``score_norm``
    g, every head's A_l = Wq_l Wk_l^T has spectral norm exactly g (after the caps), and with
    ``value_norm`` b every head's B_l = Wv_l Wo_l norm b. Without ``learned_query_key``,
    Wq = Wk = I (dot-product similarity per head); without ``learned_value_output``,
    Wv = value_cap I and Wo = output_cap I (each head mixes its own coordinates of the tokens).
    Heads split the columns of Wq, Wk, Wv (d, d) and the rows of Wo (d, d); the caps apply to
    the whole matrices, so every head's ||Wv_l Wo_l|| <= value_cap * output_cap.
    """

    def __init__(self, width: int, heads: int, query_key_cap: float | None,
                 value_cap: float, output_cap: float, num_tokens: int | None = None,
                 score_norm: float | None = None, learned_query_key: bool = True,
                 value_norm: float | None = None, learned_value_output: bool = True) -> None:
        super().__init__()
        self.score_norm = score_norm
        self.value_norm = value_norm
        self.heads = heads
        self.head_dim = width // heads
        self.scale = math.sqrt(width / heads)
        # Without learned query and key weights, Wq = Wk = I: head l compares tokens by their
        # dot product on its own dh coordinates, so no direction of the tokens is hidden from
        # every head's scores.
        self.caps = ({"query": query_key_cap, "key": query_key_cap} if learned_query_key
                     else {}) | ({"value": value_cap, "output": output_cap}
                                 if learned_value_output else {})
        self.identity_scales = {} if learned_value_output else {"value": value_cap,
                                                                  "output": output_cap}
        self.weights = nn.ParameterDict()
        for name in self.caps:
            w = torch.empty(width, width)
            nn.init.orthogonal_(w)
            self.weights[name] = nn.Parameter(w)
        self.position_bias = (None if num_tokens is None
                              else nn.Parameter(torch.zeros(heads, num_tokens, num_tokens)))
        # the dtype and device of the fixed identities (a block may have no weight of its own)
        self.register_buffer("like", torch.zeros(()), persistent=False)

    def capped_weights(self) -> dict[str, tuple[Tensor, float]]:
        return {name: (self.weights[name], cap) for name, cap in self.caps.items()
                if cap is not None}

    def _capped(self, given: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
        capped = spectral_caps(self.weights, self.caps, exact=not self.training, capped=given)
        if len(capped) < 4:  # some weights are fixed identities
            eye = torch.eye(self.heads * self.head_dim, dtype=self.like.dtype,
                            device=self.like.device)
            if "query" not in capped:
                capped["query"] = capped["key"] = eye
            for name, scale in self.identity_scales.items():
                capped[name] = scale * eye
        if self.score_norm is not None:
            capped["query"], capped["key"] = self._fixed_head_norm(
                capped["query"], capped["key"], self.score_norm)
        if self.value_norm is not None:
            value, output_t = self._fixed_head_norm(capped["value"], capped["output"].T,
                                                    self.value_norm)
            capped["value"], capped["output"] = value, output_t.T
        return capped

    def _fixed_head_norm(self, left: Tensor, right: Tensor, target: float,
                         ) -> tuple[Tensor, Tensor]:
        """left, right (d, d) with every head's columns scaled by sqrt(g / ||L_l R_l^T||), so
        that ||L_l R_l^T|| = g = target exactly, for head l's (d, dh) column blocks L_l, R_l:
        A_l = Wq_l Wk_l^T (score_norm) or B_l = Wv_l Wo_l with R = Wo^T (value_norm). Training
        cannot switch attention off by shrinking them (it still chooses their directions). The
        certifier measures the norms from the weights itself; g only shapes the function.
        ||L_l R_l^T|| = ||R_L R_R^T|| for the QR factors of the blocks, a (dh, dh) norm."""
        d, h, dh = left.shape[0], self.heads, self.head_dim
        left_heads = left.reshape(d, h, dh).permute(1, 0, 2)  # (h, d, dh)
        right_heads = right.reshape(d, h, dh).permute(1, 0, 2)
        r_left = torch.linalg.qr(left_heads).R  # mode "r" has no derivative
        r_right = torch.linalg.qr(right_heads).R
        norms = spectral_norm(r_left @ r_right.transpose(1, 2), exact=not self.training)  # (h,)
        factor = torch.sqrt(target / norms.clamp_min(1e-12))  # (h,)
        columns = factor.repeat_interleave(dh)  # head l owns columns l*dh ... (l+1)*dh - 1
        return left * columns, right * columns

    def effective_weights(self) -> dict[str, Tensor]:
        return self._effective()

    def _split_heads(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        return x.reshape(b, n, self.heads, self.head_dim).transpose(1, 2)  # (B, h, n, dh)

    def probabilities(self, x: Tensor) -> Tensor:
        """P_l(X) (B, h, n, n) for tokens x (B, n, d)."""
        w = self.effective_weights()
        q = self._split_heads(x @ w["query"])
        k = self._split_heads(x @ w["key"])
        scores = q @ k.transpose(-1, -2) / self.scale  # (B, h, n, n)
        if self.position_bias is not None:
            scores = scores + self.position_bias
        return torch.softmax(scores, dim=-1)

    def forward(self, x: Tensor, fixed_probabilities: Tensor | None = None) -> Tensor:
        """x (B, n, d) -> (B, n, d); with ``fixed_probabilities`` (h, n, n) for every sample
        (the attention ablation) or (B, h, n, n) per sample, rows summing to 1, those replace
        P_l(X)."""
        w = self.effective_weights()
        v = self._split_heads(x @ w["value"])
        probs = self.probabilities(x) if fixed_probabilities is None else fixed_probabilities
        mixed = (probs @ v).transpose(1, 2).reshape(x.shape)
        return x + mixed @ w["output"]

    def head_weights(self) -> dict[str, Tensor]:
        """Per-head effective weights, differentiable: query, key, value (h, d, dh),
        output (h, dh, d) and, where the block has one, position_bias (h, n, n)."""
        w = self.effective_weights()
        d, h, dh = w["query"].shape[0], self.heads, self.head_dim

        def per_head_columns(m: Tensor) -> Tensor:  # (d, d) -> (h, d, dh)
            return m.reshape(d, h, dh).permute(1, 0, 2)

        weights = {"query": per_head_columns(w["query"]), "key": per_head_columns(w["key"]),
                   "value": per_head_columns(w["value"]), "output": w["output"].reshape(h, dh, d)}
        if self.position_bias is not None:
            weights["position_bias"] = self.position_bias
        return weights

    def spec(self, differentiable: bool = False) -> AttentionSpec:
        w = {name: _spec_tensor(t, differentiable) for name, t in self.head_weights().items()}
        return AttentionSpec(**w, residual=True, scale=self.scale)


class SLL(KeepsWhileFrozen, nn.Module):
    """SDP-based Lipschitz residual layer (Araujo et al., 2023), applied to every token.

    x -> x - 2 W diag(1/t) relu(W^T x + b) with t_i = sum_j |W^T W|_ij q_j / q_i: diag(t)
    dominates W^T W, which makes the layer 1-Lipschitz for any weights.
    """

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width, hidden))
        nn.init.xavier_normal_(self.weight)
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.log_q = nn.Parameter(torch.zeros(hidden))

    # t held by ``hold_rescaling`` (weights fixed meanwhile), else None
    held_rescaling = None

    def rescaling(self) -> Tensor:
        """t (k,), computed in the weight's dtype: the held one while held, else kept while the
        weights cannot change (``KeepsWhileFrozen``). The k x k Gram matrix W^T W costs more
        than the layer itself on a batch of 16 (width 256, k 1024)."""
        if self.held_rescaling is not None:
            return self.held_rescaling
        return self._kept("rescaling", self._rescaling_now)

    def _rescaling_now(self) -> Tensor:
        q = torch.exp(self.log_q)
        gram = (self.weight.T @ self.weight).abs()
        return (gram * q[None, :] / q[:, None]).sum(dim=1) * (1.0 + SLL_SAFETY)

    def hold_rescaling(self, hold: bool) -> None:
        """hold=True: ``rescaling`` returns t as of now (differentiable in training mode, for
        the rest of a step) until released; the weights must not change or move meanwhile."""
        self.held_rescaling = None
        if hold:
            self.held_rescaling = self.rescaling()

    def forward(self, x: Tensor) -> Tensor:
        # x - 2 W diag(1/t) relu(W^T x + b): the bias and the difference inside the two products,
        # 2 / t folded into the (d x k) weight rather than the (tokens x k) activations
        flat = x.reshape(-1, x.shape[-1])
        hidden = torch.relu(torch.addmm(self.bias, flat, self.weight))
        scaled = self.weight * (2.0 / self.rescaling())
        return torch.addmm(flat, hidden, scaled.T, alpha=-1.0).reshape(x.shape)

    def spec(self, differentiable: bool = False) -> SLLSpec:
        return SLLSpec(weight=_spec_tensor(self.weight, differentiable),
                       bias=_spec_tensor(self.bias, differentiable),
                       t=_spec_tensor(self.rescaling(), differentiable))


class Pool(nn.Module):
    """Tokens (B, n, d) -> (B, d): mean over tokens or the class token."""

    def __init__(self, kind: Pooling | str, num_tokens: int) -> None:
        super().__init__()
        self.kind = Pooling.parse("pool", kind)
        self.num_tokens = num_tokens

    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1) if self.kind is Pooling.MEAN else x[:, 0]

    def spec(self, differentiable: bool = False) -> PoolSpec:
        return PoolSpec(kind=self.kind, num_tokens=self.num_tokens)


class Head(nn.Module):
    """Linear classifier. With ``normalized`` (the default) its rows have unit norm (last-layer
    normalisation), so ||w_y - w_j|| <= 2 and margins cannot be inflated by scaling the head;
    otherwise the rows are free and the logits' scale is learned with them. Either way the
    certificate reads the pair norms ||w_y - w_j|| of the weights in use (``HeadSpec``)."""

    def __init__(self, width: int, num_classes: int, normalized: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_classes, width) / math.sqrt(width))
        self.bias = nn.Parameter(torch.zeros(num_classes))
        self.normalized = normalized

    def effective_weight(self) -> Tensor:
        """The rows, scaled to unit norm if ``normalized``; a zero row stays zero (its class
        scores its bias)."""
        if not self.normalized:
            return self.weight
        norms = torch.linalg.vector_norm(self.weight, dim=1, keepdim=True)
        return self.weight / norms.clamp_min(torch.finfo(norms.dtype).tiny)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.effective_weight(), self.bias)

    def spec(self, differentiable: bool = False) -> HeadSpec:
        return HeadSpec(weight=_spec_tensor(self.effective_weight(), differentiable),
                        bias=_spec_tensor(self.bias, differentiable))
