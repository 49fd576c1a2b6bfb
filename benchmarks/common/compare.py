"""Regression gate: compare the ``figures`` of two benchmark runs.

    python -m benchmarks.common.compare OLD NEW [--threshold 0.1]

OLD / NEW are run directories (``results/<date>-<host>-<commit>/``) or single JSON files. For every
figure present in both, prints new/old and the change in the good direction ("+" = better); a figure
that got worse by more than ``threshold`` (relative) is marked REGRESSION and the exit status is 1.

Before merging a performance change: run ``python -m benchmarks`` (or ``--quick``) on main and on the
branch on the same machine, then ``python -m benchmarks.common.compare results/<main-run> results/<branch-run>``.
Timings on a shared machine are noisy: rerun a flagged figure before believing it, and keep the
threshold above the run-to-run spread that the report's min/median columns show.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def load_figures(path: str | Path) -> dict[str, dict[str, Any]]:
    path = Path(path)
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    out: dict[str, dict[str, Any]] = {}
    for f in files:
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("figures"), dict):
            continue
        for name, fig in doc["figures"].items():
            out[f"{doc.get('benchmark', f.stem)}/{name}"] = fig
    return out


def compare(old: dict[str, dict], new: dict[str, dict], threshold: float = 0.1) -> list[dict[str, Any]]:
    rows = []
    for name in sorted(set(old) & set(new)):
        o, n = float(old[name]["value"]), float(new[name]["value"])
        hib = bool(new[name].get("higher_is_better", old[name].get("higher_is_better", True)))
        if o == 0:
            ratio = 1.0 if n == 0 else float("inf")
            gain = 0.0 if n == 0 else (float("inf") if (n > 0) == hib else float("-inf"))
        else:
            ratio = n / o
            gain = (ratio - 1.0) if hib else (1.0 / ratio - 1.0 if ratio > 0 else float("inf"))
        # gain: relative improvement in the good direction; a 20 % slower time -> gain = 1/1.2 - 1 = -0.167,
        # so compare against the worsening of the raw figure instead: worse = how much the figure moved the bad way
        worse = (1.0 - ratio) if hib else (ratio - 1.0)
        rows.append({"figure": name, "old": o, "new": n, "ratio": ratio, "gain": gain, "unit": new[name].get("unit", ""),
                     "higher_is_better": hib, "regression": worse > threshold})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--threshold", type=float, default=0.1, help="relative worsening that fails (default 0.1)")
    args = ap.parse_args(argv)
    old, new = load_figures(args.old), load_figures(args.new)
    rows = compare(old, new, args.threshold)
    if not rows:
        print("no figures in common")
        return 2
    w = max(len(r["figure"]) for r in rows)
    print(f"{'figure':<{w}} {'old':>12} {'new':>12} {'new/old':>8} {'change':>8}")
    for r in rows:
        flag = "  REGRESSION" if r["regression"] else ""
        print(f"{r['figure']:<{w}} {r['old']:>12.4g} {r['new']:>12.4g} {r['ratio']:>8.3f} {r['gain']:>+8.1%}{flag}")
    only = sorted(set(old) ^ set(new))
    if only:
        print(f"({len(only)} figures in only one run: {', '.join(only[:8])}{' ...' if len(only) > 8 else ''})")
    n_reg = sum(r["regression"] for r in rows)
    print(f"{n_reg} regression(s) beyond {args.threshold:.0%} of {len(rows)} figures")
    return 1 if n_reg else 0


if __name__ == "__main__":
    sys.exit(main())
