"""Export: the same function as a LipschitzViT, written with plain operators and constant
weights that auto_LiRPA can bound.

auto_LiRPA cannot see through the model's parametrisation (spectral caps via an SVD, SLL's
rescaling and the normalised head rows are recomputed from raw parameters in every forward), so
`export_plain` bakes the effective weights into a plain network: each stage's spec, the record
the certificate reads, gives its own plain form (``Stage.plain``, ``bounds.plain``).
"""

from __future__ import annotations

import torch
from torch import nn

from lofast.errors import LofastError
from lofast.models.vit import LipschitzViT, foreign_part


@torch.no_grad()
def export_plain(model: LipschitzViT, dtype: torch.dtype | None = None) -> nn.Sequential:
    """A plain module computing the same function as `model` (images (B, C, H, W) -> logits).

    Every effective weight (after spectral caps, SLL rescaling, head normalisation) is evaluated
    once, in the model's own precision as in its forward pass, read from the model's stage
    specs (``LipschitzViT.structure``) and stored as a buffer (constants folded together, e.g.
    1/scale into Wq, are combined in float64 first). Buffers are in `dtype` (default: the
    model's parameter dtype) on the model's device. It agrees with `model` to rounding (about
    1e-16 relative in float64). Raises LofastError for a stage without a plain form, and for a
    model whose forward pass may differ from its specs (``foreign_part``: a hook, a replaced
    method), whose export would be another function.
    """
    foreign = foreign_part(model)
    if foreign is not None:
        raise LofastError(f"cannot export this model for CROWN: {foreign}")
    if dtype is None:
        dtype = next(model.parameters()).dtype
    training = model.training
    model.eval()  # exact spectral caps, the certifier's (training mode estimates them)
    try:
        stages = []
        for spec in model.structure():
            try:
                stages.append(spec.plain())
            except NotImplementedError:
                raise LofastError(f"cannot export stage {type(spec).__name__} for CROWN") from None
    finally:
        model.train(training)
    device = next(model.parameters()).device
    return nn.Sequential(*stages).to(device=device, dtype=dtype).eval()
