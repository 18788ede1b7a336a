"""Export: the same function as a LipschitzViT, written with plain operators and constant
weights that auto_LiRPA can bound.

auto_LiRPA cannot see through the model's parametrisation (spectral caps via an SVD, SLL's
rescaling and the normalised head rows are recomputed from raw parameters in every forward), so
`export_plain` bakes the effective weights into a plain network.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lofast.config import Pooling
from lofast.errors import LofastError
from lofast.models.layers import SLL, Attention, LayerProject, NormalizedHead, PatchEmbed, Pool
from lofast.models.vit import LipschitzViT


class PlainEmbed(nn.Module):
    """Images (B, C, H, W) -> tokens (B, 1 + n_patches, d), class token first.

    Patches are cut with reshape/permute (row-major, features ordered (c, row, col) as in
    `PatchEmbed.patchify`) and go straight into one linear map, with the centring x - c folded
    into its bias. This matters for soundness: auto_LiRPA represents the l2 ball at the input as
    the interval [x, x] plus a norm tag that only linear and conv layers interpret, so the image
    must reach a linear map through shape-only operators. The class token is a zero row
    concatenated in front, and one constant (1 + n_patches, d) table then adds the class token
    and the position embeddings.
    """

    def __init__(self, stage: PatchEmbed) -> None:
        super().__init__()
        weight = _const(stage.effective_weight())  # (d, C*p*p)
        self.patch_size = stage.patch_size
        self.register_buffer("weight", weight)
        self.register_buffer("bias", _const(stage.bias) - stage.center * weight.sum(dim=1))
        table = torch.cat([_const(stage.cls_token)[None], _const(stage.position)], dim=0)
        self.register_buffer("table", table)

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        p = self.patch_size
        patches = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(b, (h // p) * (w // p), c * p * p)
        tokens = F.linear(patches, self.weight, self.bias)  # (B, n_patches, d)
        cls = torch.zeros_like(tokens[:, :1])  # (B, 1, d): the batch size follows the input
        return torch.cat([cls, tokens], dim=1) + self.table


class PlainProject(nn.Module):
    """x * min(1, R / ||x||) over the last dim, written as x * R / sqrt(R^2 + relu(||x||^2 - R^2)).

    The two forms are equal (the scale is 1 inside the ball and R/||x|| outside, up to rounding);
    this one keeps the square root and the reciprocal away from 0 (their arguments are >= R^2
    and >= R), so their linear relaxations stay finite. x * x becomes auto_LiRPA's square op.

    Every output coordinate lies in [-R, R], since the output's norm is at most R. Saying so with
    min/max (an identity on every reachable value) caps the intervals auto_LiRPA derives further
    on; without it they grow without limit at large eps, until the softmax's bounds turn NaN.
    """

    def __init__(self, stage: LayerProject) -> None:
        super().__init__()
        self.radius = stage.radius
        self.register_buffer("limit", torch.tensor(stage.radius, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        r2 = self.radius**2
        squared_norm = (x * x).sum(dim=-1, keepdim=True)
        clipped_norm = torch.sqrt(torch.relu(squared_norm - r2) + r2)  # max(R, ||x||)
        projected = x * (self.radius * torch.reciprocal(clipped_norm))
        # torch.clamp would be traced to an ONNX Clip that auto_LiRPA fails to parse with
        # recent torch; minimum/maximum with a constant tensor work.
        return torch.minimum(torch.maximum(projected, -self.limit), self.limit)


class PlainAttention(nn.Module):
    """X + sum_l softmax(X Wq_l (X Wk_l)^T / scale + C_l) X Wv_l Wo_l on (B, n, d), no biases
    on the projections (C_l: the position bias, or none).

    The 1/scale is folded into Wq; heads are the same column blocks as in `Attention`.
    """

    def __init__(self, stage: Attention) -> None:
        super().__init__()
        w = {name: _const(t) for name, t in stage.effective_weights().items()}
        self.heads = stage.heads
        self.head_dim = stage.head_dim
        self.register_buffer("query", w["query"] / stage.scale)
        self.register_buffer("key", w["key"])
        self.register_buffer("value", w["value"])
        self.register_buffer("output", w["output"])
        bias = stage.position_bias
        self.register_buffer("position_bias", None if bias is None else _const(bias))

    def _split_heads(self, x: Tensor) -> Tensor:  # (B, n, d) -> (B, h, n, dh)
        return x.reshape(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        q = self._split_heads(x.matmul(self.query))
        k = self._split_heads(x.matmul(self.key))
        v = self._split_heads(x.matmul(self.value))
        scores = q.matmul(k.transpose(-1, -2))  # (B, h, n, n)
        if self.position_bias is not None:
            scores = scores + self.position_bias
        probs = torch.softmax(scores, dim=-1)
        mixed = probs.matmul(v).transpose(1, 2).reshape(x.shape)  # (B, n, d)
        return x + mixed.matmul(self.output)


class PlainSLL(nn.Module):
    """x - relu(x W + b) V per token, with V = 2 diag(1/t) W^T (the rescaling folded in)."""

    def __init__(self, stage: SLL) -> None:
        super().__init__()
        weight = _const(stage.weight)  # (d, k)
        t = _const(stage.rescaling())  # (k,)
        self.register_buffer("weight", weight)
        self.register_buffer("bias", _const(stage.bias))
        self.register_buffer("back", (2.0 / t)[:, None] * weight.T)  # (k, d)

    def forward(self, x: Tensor) -> Tensor:
        return x - torch.relu(x.matmul(self.weight) + self.bias).matmul(self.back)


class PlainPool(nn.Module):
    """Tokens (B, n, d) -> (B, d): mean over tokens, or the class token."""

    def __init__(self, stage: Pool) -> None:
        super().__init__()
        self.kind = stage.kind

    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1) if self.kind is Pooling.MEAN else x[:, 0]


class PlainHead(nn.Module):
    """The classifier with its normalised rows baked in: (B, d) -> (B, num_classes)."""

    def __init__(self, stage: NormalizedHead) -> None:
        super().__init__()
        self.register_buffer("weight", _const(stage.effective_weight()))
        self.register_buffer("bias", _const(stage.bias))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


_PLAIN = {PatchEmbed: PlainEmbed, LayerProject: PlainProject, Attention: PlainAttention,
          SLL: PlainSLL, Pool: PlainPool, NormalizedHead: PlainHead}


def _const(t: Tensor) -> Tensor:
    """A detached float64 copy: folded constants are computed once at full precision."""
    return t.detach().to(torch.float64).clone()


@torch.no_grad()
def export_plain(model: LipschitzViT, dtype: torch.dtype | None = None) -> nn.Sequential:
    """A plain module computing the same function as `model` (images (B, C, H, W) -> logits).

    Every effective weight (after spectral caps, SLL rescaling, head normalisation) is evaluated
    once, in the model's own precision as in its forward pass, and stored as a buffer (constants
    folded together, e.g. 1/scale into Wq, are combined in float64 first). The result uses only
    reshape/permute/transpose, linear/matmul, concatenation with zeros, add, mul, sum, relu,
    sqrt, reciprocal, softmax and mean (or index), all of which auto_LiRPA bounds. Buffers are
    in `dtype` (default: the model's parameter dtype) on the model's device. It agrees with
    `model` to rounding (about 1e-16 relative in float64). Raises LofastError for a stage type
    it does not know.
    """
    if dtype is None:
        dtype = next(model.parameters()).dtype
    training = model.training
    model.eval()  # exact spectral caps, the certifier's (training mode estimates them)
    try:
        stages = []
        for stage in model.stages:
            plain = _PLAIN.get(type(stage))
            if plain is None:
                raise LofastError(f"cannot export stage {type(stage).__name__} for CROWN")
            stages.append(plain(stage))
    finally:
        model.train(training)
    return nn.Sequential(*stages).to(dtype).eval()

