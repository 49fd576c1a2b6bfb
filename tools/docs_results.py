"""The results page and the README's headline table, read from ``benchmarks/results/*.json`` (used by
``tools/docs_gen.py``): every figure quoted is the JSON's, with the machine and the load it ran under."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

SUPERSEDED = {
    "sac_ladder.json": "sac_ladder_pendulum_peers.json",
    "sac_ladder_pendulum.json": "sac_ladder_pendulum_peers.json",
    "sac_ladder_pendulum_quiet.json": "sac_ladder_pendulum_peers.json",
    "sac_ladder_pendulum_cpp_wrapper.json": "sac_ladder_pendulum_peers.json",
    "sac_ladder_pendulum_cleanrl.json": "sac_ladder_pendulum_peers.json",
    "sac_ladder_pendulum_stored.json": "sac_ladder_pendulum_peers.json",
    "sac_ladder_world_pendulum.json": "sac_ladder_world_pendulum_shm.json",
    "sac_ladder_world_halfcheetah_cpu_quiet.json": "sac_ladder_world_halfcheetah_cpu_shm.json",
    "sac_throughput_quick.json": "sac_throughput.json",
    "learning_playground.json": "learning_playground_batch512.json",
}
"""Runs a later run of the same benchmark replaced: listed on the results page, their figures not quoted."""

MAX_FIGURES = 30  # per file on the results page; the JSON holds the rest


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def figure(data: dict, name: str) -> float:
    return float(data["figures"][name]["value"])


SCRIPT_NAMES = {"kernels": "op_kernels"}
"""Benchmarks whose JSON names them otherwise than their script."""


def script(benchmark: str) -> Path | None:
    """The script that writes a benchmark's JSON, wherever under ``benchmarks/`` it lives."""
    name = SCRIPT_NAMES.get(benchmark, benchmark)
    found = sorted(p for p in (ROOT / "benchmarks").rglob(f"{name}.py") if "peers" not in p.parts)
    return found[0] if found else None


def _num(v: float) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e15):
        return f"{int(v):,}"
    if not math.isfinite(v):
        return str(v)
    return f"{v:,.4g}" if abs(v) >= 1e-3 else f"{v:.3g}"


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.0f} s"


# The README's headline: (what, JSON under benchmarks/results (or a tuple of them), benchmark script (or a tuple),
# value from the JSON(s), one argument each).
HEADLINE: list[tuple[str, str | tuple[str, ...], str | tuple[str, ...], Callable[..., str]]] = [
    ("Pendulum, time to solve (eval ≥ −250, mean of 3 seeds) vs the real CleanRL SAC, hpcrl on 1 rank with "
     "`--compile`: training clock / from launch; LeanRL's compiled SAC from launch",
     "vs_cleanrl_pendulum_clocks/vs_cleanrl.json", "vs_cleanrl",
     lambda d: (lambda f: f"**{f('hpcrl-compile', 'speedup'):.1f}×** / **{f('hpcrl-compile', 'speedup_from_launch'):.1f}× "
                          f"faster** ({f('hpcrl-compile', 'hpcrl-compile_launch_s'):.1f} s vs "
                          f"{f('hpcrl-compile', 'cleanrl_launch_s'):.1f} s from launch); LeanRL "
                          f"{f('leanrl', 'leanrl_launch_s'):.1f} s")(
         lambda label, name: figure(d, f"pendulum_{label}_time_to_solve_{name}"))),
    ("HalfCheetah-v5, 2 seeds, 1 rank: wall time to CleanRL's 50k-step return; eval return at 50k steps, "
     "hpcrl / CleanRL", "vs_cleanrl.json", "vs_cleanrl",
     lambda d: f"**{figure(d, 'halfcheetah_time_to_cleanrl_final_ratio'):.2f}×** "
               f"({figure(d, 'halfcheetah_time_to_cleanrl_final_hpcrl_wall_s'):.0f} s vs "
               f"{figure(d, 'halfcheetah_time_to_cleanrl_final_cleanrl_wall_s'):.0f} s); "
               f"{figure(d, 'halfcheetah_at_50000_hpcrl'):,.0f} / {figure(d, 'halfcheetah_at_50000_cleanrl'):,.0f}"),
    ("FastSAC update, pendulum preset: `--compile` vs eager (flat parameters); a loop iteration of the real CleanRL / "
     "LeanRL SAC (env step, replay, updates) over the compiled update doing the same updates; 2 ranks vs 1 at the same "
     "global batch, the update alone / per update of the whole training loop",
     ("sac_ladder_pendulum_peers.json", "sac_ladder_world_pendulum_shm.json", "world_loop.json"),
     ("sac_ladder", "world_loop"),
     lambda d, w, loop: f"{figure(d, 'pendulum_compiled_update_s') * 1e3:.2f} ms vs "
                        f"{figure(d, 'pendulum_flat_update_s') * 1e3:.2f} ms "
                        f"(**{figure(d, 'pendulum_compiled_vs_flat'):.2f}×**); CleanRL / LeanRL "
                        f"**{figure(d, 'pendulum_compiled_vs_cleanrl_equal_work'):.1f}×** / "
                        f"**{figure(d, 'pendulum_compiled_vs_leanrl_equal_work'):.1f}×** the time; 2 ranks: "
                        f"{figure(w, 'pendulum_w2_vs_w1'):.2f}× / {figure(loop, 'pendulum_loop_w2_over_w1'):.2f}× the time"),
    ("Detached PPO 1:1, lag 1 vs lag 0 (40 ms rollout, 40 ms update)", "ppo_throughput.json", "ppo_throughput",
     lambda d: f"**{d['summary']['detached_1to1_over_lag0']:.2f}×** (ideal 2×)"),
    ("RLHF on the demo task, GRPO: final reward hpcrl / TRL (3 seeds); from launch to TRL's final reward with the "
     "makers' engine `hf` / `vllm` (seed 0, CPU)", ("hf_learning.json", "hf_engines_learning.json"),
     ("hf_learning", "engines_learning"),
     lambda d, e: f"{d['summary']['hpcrl-grpo']['reward_last']:.2f} / {d['summary']['trl-grpo']['reward_last']:.2f}; "
                  f"{_seconds(e['summary']['hf']['launch_to_target_s'])} / "
                  f"{_seconds(e['summary']['vllm']['launch_to_target_s'])} "
                  f"({e['summary']['hf']['tokens_per_s']:,.0f} / {e['summary']['vllm']['tokens_per_s']:,.0f} tokens/s)"),
    ("Multi-turn tool use on the demo sums, GRPO: held-out pass rate with / without the `add` tool",
     "hf_tool_learning.json", "tool_learning",
     lambda d: f"**{d['summary']['with_tool']['eval_pass_end']:.2f}** / {d['summary']['without_tool']['eval_pass_end']:.2f} "
               f"(from {d['summary']['with_tool']['eval_pass_start']:.2f} / "
               f"{d['summary']['without_tool']['eval_pass_start']:.2f})"),
    ("RLHF experience on the wire, 64 responses of 1–512 tokens: bytes sent packed vs padded; trainer padding "
     "share padded → `--ppo.pack-sequences`", "hf_wire_packing.json", "wire_packing",
     lambda d: (lambda r: f"**{r['bytes_ratio']:.2f}× fewer** ({r['packed_bytes'] / 1e3:,.0f} kB vs "
                          f"{r['padded_bytes'] / 1e3:,.0f} kB); {r['padding_frac']:.0%} → {r['packed_padding_frac']:.0%}")(
         next(r for r in d['results'] if r['layout'] == 'single-turn'))),
    ("Replay sample + n-step gather vs holosoma-style, batch 8192, 10⁶ stored", "kernels_cpu.json", "op_kernels",
     lambda d: f"**{d['targets']['replay_8192_n3_1e+06_vs_holosoma']['value']:.1f}×**"),
]


def headline_table(base: str = "") -> str:
    """The README's table: each figure linked to its script and its JSON (``base`` + the path from the
    repository root: "" in the README, "../" on a docs page)."""
    out = ["| figure | measured | from |", "|---|---|---|"]
    for what, names, benches, value in HEADLINE:
        names = (names,) if isinstance(names, str) else names
        links = []
        for bench in (benches,) if isinstance(benches, str) else benches:
            src = script(bench)
            links.append(f"[{src.name}]({base}{src.relative_to(ROOT).as_posix()})" if src else f"`{bench}`")
        src_link = ", ".join(links)
        json_links = ", ".join(f"[JSON]({base}benchmarks/results/{name})" for name in names)
        out.append(f"| {what} | {value(*map(load, names))} | {src_link} → {json_links} |")
    return "\n".join(out) + "\n"


def machine(data: dict) -> dict:
    return data.get("header") or data.get("machine") or {}


def loads(data: Any, key: str = "") -> list[float]:
    """Every 1-minute load average recorded anywhere in a result (``loadavg_start``, ``load_before``, ...)."""
    if isinstance(data, dict):
        return [x for k, v in data.items() for x in loads(v, k)]
    if key.startswith("load") and not isinstance(data, bool):
        if isinstance(data, (int, float)):
            return [float(data)]
        if isinstance(data, list) and data:
            return loads(data[0], key) if isinstance(data[0], list) else (
                [float(data[0])] if isinstance(data[0], (int, float)) else [])
    if isinstance(data, list):
        return [x for v in data for x in loads(v, key)]
    return []


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (int, float, bool)) or (isinstance(v, str) and len(v) <= 40)


def flat(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """The scalar leaves of a summary as (dotted name, value); lists (per-repeat and per-seed detail) are left
    to the JSON."""
    if isinstance(data, dict):
        return [kv for k, v in data.items() for kv in flat(v, f"{prefix}.{k}" if prefix else str(k))]
    return [(prefix, data)] if _scalar(data) and data is not None and not isinstance(data, list) else []


def _value(v: Any) -> str:
    return "—" if v is None else _num(v) if isinstance(v, (int, float)) else str(v)


def _summary_table(data: dict) -> list[str]:
    rows = flat(data)
    out = ["| figure | value |", "|---|---|"]
    out += [f"| `{k}` | {_value(v)} |" for k, v in rows[:MAX_FIGURES]]
    if len(rows) > MAX_FIGURES:
        out.append(f"| … | {len(rows) - MAX_FIGURES} more in the JSON |")
    return out if rows else []


def _rows_table(rows: list[dict]) -> list[str]:
    """One line per row of a benchmark's sweep; its scalar columns (nested ones dotted), at most 12."""
    flats = [dict(flat(r)) for r in rows if isinstance(r, dict)]
    columns: list[str] = []
    for r in flats:
        columns += [k for k in r if k not in columns]
    columns = columns[:12]
    if not columns:
        return []
    out = ["| " + " | ".join(f"`{c}`" for c in columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(_value(r.get(c)) for c in columns) + " |" for r in flats[:MAX_FIGURES]]
    return out


def figures_tables(data: dict) -> list[str]:
    """A result's figures: its ``figures`` (the common schema), else its summary and its sweep's rows."""
    if "figures" in data:
        out = ["| figure | value | unit |", "|---|---|---|"]
        return out + [f"| `{k}` | {_num(f['value'])} | {f.get('unit', '')} |" for k, f in data["figures"].items()]
    out: list[str] = []
    for key in ("summary", "targets", "ratio", "rows", "results", "publish"):
        part = data.get(key)
        table = _summary_table(part) if isinstance(part, dict) else _rows_table(part) if isinstance(part, list) else []
        if table:
            out += [f"`{key}`:", "", *table, ""]
    return out


def pngs() -> dict[str, list[str]]:
    """Each PNG of benchmarks/results with the JSON whose name is the longest prefix of its own."""
    stems = sorted((p.stem for p in RESULTS.glob("*.json")), key=len, reverse=True)
    out: dict[str, list[str]] = {}
    for png in sorted(RESULTS.glob("*.png")):
        stem = next((s for s in stems if png.stem.startswith(s)), None)
        if stem:
            out.setdefault(stem, []).append(png.name)
    return out


def _section(path: Path, images: list[str]) -> list[str]:
    data = json.loads(path.read_text())
    m = machine(data)
    bench = data.get("benchmark", path.stem)
    src = script(bench)
    lo = loads(data)
    out = [f"## {path.stem}", "",
           f"[`{path.name}`](../benchmarks/results/{path.name})"
           + (f" from [`{src.relative_to(ROOT).as_posix()}`](../{src.relative_to(ROOT).as_posix()})" if src else ""),
           "", f"- date: {str(m['date'])[:16].replace('T', ' ')}" if "date" in m else "- date: not recorded",
           (f"- machine: {m.get('cpu_model', '?')}, {m.get('cpu_count', '?')} cores, device {m.get('device', '?')}, "
            f"torch {m.get('torch', '?')}" + (f", world size {m['world_size']}" if "world_size" in m else ""))
           if m else "- machine: not recorded (each run in the JSON carries its command and load)",
           (f"- load (1-min average): {_num(min(lo))}" + (f"–{_num(max(lo))}" if max(lo) > min(lo) else ""))
           if lo else "- load: not recorded", ""]
    out += figures_tables(data)
    out += [""] if out[-1] else []
    out += [f"![{name}](../benchmarks/results/{name})\n" for name in images]
    return out


def results_page() -> str:
    images = pngs()
    current = [p for p in sorted(RESULTS.glob("*.json")) if p.name not in SUPERSEDED]
    out = ["# Results", "",
           "<!-- generated by tools/docs_gen.py from benchmarks/results/*.json: do not edit; rerun it -->", "",
           "Every figure below is read from the JSON a benchmark wrote (machine, load and configuration in its",
           "header); `.venv/bin/python tools/docs_gen.py` rewrites this page. Which claim each script backs, and",
           "the command that reproduces it: `benchmarks/README.md`. What the numbers mean,",
           "by topic: [Benchmarks](benchmarks.md). The subfolders of `benchmarks/results/` hold the per-seed parts",
           "of the CleanRL comparisons and before/after pairs; the sections below are the top-level files.", "",
           "Unless a section says otherwise the machine is a shared 2-core CPU VM without a GPU: read ratios,",
           "not absolutes, and the load next to each.", "", "## Headline", "", headline_table("../")]
    for path in current:
        out += _section(path, images.get(path.stem, []))
    out += ["## Earlier runs", "", "Replaced by a later run of the same benchmark (kept as history; not quoted):", ""]
    out += [f"- [`{old}`](../benchmarks/results/{old}) → [{Path(new).stem}](#{Path(new).stem})"
            for old, new in sorted(SUPERSEDED.items())]
    return "\n".join(out).rstrip() + "\n"
