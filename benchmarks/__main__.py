"""One entry point for the benchmark suite.

    python -m benchmarks [--quick] [--out results] [--device cpu|cuda] [--world 2] [--only a,b]

Writes ``<out>/<date>-<host>-<commit>/``: one JSON per benchmark (common header, see
benchmarks/common/schema.py), ``report.md``, PNGs and one ``*.log`` per subprocess benchmark.

Steps: collectives (W local ranks, gloo) -> cost_model (fit + projection) -> kernels (--quick in quick
mode) -> [full mode only] sac_throughput, ppo_throughput, weight_publish, scaling (benchmarks/comm/scaling.py) -> report. ``--quick`` (< 2 min on 2 CPU cores)
runs the first three; ``--only`` picks any steps (at quick sizes with ``--quick``). The older scripts' own JSON is wrapped under ``results`` with the common header.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import schema
from benchmarks.common.timing import write_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


class Progress:
    """A plain progress display: one line per step with a bar, elapsed time and status."""

    def __init__(self, names: list[str]) -> None:
        self.names, self.done, self.t0, self.log = names, 0, time.perf_counter(), []

    def _bar(self) -> str:
        n, k = len(self.names), self.done
        return "[" + "#" * (20 * k // n) + "." * (20 - 20 * k // n) + f"] {k}/{n}"

    def start(self, name: str) -> None:
        print(f"{self._bar()} {name} ... (t={time.perf_counter() - self.t0:.0f}s)", flush=True)

    def end(self, name: str, status: str, seconds: float) -> None:
        self.done += 1
        self.log.append({"name": name, "status": status, "seconds": seconds})
        print(f"{self._bar()} {name}: {status} in {seconds:.1f}s", flush=True)


def _figures_from_rows(prefix: str, rows: Any) -> dict[str, dict]:
    """hpcrl rows of the older scripts' tables -> figures (seconds per call, lower is better)."""
    figs: dict[str, dict] = {}
    if not isinstance(rows, list):
        return figs
    for r in rows:
        if not isinstance(r, dict) or r.get("case") not in (None, "hpcrl") or not isinstance(r.get("median_s"), (int, float)):
            continue
        key = "_".join(str(r[k]) for k in ("size", "dtype", "batch", "buffer", "capacity", "n_step", "nstep")
                       if k in r).replace(" ", "")
        if key:
            figs[f"{prefix}_{key}_time"] = schema.figure(r["median_s"], "s", False)
    return figs


def _figures_from_summary(prefix: str, summary: Any) -> dict[str, dict]:
    figs: dict[str, dict] = {}
    if isinstance(summary, dict):
        for k, v in summary.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf"):
                lower = any(t in k.lower() for t in ("_s", "time", "lat", "idle", "lag", "ms"))
                figs[f"{prefix}_{k}"] = schema.figure(v, "", not lower)
    return figs


def run_script(name: str, argv: list[str], outdir: Path, device: str, timeout: float, config: dict,
               script: str) -> str:
    """Run an older benchmark script (``benchmarks/<script>.py``, e.g. ``sac/sac_throughput``); wrap its JSON in the
    common schema as <name>.json."""
    raw = outdir / f"{name}_raw.json"
    log = outdir / f"{name}.log"
    cmd = [sys.executable, str(HERE / f"{script}.py"), *argv, "--json", str(raw)]
    status = "ok"
    try:
        with open(log, "w") as f:
            rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        if rc != 0:
            status = f"failed (exit {rc}, see {log.name})"
    except subprocess.TimeoutExpired:
        status = f"timed out after {timeout:.0f}s"
    payload = json.loads(raw.read_text()) if raw.exists() else {}
    figs = _figures_from_rows(name, payload.get("grad")) | _figures_from_rows(name, payload.get("replay"))
    figs |= _figures_from_summary(name, payload.get("summary"))
    results = {"raw_json": raw.name if raw.exists() else None, "log": log.name, "status": status,
               "command": " ".join(cmd[1:]), "payload": payload}
    pngs = sorted(p.name for p in outdir.glob(f"{name}*.png"))
    if pngs:
        results["png"] = ", ".join(pngs)
    write_json(outdir / f"{name}.json", schema.make(name, schema.header(device, 1, {"argv": argv, **config}), figs,
                                                     results))
    if raw.exists():
        raw.unlink()  # its content lives under results.payload
    return status


def run_dir_name(root: Path) -> Path:
    date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return root / f"{date}-{platform.node().split('.')[0]}-{schema.git_commit()}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run (< 2 min on 2 CPU cores)")
    ap.add_argument("--out", default=str(REPO / "results"), help="parent of the run directory (default results/)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: per-update compute and kernels on the GPU (collectives stay gloo unless --backend nccl)")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="nccl: one GPU per local rank")
    ap.add_argument("--world", type=int, default=2, help="local ranks of the collective sweep")
    ap.add_argument("--only", default=None, help="comma-separated subset of steps")
    ap.add_argument("--run-dir", default=None, help="write into this directory instead of <out>/<date>-<host>-<commit> "
                    "(slurm/bench.sbatch: the collectives JSON of the srun step is already there)")
    ap.add_argument("--scaling-worlds", default="1,2",
                    help="W of the FastSAC weak/strong sweeps (full mode; W > CPUs is marked oversubscribed)")
    ap.add_argument("--scaling-topologies", default="1:1,2:1,4:1,4:2", help="detached-PPO makers:trainers")
    ap.add_argument("--scaling-launcher", default="local", choices=["local", "srun"],
                    help="srun: every scaling point is an srun step across the allocation's nodes (slurm/bench.sbatch)")
    args = ap.parse_args(argv)

    outdir = Path(args.run_dir) if args.run_dir else run_dir_name(Path(args.out))  # created once --only is checked
    cfg = {"quick": args.quick, "device": args.device}

    def collectives() -> str:
        from benchmarks.comm import collectives as c

        doc = c.run_local(args.quick, args.world, compute_device=args.device, backend=args.backend)
        doc["header"]["config"]["suite"] = cfg
        write_json(outdir / "collectives.json", doc)
        c.print_table(doc["results"])
        return "ok"

    def cost_model() -> str:
        from benchmarks.comm import cost_model as cm

        src = outdir / "collectives.json"
        if not src.exists():
            return "skipped (no collectives.json)"
        coll = json.loads(src.read_text())
        ana = cm.analyse(coll, cm.load_links())
        cm.plot(coll, ana, outdir / "cost_model.png")
        write_json(outdir / "cost_model.json", cm.build_doc(coll, ana, "cost_model.png"))
        cm.print_summary(ana)
        return "ok"

    def scaling() -> str:
        from benchmarks.comm import scaling as sc

        launcher = sc.Launcher.from_slurm() if args.scaling_launcher == "srun" else sc.Launcher()
        doc = sc.run(args.quick, sc.parse_worlds(args.scaling_worlds), args.scaling_topologies.split(","), outdir,
                     device=args.device, progress=lambda m: print(m, flush=True), launcher=launcher)
        doc["header"]["config"]["suite"] = cfg
        write_json(outdir / "scaling.json", doc)
        st = doc["results"]["status"]
        return st if st == "ok" else f"failed: {st}"

    q = ["--quick"] if args.quick else []
    steps: list[tuple[str, Callable[[], str]]] = [
        ("collectives", collectives),
        ("cost_model", cost_model),
        ("kernels", lambda: run_script("kernels", [*q, "--device", args.device], outdir, args.device, 600, cfg,
                                                  script="ops/op_kernels")),
        ("sac_throughput", lambda: run_script("sac_throughput", [*q, "--no-curve", "--png",
                                              str(outdir / "sac_throughput_curve.png")], outdir, args.device, 3600, cfg,
                                              script="sac/sac_throughput")),
        ("ppo_throughput", lambda: run_script("ppo_throughput", [*q, "--png", str(outdir / "ppo_throughput.png")],
                                              outdir, args.device, 3600, cfg, script="ppo/ppo_throughput")),
        ("weight_publish", lambda: run_script("weight_publish", q, outdir, args.device, 900, cfg,
                                              script="ppo/weight_publish")),
        ("scaling", scaling),
    ]
    if args.only:  # any step, at quick sizes with --quick (e.g. bench.sbatch QUICK=1 SCALING=1)
        keep = args.only.split(",")
        if unknown := set(keep) - {n for n, _ in steps}:
            ap.error(f"--only: unknown step(s) {sorted(unknown)}; steps are {', '.join(n for n, _ in steps)}")
        steps = [s for s in steps if s[0] in keep]
    elif args.quick:
        steps = steps[:3]
    outdir.mkdir(parents=True, exist_ok=True)
    print(f"hpcrl benchmarks -> {outdir}", flush=True)
    prog = Progress([n for n, _ in steps] + ["report"])
    failed = 0
    for name, fn in steps:
        prog.start(name)
        t0 = time.perf_counter()
        try:
            status = fn()
        except Exception as e:  # noqa: BLE001 - one failing benchmark must not lose the others
            status = f"failed: {type(e).__name__}: {e}"
        failed += status.startswith(("failed", "timed out"))
        prog.end(name, status, time.perf_counter() - t0)
    prog.start("report")
    from benchmarks.common.report import write_report

    rep = write_report(outdir, prog.log)
    prog.end("report", "ok", 0.0)
    bad = [e for p in sorted(outdir.glob("*.json")) for e in schema.validate_file(p)]
    print(f"\nreport: {rep}\n{len(list(outdir.glob('*.json')))} JSON files, schema problems: {len(bad)}")
    for e in bad:
        print("  ", e)
    return 1 if failed or bad else 0


if __name__ == "__main__":
    sys.exit(main())
