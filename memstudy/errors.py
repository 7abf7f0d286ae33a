"""Errors that memstudy raises on purpose.

Every message names the setting to change: a memory study that silently measured a
different configuration is worse than one that refused to start.
"""


class MemstudyError(Exception):
    """Base class for errors memstudy reports to the user without a traceback."""


class ConfigError(MemstudyError, ValueError):
    """A configuration value, or a combination of values, that cannot run."""


class Diverged(MemstudyError):
    """The training loss became NaN or infinite."""

    def __init__(self, phase: str, step: int, value: float, hint: str | None = None):
        super().__init__(f"loss is {value} at step {step} ({phase}); " + (
            hint or "lower train.lr or drop the reduced-precision technique"))
        self.phase, self.step, self.value = phase, step, value


class PhaseFailure(MemstudyError):
    """Wraps an exception raised inside a measured phase, remembering the phase."""

    def __init__(self, phase: str, step: int, cause: BaseException):
        super().__init__(f"{type(cause).__name__} in {phase} at step {step}: {cause}")
        self.phase, self.step, self.cause = phase, step, cause
