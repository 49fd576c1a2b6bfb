"""Write ``report.md`` for a results directory from its JSON files.

    python -m benchmarks.common.report DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import schema
from benchmarks.comm.cost_model import bandwidth_text


def _t(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _bytes(n: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:g} {unit}"
    return f"{n} B"


def _collectives(doc: dict[str, Any]) -> list[str]:
    r = doc["results"]
    out = [f"## Collectives ({r['backend']}, W = {r['world']}, {r['device']})", "",
           "nccl-tests definitions: algbw = bytes / time; busbw = algbw x 2(W-1)/W (all-reduce), = algbw (broadcast). "
           "Time = median over repeats of the slowest rank.", "",
           "| op | bytes | time | algbw GB/s | busbw GB/s |", "|---|---:|---:|---:|---:|"]
    for row in r["rows"]:
        out.append(f"| {row['op']} | {_bytes(row['bytes'])} | {_t(row['time_s'])} | {row['algbw_GBps']:.4f} | "
                   f"{row['busbw_GBps']:.4f} |")
    if r.get("flat"):
        out += ["", "FastSAC flat-gradient path (flatten -> all_reduce -> unflatten_(1/W)), holosoma sizes:", "",
                "| group | params | tensors | flat path | all-reduce only | copy overhead | one all-reduce per tensor |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        for name, d in r["flat"].items():
            out.append(f"| {name} | {d['params']:,} | {d['tensors']} | {_t(d['flat_path_s'])} | "
                       f"{_t(d['allreduce_only_s'])} | {_t(d['copy_overhead_s'])} | {_t(d['per_tensor_s'])} |")
    c = r.get("update_compute")
    if c:
        out += ["", f"Per-update compute (critic fwd/bwd + actor fwd/bwd / policy_frequency, holosoma sizes, "
                    f"batch {c['batch']}, {c['device']}, {c['threads']} thread(s)): **{_t(c['per_update_s'])}**"]
    return out + [""]


def _cost(doc: dict[str, Any]) -> list[str]:
    r = doc["results"]
    out = ["## Cost model", "", "alpha-beta fits to the measured sweep (ring / tree formulas, see benchmarks/comm/cost_model.py):", "",
           "| fit | alpha | bandwidth (1/beta) | median rel. error | max rel. error |", "|---|---:|---:|---:|---:|"]
    for k, f in r["fits"].items():
        out.append(f"| {k} | {_t(f['alpha_s'])} | {bandwidth_text(f)} | {f['median_rel_err']:.2f} | "
                   f"{f['max_rel_err']:.2f} |")
    if r.get("flat_check"):
        out += ["", "Model check on the flat-gradient buffers (ring fit vs measured all-reduce):", ""]
        for name, d in r["flat_check"].items():
            out.append(f"- {name} ({_bytes(d['bytes'])}): measured {_t(d['measured_s'])}, model {_t(d['model_s'])} "
                       f"(ratio {d['ratio']:.2f})")
    if r.get("local"):
        lo = r["local"]
        out += ["", f"This machine, W = {lo['world']}: compute {_t(lo['compute_s'])}/update (batch {lo['batch']}), "
                    f"modelled comm {_t(lo['comm_model_s'])} -> efficiency {lo['efficiency_model']:.2f}."]
    out += ["", f"### FastSAC projection (weak scaling, {r['gpu_batch']} samples/rank/update, compute "
                f"{_t(r['gpu_compute_s'])}/update: {r['gpu_compute_source']}; critic+alpha {_bytes(r['critic_bytes'])}, "
                f"actor {_bytes(r['actor_bytes'])} fp32 every {r['policy_frequency']} updates)", "",
            "Link parameters: benchmarks/comm/links.json (NVLink ring busBW 370 GB/s, IB NDR 40 GB/s/GPU; sources: "
            "docs/links.md).", "",
            "| GPUs | scenario | exposed comm / update | updates/s per rank | samples/s (all ranks) | efficiency |",
            "|---:|---|---:|---:|---:|---:|"]
    for p in r["projection"]:
        sps = "-" if p["samples_per_s"] is None else f"{p['samples_per_s']:.3g}"
        mark = " **comm-bound**" if p["comm_dominates"] else ""
        out.append(f"| {p['gpus']} | {p['scenario']} | {_t(p['comm_s'])} | {p['updates_per_s']:.0f} | {sps} | "
                   f"{p['efficiency']:.2f}{mark} |")
    ref = r.get("reference", {}).get("ddppo_128_gpus")
    if ref:
        out += ["", f"Reference: DD-PPO reaches {ref['efficiency']:.0%} at {ref['gpus']} GPUs ({ref['source']})."]
    cross = r.get("crossover_gpus", {})
    out.append("")
    out.append("Communication exceeds compute from: " + ", ".join(
        f"{k}: {'never (<= 1M GPUs)' if v is None else f'{v} GPUs'}" for k, v in cross.items()) + ".")
    base1024 = [p for p in r["projection"] if p["gpus"] == 1024 and p["scenario"] == "baseline"]
    if base1024:
        out.append(f"At 1024 GPUs the baseline exposes {_t(base1024[0]['comm_s'])} of communication per update, "
                   f"so an update cheaper than that (smaller batch, faster GPU) is communication-bound.")
    if r.get("png"):
        out += ["", f"![measured vs modelled, projection]({r['png']})"]
    return out + [""]


def _generic(doc: dict[str, Any]) -> list[str]:
    out = [f"## {doc['benchmark']}", ""]
    if doc["figures"]:
        out += ["| figure | value | unit |", "|---|---:|---|"]
        for k, f in doc["figures"].items():
            out.append(f"| {k} | {f['value']:.4g} | {f['unit']} |")
    for key in ("png", "log"):
        if doc["results"].get(key):
            out.append(f"\n{key}: {doc['results'][key]}")
    if doc["results"].get("skipped"):
        out.append(f"Skipped: {doc['results']['skipped']}")
    return out + [""]


def write_report(d: str | Path, progress: list[dict[str, Any]] | None = None) -> Path:
    d = Path(d)
    docs, problems = {}, []
    for p in sorted(d.glob("*.json")):
        errs = schema.validate_file(p)
        if errs:
            problems += errs
            continue
        docs[p.stem] = json.loads(p.read_text())
    lines = [f"# hpcrl benchmark report: {d.name}", ""]
    if docs:
        h = next(iter(docs.values()))["header"]
        lines += [f"- host {h['host']} ({h['cpu_model']}, {h['cpu_count']} CPUs), device {h['device']}"
                  f"{' (' + h['gpu'] + ')' if h['gpu'] else ''}",
                  f"- torch {h['torch']}, CUDA {h['cuda']}, NCCL {h['nccl']}, git {h['git_commit']}, {h['date']}", ""]
    if progress:
        lines += ["| step | status | seconds |", "|---|---|---:|"]
        lines += [f"| {s['name']} | {s['status']} | {s['seconds']:.1f} |" for s in progress]
        lines.append("")
    order = ["collectives", "cost_model", "scaling"]
    for name in order + [k for k in docs if k not in order]:
        if name not in docs:
            continue
        doc = docs[name]
        if name == "scaling":
            from benchmarks.comm.scaling import report_lines

            lines += report_lines(doc)
            continue
        lines += _collectives(doc) if name == "collectives" else _cost(doc) if name == "cost_model" else _generic(doc)
    if problems:
        lines += ["## Schema problems", ""] + [f"- {e}" for e in problems]
    lines += ["## How to read / compare", "",
              "Every JSON has the same header and a `figures` map; `python -m benchmarks.common.compare OLD_DIR NEW_DIR` "
              "prints new/old per figure and exits 1 when one got worse by more than `--threshold` (default 10 %).", ""]
    out = d / "report.md"
    out.write_text("\n".join(lines))
    return out


if __name__ == "__main__":
    print(write_report(sys.argv[1]))
