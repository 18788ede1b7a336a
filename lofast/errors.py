"""User-facing errors: each carries one line that the command line prints as it is."""


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


class TimeLimitReached(Exception):
    """Training stopped at its --time-limit with its state saved; --resume continues it. Not a
    LofastError: nothing is wrong, and the command exits with its own code. ``history``: the
    statistics of the epochs finished before the stop."""

    def __init__(self, where: str, history: list | None = None) -> None:
        super().__init__(where)
        self.history = history or []
