"""Where the benchmark suite lives: the repository, the suite's folder and its committed results."""

from __future__ import annotations

from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
RESULTS = BENCH / "results"
