"""Every command in the README's and the docs' ``bash`` blocks runs as written after command 1: it
goes through the venv (no bare ``python`` / ``pip``), names files that exist, and its flags parse and
pass the config checks of the command it calls. Training commands are parsed and checked, not run
(other tests run them); cheap ones run for real (the hf demo's builder, ``--dry-run`` submissions).
docs/gpu.md is left out of the venv rule: its commands run in the user's own CUDA environment."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
OWN_ENVIRONMENT = {"docs/gpu.md"}  # "in the environment that holds that (CUDA) torch"


def commands(page: str) -> list[str]:
    text = (ROOT / page).read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.extend(part.strip() for part in line.split("&&"))
    return out


ALL = [(page, cmd) for page in PAGES for cmd in commands(page)]


TASK_PAGES = ["docs/getting-started.md", "docs/fastsac.md", "docs/ppo.md", "docs/rlhf.md", "docs/slurm.md"]


def test_the_pages_have_commands():
    """The README's two commands and quick start, and every task page of the docs, are checked here."""
    assert len([c for p, c in ALL if p == "README.md"]) >= 10
    assert all(any(p == page for p, _ in ALL) for page in TASK_PAGES), TASK_PAGES


_INLINE_COMMAND = re.compile(r"^(?:[A-Z_]+=\S*\s+)*(?:python3?|pip3?|\.venv/bin/\S+)(?:\s|$)")


def inline_commands(page: str) -> list[tuple[int, str]]:
    """(line, command) of the inline code spans outside fenced blocks that start like a command typed into
    a shell: ``python``, ``pip`` or ``.venv/bin/...`` (after any ``VAR=value``); a span may wrap a line."""
    text = (ROOT / page).read_text()
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)  # keep line numbers
    out = []
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
        span = re.sub(r"\s*\n\s*", " ", m.group(1)).strip()
        if "\n\n" not in m.group(1) and _INLINE_COMMAND.match(span):
            out.append((text.count("\n", 0, m.start()) + 1, span))
    return out


@pytest.mark.parametrize("page", sorted(set(PAGES) - OWN_ENVIRONMENT))
def test_python_and_pip_go_through_the_venv(page):
    bare = [c for c in commands(page) if re.search(r"(^|\s)(python3?|pip3?)\s", c)]
    assert not bare, f"{page}: use .venv/bin/python / .venv/bin/pip: {bare}"
    bare = [f"line {n}: {c}" for n, c in inline_commands(page) if re.search(r"(^|\s)(python3?|pip3?)(\s|$)", c)]
    assert not bare, f"{page}: inline commands must use .venv/bin/python / .venv/bin/pip: {bare}"


def test_inline_commands_name_what_exists():
    """An inline ``.venv/bin/python -m MODULE`` names a module that exists, ``.venv/bin/python FILE.py`` a
    file of the repository, ``.venv/bin/X`` a program that setup installs (placeholders are left alone)."""
    import importlib.util

    found, wrong = 0, []
    for page in PAGES:
        for n, cmd in inline_commands(page):
            try:
                words = _words(cmd)
            except ValueError:  # an unbalanced quote: a fragment, not a command
                wrong.append(f"{page}:{n}: {cmd}")
                continue
            found += 1
            if words[0] in (".venv/bin/python", ".venv/bin/python3") and len(words) > 1:
                if words[1] == "-m" and len(words) > 2:
                    if importlib.util.find_spec(words[2]) is None:
                        wrong.append(f"{page}:{n}: no module {words[2]}: {cmd}")
                elif words[1].endswith(".py") and not (ROOT / words[1]).is_file():
                    wrong.append(f"{page}:{n}: no file {words[1]}: {cmd}")
            elif words[0].startswith(".venv/bin/") and words[0] not in (".venv/bin/pip", ".venv/bin/python"):
                if not (Path(sys.executable).parent / Path(words[0]).name).exists():
                    wrong.append(f"{page}:{n}: {words[0]} is not installed: {cmd}")
    assert found >= 10 and not wrong, wrong


def _words(cmd: str) -> list[str]:
    words = shlex.split(cmd)
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):  # VAR=value prefixes
        words.pop(0)
    for launcher in ("sudo", "srun"):  # srun's own flags come before the program
        if words and words[0] == launcher:
            words = words[1:]
            while words and words[0].startswith("-"):
                words.pop(0)
    return words


def _module_args(words: list[str]) -> tuple[str, list[str]] | None:
    if len(words) >= 3 and words[0].endswith("python") and words[1] == "-m":
        return words[2], words[3:]
    return None


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, hf_demo):
    """A working directory where the README's earlier commands have left what later ones read: the hf
    demo's model and prompts (``runs/hf-demo``: the session's real build), a FastSAC run's config.json."""
    d = tmp_path_factory.mktemp("readme")
    (d / "runs").mkdir()
    (d / "runs" / "hf-demo").symlink_to(hf_demo.out, target_is_directory=True)
    from hpcrl.ppo import demo_tools

    demo_tools.build(d / "runs" / "tools-demo", pretrain_steps=2)  # the files the commands read, not a trained model
    return d


def _check_sac(args: list[str], workdir: Path) -> None:
    from hpcrl.sac.__main__ import parse

    config = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"), None)
    if config and not (workdir / config).exists():  # what the run that used that run dir wrote
        origin = next(c for p, c in ALL if f"--run-dir {Path(config).parent}" in c and "--config" not in c)
        cfg = parse(_module_args(_words(origin))[1])
        (workdir / config).parent.mkdir(parents=True, exist_ok=True)
        (workdir / config).write_text(json.dumps(dataclasses.asdict(cfg)))
    parse(args).check()


def _check_ppo(args: list[str], workdir: Path) -> None:
    from hpcrl.ppo.config import parse_args

    parse_args(args).check()


def _check_parse_only(module: str, args: list[str]) -> None:
    from hpcrl.run.cli import cli

    cls = {"hpcrl.sac.play": "hpcrl.sac.play:PlayConfig", "hpcrl.sac.export": "hpcrl.sac.export:ExportConfig",
           "hpcrl.plot": "hpcrl.plot:PlotConfig"}[module]
    name, attr = cls.split(":")
    cli(getattr(__import__(name, fromlist=[attr]), attr), args, f"python -m {module}")


def _check_launch(args: list[str], capsys) -> None:
    """A dry run: the flags parse and the launcher checks the request against the cluster it finds. The
    README's examples ask for a cluster of 4-GPU nodes with a ``gpu`` partition; on the local test
    cluster (2 GPUs a node, partition ``debug``) the right outcome is the one-line fit refusal."""
    from hpcrl.launch.__main__ import main

    code = main([*args, "--dry-run"] if "--dry-run" not in args else args)
    err = capsys.readouterr().err
    fit_refusal = re.search(r"unknown partition|have at most \d+ GPUs|invalid partition", err)
    assert code == 0 or (code == 2 and fit_refusal and err.count("\n") == 1), err


def _runs_help(words: list[str]) -> None:
    out = subprocess.run([sys.executable, *words[1:], "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize("page, cmd", ALL, ids=[f"{p}:{i}" for i, (p, _) in enumerate(ALL)])
def test_command_runs_as_written(page, cmd, workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    words = _words(cmd)
    prog = words[0]
    found = _module_args(words)
    if prog == "bash" or prog == "sbatch":  # scripts: they exist (golden sbatch tests and CI run them)
        script = next(w for w in words[1:] if w.endswith((".sh", ".sbatch")))
        assert (ROOT / script).is_file(), script
    elif prog.endswith("pip"):
        assert prog == ".venv/bin/pip" or page in OWN_ENVIRONMENT
        if any(w.startswith(".") or w == "-e" for w in words[2:]):  # hpcrl itself (with extras)
            assert "--no-build-isolation" in words, "the extension must build against the installed torch"
    elif prog in ("tensorboard",):
        pass
    elif found is None:  # python SCRIPT.py ...: the script exists and its flags are documented
        script = next(w for w in words[1:] if w.endswith(".py") or w == "-c")
        if script != "-c":
            assert (ROOT / script).is_file(), script
    else:
        module, args = found
        if module == "hpcrl.sac":
            _check_sac(args, workdir)
        elif module == "hpcrl.ppo":
            _check_ppo(args, workdir)
        elif module in ("hpcrl.sac.play", "hpcrl.sac.export", "hpcrl.plot"):
            _check_parse_only(module, args)
        elif module == "hpcrl.launch":
            _check_launch(args, capsys)
        elif module == "hpcrl.ppo.demo" and "--engine" in args:  # a build the fixture did not make: checked
            from hpcrl.ppo import demo

            assert demo.refusal(args) is None, demo.refusal(args)
        elif module in ("hpcrl.ppo.demo", "hpcrl.ppo.demo_tools"):
            if "--show" not in args:  # the builder ran in the fixture; its dir must not be rebuilt silently
                assert (workdir / args[0] / "model").is_dir()
        elif module == "pytest":
            pass  # this is it
        elif module.startswith("benchmarks"):
            _runs_help(words)
        else:
            pytest.fail(f"{page}: no check for python -m {module}: {cmd}")
