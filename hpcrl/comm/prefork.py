"""The ranks' server as a fork of their launcher, so a local run imports torch (and a model library) once
instead of twice: 1.5-3.7 s of every ``--nproc`` / detached run on a 2-core VM (benchmarks/sac/startup.py).

A launcher calls :func:`prefork` once it has imported what it needs and done nothing else: no run state
yet that a rank could inherit (a reward function's probe, a socket, an open file), so the server holds
what a fresh interpreter would after the same imports. It is safe to fork only a process that runs one
thread (a fork copies the caller alone: another thread's lock, or an OpenMP pool, would be broken in
every rank) and has not loaded a GPU driver (a forked child cannot initialise it again): elsewhere
nothing happens, and the first :func:`hpcrl.comm.spawn` starts a fresh interpreter as before.

The server waits until that spawn says what to preload (:func:`release`): the run's modules, and what the
launcher imported meanwhile from the libraries ranks use. It then runs multiprocessing's own forkserver
loop. A launcher that never spawns leaves it waiting on a pipe that closes when the launcher exits.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import threading
import traceback
from multiprocessing import connection, resource_tracker
from typing import Any, Sequence

__all__ = ["fork_safe", "prefork", "release"]

_GPU_DRIVERS = ("/libcuda.so", "/libamdhip64.so")  # loaded on a process's first CUDA (HIP) runtime call
_LIBRARIES = ("hpcrl", "torch", "numpy", "sympy", "transformers", "tokenizers", "safetensors", "huggingface_hub", "peft")
"""Packages whose modules the launcher imported after the fork are preloaded too: the ones ranks import
(a fresh server imports them through the run's modules as well); no user module is imported twice."""
_STOP = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)  # blocked in the server (hpcrl.comm.forkserver_preload)

_PENDING: dict[str, Any] = {}  # "go": the pipe the server waits on; "modules": sys.modules at the fork


def fork_safe() -> bool:
    """This process may be the parent of a fork that goes on running Python and torch: it has one thread
    (once OpenBLAS's pool is stopped, see :func:`_stop_blas_pools`) and has not loaded a GPU driver
    (Linux only: read from /proc)."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
        _stop_blas_pools(maps)
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        return False
    return threads == 1 and not any(lib in maps for lib in _GPU_DRIVERS)


def _stop_blas_pools(maps: str) -> None:
    """OpenBLAS (numpy's BLAS) starts a thread pool when it loads, unless OMP_NUM_THREADS or
    OPENBLAS_NUM_THREADS is 1, and stops it itself before any fork (its at-fork handler), starting it again
    on its next call. Stopped here first, the same way, so that those threads do not count."""
    paths = {line.split()[-1] for line in maps.splitlines() if "openblas" in line and ".so" in line}
    for path in paths:
        try:
            ctypes.CDLL(path).blas_thread_shutdown_()
        except (OSError, AttributeError):  # not a library that can be loaded by its path, or no such pool
            pass


def prefork() -> bool:
    """Fork this process now as the server its local ranks will be forked from (see the module doc).
    False: nothing done (no forkserver here, a server runs already, or this process is not :func:`fork_safe`)."""
    from .rank_start import socket_dir_fits

    server = multiprocessing.forkserver._forkserver
    if _PENDING or _running(server) or "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    if not socket_dir_fits() or not fork_safe():
        return False
    with server._lock:
        resource_tracker.ensure_running()  # a fresh interpreter of its own, as for a fresh server
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()  # every client holds the write end: EOF when all are gone
            go_r, go_w = os.pipe()
            for stream in (sys.stdout, sys.stderr):  # else the fork would write their buffers again
                if stream is not None:
                    stream.flush()
            pid = os.fork()
            if pid == 0:
                server._lock = threading.Lock()  # held by the launcher's thread, copied held
                _serve(listener.fileno(), alive_r, go_r)  # never returns
            os.close(alive_r)
            os.close(go_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    _PENDING.update(go=go_w, modules=set(sys.modules))
    return True


def release(preload: Sequence[str]) -> bool:
    """Send the server :func:`prefork` started what to preload, once; False when there is none waiting."""
    if not _PENDING:
        return False
    go, before = _PENDING.pop("go"), _PENDING.pop("modules")
    since = [m for m in sys.modules if m not in before and m.split(".", 1)[0] in _LIBRARIES]
    with os.fdopen(go, "w") as pipe:
        json.dump([*preload, *since], pipe)
    return True


def _running(server: Any) -> bool:
    if server._forkserver_pid is None:
        return False
    pid, _ = os.waitpid(server._forkserver_pid, os.WNOHANG)
    return not pid  # a dead one is replaced by ensure_running, which sees the same


def _serve(listener_fd: int, alive_r: int, go_r: int) -> None:
    """The forked server: what a fresh one would have (the listener, the pipe, stdio; the signal
    dispositions an exec leaves; the stop signals blocked), the modules :func:`release` names, then
    multiprocessing's server loop. It leaves without running the launcher's exit handlers."""
    code = 1
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP)  # a job-wide SIGTERM must not end it: ranks die with it
        _close_fds_except({0, 1, 2, listener_fd, alive_r, go_r})
        for sig in signal.valid_signals():
            if callable(signal.getsignal(sig)):  # a Python handler of the launcher's; SIG_IGN survives exec
                signal.signal(sig, signal.SIG_DFL)
        if signal.getsignal(signal.SIGINT) == signal.SIG_DFL:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # what a fresh interpreter installs
        gc.freeze()  # the launcher's objects stay as they are: none is collected (or closes anything) here
        with os.fdopen(go_r) as pipe:
            sent = pipe.read()
        if not sent:  # the launcher left without spawning
            code = 0
            return
        for name in json.loads(sent):
            try:
                importlib.import_module(name)
            except Exception:  # a rank imports it itself, and meets the error where it can be reported
                pass
        multiprocessing.forkserver.main(listener_fd, alive_r, [])
    except SystemExit:  # the launcher and every rank are gone
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _close_fds_except(keep: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:  # the listing's own descriptor, closed already
                pass
