"""User-facing errors: each carries one line that the command line prints as it is."""

import signal


class LofastError(Exception):
    """Base class of every error a user can cause (bad file, bad option, bad data)."""


class ConfigError(LofastError, ValueError):
    """An option or argument outside what it may be (a negative eps, a count below one, an
    unknown name): refused before any work, by the command line and the Python API alike."""


class DataError(LofastError):
    """Missing, corrupt, truncated or wrongly shaped data."""


class CheckpointError(LofastError):
    """A checkpoint that is missing, corrupt or does not match its config."""


class CertificationError(LofastError):
    """A model or input that cannot be certified as asked (NaN input, unsupported structure...)."""


class _TrainingStop:
    """What a training run stopped early with its state saved carries: ``str()`` says where
    (epoch and step), ``history`` holds the statistics of the epochs finished before the stop,
    ``reason`` (for the checkpoint's record) says why."""

    reason = "stopped"

    def __init__(self, where: str, history: list | None = None) -> None:
        super().__init__(where)
        self.history = history or []


class TimeLimitReached(_TrainingStop, Exception):
    """Training stopped at its --time-limit with its state saved; --resume continues it. Not a
    LofastError: nothing is wrong, and the command exits with its own code."""

    reason = "time limit"


class TrainingInterrupted(_TrainingStop, KeyboardInterrupt):
    """Training stopped by SIGINT (Ctrl-C) or SIGTERM at the step boundary after the signal,
    its state saved there as at a time limit; --resume continues it exactly. A
    KeyboardInterrupt, so that code which lets Ctrl-C through lets this through too.
    ``signum``: the signal received."""

    def __init__(self, where: str, history: list | None = None,
                 signum: int = signal.SIGINT) -> None:
        super().__init__(where, history)
        self.signum = int(signum)
        self.reason = signal.Signals(signum).name
