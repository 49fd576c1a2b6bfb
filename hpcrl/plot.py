"""``python -m hpcrl.plot RUN_DIR [RUN_DIR ...] --out runs.png [--labels A B ...] [--band std|minmax]``

One PNG from the ``metrics.jsonl`` of one or more run dirs (FastSAC or PPO):

* top panel: ``episode_return`` (lines) and ``eval_return`` (dashed, dots) vs env steps;
* second panel: every ``*_loss`` field (symlog scale: losses change sign and span decades), with
  ``alpha`` (the entropy temperature, log scale) on a right-hand axis when the rows have it.

x is the ``env_steps`` field of the rows: transitions collected over all envs and ranks.
Rows with a missing, null or NaN ``episode_return`` add no return point (their losses still count);
a row with an ``eval_return`` key is an eval point, whatever other keys it has, and nothing else.

Groups: by default run dirs whose ``config.json`` is the same except for the seed (and where / how it
ran: run dir, device, threads, ...) are one group, e.g. ``--seeds 0,1,2`` siblings. ``--labels``
gives one label per run dir instead; equal labels form a group. A group of several runs is drawn
as the mean over its runs with a band: ± one standard deviation over the runs (``--band std``,
population std) or their min..max (``--band minmax``), on a shared step grid: the union of the
runs' steps inside the range every run covers, each run linearly interpolated onto it.

Headless (matplotlib's Agg backend); needs ``pip install 'hpcrl[plot]'``.
Exit codes: 0 written, 2 bad input (no such run dir, no metrics, nothing to plot), one line.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import tyro

from hpcrl.run.cli import cli
from hpcrl.core.config_check import ConfigError
from hpcrl.core.conventions import EXIT_BAD_CONFIG

__all__ = ["PlotConfig", "Run", "group_runs", "load_run", "main", "plot_runs"]

# config.json fields that say where or how fast a run ran, not what it is: they never split a group.
NOT_IDENTITY = frozenset({"seed", "run_dir", "resume", "resume_missing", "device", "nproc", "threads", "timeout_s",
                          "launcher", "hosts", "log_every", "checkpoint_every", "keep_checkpoints",
                          "check_replicas_every", "wandb_project", "config", "shared_memory"})
# Derived from other fields (the run's layout): they split no group and would only crowd a label.
DERIVED = frozenset({"batch_per_rank", "envs_per_rank", "iterations"})


@dataclass
class PlotConfig:
    """Plot episode / eval returns and losses of one or more runs into a PNG."""

    run_dirs: Annotated[list[str], tyro.conf.Positional] = field(default_factory=lambda: ["runs/fastsac"])
    """Run directories (each with a metrics.jsonl)."""
    out: str = "runs.png"
    """PNG file to write."""
    labels: list[str] = field(default_factory=list)
    """One label per run dir (runs with equal labels form a group); empty = group by config.json, seed aside."""
    band: Literal["std", "minmax"] = "std"
    """Band around a group's mean: one standard deviation over its runs, or their min..max."""
    title: str = ""
    """Figure title (empty: the run dirs)."""


@dataclass
class Run:
    """The plottable series of one run dir (each a pair of arrays: env steps, values)."""

    path: Path
    config: dict[str, Any] | None
    series: dict[str, tuple[np.ndarray, np.ndarray]]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def load_run(run_dir: str | Path) -> Run:
    """Series of ``run_dir/metrics.jsonl``; unreadable lines (a torn last line) are skipped."""
    path = Path(run_dir)
    metrics = path / "metrics.jsonl"
    if not path.is_dir():
        raise ConfigError(f"{path}: no such run dir")
    if not metrics.is_file():
        raise ConfigError(f"{path}: no metrics.jsonl (not a run dir, or the run has not logged yet)")
    points: dict[str, list[tuple[float, float]]] = {}
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)  # json reads NaN / Infinity tokens as floats
        except ValueError:
            continue
        if not isinstance(row, dict) or not _finite(row.get("env_steps")):
            continue
        x = float(row["env_steps"])
        if "eval_return" in row:  # an eval point, whatever else the row holds
            if _finite(row["eval_return"]):
                points.setdefault("eval_return", []).append((x, float(row["eval_return"])))
            continue
        for key, value in row.items():
            if (key == "episode_return" or key == "alpha" or key.endswith("_loss")) and _finite(value):
                points.setdefault(key, []).append((x, float(value)))
    series = {}
    for key, pts in points.items():
        pts.sort()
        series[key] = (np.array([p[0] for p in pts]), np.array([p[1] for p in pts]))
    config = None
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        pass
    return Run(path, config if isinstance(config, dict) else None, series)


def _identity(run: Run) -> str:
    if run.config is None:
        return f"dir:{run.path.resolve()}"  # unknown config: a group of its own
    return json.dumps({k: v for k, v in run.config.items() if k not in NOT_IDENTITY}, sort_keys=True, default=str)


def group_runs(runs: list[Run], labels: list[str] | None = None) -> dict[str, list[Run]]:
    """{label: runs}, in the order the runs were given."""
    if labels:
        if len(labels) != len(runs):
            raise ConfigError(f"--labels: {len(labels)} label(s) for {len(runs)} run dir(s); give one per run dir")
        groups: dict[str, list[Run]] = {}
        for label, run in zip(labels, runs):
            groups.setdefault(label, []).append(run)
        return groups
    by_id: dict[str, list[Run]] = {}
    for run in runs:
        by_id.setdefault(_identity(run), []).append(run)
    configs = [g[0].config or {} for g in by_id.values()]
    differ = sorted(k for k in set().union(*configs) - NOT_IDENTITY - DERIVED
                    if len({json.dumps(c.get(k), default=str) for c in configs}) > 1)
    groups = {}
    for members in by_id.values():
        cfg = members[0].config
        if cfg is None or not differ:
            name = str(cfg.get("env", members[0].path.name)) if cfg and len(by_id) == 1 else members[0].path.name
        else:
            name = ", ".join(f"{k}={cfg.get(k)}" for k in differ[:3]) + (" ..." if len(differ) > 3 else "")
        seeds = sorted({str(r.config.get("seed")) for r in members if r.config and "seed" in r.config})
        if len(members) > 1:
            name += f" ({len(members)} runs, seeds {','.join(seeds)})" if seeds else f" ({len(members)} runs)"
        groups[name] = members
    return groups


def mean_band(curves: list[tuple[np.ndarray, np.ndarray]], band: str = "std"):
    """(grid, mean, low, high) of several curves on a shared grid: the union of their x inside the range
    all of them cover, each curve linearly interpolated. One curve: itself, no band."""
    curves = [c for c in curves if len(c[0])]
    if not curves:
        return None
    if len(curves) == 1:
        x, y = curves[0]
        return x, y, y, y
    lo, hi = max(c[0][0] for c in curves), min(c[0][-1] for c in curves)
    if lo > hi:  # no step range covered by every run: nothing honest to average
        return None
    grid = np.unique(np.concatenate([c[0][(c[0] >= lo) & (c[0] <= hi)] for c in curves] + [np.array([lo, hi])]))
    ys = np.stack([np.interp(grid, x, y) for x, y in curves])
    mean = ys.mean(0)
    if band == "minmax":
        return grid, mean, ys.min(0), ys.max(0)
    std = ys.std(0)
    return grid, mean, mean - std, mean + std


_LOSS_STYLES = ["-", "--", ":", "-."]


def _mean_band_of(runs: list[Run], key: str, band: str):
    return mean_band([r.series[key] for r in runs if key in r.series], band)


def _draw_returns(ax_ret, label: str, runs: list[Run], color: str, band: str) -> int:
    """One group's episode-return curve (with its band over runs) and eval-return error bars: how many drew."""
    drawn = 0
    got = _mean_band_of(runs, "episode_return", band)
    if got is not None:
        x, mean, low, high = got
        few = len(x) < 30  # a short run has a handful of finished-episode rows: show the points
        ax_ret.plot(x, mean, color=color, lw=1.8, marker="." if few else None, label=f"{label}: episode")
        if len(runs) > 1:
            ax_ret.fill_between(x, low, high, color=color, alpha=0.2, lw=0)
        drawn += 1
    got = _mean_band_of(runs, "eval_return", band)
    if got is not None:  # sparse points: error bars read better than a band
        x, mean, low, high = got
        ax_ret.errorbar(x, mean, yerr=np.stack([mean - low, high - mean]), color=color, ls="--", marker="o",
                        ms=5, capsize=3, label=f"{label}: eval (deterministic)")
        drawn += 1
    return drawn


def _draw_losses(ax_loss, ax_alpha, label: str, runs: list[Run], color: str, loss_keys: list[str], band: str):
    """One group's loss curves, and its alpha on a twin axis made on first use: returns that axis (or None)."""
    for j, key in enumerate(loss_keys):
        got = _mean_band_of(runs, key, band)
        if got is not None:
            ax_loss.plot(got[0], got[1], color=color, ls=_LOSS_STYLES[j % len(_LOSS_STYLES)], lw=1.2,
                         label=f"{label}: {key}")
    got = _mean_band_of(runs, "alpha", band)
    if got is not None:
        ax_alpha = ax_alpha or ax_loss.twinx()
        ax_alpha.plot(got[0], got[1], color=color, lw=2.5, alpha=0.35, label=f"{label}: alpha")
    return ax_alpha


def _label_axes(ax_ret, ax_loss, ax_alpha, groups: dict[str, list[Run]], has_losses: bool, band: str,
                title: str) -> None:
    """Axis labels, scales and legends (the legend title names the band when a group has several runs)."""
    band_text = "mean ± 1 std over runs" if band == "std" else "mean, min..max over runs"
    ax_ret.set_ylabel("return")
    ax_ret.set_title(title or ", ".join(r.path.name for runs in groups.values() for r in runs), fontsize=10)
    ax_ret.legend(fontsize=8, title=band_text if any(len(r) > 1 for r in groups.values()) else None,
                  title_fontsize=8)
    ax_ret.grid(alpha=0.3)
    if has_losses:
        ax_loss.set_yscale("symlog")
        ax_loss.legend(fontsize=7, loc="upper left")
    ax_loss.set_ylabel("loss (symlog)")
    ax_loss.set_xlabel("env steps (transitions, all envs and ranks)")
    ax_loss.grid(alpha=0.3)
    if ax_alpha is not None:
        ax_alpha.set_yscale("log")
        ax_alpha.set_ylabel("alpha (log)")
        ax_alpha.legend(fontsize=7, loc="upper right")


def plot_runs(groups: dict[str, list[Run]], out: str | Path, band: str = "std", title: str = "") -> Path:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install 'hpcrl[plot]'") from None
    matplotlib.use("Agg")  # headless: compute nodes and CI have no display
    import matplotlib.pyplot as plt

    fig, (ax_ret, ax_loss) = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    ax_alpha = None
    loss_keys = sorted({k for runs in groups.values() for r in runs for k in r.series if k.endswith("_loss")})
    drawn = 0
    for i, (label, runs) in enumerate(groups.items()):
        color = f"C{i % 10}"
        drawn += _draw_returns(ax_ret, label, runs, color, band)
        ax_alpha = _draw_losses(ax_loss, ax_alpha, label, runs, color, loss_keys, band)
    if not drawn:
        plt.close(fig)
        dirs = ", ".join(str(r.path) for runs in groups.values() for r in runs)
        raise ConfigError(f"nothing to plot: no finite episode_return or eval_return in {dirs} "
                          "(no episode finished yet? train longer or log more often)")
    _label_axes(ax_ret, ax_loss, ax_alpha, groups, bool(loss_keys), band, title)
    fig.tight_layout()
    out = Path(out)
    if not out.parent.is_dir():
        plt.close(fig)
        raise ConfigError(f"--out {out}: directory {out.parent} does not exist; create it or choose another path")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = cli(PlotConfig, sys.argv[1:] if argv is None else argv, "python -m hpcrl.plot")
        if not cfg.out.lower().endswith(".png"):
            raise ConfigError(f"--out {cfg.out}: must be a path ending in .png; e.g. --out runs.png")
        if not cfg.run_dirs:
            raise ConfigError("no run dirs given; e.g. python -m hpcrl.plot runs/seed0 runs/seed1 --out runs.png")
        runs = [load_run(d) for d in cfg.run_dirs]
        groups = group_runs(runs, cfg.labels)
        out = plot_runs(groups, cfg.out, cfg.band, cfg.title)
    except ConfigError as err:
        print(f"hpcrl.plot: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    summary = "; ".join(f"{label}: {len(runs)} run(s)" for label, runs in groups.items())
    print(f"hpcrl.plot: wrote {out} ({summary})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
