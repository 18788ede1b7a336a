"""Frozen settings for models, training and certification, with named model presets; none of
it imports torch, so the command line reads its option defaults from here at no cost.

- ``base``: the names users choose, the certification defaults, limits, shared checks;
- ``model``: ``ModelConfig`` and the presets;
- ``training``: ``TrainConfig`` and ``TrainRun`` (a training run);
- ``certify``: ``CertifyConfig`` and ``AttackSettings`` (a certification run).
"""

from lofast.config.base import (
    AUTOMATIC_GUARANTEE,
    BOUNDS,
    CERTIFY_DEFAULTS,
    DATASETS,
    FALLBACKS,
    GUARANTEE_CHOICES,
    GUARANTEES,
    KAPPAS,
    MAX_ATTACK_RESTARTS,
    MAX_ATTACK_STEPS,
    MAX_BATCH_SIZE,
    MAX_PARAMETERS,
    MAX_SEED,
    SPLITS,
    Bound,
    CertifyDefaults,
    Choice,
    Loss,
    Pooling,
    Schedule,
    Weights,
    check_flags,
    check_int,
    check_progress,
    json_or_text,
    plain_dict,
)
from lofast.config.certify import (
    AttackSettings,
    CertifyConfig,
    Requirement,
    check_requirements,
    parse_allowed_drop,
    parse_radii,
    parse_radius,
    parse_requirement,
    parse_shard,
)
from lofast.config.model import INIT_OPTIONS, PRESETS, ModelConfig, preset
from lofast.config.training import TrainConfig, TrainRun
from lofast.errors import ConfigError

__all__ = [
    "AUTOMATIC_GUARANTEE",
    "BOUNDS",
    "CERTIFY_DEFAULTS",
    "DATASETS",
    "FALLBACKS",
    "GUARANTEES",
    "GUARANTEE_CHOICES",
    "INIT_OPTIONS",
    "KAPPAS",
    "MAX_ATTACK_RESTARTS",
    "MAX_ATTACK_STEPS",
    "MAX_BATCH_SIZE",
    "MAX_PARAMETERS",
    "MAX_SEED",
    "PRESETS",
    "SPLITS",
    "AttackSettings",
    "Bound",
    "CertifyConfig",
    "CertifyDefaults",
    "Choice",
    "ConfigError",
    "Loss",
    "ModelConfig",
    "Pooling",
    "Requirement",
    "Schedule",
    "TrainConfig",
    "TrainRun",
    "Weights",
    "check_flags",
    "check_int",
    "check_progress",
    "check_requirements",
    "json_or_text",
    "parse_allowed_drop",
    "parse_radii",
    "parse_radius",
    "parse_requirement",
    "parse_shard",
    "plain_dict",
    "preset",
]
