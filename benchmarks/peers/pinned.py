"""A peer's source, got at run time from a pinned commit and never committed here.

Each file a peer's script needs is checked against the sha-256 recorded in :attr:`Pinned.files`; a file that
differs is refused. Where the files come from, the first that applies: a folder the user names (a checkout at
the commit), the peer's environment variable, the cache ``${XDG_CACHE_HOME:-~/.cache}/hpcrl/peers/<name>/<commit>/``,
else fetched into that cache over https. Standard library only: the peer venv runs this too.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

FETCH_TIMEOUT_S = 20.0


class PeerSourceError(RuntimeError):
    """A peer's source is missing, cannot be fetched, or differs from the pinned files (a one-line message)."""


class PeerSourceMissing(PeerSourceError):
    """A peer's source is not there and could not be fetched (as opposed to there but different)."""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class Pinned:
    """One peer: its GitHub repository, the commit, the files its script needs with their digests."""

    name: str  # as a user calls it: "CleanRL"
    repo: str  # owner/name on GitHub
    commit: str
    files: dict[str, str]  # path in the checkout -> sha-256 at the commit
    script: str  # the file that runs (one of files)
    env_var: str  # names a checkout at the commit
    flag: str  # the benchmarks' flag that names one

    @property
    def url(self) -> str:
        return f"https://github.com/{self.repo}"

    @property
    def raw_url(self) -> str:
        return f"https://raw.githubusercontent.com/{self.repo}/{self.commit}"

    def how_to_get(self) -> str:
        return (f"get {self.name}'s source with network access, or `git clone {self.url} DIR && git -C DIR checkout "
                f"{self.commit}` and pass {self.flag} DIR (or set {self.env_var}=DIR)")

    def cache_dir(self) -> Path:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "hpcrl" / "peers" / self.name.lower() / self.commit

    def mismatches(self, root: Path) -> list[str]:
        """The files under ``root`` missing or not hashing as recorded (empty: the pinned upstream files)."""
        return [name for name, digest in self.files.items()
                if not (root / name).is_file() or sha256(root / name) != digest]

    def check(self, root: Path) -> Path:
        """``root`` if it holds the pinned files, else :class:`PeerSourceError`."""
        missing = [name for name in self.files if not (root / name).is_file()]
        if missing:
            raise PeerSourceMissing(f"{self.name}'s source is not in {root} (no {', '.join(missing)}): "
                                    f"{self.how_to_get()}")
        if bad := self.mismatches(root):
            raise PeerSourceError(f"refusing to run {self.name}: {', '.join(bad)} in {root} differ from {self.repo} at "
                                  f"{self.commit} (sha-256); {self.how_to_get()}")
        return root

    def fetch(self, dest: Path, base_url: str | None = None) -> Path:
        """Download the pinned files into ``dest`` (through a temporary folder beside it) and check them."""
        base_url = base_url or self.raw_url
        tmp = dest.with_name(f"{dest.name}.part-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            for name in self.files:
                url = f"{base_url}/{name}"
                try:
                    with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as r:
                        data = r.read()
                except (urllib.error.URLError, OSError) as e:
                    raise PeerSourceMissing(f"cannot fetch {self.name}'s source ({url}: {getattr(e, 'reason', e)}); "
                                            f"{self.how_to_get()}") from None
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp / name).write_bytes(data)
            self.check(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    def locate(self, src: str | os.PathLike | None = None, fetch_missing: bool = True) -> Path:
        """The checked folder of the source: ``src``, the environment variable, the cache (fetched into when
        empty and ``fetch_missing``). Raises :class:`PeerSourceMissing` (not there, not fetchable) or
        :class:`PeerSourceError` (there but not the pinned files), each one line saying what to do."""
        given = src or os.environ.get(self.env_var)
        if given:
            return self.check(Path(given).expanduser().resolve())
        cache = self.cache_dir()
        if any((cache / name).exists() for name in self.files) or not fetch_missing:
            return self.check(cache)
        return self.fetch(cache)
