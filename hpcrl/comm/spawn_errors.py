"""How a spawned rank's failure comes back to the parent: one-line configuration and data errors
(their own exit codes at the entry points), anything else with the rank's traceback."""

from __future__ import annotations

from hpcrl.core.config_check import ConfigError, DataError, RunDirError

from .context import DistSetupError

__all__ = ["CONFIG_ERRORS", "DATA_ERRORS", "SpawnConfigError", "SpawnDataError", "SpawnError", "SpawnPeerLost",
           "is_config_error", "is_data_error"]

CONFIG_ERRORS: tuple[type[BaseException], ...] = (ConfigError, DistSetupError, RunDirError)
"""Exceptions that mean "this configuration cannot run" (and their subclasses): exit 2, one line."""
DATA_ERRORS: tuple[type[BaseException], ...] = (DataError,)
"""Exceptions that mean "the run's data is unusable" (e.g. the env returned NaN/inf): one line, exit 65."""


def is_config_error(err: BaseException) -> bool:
    """True when ``err`` is a configuration error (see :data:`CONFIG_ERRORS`): exit 2, one line."""
    return isinstance(err, CONFIG_ERRORS)


def is_data_error(err: BaseException) -> bool:
    return isinstance(err, DATA_ERRORS)


class SpawnError(RuntimeError):
    """A spawned rank failed (``rank``, ``exitcode``) or the run timed out (``rank`` is None)."""

    def __init__(self, message: str, rank: int | None, exitcode: int | None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


class SpawnDataError(SpawnError):
    """A rank stopped on unusable data (see :data:`DATA_ERRORS`); ``str(err)`` is its one-line message."""


class SpawnPeerLost(SpawnError):
    """A rank's heartbeat watch found a peer frozen (or the store gone) and ended it; ``rank`` is the peer
    that stopped responding (None: the store), ``str(err)`` the watch's one line."""


class SpawnConfigError(SpawnError):
    """A rank raised a configuration error; ``str(err)`` is its one-line message, ``type_name`` its class."""

    def __init__(self, message: str, rank: int | None, exitcode: int | None, type_name: str = ""):
        super().__init__(message, rank, exitcode)
        self.type_name = type_name
