"""Fallback certification with (alpha-)CROWN from auto_LiRPA, for samples LoFAST cannot certify.

LoFAST certifies with a local Lipschitz bound: fast, but loose on some samples. CROWN propagates
linear bounds through the exact network and can certify some of those; it is far slower, so it
is only a fallback.

auto_LiRPA cannot see through the model's parametrisation (spectral caps via an SVD, SLL's
rescaling and the normalised head rows are recomputed from raw parameters in every forward), so
`export_plain` first bakes the effective weights into a plain network of operators that
auto_LiRPA bounds, and `crown_verify` bounds the margins z_y - z_j of that network.

Threat model: the l2 ball of radius eps around the image, NOT intersected with the pixel box
[0,1]. auto_LiRPA's l2 perturbation ignores x_L/x_U (they are only used for the l-infinity
norm), so a certificate covers the whole ball. That contains the ball-and-box threat model of
`lofast.attack.pgd_l2` and LoFAST's own (which never uses the box), so it is sound, and at most
slightly looser than ball-and-box.

Strongest mode: "alpha-crown" (CROWN with optimised relaxations). auto_LiRPA contains
beta-CROWN's split constraints but not the branch-and-bound driver that uses them, which lives
in the separate alpha-beta-CROWN verifier; this module offers no branch and bound.

auto_LiRPA is optional and only imported inside functions. Install it with
    pip install --no-deps "git+https://github.com/Verified-Intelligence/auto_LiRPA"
    pip install "lofast[crown]"
(--no-deps because its setup.py pins torch and torchvision, which it does not need here).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lofast.errors import LofastError
from lofast.models.layers import SLL, Attention, LayerProject, NormalizedHead, PatchEmbed, Pool
from lofast.models.vit import LipschitzViT

INSTALL_HINT = (
    'pip install --no-deps "git+https://github.com/Verified-Intelligence/auto_LiRPA" '
    '&& pip install "lofast[crown]"'
)

METHODS = ("crown", "alpha-crown")

# ---------------------------------------------------------------------------------------------
# Export: the same function, written with plain operators and constant weights.
# ---------------------------------------------------------------------------------------------


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
        return x.mean(dim=1) if self.kind == "mean" else x[:, 0]


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
    stages = []
    for stage in model.stages:
        plain = _PLAIN.get(type(stage))
        if plain is None:
            raise LofastError(f"cannot export stage {type(stage).__name__} for CROWN")
        stages.append(plain(stage))
    return nn.Sequential(*stages).to(dtype).eval()


# ---------------------------------------------------------------------------------------------
# auto_LiRPA, imported lazily.
# ---------------------------------------------------------------------------------------------


@functools.cache
def _auto_lirpa() -> ModuleType:
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
        _auto_lirpa()
    except LofastError:
        return False
    return True


def _custom_ops(lirpa: ModuleType) -> dict[str, type]:
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
def _lirpa_context(dtype: torch.dtype) -> Iterator[None]:
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


# ---------------------------------------------------------------------------------------------
# Time limits.
# ---------------------------------------------------------------------------------------------


class _TimeLimit(BaseException):
    """Raised by the alarm inside auto_LiRPA. A BaseException, so that the library's
    `except Exception` clauses cannot swallow it."""


@contextlib.contextmanager
def _alarm(seconds: float | None) -> Iterator[None]:
    """Interrupt the body with _TimeLimit after `seconds` of wall-clock time.

    Uses SIGALRM, so it only works in the main thread on Unix and only when no other interval
    timer is running (pytest-timeout, say); otherwise the body runs to completion and the caller
    compares the elapsed time with the limit afterwards.
    """
    usable = (
        seconds is not None
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    )
    if not usable:
        yield
        return
    armed = [True]

    def on_alarm(signum: int, frame: Any) -> None:
        if armed[0]:  # the body may have finished just before the timer fired
            raise _TimeLimit

    previous = signal.signal(signal.SIGALRM, on_alarm)
    # the interrupt can land between a library's torch.set_grad_enabled(False) and its restore:
    # put the grad mode back, or it would leak into everything that runs afterwards
    grad_mode = torch.is_grad_enabled()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, previous)
        torch.set_grad_enabled(grad_mode)


def _proc_kib(path: str, field: str) -> int | None:
    """Bytes given by a 'Field:  N kB' line of a Linux /proc file, or None."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _available_memory() -> int | None:
    """Bytes of memory the kernel can still hand out (Linux MemAvailable), or None."""
    return _proc_kib("/proc/meminfo", "MemAvailable")


def _address_space() -> int | None:
    """Bytes of virtual address space this process uses now (Linux VmSize), or None."""
    return _proc_kib("/proc/self/status", "VmSize")


@contextlib.contextmanager
def _memory_guard(device: torch.device) -> Iterator[None]:
    """Turn running out of CPU memory into an exception instead of a killed process.

    CROWN's memory grows with the model and the batch (alpha-CROWN on paper-d3 takes ~8 GB per
    sample in float32 and ~15 GB in float64), and on Linux the kernel's OOM killer would end
    the whole process before any exception is raised. So the address-space limit is lowered
    to what the process uses now plus 90% of the memory still available; an allocation past
    it fails with an exception that `crown_verify` reports as "out of memory". Applies to the
    whole process while it is active. Does nothing on GPUs (CUDA raises its own error and
    maps far more address space than it uses) or where the limit or /proc are unavailable.
    """
    try:
        import resource
    except ImportError:  # not Unix
        resource = None  # type: ignore[assignment]
    available, used = _available_memory(), _address_space()
    if device.type != "cpu" or resource is None or available is None or used is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = used + int(0.9 * available)
    if soft != resource.RLIM_INFINITY:
        limit = min(limit, soft)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# ---------------------------------------------------------------------------------------------
# Verification.
# ---------------------------------------------------------------------------------------------

# alpha-CROWN's learning rate for the relaxation parameters. With auto_LiRPA's default (0.5),
# tuned for ReLU networks, every step made the bounds worse than CROWN's on these models.
ALPHA_LR = 0.05


@dataclass(frozen=True)
class FallbackResult:
    """The outcome of CROWN for one sample.

    certified: every margin z_y - z_j (j != y) has a positive lower bound on the whole l2 ball
        of radius eps around the image, so the prediction y cannot change there.
    reason: None when certified, otherwise why not ("misclassified", "margin lower bound
        -0.012 <= 0", "time limit (...)", "out of memory", "non-finite bounds", ...).
    seconds: wall-clock seconds spent on the sample (its batch's time divided by its size; the
        one-off graph construction is not included).
    margin_bound: min_j of the lower bounds on z_y - z_j when they were computed, else None.
    """

    certified: bool
    reason: str | None
    seconds: float
    margin_bound: float | None = None


def margin_spec(labels: Tensor, num_classes: int, dtype: torch.dtype) -> Tensor:
    """C (B, K-1, K) with rows e_y - e_j for the classes j != y (ascending), so C z = margins."""
    k = num_classes
    others = torch.arange(k - 1, device=labels.device)[None, :]
    others = others + (others >= labels[:, None]).long()  # skip y: (B, K-1)
    eye = torch.eye(k, dtype=dtype, device=labels.device)
    return eye[labels][:, None, :] - eye[others]


def _describe(error: Exception) -> str:
    """A one-line reason for a failed bound computation."""
    full = str(error).strip()
    message = full.splitlines()[0] if full else ""
    # The allocator's words can sit deep in the message (TorchScript wraps errors, for one).
    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)) or any(
        text in full for text in ("out of memory", "can't allocate memory")
    ):
        return "out of memory"
    if isinstance(error, NotImplementedError):
        return f"unsupported by auto_LiRPA: {message[:160]}"
    return f"auto_LiRPA error: {type(error).__name__}: {message[:160]}"


class MarginBounder:
    """(alpha-)CROWN lower bounds on the margins of a model over l2 balls of radius eps.

    Wraps one auto_LiRPA BoundedModule of `export_plain(model)`, built on first use; the
    arguments are as in `crown_verify`. Imports auto_LiRPA (LofastError if it is missing).
    """

    def __init__(self, model: LipschitzViT, eps: float, method: str = "crown", *,
                 dtype: torch.dtype = torch.float64, alpha_iterations: int = 20) -> None:
        if method not in METHODS:
            raise LofastError(f"method must be one of {', '.join(METHODS)}, not {method!r}")
        if not (isinstance(eps, (int, float)) and 0 <= eps < float("inf")):
            raise LofastError(f"eps must be a finite number >= 0, not {eps!r}")
        if alpha_iterations < 1:
            raise LofastError("alpha_iterations must be at least 1")
        self.lirpa = _auto_lirpa()
        self.plain = export_plain(model, dtype)
        self.num_classes = model.config.num_classes
        self.eps = float(eps)
        self.method = method
        self.dtype = dtype
        self.alpha_iterations = alpha_iterations
        self.bounded: Any = None  # the BoundedModule; None until built, or after a failure

    @property
    def device(self) -> torch.device:
        return next(iter(self.plain.buffers())).device

    def build(self, example: Tensor) -> None:
        """Trace the exported model on `example` (1, C, H, W); the batch size stays free."""
        with _lirpa_context(self.dtype):
            self.bounded = self.lirpa.BoundedModule(
                self.plain, example.to(self.device, self.dtype), device=self.device,
                custom_ops=_custom_ops(self.lirpa),
                bound_opts={
                    # Intersect every intermediate CROWN bound with IBP from the (already
                    # intersected) bounds of its inputs: never looser, costs little, and lifts
                    # the lower bounds of the square root's and reciprocal's arguments in
                    # LayerProject to R^2 and R, where CROWN alone may go below 0.
                    "compare_crown_with_ibp": True,
                },
            )

    def margin_bounds(self, images: Tensor, labels: Tensor,
                      max_seconds: float | None = None) -> Tensor:
        """Lower bounds (B, K-1) on z_y - z_j for the classes j != y in ascending order, valid
        for every input within l2 distance eps of each image (B, C, H, W); labels (B,).

        max_seconds (alpha-CROWN only) stops the optimisation early, keeping the best bounds
        found. Raises whatever auto_LiRPA raises; `crown_verify` turns that into results.
        """
        x = images.to(self.device, self.dtype)
        labels = labels.to(self.device, torch.long)
        if self.bounded is None:
            self.build(x[:1])
        spec = margin_spec(labels, self.num_classes, self.dtype)
        with _lirpa_context(self.dtype):
            ball = self.lirpa.BoundedTensor(
                x, self.lirpa.PerturbationLpNorm(norm=2, eps=self.eps))
            if self.method == "crown":
                with torch.no_grad():
                    lower, _ = self.bounded.compute_bounds(
                        x=(ball,), C=spec, method="backward", bound_upper=False)
                return lower
            options: dict[str, Any] = {
                "iteration": self.alpha_iterations,
                "lr_alpha": ALPHA_LR,
                # Share relaxation variables between start nodes: in our measurements a third
                # of the memory (paper-d3 needs > 20 GB per sample in float64 otherwise) and
                # half the time, for slightly looser bounds.
                "use_shared_alpha": True,
                # Stop as soon as every sample in the batch is certified.
                "stop_criterion_func": lambda lb: (lb > 0).all(dim=1, keepdim=True),
                "max_time": 1e9 if max_seconds is None else max_seconds,
            }
            self.bounded.set_bound_opts({"optimize_bound_args": options})
            with torch.enable_grad():  # alpha-CROWN optimises by gradient, even inside no_grad
                lower, _ = self.bounded.compute_bounds(
                    x=(ball,), C=spec, method="CROWN-Optimized", bound_upper=False)
            return lower.detach()


def _verify_batch(bounder: MarginBounder, x: Tensor, labels: Tensor,
                  timeout: float | None) -> list[FallbackResult]:
    """Results for a batch x (B, C, H, W) with labels (B,); never raises (except
    KeyboardInterrupt). A failed batch of several samples is retried one by one."""
    start = time.perf_counter()
    budget = None if timeout is None else timeout * len(x)

    def failed(count: int, reason: str) -> list[FallbackResult]:
        seconds = (time.perf_counter() - start) / count
        return [FallbackResult(False, reason, seconds) for _ in range(count)]

    try:
        with _memory_guard(bounder.device), _alarm(budget):
            # alpha-CROWN stops optimising in time to return its best (sound) bounds so far.
            lower = bounder.margin_bounds(x, labels, None if budget is None else 0.8 * budget)
    except _TimeLimit:
        bounder.bounded = None  # interrupted mid-computation: rebuild before reusing
        return failed(len(x), f"time limit ({timeout:.3g} s per sample)")
    except Exception as error:  # noqa: BLE001 - any failure is this batch's, not the caller's
        bounder.bounded = None
        if len(x) > 1:  # out of memory, or one sample's numerics: isolate it
            return [r for i in range(len(x))
                    for r in _verify_batch(bounder, x[i:i + 1], labels[i:i + 1], timeout)]
        return failed(1, _describe(error))
    elapsed = time.perf_counter() - start
    if budget is not None and elapsed > budget:  # the alarm was not available
        return failed(len(x), f"time limit ({timeout:.3g} s per sample)")
    results = []
    for row in lower:
        if not torch.isfinite(row).all():
            results.append(FallbackResult(False, "non-finite bounds", elapsed / len(x)))
            continue
        bound = row.min().item()
        reason = None if bound > 0 else f"margin lower bound {bound:.4g} <= 0"
        results.append(FallbackResult(bound > 0, reason, elapsed / len(x), bound))
    return results


def crown_verify(model: LipschitzViT, images: Tensor, labels: Tensor, eps: float,
                 method: str = "crown", timeout: float | None = None, batch_size: int = 1, *,
                 dtype: torch.dtype = torch.float64,
                 alpha_iterations: int = 20) -> list[FallbackResult]:
    """Certify each image against every l2 perturbation of norm <= eps with (alpha-)CROWN.

    images (N, C, H, W) in [0,1], labels (N,) class indices; returns N FallbackResults in order.
    A sample is certified iff CROWN's lower bounds on all margins z_y - z_j (j != y) of the
    exported model are positive over the l2 ball of radius eps (not intersected with [0,1]; see
    the module docstring). Samples the model misclassifies are not bounded.

    method: "crown" (backward linear bound propagation) or "alpha-crown" (CROWN with
        `alpha_iterations` steps of relaxation optimisation, stopping early once every sample of
        the batch is certified); the strongest mode offered, there is no branch and bound.
    timeout: seconds allowed per sample; a batch of k samples gets k * timeout, and if it runs
        out every sample in it is reported as "time limit (...)".
    batch_size: samples bounded together in one auto_LiRPA call; memory grows linearly with
        it. Worth raising on a GPU; on CPU a batch of 4 took no less time per sample than 1.
    dtype: precision of the exported network and of the bounds; float64 (default) keeps
        rounding far from the certification threshold, float32 is about twice as fast. The
        weights are the model's own (float32 weights are exact in float64).

    Cost on CPU (paper-d3, one thread, per sample): CROWN ~12 s and ~1 GB in float32, ~23 s
    and ~1.2 GB in float64; alpha-CROWN needs ~8 GB (float32) or ~16 GB (float64) of memory.

    Per-sample failures (time limit, out of memory, non-finite bounds, an error inside
    auto_LiRPA) become FallbackResult(False, reason, seconds) and never raise; on Linux CPUs a
    temporary address-space limit turns memory exhaustion into such a result instead of the
    kernel killing the process. Raises LofastError
    for invalid arguments or when auto_LiRPA is not installed. Changes torch's default dtype while
    bounding (not thread-safe).
    """
    if timeout is not None and not timeout > 0:
        raise LofastError(f"timeout must be positive seconds or None, not {timeout!r}")
    if batch_size < 1:
        raise LofastError("batch_size must be at least 1")
    config = model.config
    expected = (config.channels, config.image_size, config.image_size)
    if images.ndim != 4 or tuple(images.shape[1:]) != expected:
        raise LofastError(f"images must have shape (N, {', '.join(map(str, expected))}), "
                          f"not {tuple(images.shape)}")
    if labels.shape != images.shape[:1]:
        raise LofastError(f"labels must have shape ({len(images)},), not {tuple(labels.shape)}")
    if len(labels) and not (0 <= int(labels.min()) and int(labels.max()) < config.num_classes):
        raise LofastError(f"labels must lie in [0, {config.num_classes})")
    bounder = MarginBounder(model, eps, method, dtype=dtype, alpha_iterations=alpha_iterations)

    images = images.to(bounder.device, dtype)
    labels = labels.to(bounder.device, torch.long)
    with torch.no_grad():
        predictions = bounder.plain(images).argmax(dim=1)
    results: list[FallbackResult | None] = [None] * len(images)
    pending = []
    for i in range(len(images)):
        if not torch.isfinite(images[i]).all():
            results[i] = FallbackResult(False, "non-finite image", 0.0)
        elif predictions[i] != labels[i]:
            results[i] = FallbackResult(False, "misclassified", 0.0)
        else:
            pending.append(i)
    if pending:
        try:
            bounder.build(images[pending[0]:pending[0] + 1])
        except Exception as error:  # noqa: BLE001 - e.g. an operator auto_LiRPA lacks
            reason = f"auto_LiRPA cannot bound this model: {_describe(error)}"
            for i in pending:
                results[i] = FallbackResult(False, reason, 0.0)
            pending = []
    for first in range(0, len(pending), batch_size):
        chunk = pending[first:first + batch_size]
        for i, result in zip(chunk, _verify_batch(bounder, images[chunk], labels[chunk], timeout),
                             strict=True):
            results[i] = result
    return [r for r in results if r is not None]
