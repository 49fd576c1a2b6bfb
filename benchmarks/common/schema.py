"""The common JSON schema of the benchmark suite, checked with plain Python (no dependency).

Every file ``<name>.json`` in a results directory is::

    {"schema": "hpcrl-bench/1",
     "benchmark": str,                      # "collectives", "cost_model", "kernels", ...
     "header": {"date", "host", "device", "gpu", "torch", "cuda", "nccl", "backend",
                "world_size", "git_commit", "python", "cpu_model", "cpu_count", "config"},
     "figures": {name: {"value": float, "unit": str, "higher_is_better": bool}},
     "results": {...}}                      # benchmark-specific detail

``figures`` is what ``benchmarks.common.compare`` compares; ``results`` is free-form.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

SCHEMA = "hpcrl-bench/1"
REPO = Path(__file__).resolve().parents[2]

HEADER_FIELDS: dict[str, tuple[type, ...]] = {
    "date": (str,), "host": (str,), "device": (str,), "gpu": (str, type(None)), "torch": (str,),
    "cuda": (str, type(None)), "nccl": (str, type(None)), "backend": (str,), "world_size": (int,),
    "git_commit": (str,), "python": (str,), "cpu_model": (str,), "cpu_count": (int,), "config": (dict,),
}


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10)
        commit = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def header(device: str, world_size: int, config: dict[str, Any], backend: str | None = None) -> dict[str, Any]:
    import torch

    cuda = device.startswith("cuda")
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - build without NCCL
            nccl = None
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": device,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "backend": backend or ("nccl" if cuda else "gloo"),
        "world_size": int(world_size),
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count() or 0,
        "config": config,
    }


def figure(value: float, unit: str, higher_is_better: bool) -> dict[str, Any]:
    return {"value": float(value), "unit": unit, "higher_is_better": bool(higher_is_better)}


def make(benchmark: str, hdr: dict[str, Any], figures: dict[str, dict], results: dict[str, Any]) -> dict[str, Any]:
    return {"schema": SCHEMA, "benchmark": benchmark, "header": hdr, "figures": figures, "results": results}


def validate(doc: Any) -> list[str]:
    """Return the list of problems (empty when ``doc`` follows the schema)."""
    errs: list[str] = []
    if not isinstance(doc, dict):
        return ["document is not an object"]
    if doc.get("schema") != SCHEMA:
        errs.append(f"schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
    if not isinstance(doc.get("benchmark"), str) or not doc.get("benchmark"):
        errs.append("benchmark: missing or not a non-empty string")
    hdr = doc.get("header")
    if not isinstance(hdr, dict):
        errs.append("header: missing or not an object")
    else:
        for key, types in HEADER_FIELDS.items():
            if key not in hdr:
                errs.append(f"header.{key}: missing")
            elif not isinstance(hdr[key], types) or (types == (int,) and isinstance(hdr[key], bool)):
                errs.append(f"header.{key}: {type(hdr[key]).__name__} not {'/'.join(t.__name__ for t in types)}")
        if isinstance(hdr.get("world_size"), int) and hdr["world_size"] < 1:
            errs.append("header.world_size: < 1")
    figs = doc.get("figures")
    if not isinstance(figs, dict):
        errs.append("figures: missing or not an object")
    else:
        for name, f in figs.items():
            if not isinstance(f, dict):
                errs.append(f"figures.{name}: not an object")
                continue
            v = f.get("value")
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v or v in (float("inf"), float("-inf")):
                errs.append(f"figures.{name}.value: not a finite number ({v!r})")
            if not isinstance(f.get("unit"), str):
                errs.append(f"figures.{name}.unit: not a string")
            if not isinstance(f.get("higher_is_better"), bool):
                errs.append(f"figures.{name}.higher_is_better: not a bool")
    if not isinstance(doc.get("results"), dict):
        errs.append("results: missing or not an object")
    return errs


def validate_file(path: str | os.PathLike) -> list[str]:
    import json

    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        return [f"{path}: unreadable ({e})"]
    return [f"{Path(path).name}: {e}" for e in validate(doc)]


if __name__ == "__main__":
    import sys

    bad = 0
    for p in sys.argv[1:]:
        errs = validate_file(p)
        bad += bool(errs)
        print(f"{p}: {'OK' if not errs else '; '.join(errs)}")
    sys.exit(1 if bad else 0)
