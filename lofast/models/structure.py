"""What the model tells the certifier: one spec per stage, built from the effective weights.

Every tensor is detached float64, so the certifier reads the exact weights the forward pass
uses and never reaches into module internals. The activation recorded for stage k is the
clean input of stage k, shape (B, n, d) for token stages and (B, d) after pooling.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class EmbedSpec:
    """Image (B, C, H, W) -> tokens (B, n, d): centring, patches, linear map, position, class token.

    Lipschitz from the image l2 norm to the token Frobenius norm: ||weight|| (centring, patching
    and adding fixed vectors are isometries on differences). The first ``constant_tokens``
    tokens (the class token) do not depend on the image at all.
    """

    weight: Tensor  # (d, C * p * p)
    constant_tokens: int = 1


@dataclass(frozen=True)
class ProjectSpec:
    """LayerProject: each token projected onto the l2 ball of this radius (1-Lipschitz)."""

    radius: float


@dataclass(frozen=True)
class AttentionSpec:
    """F(X) = H X + sum_l softmax(X Wq_l (X Wk_l)^T / scale + C_l) X Wv_l Wo_l, the form LoFAST
    bounds (C_l a fixed position bias, or 0)."""

    query: Tensor  # (h, d, dh)
    key: Tensor  # (h, d, dh)
    value: Tensor  # (h, d, dh)
    output: Tensor  # (h, dh, d)
    residual: bool  # H = I
    scale: float
    position_bias: Tensor | None = None  # (h, n, n) C_l


@dataclass(frozen=True)
class SLLSpec:
    """x -> x - 2 W diag(1/t) relu(W^T x + b) per token; 1-Lipschitz iff diag(t) - W^T W is PSD."""

    weight: Tensor  # (d, k)
    bias: Tensor  # (k,)
    t: Tensor  # (k,)


@dataclass(frozen=True)
class PoolSpec:
    """Tokens (B, n, d) -> features (B, d): mean over tokens (1/sqrt(n)-Lipschitz) or class token."""

    kind: str
    num_tokens: int


@dataclass(frozen=True)
class HeadSpec:
    """Logits z = W h + b; certified for class y if z_y - z_j > ||w_y - w_j|| delta_h for all j."""

    weight: Tensor  # (num_classes, d)
    bias: Tensor  # (num_classes,)


StageSpec = EmbedSpec | ProjectSpec | AttentionSpec | SLLSpec | PoolSpec | HeadSpec
