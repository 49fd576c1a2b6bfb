"""Slurm host lists: ``node[01-03,7],gpu5`` -> ``["node01", "node02", "node03", "node7", "gpu5"]``.

``scontrol show hostnames`` is the authority when it is installed; the parser below is the fallback
for compute nodes without Slurm client tools (and for tests with fake Slurm variables).
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess

__all__ = ["expand_nodelist", "first_host"]

_BRACKET = re.compile(r"\[([^\]]*)\]")


def _split_top_level(nodelist: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in Slurm node list {nodelist!r}")
        elif ch == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in Slurm node list {nodelist!r}")
    parts.append(nodelist[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range(spec: str, nodelist: str) -> list[str]:
    """``01-03,7`` -> ``["01", "02", "03", "7"]``; the width of the low bound sets zero padding."""
    out: list[str] = []
    for item in spec.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in Slurm node list {nodelist!r}")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in Slurm node list {nodelist!r}")
        out.extend(str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1))
    return out


def _expand_host_pattern(pattern: str, nodelist: str) -> list[str]:
    # Several bracket groups ("rack[1-2]-n[1-2]") expand as a cartesian product, as in Slurm.
    literals = _BRACKET.split(pattern)  # [text, range, text, range, ..., text]
    choices = [[lit] if i % 2 == 0 else _expand_range(lit, nodelist) for i, lit in enumerate(literals)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list expression with the pure-Python parser (no scontrol)."""
    hosts = [h for part in _split_top_level(nodelist) for h in _expand_host_pattern(part, nodelist)]
    if not hosts:
        raise ValueError(f"empty Slurm node list {nodelist!r}")
    return hosts


def first_host(nodelist: str, use_scontrol: bool = True) -> str:
    """First host of ``nodelist``: ``scontrol show hostnames`` if available, else the parser."""
    scontrol = shutil.which("scontrol") if use_scontrol else None
    if scontrol:
        try:
            res = subprocess.run(
                [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
            )
            if res.returncode == 0 and res.stdout.split():
                return res.stdout.split()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass  # a broken client install must not stop the job: the parser knows the syntax
    return expand_nodelist(nodelist)[0]
