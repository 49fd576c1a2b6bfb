"""The launcher's one exception, in a module of its own: every other launch module imports it, and it
imports nothing of them (``request`` and ``roles`` used to import each other for it)."""

from __future__ import annotations


class LaunchError(ValueError):
    """A request that cannot run; the message says what to change."""
