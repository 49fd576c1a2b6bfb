"""hpcrl.comm.spawn as a supervisor, with real processes: stop signals forwarded from the parent,
no orphans, scratch directories swept, late signals harmless, failures named by the rank that
failed first, configuration errors as one line (exit 2), expendable ranks (PPO makers)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpcrl.run import checkpoint
from hpcrl.comm import SpawnError, init_distributed, shutdown, spawn
from hpcrl.comm import scratch
from hpcrl.comm.local import SpawnConfigError

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # this module must be importable in the spawned ranks

from rank_procs import ranks_of  # noqa: E402

pytestmark = pytest.mark.timeout(90)

LOG_EVERY = 5  # vector steps per metrics row
TINY = ["--preset", "pendulum", "--num-envs", "4", "--batch-size", "32", "--actor-hidden", "32",
        "--critic-hidden", "32", "--num-atoms", "21", "--learning-starts", "4", "--random-steps", "4",
        "--num-updates", "2", "--log-every", str(LOG_EVERY), "--eval-episodes", "0"]


# -- helpers ----------------------------------------------------------------------------------------
def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    scratch = tmp / "scratch"
    scratch.mkdir(exist_ok=True)
    env.update(TMPDIR=str(scratch), PYTHONPATH=os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", **extra)
    return env


def _cli(module: str, args: list[str], tmp: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *args], env=_env(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(cond, proc: subprocess.Popen | None, timeout: float = 60, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"exited {proc.returncode} before {what}:\n{out[-2000:]}\n{err[-3000:]}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _scratch_dirs(tmp: Path) -> list[str]:
    return [p.name for p in (tmp / "scratch").glob("hpcrl-spawn-*")]


# -- rank functions (module level: the ranks import them by name) ------------------------------------
def _stop_aware(pid_dir: str) -> str:
    """Like a trainer: a SIGTERM handler that asks to stop; returns how it ended."""
    asked: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, f: asked.append(s))
    Path(pid_dir, f"rank-{os.environ['RANK']}").write_text(str(os.getpid()))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if asked:
            return "stopped"
        time.sleep(0.01)
    return "finished"


def _stop_reason(pid_dir: str) -> str:
    """Like a trainer: a StopRequest; returns the reason it was given."""
    from hpcrl.comm import StopRequest

    stop = StopRequest.install()
    Path(pid_dir, f"rank-{os.environ['RANK']}").write_text(str(os.getpid()))
    deadline = time.monotonic() + 30
    while not stop.reason and time.monotonic() < deadline:
        time.sleep(0.01)
    return stop.reason


def test_a_forwarded_ctrl_c_is_reported_as_ctrl_c_and_a_sigterm_as_sigterm(tmp_path):
    for sig, reason in ((signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")):
        pids = tmp_path / sig.name
        pids.mkdir()
        timer = threading.Thread(target=lambda: (_wait_pids(pids, 2), os.kill(os.getpid(), sig)))
        timer.start()
        assert spawn(_stop_reason, 2, args=(str(pids),), timeout_s=60) == [reason, reason]
        timer.join()


def _collective_loop(pid_dir: str) -> None:
    ctx = init_distributed(timeout_s=30)
    Path(pid_dir, f"rank-{ctx.rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        dist.all_reduce(torch.ones(1), group=ctx.host_plane.group)
        time.sleep(0.01)
    shutdown()


def _returns_rank() -> int:
    return int(os.environ["RANK"])


def _wait_pids(pid_dir: Path, n: int, timeout: float = 60) -> list[int]:
    _wait_for(lambda: len(list(pid_dir.glob("rank-*"))) == n, None, timeout, f"{n} ranks")
    time.sleep(0.1)
    return [int((pid_dir / f"rank-{r}").read_text()) for r in range(n)]


# -- stop signals -----------------------------------------------------------------------------------
@pytest.mark.parametrize("to", ["parent", "group"])
def test_sigterm_to_the_parent_checkpoints_and_exits_75(tmp_path, to):
    """``parent``: the pid a user, systemd or docker sees; ``group``: every process of the job, as a
    scheduler stops one (the forkserver too, whose death would take the ranks before they checkpoint)."""
    run = tmp_path / "run"
    proc = _cli("hpcrl.sac", [*TINY, "--nproc", "2", "--total-env-steps", "100000", "--checkpoint-every", "0",
                              "--run-dir", str(run)], tmp_path)
    try:
        _wait_for(lambda: len(_rows(run)) >= 2, proc, what="two metrics rows")
        (os.kill if to == "parent" else os.killpg)(proc.pid, signal.SIGTERM)  # its own session: pgid = pid
        out, err = _finish(proc)
    finally:
        _finish(proc, 1)
    assert proc.returncode == 75, err[-3000:]
    assert "stop requested (SIGTERM)" in out
    # the stop is agreed at every env step: the checkpoint lands within the window after the last row
    last_row = _rows(run)[-1]["env_steps"] // 4  # vector steps (4 envs)
    step = int(checkpoint.latest(run).name.removeprefix("step_"))
    assert last_row <= step < last_row + LOG_EVERY, (last_row, step)
    assert _scratch_dirs(tmp_path) == []


def _launch_view() -> dict:
    """What a rank has from its launcher."""
    import numpy as np

    from hpcrl.run.rundir import LAUNCHED_PID_ENV

    print(f"rank {os.environ['RANK']} on stdout", flush=True)
    print(f"rank {os.environ['RANK']} on stderr", file=sys.stderr, flush=True)
    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    return {"probe": os.environ.get("HPCRL_TEST_PROBE"), "threads": torch.get_num_threads(),
            "draw": float(np.random.rand()), "mask": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, ())),
            "launcher": int(os.environ[LAUNCHED_PID_ENV]), "forked": b"forkserver" in parent}


MARK = "as imported"  # a launcher below sets it: its ranks see the launcher's value only if forked from it


def _holds(path: str) -> bool:
    for fd in Path("/proc/self/fd").iterdir():
        try:
            if os.readlink(fd) == path:
                return True
        except OSError:  # the listing's own descriptor
            pass
    return False


def _server_view(path: str) -> dict:
    server = os.getppid()
    server_parent = int(Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return {"mark": MARK, "server_parent": server_parent, "holds": _holds(path),
            "polynomial": "numpy.polynomial" in sys.modules,
            "sigusr1": str(signal.getsignal(signal.SIGUSR1)), "torch_threads": torch.get_num_threads()}


_FORK_PROBE = """
import json, os, signal, sys, threading
import test_spawn
from hpcrl.comm import spawn
from hpcrl.comm.prefork import prefork
fd = os.open(sys.argv[2], os.O_RDONLY)  # the launcher's own: no rank may hold it
test_spawn.MARK = "imported and set"
if sys.argv[1] == "thread":
    threading.Thread(target=threading.Event().wait, daemon=True).start()
forked = prefork()
test_spawn.MARK = "run state"  # what the launcher does after the fork stays its own
import numpy.polynomial  # a library's module it imported meanwhile (and torch does not): preloaded
signal.signal(signal.SIGUSR1, lambda *a: None)  # the launcher's handler: a rank starts without it
views = spawn(test_spawn._server_view, 2, args=(sys.argv[2],), timeout_s=60, num_threads=2)
print(json.dumps({"forked": forked, "launcher": os.getpid(), "views": views}))
"""


@pytest.mark.parametrize("threads", ["one", "thread"])
def test_a_launcher_forked_before_its_own_work_is_its_ranks_server(tmp_path, threads):
    """The ranks' server is a fork of a launcher that runs one thread, taken where it called prefork: its
    imports are there, what it did afterwards is not, nor its descriptors or signal handlers. A launcher
    with a second thread (which may hold a lock a fork would copy held) starts a fresh interpreter."""
    held = tmp_path / "held-by-the-launcher"
    held.write_text("")
    out = subprocess.run([sys.executable, "-c", _FORK_PROBE, threads, str(held)], env=_env(tmp_path),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    probe = json.loads(out.stdout.splitlines()[-1])
    forked = threads == "one"
    assert probe["forked"] is forked
    for view in probe["views"]:
        assert view["mark"] == ("imported and set" if forked else "as imported")
        assert view["polynomial"] is forked  # the fresh server preloads only what the run names
        assert view["server_parent"] == probe["launcher"]  # either server is the launcher's child
        assert not view["holds"]
        assert view["sigusr1"] == str(signal.SIG_DFL)  # what a fresh interpreter has
        assert view["torch_threads"] == 2


def test_a_server_forked_for_ranks_never_spawned_leaves_with_its_launcher(tmp_path):
    code = ("import os, sys; from hpcrl.comm.prefork import prefork; assert prefork(); "
            "import multiprocessing.forkserver as f; print(f._forkserver._forkserver_pid, flush=True); "
            "raise SystemExit(3)")
    out = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 3, out.stderr[-3000:]
    server = int(out.stdout.split()[0])
    _wait_for(lambda: not _alive(server), None, 10, "the unused server to exit")


def test_ranks_are_forks_that_get_what_the_launcher_has_at_launch(capfd, monkeypatch):
    """The forkserver started long before (an earlier spawn here) must not leak its own state into a
    rank: the environment, stdout/stderr and signal mask are the launcher's at this launch, the thread
    count is what was asked (or what OMP_NUM_THREADS says), and numpy draws differ between ranks."""
    with capfd.disabled():  # the server exists now, with this process's state of now (streams uncaptured)
        spawn(_returns_rank, 1, timeout_s=60)
    monkeypatch.setenv("HPCRL_TEST_PROBE", "after the server started")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    capfd.readouterr()
    views = spawn(_launch_view, 2, timeout_s=60, num_threads=None)
    out, err = capfd.readouterr()
    assert all(v["forked"] and v["launcher"] == os.getpid() for v in views)
    assert [v["probe"] for v in views] == ["after the server started"] * 2
    assert [v["threads"] for v in views] == [2, 2]
    assert views[0]["draw"] != views[1]["draw"]
    assert views[0]["mask"] == views[1]["mask"] == sorted(signal.pthread_sigmask(signal.SIG_BLOCK, ()))
    assert "rank 0 on stdout" in out and "rank 1 on stdout" in out, out
    assert "rank 0 on stderr" in err and "rank 1 on stderr" in err, err
    assert [v["threads"] for v in spawn(_launch_view, 1, timeout_s=60, num_threads=1)] == [1]


def _loaded(module: str) -> bool:
    return module in sys.modules


@pytest.mark.parametrize("preload", [["tabnanny"], []])  # a module neither torch nor hpcrl imports
def test_preloaded_modules_are_imported_by_the_server_not_by_each_rank(tmp_path, preload):
    code = ("from hpcrl.comm import spawn; from test_spawn import _loaded; "
            f"print(spawn(_loaded, 2, args=('tabnanny',), timeout_s=60, preload={preload!r}))")
    out = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str([bool(preload)] * 2)


def test_ranks_start_with_what_an_optimizer_imports_loaded_once_by_the_server():
    """torch.optim.Optimizer's constructor imports torch._dynamo (~1 s): the ranks' server has it, not each rank."""
    assert spawn(_loaded, 2, args=("torch._dynamo",), timeout_s=60) == [True, True]


def test_sigint_becomes_a_stop_and_a_second_one_kills(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    timer = threading.Thread(target=lambda: (_wait_pids(pids, 2), os.kill(os.getpid(), signal.SIGINT)))
    timer.start()
    assert spawn(_stop_aware, 2, args=(str(pids),), timeout_s=60) == ["stopped", "stopped"]  # SIGINT -> SIGTERM
    timer.join()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored

    for p in pids.iterdir():
        p.unlink()

    def twice() -> None:
        ranks = _wait_pids(pids, 2)
        for r in ranks:  # the terminal's Ctrl-C reaches the whole group: the ranks ignore it
            os.kill(r, signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Thread(target=twice)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        timer.start()
        spawn(_never_stops, 2, args=(str(pids),), timeout_s=60)
    timer.join()
    assert time.monotonic() - t0 < 30
    assert not any(_alive(int(p.read_text())) for p in pids.iterdir())


def _never_stops(pid_dir: str) -> None:
    signal.signal(signal.SIGTERM, lambda s, f: None)  # asked to stop, but keeps going
    Path(pid_dir, f"rank-{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(40)


def test_stop_signals_after_the_last_step_leave_a_finished_run_at_0(tmp_path):
    run = tmp_path / "run"
    proc = _cli("hpcrl.sac", [*TINY, "--nproc", "2", "--total-env-steps", "80", "--checkpoint-every", "0",
                              "--run-dir", str(run)], tmp_path)
    try:
        _wait_for(lambda: any(r["env_steps"] == 80 for r in _rows(run)), proc, what="the last row")
        while proc.poll() is None:  # a storm of stop signals through shutdown and exit, to every process
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                break
            time.sleep(0.01)
        out, err = _finish(proc)
    finally:
        _finish(proc, 1)
    assert proc.returncode == 0, err[-3000:]
    assert "stop requested" not in out
    assert _scratch_dirs(tmp_path) == []


# -- orphans, scratch -------------------------------------------------------------------------------
def test_sigkilled_parent_takes_its_ranks_and_its_scratch_dirs_are_swept(tmp_path, monkeypatch):
    proc = _cli("hpcrl.sac", [*TINY, "--nproc", "2", "--total-env-steps", "100000", "--checkpoint-every", "0",
                              "--run-dir", str(tmp_path / "run")], tmp_path)
    roots = [tmp_path / "scratch", Path("/tmp")]  # the forkserver's socket dir is under /tmp: $TMPDIR is long

    def left_by_parent() -> list[Path]:
        return [d for root in roots for d in root.glob(f"{scratch.PREFIX}{scratch.host_tag()}-{proc.pid}-*")]

    try:
        _wait_for(lambda: len(ranks_of(proc.pid)) == 2, proc, what="two ranks")
        ranks = ranks_of(proc.pid)
        assert len(_scratch_dirs(tmp_path)) == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        _wait_for(lambda: not any(_alive(p) for p in ranks), None, 10, "the orphaned ranks to die")
    finally:
        _finish(proc, 30)  # the pipes close when the forkserver, too, has seen its parent die (later under load)
    # a SIGKILLed parent cannot clean up: the run's scratch dir and its forkserver's socket dir stay ...
    assert len(_scratch_dirs(tmp_path)) == 1 and len(left_by_parent()) == 2
    live = tmp_path / "scratch" / f"{scratch.PREFIX}{scratch.host_tag()}-{os.getpid()}-{scratch.start_tag(os.getpid())}-x"
    live.mkdir()  # ... but a live owner's directory is kept
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    assert spawn(_returns_rank, 1, timeout_s=60) == [0]  # ... the next spawn sweeps the dead one
    assert _scratch_dirs(tmp_path) == [live.name]
    scratch.sweep_scratch("/tmp")  # what the next spawn whose temp dir is /tmp does
    assert left_by_parent() == []


def _sleeps(pid_dir: str) -> None:
    Path(pid_dir, f"rank-{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(600)  # no store, no heartbeat: nothing but the death signal can end it


def test_ranks_that_never_look_at_their_peers_die_with_a_sigkilled_launcher(tmp_path):
    """The death signal alone, not a lost store or peer, ends ranks that are past their start (the
    forkserver they are forked from must exit with the launcher although CPython hands every child the
    launcher's end of the pipe that tells the server its launcher is gone)."""
    pids = tmp_path / "pids"
    pids.mkdir()
    code = f"from hpcrl.comm import spawn; from test_spawn import _sleeps; spawn(_sleeps, 2, args=({str(pids)!r},))"
    proc = subprocess.Popen([sys.executable, "-c", code], env=_env(tmp_path), start_new_session=True)
    ranks = []
    try:
        ranks = _wait_pids(pids, 2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        _wait_for(lambda: not any(_alive(p) for p in ranks), None, 5, "the orphaned ranks to die")
    finally:
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# -- failures ---------------------------------------------------------------------------------------
def test_the_rank_that_failed_first_is_named(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    killer = threading.Thread(target=lambda: os.kill(_wait_pids(pids, 3)[0], signal.SIGKILL))
    killer.start()
    with pytest.raises(SpawnError) as err:
        spawn(_collective_loop, 3, args=(str(pids),), timeout_s=80)
    killer.join()
    message = str(err.value)
    assert message.startswith("rank 0 failed first (killed by SIGKILL)"), message
    # no record of its own (a signal): nothing to append, not an empty ":" nor a pointer to an empty log
    assert not message.rstrip().endswith(":") and "no traceback recorded" not in message, message
    assert err.value.rank == 0 and err.value.exitcode == -signal.SIGKILL
    assert not isinstance(err.value, SpawnConfigError)


def _dies_natively(log_dir: str, how: str) -> None:
    """Rank 1 diverts its native stderr to its log, then dies without a Python error: a C++-style abort
    after its message, or silently by SIGKILL; the others wait to be stopped."""
    from hpcrl.comm.native_log import divert_native_stderr

    if os.environ["RANK"] != "1":
        time.sleep(60)
        return
    divert_native_stderr(log_dir, 1)
    if how == "abort":
        os.write(2, b"terminate called after throwing an instance of 'gloo::IoException'\n"
                    b"  what():  [gloo/transport/tcp/pair.cc:598] Connection closed by peer\n"
                    b"frame #0: c10::Error::Error + 0x42\n")
        os.abort()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("how", ["abort", "sigkill"])
def test_a_rank_dying_without_a_python_error_is_named_with_its_native_last_line(tmp_path, how):
    """Its failure line quotes the last line its native side wrote to its log in this run (C++ frames
    skipped), or ends with its exit when it wrote none (an earlier job's lines in the log are not quoted)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank1.log").write_text("an earlier job's last line\n")
    with pytest.raises(SpawnError) as err:
        spawn(_dies_natively, 2, args=(str(logs), how), timeout_s=60)
    message = str(err.value)
    assert err.value.rank == 1 and "earlier job" not in message, message
    if how == "abort":
        assert message.startswith(f"rank 1 failed first (killed by SIGABRT; its log {logs / 'rank1.log'} ends: "
                                  "what():  [gloo/transport/tcp/pair.cc:598] Connection closed by peer)"), message
    else:
        assert message.startswith("rank 1 failed first (killed by SIGKILL)") and "its log" not in message, message


@pytest.mark.parametrize("case", ["unknown gym id", "run dir is a file"])
def test_config_errors_in_the_ranks_exit_2_with_one_line(tmp_path, case):
    (tmp_path / "file").write_text("not a directory")
    args = ["--env", "gym:NoSuchEnv-v0", "--run-dir", str(tmp_path / "run")] if case == "unknown gym id" else \
        ["--run-dir", str(tmp_path / "file")]
    proc = _cli("hpcrl.sac", [*TINY, "--nproc", "2", "--total-env-steps", "80", *args], tmp_path)
    _, err = _finish(proc, 60)
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("hpcrl.sac: error: "), err
    assert ("NoSuchEnv" if case == "unknown gym id" else "file") in lines[0]
    assert _scratch_dirs(tmp_path) == []


def test_a_dead_maker_is_dropped_under_local_spawn(tmp_path):
    run = tmp_path / "run"
    proc = _cli("hpcrl.ppo", ["--workload", "ppo_toy:ToyWorkload", "--makers", "2", "--trainers", "1",
                              "--total-steps", "40", "--rollout-s", "0.05",
                              "--heartbeat-timeout-s", "3", "--run-dir", str(run)], tmp_path)
    try:
        _wait_for(lambda: len(_rows(run)) >= 3, proc, what="three metrics rows")
        ranks = ranks_of(proc.pid)
        assert len(ranks) == 3
        os.kill(ranks[2], signal.SIGKILL)  # rank 2: maker 1
        out, err = _finish(proc, 80)
    finally:
        _finish(proc, 1)
    assert proc.returncode == 0, err[-3000:]
    final = _rows(run)[-1]
    assert final["policy_version"] == 40 and final["makers_lost"] == 1
    assert "rank 2 failed (killed by SIGKILL); it is expendable" in err


@pytest.mark.parametrize("stop", [False, True], ids=["finished", "sigterm"])
def test_detached_ppo_leaves_neither_its_scratch_nor_its_socket_dir(tmp_path, stop):
    """``python -m hpcrl.ppo`` leaves through ``os._exit`` (past multiprocessing's exit hook that removes the
    forkserver's socket dir): both dirs go anyway, after a finished run (0) and a stopped one (75). Its
    checkpoint files are 0600 in 0700 dirs."""
    short = Path(tempfile.mkdtemp(prefix="hs", dir="/tmp"))  # short enough for the socket: it lands here
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.ppo", "--workload", "ppo_toy:ToyWorkload", "--makers", "1",
                             "--trainers", "1", "--total-steps", "400" if stop else "10", "--rollout-s", "0.05",
                             "--run-dir", str(run)], env={**_env(tmp_path), "TMPDIR": str(short)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if stop:
            _wait_for(lambda: len(_rows(run)) >= 3, proc, what="three metrics rows")
            assert [p.name for p in short.glob("hpcrl-spawn-*/listener-*")], "the socket dir is not where looked"
            proc.send_signal(signal.SIGTERM)
        _, err = _finish(proc, 80)
        assert proc.returncode == (75 if stop else 0), err[-3000:]
        assert sorted(p.name for p in short.glob("hpcrl-spawn-*")) == [], err[-2000:]
        # the checkpoint's files (DCP shards among them) private from creation, as FastSAC's
        made = list(checkpoint.checkpoint_root(run).rglob("*"))
        assert any(p.parent.name == "dcp" for p in made), made
        loose = [f"{p} {p.stat().st_mode & 0o777:o}" for p in made if p.stat().st_mode & 0o077]
        assert loose == [], loose
    finally:
        _finish(proc, 1)
        shutil.rmtree(short, ignore_errors=True)


def test_numpys_blas_pool_does_not_keep_a_launcher_from_forking(tmp_path):
    """Without OMP_NUM_THREADS (as users run), numpy's OpenBLAS starts a thread pool when it loads; it stops
    that pool itself before a fork, so the launcher stops it first and forks (its next call restarts it)."""
    env = {k: v for k, v in _env(tmp_path).items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    code = ("import os, numpy as np, torch; from hpcrl.comm.prefork import prefork; "
            "print(len(os.listdir('/proc/self/task')), prefork(), len(os.listdir('/proc/self/task')))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    before, forked, after = out.stdout.split()
    assert int(before) > 1 or (os.cpu_count() or 1) == 1, out.stdout  # the pool was there
    assert forked == "True" and after == "1", out.stdout
