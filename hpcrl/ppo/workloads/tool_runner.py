"""Tools of multi-turn RLHF episodes: ``package.module:function`` callables (one str in, one str out) run
in a pool of worker subprocesses, so that a call is bounded in time and a hung tool is really stopped (its
process group killed, not a thread left spinning), an exception or a bad return is an error result (never
the caller's crash), and episodes on several threads call tools at once.

Run as a script (``python tool_runner.py``) this file is the worker: one JSON request a line on stdin,
one JSON reply a line on stdout. Its top-level imports are stdlib only, so a fresh worker starts in tens
of ms, without torch or hpcrl."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["FLAG", "ToolResult", "ToolRunner", "check_tools", "parse_tools"]

FLAG = "--hf.tools"
"""The flag that names the tools; messages name it so the fix is typed where the mistake was."""
SPEC = re.compile(r"[^\W\d]\w*(?:\.[^\W\d]\w*)*:[^\W\d]\w*(?:\.[^\W\d]\w*)*")
"""``package.module:function`` (the function may be ``Class.method``)."""
NAME = re.compile(r"[\w.-]+")
"""A tool's name as the model writes it in a call."""
WORKER = os.path.abspath(__file__)
_EMPTY_SLOT, _CLOSED = object(), object()  # idle-queue markers: spawn a worker here / the runner is closed


@dataclass(frozen=True)
class ToolResult:
    """What a call gives the episode: the tool's text, or why there is none (``error``, ``timeout``)."""

    text: str
    status: Literal["ok", "error", "timeout"]


def _describe(exc: BaseException) -> str:
    """``ExcType: first line of the message``: one line, fit for a model's context or a ConfigError."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _resolve(spec: str) -> Any:
    if not SPEC.fullmatch(spec):
        raise ValueError(f"{spec!r} is not package.module:function")
    module, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _answer(spec: str, arg: str, max_chars: int, cache: dict[str, Any]) -> dict[str, str]:
    """One call, in the worker. Every failure (import, raise, sys.exit, a non-str return) is a reply, so
    the worker lives on for the next call."""
    try:
        fn = cache.get(spec)
        if fn is None:
            fn = cache[spec] = _resolve(spec)
        out = fn(arg)
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: a tool must not end its worker
        return {"error": _describe(exc)[:max_chars]}
    if not isinstance(out, str):
        return {"error": f"{spec} returned {type(out).__name__}, not str"}
    return {"ok": out[:max_chars]}


def _serve() -> None:
    """The worker loop. The protocol keeps private copies of fds 0 and 1; fd 0 becomes /dev/null and fd 1
    stderr, so a tool that prints (even from C or a subprocess) or reads stdin cannot corrupt it."""
    here = os.path.dirname(os.path.realpath(__file__))
    if sys.path and os.path.realpath(sys.path[0] or os.curdir) == here:
        del sys.path[0]  # this file's siblings (hf.py, engine.py, ...) must not shadow a tool's imports
    requests, replies = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    cache: dict[str, Any] = {}
    for line in requests:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            reply = _answer(request["spec"], request["arg"], int(request.get("max_chars", 1 << 30)), cache)
        except (ValueError, KeyError, TypeError) as exc:
            reply = {"error": f"bad request to the tool worker ({_describe(exc)})"}
        try:
            replies.write(json.dumps(reply).encode() + b"\n")
            replies.flush()
        except BrokenPipeError:
            return


def _wait(fd: int, events: int, deadline: float) -> None:
    """Block until ``fd`` is ready (or hung up), TimeoutError past ``deadline``. poll, not select: a big
    process (torch, NCCL sockets) has fds above select's 1024."""
    remaining = deadline - time.monotonic()
    poller = select.poll()
    poller.register(fd, events)
    if remaining <= 0 or not poller.poll(remaining * 1000):
        raise TimeoutError


class _Worker:
    """One worker subprocess, used by one call at a time. Its own session (process group): a kill stops
    whatever the tool started too. The request is written non-blocking and the reply read through poll
    against the call's deadline, so neither a hung tool nor one that stops reading holds the caller."""

    def __init__(self, env: dict[str, str], cwd: str | None, log: Any) -> None:
        self.proc = subprocess.Popen([sys.executable, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log if log is not None else subprocess.DEVNULL, cwd=cwd, env=env,
                                     start_new_session=True)
        os.set_blocking(self.proc.stdin.fileno(), False)
        self._lock, self._killed = threading.Lock(), False

    def ask(self, payload: bytes, deadline: float) -> dict[str, Any]:
        """Send one request line and read its reply: TimeoutError past ``deadline``, EOFError when the
        worker died, OSError when its pipe broke, ValueError / TypeError on a garbled reply."""
        out, into = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        view = memoryview(payload)
        while view:
            _wait(out, select.POLLOUT, deadline)
            try:
                view = view[os.write(out, view):]
            except BlockingIOError:
                continue
        reply = bytearray()
        while not reply.endswith(b"\n"):
            _wait(into, select.POLLIN, deadline)
            chunk = os.read(into, 1 << 16)
            if not chunk:
                raise EOFError(f"worker {self.proc.pid} exited")
            reply += chunk
        answer = json.loads(reply)
        if not isinstance(answer, dict):
            raise TypeError(f"worker {self.proc.pid} replied {type(answer).__name__}, not an object")
        return answer

    def kill(self) -> None:
        """SIGKILL the worker's process group and reap it (no zombie); idempotent, any thread."""
        with self._lock:
            if self._killed:
                return
            self._killed = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # stuck in the kernel (D state): leave it
                self.proc.wait(timeout=10)

    def close_pipes(self) -> None:
        """Only by the thread holding the worker: closing an fd another thread polls on is unsafe."""
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()


def _kill_all(live: set[_Worker], lock: threading.Lock) -> None:
    """close(), or the runner's finalizer: no worker outlives a runner dropped without close()."""
    with lock:
        workers = list(live)
        live.clear()
    for worker in workers:
        worker.kill()


class ToolRunner:
    """A pool of ``workers`` tool subprocesses shared by the episodes' threads: ``call`` is thread-safe,
    each call bounded by ``timeout_s`` waiting for a free worker and ``timeout_s`` for the tool (so a
    tool's time does not depend on the load); a worker that timed out or died is killed with its process
    group and replaced. A tool module is imported on a worker's first call of it (inside that call's
    time). Tools' stderr and prints go to ``log_path`` (appended) or nowhere."""

    def __init__(self, tools: dict[str, str], timeout_s: float, workers: int = 2, cwd: str | None = None,
                 max_chars: int = 4096, log_path: str | None = None) -> None:
        if workers < 1 or not timeout_s > 0 or max_chars < 1:
            raise ValueError(f"need workers >= 1, timeout_s > 0, max_chars >= 1; got {workers}, {timeout_s}, "
                             f"{max_chars}")
        self.tools, self.timeout_s, self.workers, self.max_chars = dict(tools), float(timeout_s), workers, max_chars
        self._cwd, self._log_path = cwd, log_path
        # The parent's sys.path ('' is its cwd): a tool importable here is importable in a worker.
        path = dict.fromkeys(os.path.abspath(p or os.curdir) for p in sys.path)
        self._env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        self._lock = threading.Lock()
        self._live: set[_Worker] = set()
        self._idle: queue.Queue = queue.Queue()
        self._closed = False
        self._finalizer = weakref.finalize(self, _kill_all, self._live, self._lock)
        try:
            for _ in range(workers):
                self._idle.put(self._spawn())
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        """The live workers' pids (monitoring, tests)."""
        with self._lock:
            return sorted(w.proc.pid for w in self._live)

    def call(self, name: str, arg: str) -> ToolResult:
        """Run tool ``name`` on ``arg``; never raises for the tool's sake: failures are results."""
        spec = self.tools.get(name)
        if spec is None:
            return ToolResult(f"no tool named {name!r} (tools: {', '.join(self.tools) or 'none'})", "error")
        if not isinstance(arg, str):
            return ToolResult(f"tool {name!r} takes a str, not {type(arg).__name__}", "error")
        if self._closed:
            return ToolResult(f"tool {name!r} cannot run: the tool runner is closed", "error")
        try:
            worker = self._take(time.monotonic() + self.timeout_s)
        except (RuntimeError, OSError) as exc:
            return ToolResult(f"tool {name!r} cannot run: {exc}", "error")
        if worker is None:
            return ToolResult(f"tool {name!r} timed out after {self.timeout_s:g} s waiting for a free worker "
                              f"(all {self.workers} busy)", "timeout")
        payload = json.dumps({"spec": spec, "arg": arg, "max_chars": self.max_chars}).encode() + b"\n"
        try:
            reply = worker.ask(payload, time.monotonic() + self.timeout_s)
        except TimeoutError:
            self._replace(worker)
            return ToolResult(f"tool {name!r} timed out after {self.timeout_s:g} s", "timeout")
        except (EOFError, OSError, ValueError, TypeError) as exc:
            self._replace(worker)
            why = "the tool runner was closed" if self._closed else _describe(exc)
            return ToolResult(f"tool {name!r} ended its worker ({why})"[:self.max_chars], "error")
        self._idle.put(worker)
        if "ok" in reply:
            return ToolResult(str(reply["ok"])[:self.max_chars], "ok")
        return ToolResult(str(reply.get("error"))[:self.max_chars], "error")

    def _spawn(self) -> _Worker | None:
        """A new worker, registered for close(); None once closed (under the lock: close misses none)."""
        with self._lock:
            if self._closed:
                return None
            log = open(self._log_path, "ab") if self._log_path else None  # noqa: SIM115 - the child keeps a dup
            try:
                worker = _Worker(self._env, self._cwd, log)
            finally:
                if log is not None:
                    log.close()
            self._live.add(worker)
        return worker

    def _take(self, deadline: float) -> _Worker | None:
        """An idle worker (started here for an empty slot, or for one that died idle); None when none
        frees up by ``deadline``; RuntimeError once closed."""
        try:
            slot = self._idle.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if slot is _CLOSED:
            self._idle.put(_CLOSED)  # wakes the next waiter too
            raise RuntimeError("the tool runner is closed")
        if slot is not _EMPTY_SLOT and slot.proc.poll() is None:
            return slot
        if slot is not _EMPTY_SLOT:
            self._retire(slot)
        try:
            worker = self._spawn()
        except OSError:
            self._idle.put(_EMPTY_SLOT)  # the pool keeps its size: a later call tries again
            raise
        if worker is None:
            raise RuntimeError("the tool runner is closed")
        return worker

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        worker.close_pipes()
        with self._lock:
            self._live.discard(worker)

    def _replace(self, worker: _Worker) -> None:
        """Kill a worker that timed out or broke and start its successor now, so it warms up while idle."""
        self._retire(worker)
        try:
            fresh: Any = self._spawn()
        except OSError:
            fresh = _EMPTY_SLOT
        if fresh is not None:
            self._idle.put(fresh)

    def close(self) -> None:
        """Kill and reap every worker (busy ones too: their calls return errors); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer()
        while True:
            try:
                slot = self._idle.get_nowait()
            except queue.Empty:
                break
            if isinstance(slot, _Worker):
                slot.close_pipes()
        self._idle.put(_CLOSED)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _config_error(message: str) -> Exception:
    # Imported here, not at the top: the worker (this file run as a script) imports nothing of hpcrl.
    from hpcrl.core.config_check import ConfigError

    return ConfigError(message)


def _one_line(text: str) -> str:
    return text if text.isprintable() else repr(text)


def parse_tools(spec: str) -> dict[str, str]:
    """The flag's value ``name=pkg.mod:fn,pkg.mod:other`` (a name defaults to the function's) as
    ``{name: spec}``; ConfigError (one line) on an empty or malformed entry or a name given twice."""
    tools: dict[str, str] = {}
    if not spec.strip():
        return tools
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            raise _config_error(f"{FLAG} {_one_line(spec)}: an empty entry (a stray comma?); pass "
                                "name=package.module:function entries separated by single commas")
        name, target = (part.strip() for part in entry.split("=", 1)) if "=" in entry else ("", entry)
        if not SPEC.fullmatch(target):
            raise _config_error(f"{FLAG} {_one_line(entry)}: {target!r} is not package.module:function; "
                                f"e.g. {FLAG} add=mytools.math:add")
        if "=" in entry and not NAME.fullmatch(name):
            raise _config_error(f"{FLAG} {_one_line(entry)}: the name {name!r} is not letters, digits, _ . -; "
                                f"e.g. {FLAG} add={target}")
        name = name or target.rpartition(":")[2].rpartition(".")[2]
        if name in tools:
            raise _config_error(f"{FLAG} {_one_line(entry)}: the name {name!r} is given twice; rename one, "
                                f"e.g. {name}2={target}")
        tools[name] = target
    return tools


def check_tools(tools: dict[str, str]) -> None:
    """Import every tool in this process before any episode: a typo fails the run at startup with one
    line naming the fix, not as error results in the middle of training."""
    for name, spec in tools.items():
        where = f"{FLAG} {_one_line(name)}={_one_line(spec)}"
        if not SPEC.fullmatch(spec):
            raise _config_error(f"{where}: not package.module:function; e.g. {FLAG} {name}=mytools.text:{name}")
        module, _, attr = spec.partition(":")
        try:
            obj: Any = importlib.import_module(module)
        except (Exception, SystemExit) as exc:
            raise _config_error(f"{where}: cannot import module {module!r} ({_describe(exc)}); pass "
                                "package.module:function of an importable module") from exc
        for part in attr.split("."):
            try:
                obj = getattr(obj, part)
            except Exception as exc:
                raise _config_error(f"{where}: module {module!r} has no attribute {attr!r}; pass a function "
                                    f"defined in {module}") from exc
        if not callable(obj):
            raise _config_error(f"{where}: {attr!r} is a {type(obj).__name__}, not callable; pass a function "
                                "taking one str and returning a str")


if __name__ == "__main__":
    _serve()
