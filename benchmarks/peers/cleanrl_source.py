"""CleanRL's SAC script, the peer of benchmarks/sac/vs_cleanrl.py, got at run time and never committed here.

    python -m benchmarks.peers.cleanrl_source [--cleanrl-src DIR]   # fetch (or check DIR); print its folder

The files CleanRL's ``sac_continuous_action.py`` needs are taken from a pinned commit of vwxyzjn/cleanrl
(MIT), each checked against the sha-256 recorded in :data:`FILES`; a file that differs is refused. Where
they come from, the first that applies: ``--cleanrl-src DIR`` (a checkout the user has at :data:`COMMIT`),
``$HPCRL_CLEANRL_SRC``, the cache ``${XDG_CACHE_HOME:-~/.cache}/hpcrl/peers/cleanrl/<COMMIT>/``, else
fetched into that cache over https. Standard library only: the peer venv runs this too.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path

REPO_URL = "https://github.com/vwxyzjn/cleanrl"
COMMIT = "fe8d8a03c41a7ef5b523e2e354bd01c363e786bb"
RAW_URL = f"https://raw.githubusercontent.com/vwxyzjn/cleanrl/{COMMIT}"
FILES = {  # path in the checkout -> sha-256 of the file at COMMIT
    "cleanrl/sac_continuous_action.py": "f411ff829c864f1312dbca6a01b7a8c8830a4d9640e37beffa41630ff71bb7e0",
    "cleanrl_utils/buffers.py": "b43d54020783ac53f7d23fe7c0ed72aff20e1f377a633d134d66eb9bdbece4b8",
    "cleanrl_utils/__init__.py": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "LICENSE": "c6c269472eecb009754856b5fe1029ee53b99b986f57bf22ad7c747b04799c69",
}
SCRIPT = "cleanrl/sac_continuous_action.py"
ENV_VAR = "HPCRL_CLEANRL_SRC"
FETCH_TIMEOUT_S = 20.0


class PeerSourceError(RuntimeError):
    """CleanRL's source is missing, cannot be fetched, or differs from the pinned files (a one-line message)."""


class PeerSourceMissing(PeerSourceError):
    """CleanRL's source is not there and could not be fetched (as opposed to there but different)."""


def how_to_get() -> str:
    return (f"get CleanRL's source with network access (`python -m benchmarks.peers.cleanrl_source`), or "
            f"`git clone {REPO_URL} DIR && git -C DIR checkout {COMMIT}` and pass --cleanrl-src DIR "
            f"(or set {ENV_VAR}=DIR)")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hpcrl" / "peers" / "cleanrl" / COMMIT


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def mismatches(root: Path) -> list[str]:
    """The files under ``root`` missing or not hashing as recorded (empty: the pinned upstream files)."""
    return [name for name, digest in FILES.items()
            if not (root / name).is_file() or sha256(root / name) != digest]


def check(root: Path) -> Path:
    """``root`` if it holds the pinned files, else :class:`PeerSourceError`."""
    missing = [name for name in FILES if not (root / name).is_file()]
    if missing:
        raise PeerSourceMissing(f"CleanRL's source is not in {root} (no {', '.join(missing)}): {how_to_get()}")
    if bad := mismatches(root):
        raise PeerSourceError(f"refusing to run CleanRL: {', '.join(bad)} in {root} differ from vwxyzjn/cleanrl at "
                              f"{COMMIT} (sha-256); {how_to_get()}")
    return root


def fetch(dest: Path, base_url: str = RAW_URL) -> Path:
    """Download the pinned files into ``dest`` (through a temporary folder beside it) and check them."""
    tmp = dest.with_name(f"{dest.name}.part-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for name in FILES:
            url = f"{base_url}/{name}"
            try:
                with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as r:
                    data = r.read()
            except (urllib.error.URLError, OSError) as e:
                raise PeerSourceMissing(f"cannot fetch CleanRL's source ({url}: {getattr(e, 'reason', e)}); "
                                      f"{how_to_get()}") from None
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)
        check(tmp)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def locate(src: str | os.PathLike | None = None, fetch_missing: bool = True) -> Path:
    """The checked folder of CleanRL's source: ``src``, ``$HPCRL_CLEANRL_SRC``, the cache (fetched into
    when empty and ``fetch_missing``). Raises :class:`PeerSourceMissing` (not there, not fetchable) or
    :class:`PeerSourceError` (there but not the pinned files), each one line saying what to do."""
    given = src or os.environ.get(ENV_VAR)
    if given:
        return check(Path(given).expanduser().resolve())
    cache = cache_dir()
    if any((cache / name).exists() for name in FILES) or not fetch_missing:
        return check(cache)
    return fetch(cache)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cleanrl-src", default=None, help="a checkout of vwxyzjn/cleanrl at the pinned commit")
    a = ap.parse_args(argv)
    try:
        print(locate(a.cleanrl_src))
    except PeerSourceError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
