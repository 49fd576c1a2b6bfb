"""Small shared helpers for the benchmark scripts: timing, machine info, tables, JSON.

Timing rule used everywhere: a few warm-up calls, then ``repeats`` repeats; each repeat runs the
function ``inner`` times back to back and records the mean time per call. Reported: the median of
the repeats and their min / max. ``inner`` is chosen from the warm-up so that one repeat lasts at
least ``min_repeat_s`` (tiny calls are not timed one by one). Cases compared with each other are
timed together by :func:`measure_group`, which interleaves their repeats. On CUDA the time comes from CUDA
events around the ``inner`` calls, with ``torch.cuda.synchronize()`` before and after.
On the CPU the process CPU time is recorded too: ``cpu_frac`` = CPU time / wall time, per thread
used, is ~1 on a quiet machine and drops when another process takes the cores.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch


def wait_for(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def calls_per_repeat(fn: Callable[[], Any], device: torch.device, warmup: int, min_repeat_s: float,
                     max_inner: int) -> int:
    """Warm up, then calibrate (first calls pay for allocation and page faults): grow the call count
    until a batch takes >= min_repeat_s / 4, then scale to min_repeat_s."""
    for _ in range(warmup):
        fn()
    n = 1
    while True:
        wait_for(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        wait_for(device)
        elapsed = time.perf_counter() - t0
        if elapsed >= min_repeat_s / 4 or n >= max_inner:
            break
        n *= 4
    return int(min(max_inner, max(1, round(n * min_repeat_s / max(elapsed, 1e-9)))))


def measure_group(
    fns: dict[str, Callable[[], Any]],
    device: torch.device | str = "cpu",
    *,
    warmup: int = 3,
    repeats: int = 9,
    min_repeat_s: float = 0.01,
    max_inner: int = 1000,
) -> dict[str, dict[str, Any]]:
    """Time several functions with their repeats interleaved (A B C A B C ...), so that a burst of
    load from another process hits all of them alike and their ratios stay meaningful.

    Returns, per name, seconds per call: median_s, min_s, max_s, samples_s, plus inner, repeats,
    cpu_frac and cpu_median_s (both None on CUDA).
    """
    device = torch.device(device)
    is_cuda = device.type == "cuda"
    inner = {name: calls_per_repeat(fn, device, warmup, min_repeat_s, max_inner) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    cpu_samples: dict[str, list[float]] = {name: [] for name in fns}
    wall = dict.fromkeys(fns, 0.0)
    cpu = dict.fromkeys(fns, 0.0)
    for _ in range(repeats):
        for name, fn in fns.items():
            n = inner[name]
            if is_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(n):
                    fn()
                end.record()
                torch.cuda.synchronize()
                samples[name].append(start.elapsed_time(end) / 1e3 / n)
            else:
                c0, w0 = time.process_time(), time.perf_counter()
                for _ in range(n):
                    fn()
                w1, c1 = time.perf_counter(), time.process_time()
                samples[name].append((w1 - w0) / n)
                cpu_samples[name].append((c1 - c0) / n)
                wall[name] += w1 - w0
                cpu[name] += c1 - c0
    threads = torch.get_num_threads()
    out = {}
    for name, xs in samples.items():
        out[name] = {
            "median_s": statistics.median(xs),
            "min_s": min(xs),
            "max_s": max(xs),
            "samples_s": xs,
            "inner": inner[name],
            "repeats": repeats,
            "cpu_frac": None if is_cuda or wall[name] == 0 else cpu[name] / wall[name] / threads,
            # process CPU seconds per call (all threads): robust to being descheduled on 1 thread
            "cpu_median_s": statistics.median(cpu_samples[name]) if cpu_samples[name] else None,
        }
    return out


def measure(fn: Callable[[], Any], device: torch.device | str = "cpu", **kw: Any) -> dict[str, Any]:
    """Time one function; see :func:`measure_group`."""
    return measure_group({"fn": fn}, device, **kw)["fn"]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _busy_cpu_seconds() -> float | None:
    """CPU seconds spent by the whole machine (all processes, all cores) since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    """This process's CPU seconds, with its children that have been waited for (spawned ranks)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OtherLoad:
    """How many cores *other* processes kept busy while this one (and its joined children) ran:
    (machine CPU time - own CPU time) / wall time. ~0 on a quiet machine; on a 2-core box, 1 means
    one core was taken."""

    def __init__(self) -> None:
        self.t0, self.own0, self.busy0 = time.perf_counter(), _own_cpu_seconds(), _busy_cpu_seconds()

    def cores(self) -> float | None:
        busy = _busy_cpu_seconds()
        if busy is None or self.busy0 is None:
            return None
        wall = time.perf_counter() - self.t0
        return round(max(0.0, (busy - self.busy0) - (_own_cpu_seconds() - self.own0)) / wall, 2)


class Quiet:
    """Sections of a benchmark run on a shared machine. :meth:`start` waits until the 1-min load
    average is below ``limit`` (0 = never wait; all waits together at most ``max_wait`` s);
    :meth:`end` records the load and the cores other processes kept busy during the section."""

    def __init__(self, limit: float, max_wait: float) -> None:
        self.limit, self.budget = limit, max_wait
        self.sections: dict[str, dict[str, Any]] = {}
        self._other: dict[str, OtherLoad] = {}

    def start(self, name: str) -> float:
        t0 = time.time()
        while self.limit > 0 and os.getloadavg()[0] >= self.limit and time.time() - t0 < self.budget:
            time.sleep(5)
        waited = time.time() - t0
        self.budget = max(0.0, self.budget - waited)
        self.sections[name] = {"waited_s": round(waited, 1), "load_start": loadavg()}
        self._other[name] = OtherLoad()
        return time.perf_counter()

    def end(self, name: str) -> float:
        """The section's seconds since :meth:`start` returned."""
        other = self._other.pop(name)
        self.sections[name].update(load_end=loadavg(), other_processes_cores=other.cores())
        return round(time.perf_counter() - other.t0, 1)

    def waited_s(self) -> float:
        return sum(v["waited_s"] for v in self.sections.values())


def machine_info(device: torch.device | str, threads: int) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": threads,
        "device": str(device),
        "loadavg_start": loadavg(),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Plain fixed-width table (also valid-ish Markdown when pasted)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    print(f"\n{title}")
    print(line(cells[0]))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        print(line(r))


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return path
