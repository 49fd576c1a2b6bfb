"""What every ``python -m hpcrl.*`` command line shares: tyro parsing whose errors are one line, the
value of a flag read before parsing, and the exception -> exit code ladder of the training entry
points. Light on purpose (tyro is imported when a parse runs): the entry points refuse bad flags and
run dirs before anything heavy loads."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import os
import re
import shlex
import sys
import types
from typing import Annotated, Any, Callable, Literal, Union, get_args, get_origin, get_type_hints

from hpcrl.core.config_check import ConfigError, show
from hpcrl.core.conventions import EXIT_BAD_CONFIG, EXIT_DISK, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_NONFINITE, EXIT_STOPPED

__all__ = ["OLD_NAMES", "bool_flags", "cli", "exit_code", "flag_value", "renamed", "respell_bools", "spell_bools",
           "switch_value", "tyro_call", "warn_renamed"]

# Config fields renamed when each concept got one word ("average" gradients, "replica check"); the old
# spellings still work, with a warning, for one release: as flags and as --config file keys.
OLD_NAMES = {"grad_sync": "grad_average", "check_sync_every": "check_replicas_every"}


def renamed(name: str) -> str | None:
    """The current name of an old field name ``name`` (spelt with ``-`` or ``_``, kept so), else None."""
    new = OLD_NAMES.get(name.replace("-", "_"))
    return None if new is None else (new.replace("_", "-") if "-" in name else new)


def warn_renamed(old: str, new: str) -> None:
    print(f"hpcrl: warning: {old} is now {new}; the old name goes in the next release", file=sys.stderr, flush=True)


def _current_flags(argv: list[str]) -> list[str]:
    out = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        new = renamed(flag[2:]) if flag.startswith("--") else None
        if new is not None:
            warn_renamed(flag, "--" + new)
            arg = "--" + new + eq + value
        out.append(arg)
    return out


def flag_value(argv: list[str], name: str) -> str | None:
    """The value of ``name V`` / ``name=V`` in ``argv`` (the last one wins, as in tyro), or None;
    :class:`ConfigError` when the flag is there without a value."""
    found = None
    for i, arg in enumerate(argv):
        if arg == name:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"{name} needs a value")
            found = argv[i + 1]
        elif arg.startswith(name + "="):
            found = arg[len(name) + 1:]
    return found


def tyro_call(parse: Callable[[], Any], prog: str, default: Any = None) -> Any:
    """Run a tyro parse; a parse error (tyro prints a box of help and exits 2) becomes one
    :class:`ConfigError` line: tyro's message, its "perhaps you meant ..." flags, and a value that
    works for the flag it names (from ``default``, the config the flags are parsed against, else
    tyro's shown default). ``--help`` (exit 0) prints as tyro prints it."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
            return parse()
    except SystemExit as err:
        text = out.getvalue()
        if not err.code:  # --help: the captured text is the help
            print(text, end="")
            raise
        text = _error_unwrapped(parse) or text
        raise ConfigError(_tyro_message(text, default) + f"; see {prog} --help") from None


_WIDE = "100000"


def _error_unwrapped(parse: Callable[[], Any]) -> str | None:
    """The error box of the same failing parse, rendered ``_WIDE`` columns wide. tyro wraps its box at
    the terminal's width (``shutil.get_terminal_size``: ``COLUMNS`` first), cutting a long path or
    value mid-word; joined back into one line, the cut became a space (``/tmp/run_ dir``)."""
    out, before = io.StringIO(), os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = _WIDE
    try:
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
            parse()
    except SystemExit as err:
        return out.getvalue() if err.code else None
    except Exception:  # the first parse's box is still there to report
        return None
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before
    return None


def cli(cls: type, argv: list[str], prog: str, **kwargs: Any) -> Any:
    """``tyro.cli(cls, args=argv, prog=prog, **kwargs)`` through :func:`tyro_call` (old flag names renamed,
    bool flags in any of their spellings: :func:`spell_bools`)."""
    import tyro

    argv = spell_bools(cls, _current_flags(list(argv)))
    return tyro_call(lambda: tyro.cli(cls, args=argv, prog=prog, **kwargs), prog, kwargs.get("default"))


BoolStyle = Literal["switch", "value"]
"""How tyro takes a bool field: ``switch``, a field with a default (``--x`` / ``--no-x``); ``value``, one
without a default or ``bool | None`` (``--x True``)."""


def bool_flags(cls: Any, prefix: str = "--") -> dict[str, BoolStyle]:
    """Every bool flag of the tyro command line of ``cls`` (a dataclass, or a class parsed by its
    constructor), nested groups by dots (``--ppo.trim-padding``), with the style tyro gives it."""
    import tyro

    out: dict[str, BoolStyle] = {}
    for name, hint, has_default in _parameters(cls):
        marks = get_args(hint)[1:] if get_origin(hint) is Annotated else ()
        hint = get_args(hint)[0] if marks else hint
        if any(m is tyro.conf.Suppress for m in marks):
            continue
        flag = prefix + name.replace("_", "-")
        inner = [a for a in get_args(hint) if a is not type(None)] if _is_union(hint) else [hint]
        if inner == [bool]:
            out[flag] = "switch" if has_default and hint is bool else "value"
        elif len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            omit = any(m is tyro.conf.OmitArgPrefixes for m in marks)
            out.update(bool_flags(inner[0], prefix if omit else flag + "."))
    return out


def _parameters(cls: Any) -> list[tuple[str, Any, bool]]:
    """``(name, type hint, has a default)`` of each field of a dataclass / constructor argument."""
    if dataclasses.is_dataclass(cls):
        hints = get_type_hints(cls, include_extras=True)
        return [(f.name, hints.get(f.name), f.default is not dataclasses.MISSING
                 or f.default_factory is not dataclasses.MISSING) for f in dataclasses.fields(cls) if f.init]
    try:
        hints = get_type_hints(cls.__init__, include_extras=True)
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError, NameError):
        return []
    return [(p.name, hints.get(p.name), p.default is not p.empty) for p in params if p.name in hints]


def _is_union(hint: Any) -> bool:
    return get_origin(hint) in (Union, types.UnionType)


_TRUE, _FALSE = "true", "false"


def spell_bools(cls: Any, argv: list[str]) -> list[str]:
    """``argv`` with every bool flag of ``cls`` in the spelling tyro takes for it, so that each takes the
    same four everywhere: ``--x``, ``--no-x``, ``--x True`` / ``--x False`` (``=`` too, any case). tyro
    takes a field with a default only as ``--x`` / ``--no-x`` and a ``bool | None`` field only as
    ``--x True``; the README and the docs write both kinds with values."""
    return respell_bools(argv, bool_flags(cls))


def switch_value(argv: list[str], flag: str) -> bool:
    """The value of the switch ``flag`` in ``argv`` in any of its spellings (the last one wins; default
    False), read before parsing; :class:`ConfigError` for a value that is no bool."""
    value = False
    for arg in respell_bools(argv, {flag: "switch"}):
        if arg in (flag, _negated(flag)):
            value = arg == flag
    return value


def respell_bools(argv: list[str], styles: dict[str, BoolStyle]) -> list[str]:
    """:func:`spell_bools` for the bool flags ``styles`` names (:func:`bool_flags`)."""
    negated = {_negated(flag): flag for flag in styles}
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        key = name.replace("_", "-") if name.startswith("--") else name
        flag = key if key in styles else negated.get(key)
        if flag is None or (eq and key not in styles):
            out.append(arg)
            i += 1
            continue
        if key != flag:  # --no-x
            truth, used = _FALSE, 1
        elif eq:
            truth, used = value.lower(), 1
        elif i + 1 < len(argv) and (argv[i + 1].lower() in (_TRUE, _FALSE)
                                    or styles[flag] == "value" and not argv[i + 1].startswith("-")):
            truth, used = argv[i + 1].lower(), 2  # a value-style flag's other values (None) pass as given
        else:
            truth, used = _TRUE, 1
        if truth not in (_TRUE, _FALSE) and (eq or styles[flag] == "switch"):
            raise ConfigError(f"{flag} {value}: a bool flag takes {flag}, {_negated(flag)}, {flag} True or {flag} "
                              "False")
        if truth not in (_TRUE, _FALSE):  # --x None (a bool | None flag), or tyro's own error names the value
            out += argv[i:i + used]
        elif styles[flag] == "switch":
            out.append(flag if truth == _TRUE else _negated(flag))
        else:
            out += [flag, "True" if truth == _TRUE else "False"]
        i += used
    return out


def _negated(flag: str) -> str:
    """tyro's negation of a switch: ``--group.no-name``."""
    group, dot, name = flag[2:].rpartition(".")
    return f"--{group}{dot}no-{name}"


_RULE = re.compile(r"[─━]{3,}|[+|\s]*-{3,}[+|\s]*$")  # a box's horizontal line (a title may sit in it)
_FLAG = re.compile(r"--[A-Za-z0-9][\w.-]*")
_SHOWN_DEFAULT = re.compile(r"\(default: ([^)]*)\)")


def _sections(text: str) -> list[list[str]]:
    """The non-empty lines of a tyro error box between its rules (a title above the first rule, as
    tyro prints it without a terminal, is dropped)."""
    sections: list[list[str]] = []
    current: list[str] | None = None  # None: before the first rule
    for line in (raw.strip(" │┃\t") for raw in text.splitlines()):
        if _RULE.search(line) if "─" in line or "━" in line else _RULE.match(line):
            current = []
            sections.append(current)
        elif line and current is not None:
            current.append(line)
    sections = [s for s in sections if s]
    return sections or [[line.strip() for line in text.splitlines() if line.strip()]]


def _example(flag: str, default: Any, shown: str | None) -> str | None:
    """A value that works for ``flag``: its value in ``default`` (nested groups by dots), else tyro's."""
    value = default
    for part in flag[2:].replace("-", "_").split("."):
        value = getattr(value, part, None) if value is not None else None
    if value is not None and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return shlex.quote(str(value)) if isinstance(value, str) else show(value)
    return shown


def _tyro_message(text: str, default: Any = None) -> str:
    """One line from a tyro error box: its message, the flags it suggests, and an example value."""
    sections = _sections(text)
    if not sections:
        return "could not parse the command line"
    message = re.sub(r"\s+", " ", " ".join(sections[0]))
    extra = []
    for section in sections[1:]:
        joined = " ".join(section)
        if section[0].lower().startswith("perhaps you meant"):
            flags = [m.group(0) for line in section[1:] if (m := _FLAG.match(line))]
            if flags:
                extra.append("perhaps you meant " + " or ".join(dict.fromkeys(flags)))
        elif section[0].lower().startswith("argument helptext") and (named := _FLAG.search(message)):
            shown = _SHOWN_DEFAULT.search(joined)
            if (value := _example(named.group(0), default, shown.group(1) if shown else None)) is not None:
                extra.append(f"e.g. {named.group(0)} {value}")
    return "; ".join([message.rstrip(". "), *extra])


def exit_code(err: BaseException, prog: str, failures: tuple[type[BaseException], ...] = ()) -> int | None:
    """The exit code of an exception that ended a run, after printing its one line on stderr; None
    for an exception that is a bug (the caller re-raises it: a traceback). ``failures``: more types
    that mean "a rank failed" (exit 1; e.g. detached PPO's lost trainer)."""
    from hpcrl.comm.local import SpawnConfigError, SpawnDataError, SpawnError, is_config_error, is_data_error
    from hpcrl.core.diskfault import DiskFault

    DISK_FAULT = f"{DiskFault.__module__}.{DiskFault.__qualname__}"  # how a rank's error record names it

    if isinstance(err, KeyboardInterrupt):
        print(f"{prog}: interrupted: stopped without a checkpoint", file=sys.stderr)
        return EXIT_INTERRUPTED
    if isinstance(err, DiskFault) or getattr(err, "type_name", "") == DISK_FAULT:
        code = EXIT_DISK  # before the config branch: a DiskFault is a RunDirError too
    elif isinstance(err, SpawnDataError) or is_data_error(err):  # one rank's line, whichever ranks hit it
        code = EXIT_NONFINITE
    elif isinstance(err, SpawnConfigError) or is_config_error(err):
        code = EXIT_BAD_CONFIG
    elif isinstance(err, (SpawnError, *failures)):
        code = EXIT_FAILED  # the message names the rank that failed first (and carries its traceback)
    else:
        return None
    print(f"{prog}: error: {err}", file=sys.stderr)
    return code


def run_exit(rows: list[Any]) -> int:
    """0, or :data:`EXIT_STOPPED` when a rank's final row says it stopped on request after a checkpoint."""
    return EXIT_STOPPED if any(row and row.get("preempted") for row in rows) else 0
