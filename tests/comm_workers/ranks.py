"""The 2-rank run shared by most multi-rank tests: one process start-up (torch import) for all."""

from __future__ import annotations

from hpcrl.comm import init_distributed, shutdown

from . import grad, misc


def main() -> dict:
    ctx = init_distributed(timeout_s=30)
    try:
        return {"grad": grad.run(ctx), "misc": misc.run(ctx)}
    finally:
        shutdown(timeout_s=15)
