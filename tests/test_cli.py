"""Every command line answers a bad flag with one line (flag, value, a valid value, tyro's "perhaps you
meant"), exit 2; the shared pieces of hpcrl.run.cli (tyro's box to one line, a flag's value before
parsing, the exit-code ladder)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from hpcrl.run import cli
from hpcrl.core.config_check import ConfigError, DataError
from hpcrl.core.conventions import EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_NONFINITE
from hpcrl.run.rundir import RunDirError

UNICODE_BOX = """\
╭─ Unrecognized options ─────────────────────────────────────────╮
│ Unrecognized options: --total-env-step, 5                      │
│ ────────────────────────────────────────────────────────────── │
│ Perhaps you meant:                                             │
│     --total-env-steps INT                                      │
│         Transitions to collect over all ranks (>= 1; rounded   │
│         up to a multiple of num_envs). (default: 100000)       │
│ ────────────────────────────────────────────────────────────── │
│ For full helptext, run /tmp/x.py --help                        │
╰────────────────────────────────────────────────────────────────╯
"""
PLAIN_BOX = """\
 Value error
 -----------------------------------------------------------
  Error parsing --batch-size: invalid literal for int() with
  base 10: 'abc'
  ----------------------------------------------------------
  Argument helptext:
  --batch-size INT
  GLOBAL batch per update (>= 1). (default: 8192)
  ----------------------------------------------------------
  For full helptext, see x --help
"""


class Preset:
    batch_size = 256


def test_a_tyro_box_becomes_one_line_with_the_suggestion_and_a_value_that_works():
    assert cli._tyro_message(UNICODE_BOX) == ("Unrecognized options: --total-env-step, 5; "
                                              "perhaps you meant --total-env-steps")
    assert cli._tyro_message(PLAIN_BOX) == ("Error parsing --batch-size: invalid literal for int() with base 10: "
                                            "'abc'; e.g. --batch-size 8192")
    assert cli._tyro_message(PLAIN_BOX, Preset()).endswith("e.g. --batch-size 256")  # the values in use
    assert "\n" not in cli._tyro_message(UNICODE_BOX) and "helptext" not in cli._tyro_message(PLAIN_BOX)


def test_flag_value_is_the_last_one_and_needs_a_value():
    assert cli.flag_value(["--a", "1", "--a=2"], "--a") == "2"
    assert cli.flag_value(["--ab", "1"], "--a") is None
    with pytest.raises(ConfigError, match="--a needs a value"):
        cli.flag_value(["--a", "--b"], "--a")


def test_the_exit_code_ladder(capsys):
    assert cli.exit_code(ConfigError("bad"), "p") == EXIT_BAD_CONFIG
    assert cli.exit_code(RunDirError("in use"), "p") == EXIT_BAD_CONFIG
    assert cli.exit_code(DataError("nan"), "p") == EXIT_NONFINITE
    assert cli.exit_code(KeyboardInterrupt(), "p") == EXIT_INTERRUPTED

    class Lost(RuntimeError):
        pass

    assert cli.exit_code(Lost("trainer 1"), "p", failures=(Lost,)) == EXIT_FAILED
    assert cli.exit_code(ZeroDivisionError("bug"), "p") is None  # a bug keeps its traceback
    err = capsys.readouterr().err.splitlines()
    assert err[:3] == ["p: error: bad", "p: error: in use", "p: error: nan"] and len(err) == 5


def _main(module: str):
    import importlib

    return importlib.import_module(module).main


@pytest.mark.parametrize("module, argv, parts", [
    ("hpcrl.sac.__main__", ["--total-env-step", "5"], ["--total-env-step", "perhaps you meant --total-env-steps"]),
    ("hpcrl.sac.__main__", ["--preset", "pendulum", "--batch-size", "x"], ["--batch-size", "'x'",
                                                                           "e.g. --batch-size 256"]),
    ("hpcrl.sac.__main__", ["--amp", "fp8"], ["'fp8'", "--amp", "'bf16'"]),
    ("hpcrl.ppo.__main__", ["--total-step", "5"], ["--total-step", "perhaps you meant --total-steps"]),
    ("hpcrl.ppo.__main__", ["--env.num-env", "5"], ["perhaps you meant --env.num-envs"]),
    ("hpcrl.ppo.__main__", ["--lag", "one"], ["--lag", "'one'", "e.g. --lag 1"]),
    ("hpcrl.launch.__main__", ["sac", "--nodes", "two", "--dry-run"], ["--nodes", "'two'", "e.g. --nodes 1"]),
    ("hpcrl.plot", ["--bnd", "x"], ["--bnd", "perhaps you meant --band"]),
])
def test_every_cli_answers_a_bad_flag_with_one_line(module, argv, parts, capsys):
    assert _main(module)(argv) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "│" not in err, err
    for part in parts:
        assert part in err, err


def test_old_field_names_still_work_for_one_release_with_a_warning(tmp_path, capsys):
    """--grad-sync / --check-sync-every (and those keys in a --config file) became --grad-average /
    --check-replicas-every when each concept got one word; the old spellings parse, with a warning."""
    from hpcrl.run.config_file import load_config_file
    from hpcrl.sac.config import SACConfig

    cfg = cli.cli(SACConfig, ["--grad-sync", "view", "--check-sync-every=7"], "python -m hpcrl.sac")
    assert (cfg.grad_average, cfg.check_replicas_every) == ("view", 7)
    err = capsys.readouterr().err
    assert "--grad-sync is now --grad-average" in err and "--check-sync-every is now --check-replicas-every" in err
    path = tmp_path / "c.json"
    path.write_text('{"grad_sync": "ddp"}')
    assert load_config_file(path, SACConfig) == {"grad_average": "ddp"}
    assert "key grad_sync is now grad_average" in capsys.readouterr().err


def test_help_lists_every_preset(capsys):
    from hpcrl.sac.__main__ import main
    from hpcrl.sac.config import PRESETS

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # tyro wraps the help text
    assert all(name in out for name in PRESETS), out


def test_a_long_value_in_a_flag_error_keeps_its_characters(monkeypatch):
    # tyro wraps its box at the terminal's width: a path longer than a line was cut mid-word, and the
    # one-line message carried "/pa th" (seen with pytest-xdist's longer temp paths)
    monkeypatch.setenv("COLUMNS", "80")
    path = "/tmp/" + "a-rather-long-directory-name-" * 4 + "x.jsonl"
    with pytest.raises(ConfigError) as err:
        cli.cli(BatchOnly, ["--batch-size", path], "x")
    assert path in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert os.environ["COLUMNS"] == "80"  # the terminal's width is left as it was


@dataclasses.dataclass
class BatchOnly:
    batch_size: int = 256


def _value(obj: object, flag: str) -> object:
    for part in flag[2:].replace("-", "_").split("."):
        obj = getattr(obj, part)
    return obj


def _ppo(argv: list[str]) -> object:
    from hpcrl.ppo.config import parse_args

    return parse_args(argv)


def _sac(argv: list[str]) -> object:
    from hpcrl.sac.__main__ import parse

    return parse(argv)


def _launch(argv: list[str]) -> object:
    from hpcrl.launch.__main__ import parse

    import types

    cmd, request = parse(["sac", *argv])  # the request's flags have no group prefix (OmitArgPrefixes)
    values = {f.name: getattr(x, f.name) for x in (cmd, request) for f in dataclasses.fields(x)}
    return types.SimpleNamespace(**values)


def _classes():
    from hpcrl.launch.__main__ import LaunchCommand
    from hpcrl.ppo.config import DetachedConfig
    from hpcrl.ppo.export import ExportArgs
    from hpcrl.sac.config import SACConfig

    return [(DetachedConfig, _ppo), (SACConfig, _sac), (LaunchCommand, _launch), (ExportArgs, _ppo_export)]


def _ppo_export(argv: list[str]) -> object:
    import tyro

    from hpcrl.ppo.export import ExportArgs

    return tyro.cli(ExportArgs, args=cli.spell_bools(ExportArgs, ["run", "--out", "o", *argv]))


SPELLINGS = [(lambda f: [f], True), (lambda f: [cli._negated(f)], False), (lambda f: [f, "True"], True),
             (lambda f: [f, "False"], False), (lambda f: [f + "=true"], True), (lambda f: [f + "=FALSE"], False)]


@pytest.mark.parametrize("index", range(4), ids=["ppo", "sac", "launch", "ppo.export"])
def test_every_bool_flag_takes_the_same_spellings(index):
    """--x, --no-x, --x True / False (= and any case too) for every bool field of every command line, nested
    groups included, whether tyro makes it a switch (a field with a default) or a value (bool | None)."""
    cls, parse = _classes()[index]
    flags = cli.bool_flags(cls)
    assert "--overwrite" in flags, flags  # the walk finds them: not a vacuous pass
    for flag in flags:
        for spell, want in SPELLINGS:
            assert _value(parse(spell(flag)), flag) is want, (flag, spell(flag))
    if cls.__name__ == "DetachedConfig":
        assert flags["--hf.truncate-prompts"] == "switch" and flags["--ppo.trim-padding"] == "value", flags
        assert _value(parse(["--ppo.trim-padding", "None"]), "--ppo.trim-padding") is None  # its third value


def test_a_plugin_constructor_bool_takes_the_same_spellings():
    import tyro

    class Plugin:
        def __init__(self, fast: bool = False, exact: bool | None = None, name: str = "x") -> None:
            self.fast, self.exact = fast, exact

    assert cli.bool_flags(Plugin) == {"--fast": "switch", "--exact": "value"}
    for argv, want in [(["--fast", "True", "--exact"], (True, True)), (["--no-fast", "--no-exact"], (False, False)),
                       (["--fast=false", "--exact", "False", "--name", "y"], (False, False))]:
        got = tyro.cli(Plugin, args=cli.spell_bools(Plugin, argv))
        assert (got.fast, got.exact) == want, argv
    with pytest.raises(ConfigError, match="--fast maybe: a bool flag takes --fast, --no-fast, --fast True or"):
        cli.cli(Plugin, ["--fast=maybe"], "x")


def test_a_switch_read_before_parsing_takes_every_spelling():
    # hpcrl.ppo reads --resume / --overwrite before torch loads: "--resume False" must not mean resume
    for argv, want in [(["--resume"], True), (["--resume", "False"], False), (["--resume=TRUE"], True),
                       (["--resume", "--no-resume"], False), (["--run-dir", "r"], False)]:
        assert cli.switch_value(argv, "--resume") is want, argv
    with pytest.raises(ConfigError, match="--resume maybe: a bool flag takes"):
        cli.switch_value(["--resume=maybe"], "--resume")
