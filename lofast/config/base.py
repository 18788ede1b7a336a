"""The names users choose (option kinds, guarantees, data set kinds, fallbacks), the defaults
of certification, the limits of every count, and the checks the configs share."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import numbers
from dataclasses import dataclass
from typing import Any

from lofast.errors import LofastError


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
# "auto" picks one of them per model (``certificate.automatic_guarantee``): exact where its
# proofs are affordable, probabilistic where (n d)^2 Gram matrices would not be.
AUTOMATIC_GUARANTEE = "auto"
GUARANTEE_CHOICES = (AUTOMATIC_GUARANTEE, *GUARANTEES)
BOUNDS = tuple(b.value for b in Bound)  # see ``certificate.BOUND_TERMS``
KAPPAS = (0.5, 1.0)  # softmax Lipschitz constants: 1/2 is tight and sound, 1 is the paper's


@dataclass(frozen=True)
class CertifyDefaults:
    """What ``lofast certify`` and ``certificate.Certifier`` do when not told otherwise."""

    guarantee: str = AUTOMATIC_GUARANTEE
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
    """A real number of Python or numpy (float32, int64, ...), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def plain_number(value: Any) -> int | float:
    """A Python int or float as it is, any other real number (numpy's) as a float: what JSON
    records and checkpoint metadata can hold."""
    return value if type(value) in (int, float) else float(value)


def plain_option(name: str, value: Any, error: type[LofastError] = LofastError) -> Any:
    """A model option's value with a numpy or torch scalar made the Python one (``.item()``):
    the options go into the checkpoint's JSON metadata, which cannot hold numpy's types, and
    ``ModelConfig`` checks the values themselves."""
    if value is None or isinstance(value, (str, bytes, bool, int, float)):
        return value
    item = getattr(value, "item", None)
    if item is None:
        return value
    try:
        return item()
    except (ValueError, RuntimeError):  # an array of several values
        raise error(f"model option {name} must be one value, not {value!r}") from None


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None,
              error: type[LofastError] = LofastError) -> int:
    """``value`` as a Python int: it must be an integer (a Python or numpy one, not a bool) in
    minimum .. maximum; ``error`` otherwise. Callers store the result, so that a numpy integer
    (say from ``np.arange``) reaches JSON, checkpoint metadata and records as a plain int."""
    if (not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum
            or (maximum is not None and value > maximum)):
        bounds = f">= {minimum}" if maximum is None else f"in {minimum} .. {maximum}"
        raise error(f"{name} must be an integer {bounds}, not {value!r}")
    return int(value)


def check_flags(owner: Any, names: tuple[str, ...],
                 error: type[LofastError] = LofastError) -> None:
    """Each of ``owner``'s fields ``names`` must be True or False: a text such as "no" or None
    would silently read as true or false."""
    for name in names:
        if not isinstance(getattr(owner, name), bool):
            raise error(f"{name} must be true or false, not {getattr(owner, name)!r}")


def check_positive(name: str, value: Any, error: type[LofastError] = LofastError) -> int | float:
    """``value`` as a plain number (``plain_number``, which callers store): it must be a
    positive finite real number; ``error`` otherwise."""
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise error(f"{name} must be a positive finite number, not {value!r}")
    return plain_number(value)


def check_progress(value: Any, protocol: type, error: type[LofastError] = LofastError) -> None:
    """``value`` (a run's progress reporter) must have every public method of ``protocol``
    (``RunProgress``, ``TrainProgress``: any object with them will do); ``error`` otherwise,
    before the run starts, not an AttributeError in its middle."""
    missing = [name for name, member in vars(protocol).items()
               if callable(member) and not name.startswith("_")
               and not callable(getattr(value, name, None))]
    if missing:
        raise error(f"progress must have the methods of {protocol.__name__} "
                    f"({', '.join(missing)} missing), not {type(value).__name__}")


def json_or_text(text: str) -> Any:
    """``text`` as the JSON value it spells, else the text itself (a --model-option value, a
    checkpoint's metadata string); JSON nested past the parser's depth stays text too, for the
    field's own check to refuse."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text
