"""hpcrl.core.conventions: the torch-free facts that trainers, the launcher and the sbatch scripts share.

It and the launcher import without torch (checked in a fresh interpreter: this test session has torch
loaded already), its CLI prints the values the sbatch scripts read, the port rule keeps the steps of a
job apart, ppo_role is the detached-PPO rank layout, and the launcher and the scripts hold no copies.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from hpcrl.core import conventions
from hpcrl.core.conventions import (DEFAULT_MAKERS, DEFAULT_TRAINERS, EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_STOPPED, ppo_role,
                               rendezvous_port)

REPO = Path(__file__).resolve().parents[1]


def python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60, cwd=REPO)


@pytest.mark.parametrize("module", ["hpcrl.core.conventions", "hpcrl.launch", "hpcrl.launch.__main__"])
def test_imports_without_torch(module):
    proc = python("-c", f"import sys, {module}; bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch'); "
                        "assert not bad, bad")
    assert proc.returncode == 0, proc.stderr


def test_cli_prints_values():
    assert python("-m", "hpcrl.core.conventions", "EXIT_STOPPED").stdout == f"{EXIT_STOPPED}\n" == "75\n"
    assert python("-m", "hpcrl.core.conventions", "DEFAULT_TRAINERS").stdout == f"{DEFAULT_TRAINERS}\n"
    assert python("-m", "hpcrl.core.conventions", "rendezvous_port", "1234", "3").stdout == f"{rendezvous_port(1234, 3)}\n"
    assert python("-m", "hpcrl.core.conventions", "rendezvous_port", "1234").stdout == f"{rendezvous_port(1234, 0)}\n"
    assert python("-m", "hpcrl.core.conventions", "ppo_role", "1", "1", "1").stdout == "maker\n"


@pytest.mark.parametrize("args, message", [
    (["EXIT_STOPPPED"], "unknown name 'EXIT_STOPPPED'; known: DEFAULT_MAKERS"),
    (["sys"], "unknown name 'sys'"),  # module globals outside __all__ are not conventions
    (["_main"], "unknown name '_main'"),
    ([], "usage: python -m hpcrl.core.conventions NAME [ARGS]"),
    (["rendezvous_port", "x"], "rendezvous_port('x',)"),
    (["ppo_role", "5", "1", "1"], "rank 5 outside a world of 2"),
])
def test_cli_exits_2_on_bad_input(args, message):
    proc = python("-m", "hpcrl.core.conventions", *args)
    assert (proc.returncode, proc.stdout) == (EXIT_BAD_CONFIG, "") and message in proc.stderr, proc.stderr


def test_exit_codes_are_distinct():
    assert len({0, EXIT_FAILED, EXIT_BAD_CONFIG, EXIT_STOPPED}) == 4
    assert EXIT_STOPPED == 75  # sysexits EX_TEMPFAIL: what requeue logic outside this repo may know too


def test_port_rule_keeps_the_steps_of_a_job_apart():
    for job in (0, 1, 4321, 9999, 10_000, 123_456_789):
        ports = [rendezvous_port(job, step) for step in range(10_000)]
        assert len(set(ports)) == 10_000 and min(ports) >= 20000 and max(ports) <= 29999
        assert ports[0] == rendezvous_port(job) == 20000 + job % 10000  # step 0: the job id alone
    assert rendezvous_port(1234, 1) == 20000 + (1234 + 7919) % 10000


def test_ppo_role_is_the_detached_rank_layout():
    assert [ppo_role(r, 2, 3) for r in range(5)] == ["trainer"] * 2 + ["maker"] * 3
    assert DEFAULT_TRAINERS >= 1 and DEFAULT_MAKERS >= 1
    assert ppo_role(DEFAULT_TRAINERS, DEFAULT_TRAINERS, DEFAULT_MAKERS) == "maker"
    for bad in [(0, 0, 1), (0, 1, 0)]:
        with pytest.raises(ValueError, match="needs >= 1 trainer and >= 1 maker"):
            ppo_role(*bad)
    for rank in (-1, 5):
        with pytest.raises(ValueError, match=f"rank {rank} outside a world of 5"):
            ppo_role(rank, 2, 3)


def test_every_public_name_is_exported():
    """What the CLI can print: every public constant and function of the module."""
    constants = {n for n in vars(conventions) if n.isupper() and not n.startswith("_")}
    functions = {n for n, v in vars(conventions).items() if inspect.isfunction(v) and not n.startswith("_")
                 and v.__module__ == conventions.__name__}
    assert constants | functions == set(conventions.__all__)


COPIED = {"75": "hpcrl.core.conventions.EXIT_STOPPED", "20000": "hpcrl.core.conventions.rendezvous_port",
          "7919": "hpcrl.core.conventions.rendezvous_port", "10000": "hpcrl.core.conventions.rendezvous_port"}


def numbers(path: Path) -> set[str]:
    """Number literals in the code of ``path`` (not in comments or, for Python, strings and docstrings)."""
    if path.suffix == ".py":
        with path.open() as f:
            return {t.string for t in tokenize.generate_tokens(f.readline) if t.type == tokenize.NUMBER}
    code = [line.split(" #", 1)[0] for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    return set(re.findall(r"\b\d+\b", "\n".join(code)))


SHARERS = sorted((REPO / "slurm").glob("*.sbatch")) + sorted((REPO / "hpcrl" / "launch").glob("*.py"))


@pytest.mark.parametrize("path", SHARERS, ids=lambda p: p.name)
def test_launcher_and_scripts_hold_no_copies(path):
    """The stop exit code and the port rule come from hpcrl.core.conventions, not from literals of their own."""
    copies = {n: COPIED[n] for n in numbers(path) & COPIED.keys()}
    assert not copies, f"{path.name} repeats {sorted(copies)}: use {sorted(set(copies.values()))}"
