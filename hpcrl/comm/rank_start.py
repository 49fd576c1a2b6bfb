"""How :func:`hpcrl.comm.spawn` starts local ranks: as forks of multiprocessing's forkserver, started once
per launching process with torch (and the run's own modules) already imported, where the platform has
one; else as fresh interpreters ("spawn"). The forkserver's socket lives in a scratch dir of this
process (:mod:`hpcrl.comm.scratch`), so a SIGKILLed launcher's is swept like the others. What a rank
takes over from its launcher at start (environment, streams, mask) is :mod:`hpcrl.comm.spawn_child`'s."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import shutil
import signal
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp

from .prefork import release
from .scratch import PREFIX, host_tag, make_scratch_dir, start_tag

__all__ = ["current_mask", "is_open", "remove_socket_dir", "socket_dir_fits", "start_method"]

_PRELOAD = ["hpcrl.comm.forkserver_preload"]


def start_method(preload: Sequence[str]) -> tuple[Any, int | None]:
    """How ranks start, and the pid that will be their parent: forks of multiprocessing's forkserver with
    torch loaded (``hpcrl.comm.forkserver_preload``; one server per launching process: the one
    :func:`~hpcrl.comm.prefork.prefork` started, else a fresh interpreter started on first use), where the
    platform has one, else fresh interpreters ("spawn", parented by this process)."""
    if "forkserver" not in mp.get_all_start_methods() or not socket_dir_fits():
        return mp.get_context("spawn"), None
    ctx = mp.get_context("forkserver")
    modules = [*_PRELOAD, *preload]
    if not release(modules):
        ctx.set_forkserver_preload(modules)  # read when the server starts; one running keeps its own
        multiprocessing.forkserver.ensure_running()
    return ctx, multiprocessing.forkserver._forkserver._forkserver_pid


_SUN_PATH_MAX = 107  # bytes of a unix socket's path; the forkserver's is <temp dir>/listener-XXXXXXXX


def socket_dir_fits() -> bool:
    """Give multiprocessing's temp dir of this process (where the forkserver listens) the form of a
    :func:`make_scratch_dir`, so a SIGKILLed launcher's is swept like its other scratch dirs, under /tmp
    when $TMPDIR is too long for a socket path (as Python 3.13 does); False: no short one to be had."""
    import tempfile
    from multiprocessing import process, util

    config = process.current_process()._config
    if config.get("tempdir") is None:
        name = f"{PREFIX}{host_tag()}-{os.getpid()}-{start_tag(os.getpid())}-12345678/listener-12345678"
        fits = [r for r in (tempfile.gettempdir(), "/tmp") if len(os.path.join(r, name)) <= _SUN_PATH_MAX]
        if not fits or not os.access(fits[0], os.W_OK):
            return False
        path = make_scratch_dir(fits[0])
        _REMOVE[:] = [util.Finalize(None, _remove_temp_dir, args=(shutil.rmtree, path), exitpriority=-100)]
        config["tempdir"] = path
    return len(os.path.join(config["tempdir"], "listener-12345678")) <= _SUN_PATH_MAX


_REMOVE: list[Callable[[], Any]] = []  # the finalizer that removes the socket dir made above, once


def remove_socket_dir() -> None:
    """Remove the forkserver's socket dir now. Interpreter exit does it (a multiprocessing finalizer);
    call this before leaving through ``os._exit``, which skips that. Ranks can no longer be started
    from this process afterwards."""
    if _REMOVE:
        _REMOVE.pop()()


def _remove_temp_dir(rmtree: Callable[..., None], path: str) -> None:  # rmtree held: called late at exit
    rmtree(path, ignore_errors=True)
    from multiprocessing import process

    process.current_process()._config["tempdir"] = None


def current_mask() -> set[int] | None:
    return signal.pthread_sigmask(signal.SIG_BLOCK, ()) if hasattr(signal, "pthread_sigmask") else None


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
