"""The house rules that keep hpcrl easy to change, checked on the source tree.

- the layer table of docs/architecture.md (pyproject.toml ``[tool.importlinter]``) holds: ``lint-imports``
  passes, and fails on a scratch copy with one import pointing up a layer;
- every module sits in a package of the table (no loose top-level modules but the entry point ``plot``);
- no module imports another module's private (``_name``) names;
- no library file over 400 lines, no function over 60.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "hpcrl"
LINT = Path(sys.executable).with_name("lint-imports")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def lint(root: Path) -> subprocess.CompletedProcess:
    if not LINT.exists():
        pytest.fail(f"{LINT} is missing: install the dev extra (pip install -e '.[dev]'), which brings import-linter")
    env = {"PATH": str(LINT.parent), "PYTHONPATH": str(root), "HOME": str(root)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def sources() -> list[Path]:
    return sorted(p for p in LIBRARY.rglob("*.py") if "__pycache__" not in p.parts)


def test_layers_hold():
    proc = lint(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def test_an_import_up_a_layer_fails(tmp_path):
    shutil.copytree(LIBRARY, tmp_path / "hpcrl", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    victim = tmp_path / "hpcrl" / "comm" / "nodelist.py"
    victim.write_text(victim.read_text() + "\nfrom hpcrl.run import metrics  # noqa: E402  up a layer\n")
    proc = lint(tmp_path)
    assert proc.returncode != 0, proc.stdout
    assert "hpcrl.comm.nodelist -> hpcrl.run.metrics" in proc.stdout, proc.stdout


def test_no_loose_top_level_modules():
    loose = sorted(p.stem for p in LIBRARY.glob("*.py") if p.stem not in {"__init__", "plot"})
    assert not loose, f"modules outside every layer (move them into a package of docs/architecture.md): {loose}"


def _module_of(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_imports_of_private_names():
    found = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "hpcrl"):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
                           and a.name != "_C"]  # the compiled extension keeps its conventional name
                if private:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {private}")
    assert not found, "imports of another module's private names (make the name public or move the code):\n" + \
        "\n".join(found)


def test_files_and_functions_are_small():
    big_files, big_functions = [], []
    for path in sources():
        text = path.read_text()
        if (n := len(text.splitlines())) > MAX_FILE_LINES:
            big_files.append(f"{path.relative_to(REPO)}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    big_functions.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {n} lines")
    assert not big_files + big_functions, "split these:\n" + "\n".join(big_files + big_functions)
