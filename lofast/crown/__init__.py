"""Fallback certification with (alpha-)CROWN from auto_LiRPA, for samples LoFAST cannot certify.

LoFAST certifies with a local Lipschitz bound: fast, but loose on some samples. CROWN propagates
linear bounds through the exact network and can certify some of those; it is far slower, so it
is only a fallback. The modules:

- `export`: `export_plain` bakes the model's effective weights into a plain network of
  operators that auto_LiRPA bounds (it cannot see through the parametrisation).
- `lirpa`: auto_LiRPA imported lazily (an optional dependency) and run quietly.
- (`lofast.runtime` holds the wall-clock and memory limits that turn overruns into per-sample
  results, for these and for `lofast.bab`.)
- `verify`: `crown_verify` bounds the margins z_y - z_j of the exported network with CROWN or
  alpha-CROWN (`MarginBounder`).
- `beta`: the auto_LiRPA bounder for branch and bound (`lofast.bab`): alpha-CROWN with beta
  split constraints on subdomains of the ReLU activation patterns ("beta-crown").

Threat model: the l2 ball of radius eps around the image, NOT intersected with the pixel box
[0,1]. auto_LiRPA's l2 perturbation ignores x_L/x_U (they are only used for the l-infinity
norm), so a certificate covers the whole ball. That contains the ball-and-box threat model of
`lofast.certification.attack.pgd_l2` and LoFAST's own (which never uses the box), so it is
sound, and at most slightly looser than ball-and-box.

auto_LiRPA is optional and only imported inside functions. Install it with
    pip install --no-deps "git+https://github.com/Verified-Intelligence/auto_LiRPA"
    pip install "lofast[crown]"
(--no-deps because its setup.py pins torch and torchvision, which it does not need here).
"""

from lofast.crown.export import export_plain
from lofast.crown.lirpa import INSTALL_HINT, auto_lirpa, crown_available
from lofast.crown.verify import (
    METHODS,
    FallbackResult,
    MarginBounder,
    crown_verify,
    margin_spec,
)

__all__ = ["INSTALL_HINT", "METHODS", "FallbackResult", "MarginBounder", "auto_lirpa",
           "crown_available", "crown_verify", "export_plain", "margin_spec"]
