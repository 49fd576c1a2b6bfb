"""The docs cannot drift: the configuration reference, the results page and the README's headline table are
what ``tools/docs_gen.py`` makes of the typed configs and ``benchmarks/results/*.json`` today; the README
leads a newcomer to a page and a command for each task; the site builds with ``mkdocs build --strict``."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import docs_gen  # noqa: E402
import docs_results  # noqa: E402


def test_the_generated_pages_are_up_to_date():
    stale = [str(p.relative_to(ROOT)) for p in docs_gen.stale()]
    assert not stale, f"stale: {stale}; rerun .venv/bin/python tools/docs_gen.py"


def test_a_new_flag_or_a_changed_figure_makes_the_pages_stale(monkeypatch, tmp_path):
    from hpcrl.sac import SACConfig

    page = docs_gen.config_page()
    extended = dataclasses.make_dataclass("SACConfig", [("brand_new_flag", int, dataclasses.field(default=3))],
                                          bases=(SACConfig,))
    extended.__module__ = SACConfig.__module__
    rows, _ = docs_gen.flag_rows(extended)
    assert any("`--brand-new-flag`" in r for r in rows) and "--brand-new-flag" not in page

    results = tmp_path / "results"
    shutil.copytree(docs_results.RESULTS, results)
    monkeypatch.setattr(docs_results, "RESULTS", results)
    before = docs_results.results_page()
    data = json.loads((results / "ppo_throughput.json").read_text())
    data["summary"]["detached_1to1_over_lag0"] = 1.234
    (results / "ppo_throughput.json").write_text(json.dumps(data))
    after = docs_results.results_page()
    assert before != after and "1.234" in after


@pytest.mark.parametrize("module", ["hpcrl.sac", "hpcrl.ppo"])
def test_every_flag_that_help_lists_is_in_the_reference(module):
    """The reference names flags as tyro spells them: each one ``--help`` prints is on the page."""
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "COLUMNS": "80"})  # one column: flags start the lines
    assert out.returncode == 0, out.stderr[-2000:]
    listed = {f for line in out.stdout.splitlines() if re.match(r" {1,4}--[a-z]", line)
              for f in re.findall(r"--[a-z][\w.-]*[a-z0-9]", line.split("  ")[1] if line.startswith("  ") else line)}
    listed -= {"--help"}
    page = docs_gen.CONFIG_PAGE.read_text()
    positive = {re.sub(r"(^--|\.)no-", r"\1", f) for f in listed}  # --no-X is the off switch of the bool --X
    missing = sorted(f for f in positive if f"`{f}`" not in page)
    assert len(listed) > 20 and not missing, missing


def test_the_headline_table_links_each_figure_to_its_script_and_json():
    readme = docs_gen.README.read_text()
    block = readme.split(docs_gen.BEGIN, 1)[1].split(docs_gen.END, 1)[0]
    # | what | value | script → JSON |
    rows = [r for r in block.splitlines() if r.startswith("| ") and not r.startswith("| figure")]
    assert 1 <= len(rows) <= 8
    for row in rows:
        links = re.findall(r"\]\(([^)]+)\)", row)
        assert any(link.endswith(".py") for link in links) and any(link.endswith(".json") for link in links), row
        assert all((ROOT / link).is_file() for link in links), row


def test_readme_is_a_front_door():
    """At most ~200 lines, nothing about how the project was made, and a quick start whose every block leads
    to a docs page that holds a command of the same program."""
    text = docs_gen.README.read_text()
    assert len(text.splitlines()) <= 200
    assert not re.search(r"this session|no GPU was lent|helper|issue \d+", text, re.I)
    quick = text.split("## Quick start by task", 1)[1].split("\n## ", 1)[0]
    sections = re.findall(r"\((docs/[\w-]+\.md)\)[^`]*?```bash\n(.*?)```", quick, re.S)
    assert len(sections) >= 4
    for page, block in sections:
        programs = set(re.findall(r"-m ([\w.]+)|(sbatch)", block))
        body = (ROOT / page).read_text()
        assert any(p and (f"-m {p}" in body or p in body) for pair in programs for p in pair), (page, programs)


def test_every_relative_link_in_the_readme_and_docs_names_a_file():
    """The site build checks docs/ against itself; this also covers the README and links out of docs/."""
    pages = [docs_gen.README, *sorted((ROOT / "docs").glob("*.md"))]
    wrong = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            target = link.split("#", 1)[0]
            if not target or re.match(r"[a-z]+:", target):
                continue
            if not (page.parent / target).exists():
                wrong.append(f"{page.relative_to(ROOT)}: {link}")
    assert not wrong, wrong


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason="mkdocs or mkdocs-material is not installed (the docs extra)")
def test_the_site_builds_strict(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()
