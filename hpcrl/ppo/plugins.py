"""A user's workload named ``package.module:Class``: its class, imported on demand."""

from __future__ import annotations

import importlib

from hpcrl.core.config_check import ConfigError

__all__ = ["plugin_class"]


def plugin_class(workload: str) -> type:
    """The class of a ``package.module:Class`` workload (ConfigError naming --workload if it is not there)."""
    module, _, attr = workload.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"--workload {workload!r}: {err}; give an importable package.module:Class "
                          "(its module on PYTHONPATH)") from None
