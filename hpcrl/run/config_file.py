"""``--config FILE``: field values of a typed dataclass config from a YAML or JSON file.

Generic over the dataclass (FastSAC's ``SACConfig`` today; any CLI's config can use it). The values
become the defaults tyro parses the flags against, so the order is: dataclass defaults < preset <
file < command-line flags. A file a run wrote (``RUN_DIR/config.json``) also holds values the run
*resolved* (world size, hosts, ...): the caller names them in ``ignore`` and they are skipped; any
other key that is not a field is refused, naming the key (a typo must not be silently dropped).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Collection

from hpcrl.run.cli import renamed, warn_renamed
from hpcrl.core.config_check import ConfigError

__all__ = ["load_config_file"]


def load_config_file(path: str | Path, cls: type, *, ignore: Collection[str] = ()) -> dict[str, Any]:
    """The ``{field: value}`` mapping in ``path`` (``.yaml``/``.yml`` as YAML, anything else as JSON;
    YAML needs pyyaml) for the dataclass ``cls``. Keys in ``ignore`` are dropped; unknown keys, a
    missing or unreadable file and a file that is not a mapping raise :class:`ConfigError` (one line,
    naming the file and what to change). Values are not range-checked here: the config's own
    ``check()`` does that after the flags are applied."""
    path = Path(path)
    where = f"--config {path}"
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{where}: cannot read it ({err.strerror or err}); pass an existing YAML or JSON file") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{where}: reading YAML needs pyyaml (pip install pyyaml), or pass a JSON file") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            at = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{where}: not valid YAML{at}; fix the file") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as err:
            raise ConfigError(f"{where}: not valid JSON ({err}); fix the file, or name a .yaml file") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must hold a mapping of field: value, not a {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key in ignore:
            continue
        if (new := renamed(str(key))) is not None:
            warn_renamed(f"{where}: key {key}", new)
            key = new
        name = str(key).replace("-", "_")  # a flag's spelling is accepted too
        if name not in fields:
            raise ConfigError(f"{where}: unknown key {key!r} (not a field of {cls.__name__}); remove it or fix "
                              f"its spelling (see --help for the fields)")
        if isinstance(value, list) and isinstance(fields[name].default, tuple):
            value = tuple(value)
        values[name] = value
    return values
