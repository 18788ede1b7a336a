"""Frozen settings for models, training and certification, with named model presets."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lofast.errors import ConfigError, LofastError


class Choice(str, enum.Enum):
    """An option with a fixed set of names. A member equals, hashes and prints as its name, so
    JSON, checkpoint metadata and the command line keep the plain string."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, field: str, value: Any, error: type[LofastError] = LofastError) -> Choice:
        """The member named ``value``, else one clear error naming ``field`` and the choices."""
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(m.value) for m in cls)
            raise error(f"{field} must be one of {names}, not {value!r}") from None


class Pooling(Choice):
    MEAN = "mean"  # the mean over all tokens, 1/sqrt(n)-Lipschitz
    CLASS_TOKEN = "cls"


class Weights(Choice):
    """How an attention block's query/key (or value/output) matrices are made."""

    LEARNED = "learned"  # learned and spectrally capped
    IDENTITY = "identity"  # fixed identities: each head works on the coordinates it owns


class Loss(Choice):
    CE = "ce"
    MARGIN = "margin"  # Lipschitz-margin cross-entropy (Tsuzuku et al. 2018)
    CERTIFIED = "certified"  # cross-entropy on logits worsened by the LoFAST training bound


class Schedule(Choice):
    COSINE = "cosine"
    CONSTANT = "constant"


class Bound(Choice):
    LOFAST = "lofast"  # the paper's practical bound delta_2^(2)
    LOFAST_TIGHT = "lofast-tight"  # its delta_2^(1)
    NAIVE = "naive"  # the first-order term of the paper's eq. (12)


def plain_dict(config: Any) -> dict[str, Any]:
    """A dataclass as a dict of plain values (a Choice becomes its name): for files that must
    hold plain data only, such as the training state read with ``weights_only``."""
    return dataclasses.asdict(config, dict_factory=lambda items: {
        k: v.value if isinstance(v, Choice) else v for k, v in items})

# Certification: the names users choose, read by the library (``certificate.CertifySettings``) and
# the CLI alike. A guarantee says what every norm in a certificate is (``bounds.spectral.
# Guarantee`` has the same values) and names the spectral method that delivers it.
GUARANTEES = {"exact": "verified", "probabilistic": "lanczos", "estimate": "power"}
BOUNDS = tuple(b.value for b in Bound)  # see ``certificate.BOUND_TERMS``
KAPPAS = (0.5, 1.0)  # softmax Lipschitz constants: 1/2 is tight and sound, 1 is the paper's


@dataclass(frozen=True)
class CertifyDefaults:
    """What ``lofast certify`` and ``certificate.Certifier`` do when not told otherwise."""

    guarantee: str = "exact"
    bound: Bound = Bound.LOFAST
    kappa: float = 0.5
    softmax_jacobian: bool = True  # the second-order refinement of ``bounds.attention``
    local_projection: bool = True  # LayerProject's local contraction (else 1-Lipschitz)
    seed: int = 0


CERTIFY_DEFAULTS = CertifyDefaults()

# Larger models are refused before any allocation (4 GiB of float32 weights).
MAX_PARAMETERS = 2**30

# The names of data set kinds, splits and fallback verifiers, for the library and the CLI alike.
DATASETS = ("cifar10", "svhn", "folder")
SPLITS = ("train", "test")
FALLBACKS = ("crown", "alpha-crown", "beta-crown")  # auto_LiRPA's verifiers (``lofast.crown``)

# Upper limits of the counts a user sets: each sizes memory or time, and a larger one is a typo
# (``--attack-restarts 1000000`` would allocate restarts x batch images at once).
MAX_ATTACK_STEPS = 100_000
MAX_ATTACK_RESTARTS = 100
MAX_BATCH_SIZE = 2**16
MAX_SEED = 2**63 - 1


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None,
               error: type[LofastError] = LofastError) -> None:
    if (not isinstance(value, int) or isinstance(value, bool) or value < minimum
            or (maximum is not None and value > maximum)):
        bounds = f">= {minimum}" if maximum is None else f"in {minimum} .. {maximum}"
        raise error(f"{name} must be an integer {bounds}, not {value!r}")


def _check_positive(name: str, value: Any) -> None:
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise LofastError(f"{name} must be a positive finite number, not {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """A Lipschitz ViT: every stage is L-Lipschitz with known L or an exact LoFAST attention block.

    Per block: X <- Proj_attn_radius(X); X <- X + MHA(X); [X <- Proj_mlp_radius(X)]; X <- SLL(X).
    """

    image_size: int = 32
    channels: int = 3
    num_classes: int = 10
    patch_size: int = 16
    width: int = 128
    depth: int = 3
    heads: int = 8
    mlp_ratio: int = 4
    embed_cap: float = 1.0  # spectral cap of the patch embedding (its Lipschitz constant)
    query_key_cap: float | None = 1.0  # caps on Wq and Wk (None: free)
    value_cap: float = 0.5  # cap on Wv (the paper finds caps below 1 essential)
    output_cap: float = 0.5  # cap on Wo
    attn_radius: float = 1.0  # LayerProject radius of the stream entering every attention block
    mlp_radius: float | None = None  # LayerProject before every SLL layer (None: none)
    final_radius: float | None = 1.0  # LayerProject before pooling (None: none)
    pool: Pooling = Pooling.MEAN
    input_center: float = 0.5  # x - c is an isometry; no std division (it would scale L)
    # A learned (heads, n, n) bias added to every attention block's scores. It does not depend
    # on the input, so it adds nothing to the softmax terms of the bound; zeta is taken around
    # softmax(bias) instead of uniform attention. Collapsed scores still mix tokens spatially.
    position_bias: bool = False
    # Fix every head's ||Wq_l Wk_l^T|| at this value (None: only capped, which lets certified
    # training drive the scores, and with them input-dependent attention, to zero).
    score_norm: float | None = None
    # Wq = Wk = I (identity): each head's scores are the dot products of the tokens'
    # coordinates it owns (no learned direction can make the scores constant)
    query_key: Weights = Weights.LEARNED
    # Fix every head's ||Wv_l Wo_l|| at this value (None: only capped, which lets training switch
    # attention off by shrinking what it mixes in).
    value_norm: float | None = None
    # Wv = value_cap I, Wo = output_cap I (identity): each head mixes the coordinates it owns as
    # they are, so the value path cannot turn away from the directions in which tokens differ
    # (with learned Wv, Wo certified training makes X Wv Wo nearly constant over the tokens).
    value_output: Weights = Weights.LEARNED
    # score_norm, value_norm, query_key and value_output apply to `live_blocks` blocks only
    # (None: all): the last ones, or with live_first the first ones, whose tokens are the
    # projected patches themselves. The others keep learned, capped weights.
    live_blocks: int | None = None
    live_first: bool = False

    def __post_init__(self) -> None:
        # Every value here reaches the forward pass, and the radii reach the Lipschitz
        # accounting: a value read from a file is checked like any other input.
        for name in ("image_size", "channels", "num_classes", "patch_size", "width", "depth",
                     "heads", "mlp_ratio"):
            _check_int(name, getattr(self, name), minimum=2 if name == "num_classes" else 1)
        for name in ("embed_cap", "value_cap", "output_cap", "attn_radius"):
            _check_positive(name, getattr(self, name))
        for name in ("query_key_cap", "mlp_radius", "final_radius", "score_norm", "value_norm"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if not _is_real(self.input_center) or not math.isfinite(self.input_center):
            raise LofastError(f"input_center must be a finite number, not {self.input_center!r}")
        # frozen: the names read from a file become their members once, here
        object.__setattr__(self, "pool", Pooling.parse("pool", self.pool))
        object.__setattr__(self, "query_key", Weights.parse("query_key", self.query_key))
        object.__setattr__(self, "value_output",
                           Weights.parse("value_output", self.value_output))
        if self.live_blocks is not None:
            _check_int("live_blocks", self.live_blocks, minimum=1)
            if self.live_blocks > self.depth:
                raise LofastError(f"live_blocks {self.live_blocks} exceeds depth {self.depth}")
        for name in ("position_bias", "live_first"):
            if not isinstance(getattr(self, name), bool):
                raise LofastError(f"{name} must be true or false, not {getattr(self, name)!r}")
        if self.image_size % self.patch_size:
            raise LofastError(
                f"patch_size {self.patch_size} does not divide image_size {self.image_size}"
            )
        if self.width % self.heads:
            raise LofastError(f"width {self.width} is not divisible by heads {self.heads}")
        if self.parameter_count() > MAX_PARAMETERS:
            raise LofastError(
                f"the model would have {self.parameter_count():,} parameters "
                f"({4 * self.parameter_count() / 2**30:.1f} GiB in float32); "
                f"lofast builds at most {MAX_PARAMETERS:,}"
            )

    def parameter_count(self) -> int:
        """Number of learned values, computed from the config alone (before allocating)."""
        d, n, hidden = self.width, self.num_tokens, self.width * self.mlp_ratio
        embed = d * self.channels * self.patch_size**2 + d + self.num_patches * d + d
        bias = self.heads * n * n if self.position_bias else 0
        block = 4 * d * d + bias + d * hidden + 2 * hidden
        identity = sum((not self.learned_query_key(b)) + (not self.learned_value_output(b))
                       for b in range(self.depth))  # pairs of d x d matrices not learned
        return embed + self.depth * block - identity * 2 * d * d + self.num_classes * (d + 1)

    def is_live(self, block: int) -> bool:
        """Whether score_norm, value_norm, query_key and value_output apply to block (0-based)."""
        if self.live_blocks is None:
            return True
        if self.live_first:
            return block < self.live_blocks
        return block >= self.depth - self.live_blocks

    def learned_query_key(self, block: int) -> bool:
        return self.query_key is Weights.LEARNED or not self.is_live(block)

    def learned_value_output(self, block: int) -> bool:
        return self.value_output is Weights.LEARNED or not self.is_live(block)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_tokens(self) -> int:
        return self.num_patches + 1  # the class token

    def to_json(self) -> str:
        return json.dumps(plain_dict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        if not isinstance(values, dict):
            raise LofastError(f"a model config is a mapping of fields, not {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise LofastError(f"unknown model config keys: {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(known))}")
        return cls(**values)


PRESETS: dict[str, ModelConfig] = {
    # The LoFAST paper's small models (Table 1): width 128, patch 16, depth 3/4/5.
    "paper-d3": ModelConfig(depth=3),
    "paper-d4": ModelConfig(depth=4),
    "paper-d5": ModelConfig(depth=5),
    # The paper's width-384 models (Figure 2).
    "paper-w384": ModelConfig(width=384, depth=3, heads=8),
    # Tiny model for tests and smoke runs.
    "tiny": ModelConfig(patch_size=8, width=32, depth=2, heads=2, mlp_ratio=2),
    # Our choice: smaller patches (17 tokens) keep more spatial detail at the same width.
    "lofast-s": ModelConfig(patch_size=8, width=128, depth=3, heads=8),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The named preset, with any fields replaced."""
    if name not in PRESETS:
        raise LofastError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return ModelConfig.from_dict({**dataclasses.asdict(PRESETS[name]), **overrides})


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run (saved with the checkpoint)."""

    epochs: int = 10
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_epochs: float = 1.0
    schedule: Schedule = Schedule.COSINE  # after warm-up
    loss: Loss = Loss.CE
    margin: float = 0.0  # margin in head-feature units; logit j != y is raised by margin*||w_y - w_j||
    temperature: float = 1.0  # logits are divided by this before cross-entropy
    train_eps: float = 0.0  # certified: image radius whose LoFAST bound raises the logits
    eps_ramp_epochs: float = 0.0  # certified: train_eps grows linearly from 0 over these epochs
    clean_mix: float = 0.0  # certified: weight of the clean cross-entropy in the loss
    power_iterations: int = 2  # certified: power steps per batch for zeta (warm-started)
    softmax_jacobian: bool = True  # certified: train against the certifier's refined bound
    # attention reward: a hinge penalty ablation_weight * max(0, ablation_margin - (CE of the
    # model with every P_l(X) replaced by its batch mean - CE of the model)), in nats; 0: off
    ablation_margin: float = 0.0
    ablation_weight: float = 1.0
    augment: bool = True  # random crop (pad 4) and horizontal flip
    seed: int = 0
    amp: bool = True  # bfloat16 autocast on CUDA only

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss", Loss.parse("loss", self.loss))
        object.__setattr__(self, "schedule", Schedule.parse("schedule", self.schedule))
        for name in ("epochs", "batch_size", "power_iterations"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("seed", self.seed, minimum=0)
        if self.seed >= 2**63:
            raise LofastError(f"seed must be below 2**63, not {self.seed}")
        for name in ("lr", "temperature"):
            _check_positive(name, getattr(self, name))
        for name in ("weight_decay", "warmup_epochs", "margin", "train_eps", "eps_ramp_epochs",
                     "ablation_margin", "ablation_weight"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or value < 0:
                raise LofastError(f"{name} must be a finite number >= 0, not {value!r}")
        if self.loss is Loss.CERTIFIED and not self.train_eps > 0:
            raise LofastError("--loss certified needs a positive --train-eps")
        if not _is_real(self.clean_mix) or not 0.0 <= self.clean_mix <= 1.0:
            raise LofastError("clean mix must lie in [0, 1]")


def parse_radius(value: Any, name: str = "eps") -> float:
    """A positive finite l2 radius from a number or a text such as "0.05" or "36/255";
    ConfigError otherwise (a radius <= 0 would certify nothing, or count a misclassified
    sample as robust)."""
    if isinstance(value, str):
        text = value.strip()
        try:
            if text.count("/") == 1:
                numerator, denominator = text.split("/")
                number = float(numerator) / float(denominator)
            else:
                number = float(text)
        except (ValueError, ZeroDivisionError):
            raise ConfigError(f"{name} {value!r} is not a number") from None
    elif isinstance(value, bool) or not hasattr(value, "__float__"):
        raise ConfigError(f"{name} must be a number, not {value!r}")
    else:
        number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ConfigError(f"{name} must be a positive finite number, not {value!r}")
    return number


def parse_radii(value: Any) -> tuple[float, ...]:
    """The distinct radii of one eps (a number or a text) or of a sequence of them, ascending."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        value = [value]
    radii = {parse_radius(v) for v in value}
    if not radii:
        raise ConfigError("give at least one eps")
    return tuple(sorted(radii))


def parse_shard(value: Any) -> tuple[int, int] | None:
    """(I, N) from "I/N" or a pair: part I (from 0) of N interleaved parts; None stays None."""
    if value is None:
        return None
    try:
        index, count = (int(part) for part in value.split("/")) if isinstance(value, str) \
            else value
        if isinstance(index, bool) or isinstance(count, bool) or index != int(index) \
                or count != int(count):
            raise TypeError
    except (TypeError, ValueError):
        raise ConfigError(f"shard {value!r} is not I/N (e.g. 0/4)") from None
    if not 0 <= index < count:
        raise ConfigError(f"shard {value!r}: I must lie in 0 .. N-1")
    return int(index), int(count)


@dataclass(frozen=True)
class AttackSettings:
    """l2 PGD on the samples no verifier certified (``lofast.attack.pgd_attack``)."""

    steps: int = 100
    restarts: int = 5
    box: bool = True  # keep adversarial images in the pixel box [0, 1]
    seed: int = 0
    save_dir: Any = None  # a folder (str or Path): every counterexample found there as .npz

    def __post_init__(self) -> None:
        _check_int("attack steps", self.steps, 1, MAX_ATTACK_STEPS, ConfigError)
        _check_int("attack restarts", self.restarts, 1, MAX_ATTACK_RESTARTS, ConfigError)
        _check_int("seed", self.seed, 0, MAX_SEED, ConfigError)
        if not isinstance(self.box, bool):
            raise ConfigError(f"attack box must be true or false, not {self.box!r}")
        object.__setattr__(self, "save_dir", _optional_path("save_adversarial", self.save_dir))

    def describe(self) -> dict:
        """The settings a record's verdicts depend on (for --resume)."""
        return {"steps": self.steps, "restarts": self.restarts, "box": self.box,
                "seed": self.seed}


def _optional_path(name: str, value: Any) -> Path | None:
    if value is None or isinstance(value, Path):
        return value
    if isinstance(value, (str, os.PathLike)) and str(value):
        return Path(value)
    raise ConfigError(f"{name} must be a path, not {value!r}")


@dataclass(frozen=True)
class CertifyConfig:
    """One certification run, as ``lofast certify`` and ``lofast.certify`` take it; every field
    is checked here, once, for both (``pipeline.run_certify`` runs it).

    eps: one radius or several (numbers or texts such as "36/255"), kept as a sorted tuple of
    distinct positive radii; checkpoint: a path, a loaded LipschitzViT, or None (the shipped
    default); data: a path, a loaded ImageDataset, or None (the bundled sample); dataset: the
    kind of data at a path (None: the checkpoint's); limit: the first N samples of the
    class-balanced order (None: all); settings: a ``CertifySettings`` (None: the defaults);
    fallback: one of FALLBACKS or None; attack: an ``AttackSettings`` (True: the defaults) or
    None; out: the JSONL record file (resume continues it); shard: (I, N) or "I/N".
    """

    eps: Any
    checkpoint: Any = None
    data: Any = None
    dataset: str | None = None
    split: str = "test"
    limit: int | None = None
    batch_size: int | None = None
    device: str = "auto"
    settings: Any = None
    fallback: str | None = None
    fallback_timeout: float | None = None
    attack: Any = None
    out: Any = None
    resume: bool = False
    shard: Any = None
    attention_report: bool = False
    classes_unchecked: bool = False  # a checkpoint that names no classes: take the data's

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)  # frozen: normalised once, here
        set_("eps", parse_radii(self.eps))
        for name in ("checkpoint", "data"):
            value = getattr(self, name)
            if isinstance(value, (str, os.PathLike)):
                set_(name, _optional_path(name, value))
        if self.dataset is not None and self.dataset not in DATASETS:
            raise ConfigError(f"dataset must be one of {', '.join(DATASETS)}, not "
                              f"{self.dataset!r}")
        if self.split not in SPLITS:
            raise ConfigError(f"split must be one of {', '.join(SPLITS)}, not {self.split!r}")
        if self.limit is not None:
            _check_int("n", self.limit, 1, error=ConfigError)
        if self.batch_size is not None:
            _check_int("batch size", self.batch_size, 1, MAX_BATCH_SIZE, ConfigError)
        if not isinstance(self.device, str) or not self.device:
            raise ConfigError(f"device must be a name such as 'cpu' or 'cuda', not "
                              f"{self.device!r}")
        if self.fallback not in (None, *FALLBACKS):
            raise ConfigError(f"fallback must be one of {', '.join(FALLBACKS)} or None, not "
                              f"{self.fallback!r}")
        if self.fallback_timeout is not None:
            set_("fallback_timeout", parse_radius(self.fallback_timeout, "fallback timeout"))
        if self.attack is True:
            set_("attack", AttackSettings())
        elif self.attack is False:
            set_("attack", None)
        elif self.attack is not None and not isinstance(self.attack, AttackSettings):
            raise ConfigError(f"attack must be True, False or an AttackSettings, not "
                              f"{self.attack!r}")
        set_("out", _optional_path("out", self.out))
        for name in ("resume", "attention_report", "classes_unchecked"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, not {getattr(self, name)!r}")
        if self.resume and self.out is None:
            raise ConfigError("--resume needs --out, the file to continue")
        set_("shard", parse_shard(self.shard))
        if self.settings is not None:
            from lofast.certificate import CertifySettings  # torch: only where given

            if not isinstance(self.settings, CertifySettings):
                raise ConfigError(f"settings must be a CertifySettings, not "
                                  f"{type(self.settings).__name__}")
