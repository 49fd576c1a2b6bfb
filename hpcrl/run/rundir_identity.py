"""A run's identity: what must not change on resume (FastSAC: env, sizes, seed, world size, network
shapes, ...). The caller passes a flat dict; checkpoints store it with :func:`identity_hash`, and
:func:`identity_difference` names the first field that differs, with both values."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

__all__ = ["identity_difference", "identity_hash", "normalize_identity"]


def normalize_identity(identity: Mapping[str, Any]) -> dict[str, Any]:
    """The identity as JSON will give it back (tuples -> lists, keys -> str), so both sides compare alike."""
    return json.loads(json.dumps(dict(identity), default=str))


def identity_hash(identity: Mapping[str, Any]) -> str:
    canonical = json.dumps(normalize_identity(identity), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=8).hexdigest()


_ABSENT = object()


def identity_difference(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """None when equal; else "FIELD is A in the checkpoint but B in this run" for the first field
    (in ``current``'s order) that differs, plus the names of the other differing fields."""
    saved, current = normalize_identity(saved), normalize_identity(current)
    keys = list(current) + [k for k in saved if k not in current]
    differ = [k for k in keys if saved.get(k, _ABSENT) != current.get(k, _ABSENT)]
    if not differ:
        return None

    def show(value: Any) -> str:
        return "absent" if value is _ABSENT else json.dumps(value)

    first = differ[0]
    text = (f"{first} is {show(saved.get(first, _ABSENT))} in the checkpoint but "
            f"{show(current.get(first, _ABSENT))} in this run")
    if len(differ) > 1:
        text += f" (also different: {', '.join(differ[1:])})"
    return text
