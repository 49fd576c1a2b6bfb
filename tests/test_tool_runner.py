"""hpcrl.ppo.workloads.tool_runner: tools run in real worker subprocesses. A call is bounded in time and a
hung tool's process (and what it started) is really gone; exceptions, sys.exit, os._exit and bad returns
are error results; prints do not corrupt the protocol; threads call at once; close() leaves no child;
check_tools / parse_tools fail with one line naming the fix."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import pytest

from hpcrl.core.config_check import ConfigError
from hpcrl.ppo.workloads.tool_runner import FLAG, ToolResult, ToolRunner, check_tools, parse_tools

MOD = "runner_test_tools"
TOOLS = '''
import os, subprocess, sys, time

NOT_CALLABLE = 3

def echo(s):
    return s

def add(s):
    a, b = s.split()
    return str(int(a) + int(b))

def slow(s):
    time.sleep(30)
    return s

def boom(s):
    raise ValueError("no " + s)

def bad(s):
    return 5

def noisy(s):
    print("chatter from print")
    sys.stdout.flush()
    os.write(1, b"chatter on fd 1\\n")
    subprocess.run(["echo", "chatter from a child"], check=True)
    return "quiet " + s

def stdin(s):
    return repr(sys.stdin.read())

def quit(s):
    sys.exit(3)

def die(s):
    os._exit(1)

def nap(s):
    time.sleep(float(s))
    return f"{s} {os.getpid()}"

def hang_with_child(s):
    child = subprocess.Popen(["sleep", "60"])
    with open(s, "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(30)

def where(s):
    return os.getcwd()

def length(s):
    return str(len(s))

def loaded(s):
    return ",".join(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "hpcrl")))
'''
NAMES = ["echo", "add", "slow", "boom", "bad", "noisy", "stdin", "quit", "die", "nap", "hang_with_child", "where",
         "length", "loaded"]
ALL = {name: f"{MOD}:{name}" for name in NAMES}


@pytest.fixture(scope="module", autouse=True)
def tools_module(tmp_path_factory):
    """The tools' module, importable in this process only through sys.path (so workers need PYTHONPATH)."""
    root = tmp_path_factory.mktemp("tools")
    (root / f"{MOD}.py").write_text(TOOLS)
    (root / "broken_at_import.py").write_text("raise RuntimeError('no config file\\nsecond line')\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        yield root


@pytest.fixture(scope="module")
def runner():
    with ToolRunner(ALL, timeout_s=20, workers=2) as shared:
        yield shared


def reaped(pid: int) -> bool:
    """Our child ``pid`` is dead and reaped: no /proc entry (a zombie keeps one), not waitable."""
    if Path(f"/proc/{pid}").exists():
        return False
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    return True


def dead(pid: int) -> bool:
    """Not running (gone, or a zombie waiting for init: a grandchild is not ours to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def children() -> set[int]:
    found: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended, or no CONFIG_PROC_CHILDREN
            found.update(int(pid) for pid in (task / "children").read_text().split())
    return found


def test_ok_results_round_trip_any_text(runner):
    assert runner.call("add", "3 4") == ToolResult("7", "ok")
    text = "line one\nline two \"quoted\" \\ é 漢字 \U0001f600 \x00"
    assert runner.call("echo", text) == ToolResult(text, "ok")
    assert runner.call("length", "x" * 1_000_000) == ToolResult("1000000", "ok")  # past the pipe's buffer


def test_the_worker_imports_no_torch_nor_hpcrl(runner):
    assert runner.call("loaded", "") == ToolResult("", "ok")


def test_failures_are_error_results_and_the_worker_lives_on(runner):
    pids = runner.pids
    result = runner.call("boom", "way")
    assert result.status == "error" and result.text == "ValueError: no way"
    assert runner.call("bad", "x") == ToolResult(f"{MOD}:bad returned int, not str", "error")
    assert runner.call("quit", "x") == ToolResult("SystemExit: 3", "error")
    assert runner.call("add", "3").status == "error"  # unpacking fails: a ValueError
    assert runner.pids == pids  # none of these cost a worker


def test_a_printing_tool_keeps_the_protocol_and_its_output_goes_to_the_log(tmp_path):
    log = tmp_path / "tools.log"
    with ToolRunner(ALL, timeout_s=20, workers=1, log_path=str(log)) as tools:
        assert tools.call("noisy", "please") == ToolResult("quiet please", "ok")
        assert tools.call("stdin", "") == ToolResult("''", "ok")  # a tool reading stdin reads nothing
        assert tools.call("echo", "after") == ToolResult("after", "ok")
    for chatter in ("chatter from print", "chatter on fd 1", "chatter from a child"):
        assert chatter in log.read_text()


def test_unknown_tool_and_non_str_arg(runner):
    assert runner.call("nope", "x") == ToolResult(f"no tool named 'nope' (tools: {', '.join(NAMES)})", "error")
    assert runner.call("echo", 5).status == "error"


def test_a_hung_tool_is_killed_with_what_it_started_and_the_next_call_works(tmp_path):
    with ToolRunner(ALL, timeout_s=1.5, workers=1) as tools:
        assert tools.call("echo", "warm") == ToolResult("warm", "ok")  # started, tools module imported
        start = time.monotonic()
        result = tools.call("hang_with_child", str(tmp_path / "pids"))
        elapsed = time.monotonic() - start
        assert result == ToolResult("tool 'hang_with_child' timed out after 1.5 s", "timeout")
        assert 1.5 <= elapsed < 1.5 + 2, elapsed
        worker, grandchild = map(int, (tmp_path / "pids").read_text().split())
        assert reaped(worker) and worker not in tools.pids
        deadline = time.monotonic() + 5
        while not dead(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dead(grandchild)  # killed with the worker's process group
        assert tools.call("add", "20 22") == ToolResult("42", "ok")  # a fresh worker
        assert len(tools.pids) == 1


def test_a_dying_tool_is_an_error_and_its_worker_replaced():
    with ToolRunner(ALL, timeout_s=20, workers=1) as tools:
        (before,) = tools.pids
        result = tools.call("die", "x")
        assert result.status == "error" and "ended its worker" in result.text, result
        assert reaped(before)
        assert tools.call("echo", "again") == ToolResult("again", "ok")


def test_threads_share_the_pool_and_run_at_once(runner):
    pool = ToolRunner(ALL, timeout_s=20, workers=2)
    results: dict[int, list[ToolResult]] = {}

    def episode(i: int) -> None:
        results[i] = [pool.call("add", f"{i} {j}") for j in range(5)] + [pool.call("nap", "1.0")]

    try:
        warm = [threading.Thread(target=pool.call, args=("nap", "0.2")) for _ in range(2)]  # both workers
        for thread in warm:
            thread.start()
        for thread in warm:
            thread.join()
        threads = [threading.Thread(target=episode, args=(i,)) for i in range(4)]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        elapsed = time.monotonic() - start
        for i in range(4):
            assert results[i][:5] == [ToolResult(str(i + j), "ok") for j in range(5)]
        naps = [results[i][5] for i in range(4)]
        assert all(r.status == "ok" and r.text.startswith("1.0 ") for r in naps), naps
        assert {int(r.text.split()[1]) for r in naps} == set(pool.pids)  # both workers served
        assert 2.0 <= elapsed < 3.5, elapsed  # 4 s of naps on 2 workers: 2 at a time, never more
    finally:
        pool.close()


def test_waiting_for_a_busy_pool_is_bounded_too():
    with ToolRunner(ALL, timeout_s=0.5, workers=1) as tools:
        results: list[ToolResult] = []
        threads = [threading.Thread(target=lambda: results.append(tools.call("slow", "x"))) for _ in range(2)]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert time.monotonic() - start < 2 * 0.5 + 2
        assert [r.status for r in results] == ["timeout", "timeout"], results


def test_results_are_cut_to_max_chars():
    with ToolRunner(ALL, timeout_s=20, workers=1, max_chars=100) as tools:
        assert tools.call("echo", "y" * 5000) == ToolResult("y" * 100, "ok")
        assert len(tools.call("boom", "z" * 5000).text) == 100


def test_workers_run_in_cwd(tmp_path):
    with ToolRunner(ALL, timeout_s=20, workers=1, cwd=str(tmp_path)) as tools:
        assert os.path.realpath(tools.call("where", "").text) == os.path.realpath(tmp_path)


def test_close_kills_and_reaps_every_worker_busy_ones_too():
    tools = ToolRunner(ALL, timeout_s=30, workers=2)
    pids = tools.pids
    assert len(pids) == 2 and set(pids) <= children()
    assert tools.call("echo", "x").status == "ok"
    results: list[ToolResult] = []
    busy = threading.Thread(target=lambda: results.append(tools.call("slow", "x")))
    busy.start()
    time.sleep(0.5)
    start = time.monotonic()
    tools.close()
    busy.join(5)
    assert time.monotonic() - start < 3 and not busy.is_alive()
    assert results[0].status == "error" and "closed" in results[0].text, results
    assert all(reaped(pid) for pid in pids) and not set(pids) & children() and tools.pids == []
    tools.close()  # idempotent
    assert tools.call("echo", "x") == ToolResult("tool 'echo' cannot run: the tool runner is closed", "error")


def test_check_tools_accepts_importable_callables():
    assert check_tools(ALL) is None


@pytest.mark.parametrize("name, spec, says", [
    ("add", "nope.mod:f", ("cannot import module 'nope.mod' (ModuleNotFoundError: No module named 'nope'); "
                           "pass package.module:function of an importable module")),
    ("x", MOD, "not package.module:function; e.g. --hf.tools x=mytools.text:x"),
    ("x", f"{MOD}:f:g", "not package.module:function"),
    ("x", f"{MOD}:missing", f"module '{MOD}' has no attribute 'missing'"),
    ("x", f"{MOD}:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not callable"),
    ("x", "broken_at_import:f", "cannot import module 'broken_at_import' (RuntimeError: no config file)"),
])
def test_check_tools_fails_with_one_line_naming_the_fix(name, spec, says):
    with pytest.raises(ConfigError) as info:
        check_tools({"echo": f"{MOD}:echo", name: spec})
    message = str(info.value)
    assert message.startswith(f"{FLAG} {name}={spec}: ") and says in message and "\n" not in message, message


def test_parse_tools():
    assert parse_tools("add=m.a:f, m.b:g ,m.c:Cls.method") == {"add": "m.a:f", "g": "m.b:g", "method": "m.c:Cls.method"}
    assert parse_tools("") == {} and parse_tools("  ") == {}


@pytest.mark.parametrize("spec, says", [
    ("m:f,,m:g", "an empty entry"),
    ("m:f,", "an empty entry"),
    ("m:f,n:f", "the name 'f' is given twice; rename one, e.g. f2=n:f"),
    ("x=nocolon", "'nocolon' is not package.module:function"),
    ("=m:f", "the name '' is not"),
    ("a b=m:f", "the name 'a b' is not"),
])
def test_parse_tools_fails_with_one_line(spec, says):
    with pytest.raises(ConfigError) as info:
        parse_tools(spec)
    message = str(info.value)
    assert message.startswith(f"{FLAG} ") and says in message and "\n" not in message, message
