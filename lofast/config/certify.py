"""A certification run's config, checked in one place for the command line and the Python API
(``pipeline.run_certify`` runs it)."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path
from typing import Any

from lofast.config.base import (
    DATASETS,
    FALLBACKS,
    MAX_ATTACK_RESTARTS,
    MAX_ATTACK_STEPS,
    MAX_BATCH_SIZE,
    MAX_SEED,
    SPLITS,
    check_flags,
    check_int,
)
from lofast.errors import ConfigError


def parse_radius(value: Any, name: str = "eps") -> float:
    """A positive finite l2 radius from a number or a text such as "0.05" or "36/255";
    ConfigError otherwise (a radius <= 0 would certify nothing, or count a misclassified
    sample as robust). A 0-d numpy array or torch tensor counts as its number."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # a bool tensor becomes a bool, refused below
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


def parse_radii(value: Any, name: str = "eps") -> tuple[float, ...]:
    """The distinct radii of one eps (a number or a text) or of a sequence of them, ascending;
    ConfigError naming ``name`` otherwise."""
    if (isinstance(value, (str, bytes)) or not hasattr(value, "__iter__")
            or getattr(value, "ndim", None) == 0):  # a 0-d array or tensor is one radius
        value = [value]
    radii = {parse_radius(v, name) for v in value}
    if not radii:
        raise ConfigError(f"give at least one {name}")
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
class Requirement:
    """A floor on a run's accuracy (``--require`` of ``lofast certify`` and ``lofast report``):
    certified accuracy at ``eps``, or clean accuracy where eps is None, of at least ``percent``
    % (exact: ``report.Summary.unmet`` compares counts of samples, so 42.3 needs 4,230 of
    10,000 and 4,229 fails). ``text`` is the requirement as written, for messages."""

    eps: float | None
    percent: Fraction
    text: str


def parse_requirement(value: Any) -> Requirement:
    """A ``Requirement`` from "EPS=PERCENT" (EPS a radius such as 0.05 or 36/255, or "clean";
    PERCENT in [0, 100], "%" optional), e.g. "36/255=42" or "clean=50%"."""
    return _eps_and_share(value, "requirement", "EPS=PERCENT (e.g. 36/255=42 or clean=50)",
                          "a percentage", "percentage")


def parse_allowed_drop(value: Any) -> Requirement:
    """A ``Requirement`` from "EPS=POINTS" (``lofast report --max-drop``): the most that
    certified accuracy at EPS (clean accuracy for "clean") may fall below a baseline run's on
    the same samples, in percentage points in [0, 100], e.g. "36/255=0.5"; ``percent`` holds
    the points."""
    return _eps_and_share(value, "allowed drop", "EPS=POINTS (e.g. 36/255=0.5 or clean=1)",
                          "a number of points", "points")


def _eps_and_share(value: Any, name: str, form: str, share: str, unit: str) -> Requirement:
    """The eps ("clean": None) and the exact share in [0, 100] of "EPS=SHARE"; ConfigError
    otherwise, naming the text as ``name`` with its ``form``, ``share`` ("a percentage") and
    ``unit`` ("percentage")."""
    text = str(value).strip()
    where, sep, floor = text.partition("=")
    if not sep or not where.strip() or not floor.strip():
        raise ConfigError(f"{name} {text!r} is not {form}")
    where = where.strip()
    eps = None if where.lower() == "clean" else parse_radius(where, f"{name} {text!r}: eps")
    try:
        number = Decimal(floor.strip().removesuffix("%").strip())
    except InvalidOperation:
        raise ConfigError(f"{name} {text!r}: {floor.strip()!r} is not {share}") from None
    if not (number.is_finite() and 0 <= number <= 100):
        raise ConfigError(f"{name} {text!r}: the {unit} must lie in 0 .. 100")
    return Requirement(eps=eps, percent=Fraction(number), text=text)


def check_requirements(requirements: Sequence[Requirement], eps: Sequence[float]) -> None:
    """ConfigError where a requirement names an eps that is not among the run's ``eps``."""
    for requirement in requirements:
        if requirement.eps is not None and requirement.eps not in eps:
            shown = ", ".join(f"{e:g}" for e in sorted(eps))
            raise ConfigError(f"requirement {requirement.text}: the run certifies at eps "
                              f"{shown}, not {requirement.eps:g}")


@dataclass(frozen=True)
class AttackSettings:
    """l2 PGD on the samples no verifier certified (``lofast.certification.attack.pgd_attack``)."""

    steps: int = 100
    restarts: int = 5
    box: bool = True  # keep adversarial images in the pixel box [0, 1]
    seed: int = 0
    save_dir: Any = None  # a folder (str or Path): every counterexample found there as .npz

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        set_("steps", check_int("attack steps", self.steps, 1, MAX_ATTACK_STEPS, ConfigError))
        set_("restarts", check_int("attack restarts", self.restarts, 1, MAX_ATTACK_RESTARTS,
                                   ConfigError))
        set_("seed", check_int("seed", self.seed, 0, MAX_SEED, ConfigError))
        check_flags(self, ("box",), ConfigError)
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
    class-balanced order (None: all); settings: a ``certificate.CertifySettings`` (None: the
    defaults; its type is checked by the driver, which owns the certifier);
    fallback: one of FALLBACKS or None; attack: an ``AttackSettings`` (True: the defaults) or
    None; out: the JSONL record file (resume continues it); shard: (I, N) or "I/N";
    verdicts_only: certificates whose verdicts at every eps are the full certificate's, with
    the per-sample proofs only where a verdict needs them (the settings' ``verdicts_at`` set
    to the run's eps; other radii may be smaller, each still certified).
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
    verdicts_only: bool = False

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
            set_("limit", check_int("n", self.limit, 1, error=ConfigError))
        if self.batch_size is not None:
            set_("batch_size", check_int("batch size", self.batch_size, 1, MAX_BATCH_SIZE,
                                         ConfigError))
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
        check_flags(self, ("resume", "attention_report", "classes_unchecked", "verdicts_only"),
                    ConfigError)
        if self.resume and self.out is None:
            raise ConfigError("--resume needs --out, the file to continue")
        set_("shard", parse_shard(self.shard))
