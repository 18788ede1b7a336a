"""auto_LiRPA, imported lazily and run quietly in a chosen precision.

auto_LiRPA is optional: nothing here imports it at module import time. Install it with the
command in INSTALL_HINT (--no-deps because its setup.py pins torch and torchvision, which it does
not need here).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from lofast.errors import LofastError

INSTALL_HINT = (
    'pip install --no-deps "git+https://github.com/Verified-Intelligence/auto_LiRPA" '
    '&& pip install "lofast[crown]"'
)


@functools.cache
def auto_lirpa() -> ModuleType:
    """auto_LiRPA, imported once with its import-time side effects on global state undone.

    Raises LofastError with the install command when it cannot be imported.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        # catch_warnings restores the filters that auto_LiRPA changes (simplefilter('once')),
        # and record=True collects (hides) the torch.jit deprecation warnings it raises while
        # loading: a filter would not do, since the library resets the filters first.
        with warnings.catch_warnings(record=True):
            import auto_LiRPA
    except Exception as error:  # ImportError, or a version mismatch surfacing at import time
        raise LofastError(
            f"auto_LiRPA cannot be imported ({type(error).__name__}: {error}); "
            f"install it with: {INSTALL_HINT}"
        ) from error
    finally:
        # auto_LiRPA calls logging.basicConfig(level=INFO) when imported, which would print every
        # INFO record of the process; keep the root logger as the application configured it.
        root.handlers[:] = handlers
        root.setLevel(level)
    logging.getLogger("auto_LiRPA").setLevel(logging.WARNING)
    return auto_LiRPA


def crown_available() -> bool:
    """Whether auto_LiRPA (and its small dependencies) can be imported."""
    try:
        auto_lirpa()
    except LofastError:
        return False
    return True


def custom_ops(lirpa: ModuleType) -> dict[str, type]:
    """Operator overrides for BoundedModule: a softmax that alpha-CROWN can optimise through.

    auto_LiRPA bounds softmax with an LSE relaxation whose coefficients pick between two formulas
    with torch.where; where an entry's probability bounds coincide, the unused branch divides 0
    by 0, and its NaN gradient (w.r.t. the intermediate bounds) poisons every alpha after the
    first optimisation step. Detaching the bounds the coefficients are computed from removes only
    that gradient: the relaxation, hence the soundness of every bound, is unchanged. If a future
    auto_LiRPA renames these private methods, the stock softmax is used (and alpha-CROWN may
    report non-finite bounds, which `crown_verify` turns into "not certified").
    """
    base = lirpa.operators.BoundSoftmax
    if not all(hasattr(base, name) for name in ("_softmax_lse_lower", "_softmax_lse_upper")):
        return {}

    def detached(args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(a.detach() if isinstance(a, Tensor) else a for a in args)

    class DetachedSoftmax(base):  # type: ignore[misc, valid-type]
        def _softmax_lse_lower(self, *args: Any) -> Any:
            return super()._softmax_lse_lower(*detached(args))

        def _softmax_lse_upper(self, *args: Any) -> Any:
            return super()._softmax_lse_upper(*detached(args))

    return {"onnx::Softmax": DetachedSoftmax}


@contextlib.contextmanager
def lirpa_context(dtype: torch.dtype) -> Iterator[None]:
    """Run auto_LiRPA in `dtype`, quietly.

    auto_LiRPA creates some tensors (traced scalar constants, alpha variables) in torch's default
    dtype, so that must be the dtype the bounds are computed in; it is restored afterwards (this
    is process-global state: do not bound in two threads at once). The library prints progress
    messages to stdout and raises many warnings, which would clutter the command line.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(record=True):
            yield
    finally:
        torch.set_default_dtype(previous)

