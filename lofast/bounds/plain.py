"""Every stage spec as a plain torch module with constant weights: the function a certificate
bounds, written with the operators an external verifier (auto_LiRPA, ``lofast.crown``) traces.

The modules are built from the specs themselves (``StageSpec.plain()``), the very record the
certificate reads, so the CROWN fallback bounds exactly that function. They use only
reshape/permute/transpose, linear/matmul, concatenation, add, mul, sum, relu, sqrt,
reciprocal, softmax, minimum/maximum with a constant, and mean (or index).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _const(t: Tensor) -> Tensor:
    """A detached float64 copy: folded constants are combined at full precision."""
    return t.detach().to(torch.float64).clone()


class PlainEmbed(nn.Module):
    """Images (B, C, H, W) -> tokens (B, 1 + n_patches, d), class token first.

    Patches are cut with reshape/permute (row-major, features ordered (c, row, col)) and go
    straight into one linear map, with the centring x - c folded into its bias. This matters
    for soundness: auto_LiRPA represents the l2 ball at the input as the interval [x, x] plus a
    norm tag that only linear and conv layers interpret, so the image must reach a linear map
    through shape-only operators. The class token is a zero row concatenated in front, and one
    constant (1 + n_patches, d) table then adds the class token and the position embeddings.
    """

    def __init__(self, weight: Tensor, bias: Tensor, position: Tensor, class_token: Tensor,
                 center: float, patch_size: int) -> None:
        super().__init__()
        weight = _const(weight)  # (d, C*p*p)
        self.patch_size = patch_size
        self.register_buffer("weight", weight)
        self.register_buffer("bias", _const(bias) - center * weight.sum(dim=1))
        self.register_buffer("table", torch.cat([_const(class_token)[None], _const(position)]))

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

    def __init__(self, radius: float) -> None:
        super().__init__()
        self.radius = radius
        self.register_buffer("limit", torch.tensor(radius, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        r2 = self.radius**2
        squared_norm = (x * x).sum(dim=-1, keepdim=True)
        clipped_norm = torch.sqrt(torch.relu(squared_norm - r2) + r2)  # max(R, ||x||)
        projected = x * (self.radius * torch.reciprocal(clipped_norm))
        # torch.clamp would be traced to an ONNX Clip that auto_LiRPA fails to parse with
        # recent torch; minimum/maximum with a constant tensor work.
        return torch.minimum(torch.maximum(projected, -self.limit), self.limit)


class PlainAttention(nn.Module):
    """H X + sum_l softmax(X Wq_l (X Wk_l)^T / scale + C_l) X Wv_l Wo_l on (B, n, d), no biases
    on the projections (C_l: the position bias, or none; H = I or 0).

    The heads' weights are stacked into d x (h dh) (and (h dv) x d) matrices whose column blocks
    are the heads, and 1/scale is folded into Wq.
    """

    def __init__(self, query: Tensor, key: Tensor, value: Tensor, output: Tensor,
                 residual: bool, scale: float, position_bias: Tensor | None) -> None:
        super().__init__()
        heads, d, self.head_dim = query.shape
        self.heads, self.value_dim, self.residual = heads, value.shape[2], residual

        def stacked(t: Tensor) -> Tensor:  # (h, d, k) -> (d, h k), head l in columns l k ..
            return _const(t).permute(1, 0, 2).reshape(d, -1)

        self.register_buffer("query", stacked(query) / scale)
        self.register_buffer("key", stacked(key))
        self.register_buffer("value", stacked(value))
        self.register_buffer("output", _const(output).reshape(-1, d))  # (h dv, d)
        self.register_buffer("position_bias",
                             None if position_bias is None else _const(position_bias))

    def _split_heads(self, x: Tensor, size: int) -> Tensor:  # (B, n, h k) -> (B, h, n, k)
        return x.reshape(x.shape[0], x.shape[1], self.heads, size).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        q = self._split_heads(x.matmul(self.query), self.head_dim)
        k = self._split_heads(x.matmul(self.key), self.head_dim)
        v = self._split_heads(x.matmul(self.value), self.value_dim)
        scores = q.matmul(k.transpose(-1, -2))  # (B, h, n, n)
        if self.position_bias is not None:
            scores = scores + self.position_bias
        probs = torch.softmax(scores, dim=-1)
        mixed = probs.matmul(v).transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        mixed = mixed.matmul(self.output)  # (B, n, d)
        return x + mixed if self.residual else mixed


class PlainSLL(nn.Module):
    """x - relu(x W + b) V per token, with V = 2 diag(1/t) W^T (the rescaling folded in)."""

    def __init__(self, weight: Tensor, bias: Tensor, t: Tensor) -> None:
        super().__init__()
        weight = _const(weight)  # (d, k)
        self.register_buffer("weight", weight)
        self.register_buffer("bias", _const(bias))
        self.register_buffer("back", (2.0 / _const(t))[:, None] * weight.T)  # (k, d)

    def forward(self, x: Tensor) -> Tensor:
        return x - torch.relu(x.matmul(self.weight) + self.bias).matmul(self.back)


class PlainPool(nn.Module):
    """Tokens (B, n, d) -> (B, d): mean over tokens ("mean"), or the class token ("cls")."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = str(kind)

    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1) if self.kind == "mean" else x[:, 0]


class PlainHead(nn.Module):
    """The classifier: (B, d) -> (B, num_classes)."""

    def __init__(self, weight: Tensor, bias: Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", _const(weight))
        self.register_buffer("bias", _const(bias))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)
