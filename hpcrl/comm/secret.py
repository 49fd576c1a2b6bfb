"""The job secret and the store values signed with it (see ``docs/trust.md``).

The rendezvous store has no authentication: any process that reaches its port can read and write
keys. Values the run acts on (barriers, checkpoint agreement, liveness, done / dropped flags, GPU
identities) are therefore written through :class:`SignedStore`, which appends an HMAC-SHA256 tag
over (scope, key, value) made with the job's secret, and verifies it on every read: a value written
by a process that does not know the secret raises :class:`UntrustedKeyError` naming the key, before
the run uses it. Every rank also proves the secret when it joins (:func:`check_join`), so a rank
started without it (or with another job's) is refused with a message saying what to set.

The secret comes from ``HPCRL_JOB_SECRET`` (``hpcrl.comm.spawn`` creates one per run; the Slurm
launcher exports one in the batch script) or from a 0600 file named by ``HPCRL_JOB_SECRET_FILE``
(e.g. on a shared home for torchrun). MPI ranks get rank 0's over MPI. Without one the run is
unauthenticated: a one-line warning says so, and ``HPCRL_REQUIRE_SECRET=1`` makes that an error.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import sys
from datetime import timedelta
from typing import Mapping, Sequence

from .context import DistSetupError

__all__ = ["JOIN_KEY", "MIN_SECRET_CHARS", "REQUIRE_ENV", "SECRET_ENV", "SECRET_FILE_ENV", "SignedStore",
           "UntrustedKeyError", "UntrustedPeerError", "check_join", "unverified_text", "HOW_TO_FIX", "load_secret", "new_secret"]

SECRET_ENV = "HPCRL_JOB_SECRET"
SECRET_FILE_ENV = "HPCRL_JOB_SECRET_FILE"
REQUIRE_ENV = "HPCRL_REQUIRE_SECRET"
MIN_SECRET_CHARS = 32  # 128 bits of hex: a short secret is refused rather than silently weak
_MAGIC = b"hpcrl-hmac1:"
_TAG_CHARS = 64  # hex of SHA-256
JOIN_KEY = "trust/join/{rank}"
HOW_TO_FIX = ("start every rank with the same HPCRL_JOB_SECRET (the hpcrl launcher and --nproc set it; for torchrun "
        "export one, e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`, or point "
        "HPCRL_JOB_SECRET_FILE at a 0600 file on a shared filesystem)")


class UntrustedKeyError(RuntimeError):
    """A store value is not signed with this job's secret: it was written by a process that does not
    know it. ``key`` is the store key (it names the peer: ``ppo/done/2``, ``barrier/init/0/3``)."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


class UntrustedPeerError(DistSetupError):
    """A rank (or an impostor in its place) does not know the job secret, or this rank does not."""


def new_secret() -> str:
    """A fresh job secret (256 bits, hex)."""
    return secrets.token_hex(32)


def _checked(value: str, what: str) -> bytes:
    value = value.strip()
    if len(value) < MIN_SECRET_CHARS:
        raise DistSetupError(f"{what} is {len(value)} characters; use at least {MIN_SECRET_CHARS} random ones, "
                             "e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`")
    return value.encode()


def load_secret(env: Mapping[str, str] | None = None) -> bytes | None:
    """The job secret from ``HPCRL_JOB_SECRET`` or the file ``HPCRL_JOB_SECRET_FILE``, or None.

    The file must belong to this user and grant nobody else any access (a secret others can read
    protects nothing); otherwise :class:`DistSetupError` says which ``chmod`` fixes it.
    """
    env = os.environ if env is None else env
    if env.get(SECRET_ENV):
        return _checked(env[SECRET_ENV], SECRET_ENV)
    path = env.get(SECRET_FILE_ENV)
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as err:
        raise DistSetupError(f"{SECRET_FILE_ENV}={path}: cannot open it ({err.strerror}); create it with "
                             "`umask 077; python -c 'import secrets; print(secrets.token_hex(32))' > FILE`") from None
    with os.fdopen(fd, "r") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise DistSetupError(f"{SECRET_FILE_ENV}={path} is mode {stat.filemode(st.st_mode)} owned by uid "
                                 f"{st.st_uid}: it must be yours and private (`chmod 600 {path}`)")
        return _checked(f.read(4096), f"the secret in {path}")


class SignedStore:
    """A rendezvous store whose ``set`` values carry an HMAC tag and whose reads verify it.

    ``scope`` enters every tag (e.g. the torchrun attempt), so a value cannot be replayed from
    another attempt. ``secret=None``: an unauthenticated pass-through (values stored as given).
    ``add`` counters cannot be signed (the server increments them) and pass through: nothing the run
    trusts is a counter it only reads through ``add`` without a bound (see ``docs/trust.md``).
    ``wait`` and ``check`` verify the values of the keys they found (one extra ``multi_get``), so a
    forged key never satisfies a wait.
    """

    def __init__(self, store, secret: bytes | None, scope: str = "") -> None:
        self.raw, self.secret, self.scope = store, secret, scope

    @property
    def signed(self) -> bool:
        return self.secret is not None

    # -- the tag ------------------------------------------------------------------------------
    def _tag(self, key: str, value: bytes) -> bytes:
        assert self.secret is not None
        msg = b"\0".join((self.scope.encode(), key.encode(), value))
        return hmac.new(self.secret, msg, hashlib.sha256).hexdigest().encode()

    def seal(self, key: str, value: str | bytes) -> bytes:
        data = value.encode() if isinstance(value, str) else bytes(value)
        return data if self.secret is None else _MAGIC + self._tag(key, data) + b":" + data

    def open(self, key: str, raw: bytes) -> bytes:
        """``raw``'s value when its tag verifies under ``key``; else :class:`UntrustedKeyError`."""
        if self.secret is None:
            return raw
        head = len(_MAGIC) + _TAG_CHARS + 1
        if not raw.startswith(_MAGIC) or len(raw) < head or raw[head - 1 : head] != b":":
            why = "it carries no signature"
        elif not hmac.compare_digest(raw[len(_MAGIC) : head - 1], self._tag(key, raw[head:])):
            why = "its signature does not verify"
        else:
            return raw[head:]
        raise UntrustedKeyError(
            f"store key {key!r} refused: {why} with this job's secret, so a process that does not know the "
            "secret wrote it (another user's process that reached the store, or a rank started without the "
            f"job's secret); the run does not act on it. To fix a misstarted rank: {HOW_TO_FIX}", key)

    # -- the store interface the run uses -----------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self.raw.set(key, self.seal(key, value))

    def get(self, key: str) -> bytes:
        return self.open(key, self.raw.get(key))

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self.raw.multi_set(list(keys), [self.seal(k, v) for k, v in zip(keys, values)])

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = list(keys)
        return [self.open(k, bytes(v)) for k, v in zip(keys, self.raw.multi_get(keys))]

    def verify(self, keys: Sequence[str]) -> None:
        """Raise :class:`UntrustedKeyError` for the first of ``keys`` (all present) that does not verify."""
        if self.secret is not None and keys:
            self.multi_get(keys)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        keys = list(keys)
        if timeout is None:
            self.raw.wait(keys)
        else:
            self.raw.wait(keys, timeout)
        self.verify(keys)

    def check(self, keys: Sequence[str]) -> bool:
        keys = list(keys)
        found = bool(self.raw.check(keys))
        if found:
            self.verify(keys)
        return found

    def add(self, key: str, amount: int) -> int:
        return int(self.raw.add(key, amount))

    def delete_key(self, key: str) -> bool:
        return bool(self.raw.delete_key(key))

    def num_keys(self) -> int:
        return int(self.raw.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self.raw.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self.raw.timeout

    def clone(self) -> "SignedStore":
        """Another client (own connection) with the same secret and scope."""
        return SignedStore(self.raw.clone(), self.secret, self.scope)


def check_join(store: SignedStore, rank: int, world_size: int, describe) -> None:
    """After every rank wrote its join key (the init barrier): refuse a mix of ranks with and without
    the secret. A signed rank already refused unsigned peers' barrier keys (:func:`hpcrl.comm.barrier`);
    here a rank *without* the secret learns that the job has one. ``describe(rank)`` names a rank."""
    keys = [JOIN_KEY.format(rank=r) for r in range(world_size)]
    raw = [bytes(v) for v in store.raw.multi_get(keys)]
    if store.signed:
        store.verify(keys)
        return
    signed = [r for r, v in enumerate(raw) if v.startswith(_MAGIC)]
    if signed:
        raise UntrustedPeerError(
            f"rank {rank}: this rank has no job secret, but {describe(signed[0])} signs its store keys with one, so "
            f"this rank cannot prove it belongs to the job: {HOW_TO_FIX}")


def unverified_text(raw: bytes, limit: int = 64) -> str:
    """A store value for an error message only (a host name): its tag stripped, unverified, cut short."""
    head = len(_MAGIC) + _TAG_CHARS + 1
    body = raw[head:] if raw.startswith(_MAGIC) else raw
    return "".join(c for c in body[:limit].decode(errors="replace") if c.isprintable())


def no_secret_policy(env: Mapping[str, str], rank: int, source: str) -> None:
    """What a multi-rank run without a secret does: refuse with ``HPCRL_REQUIRE_SECRET=1``, else one
    warning line (rank 0) that the store is unauthenticated."""
    if env.get(REQUIRE_ENV, "") not in ("", "0"):
        raise UntrustedPeerError(f"rank {rank} ({source}): {REQUIRE_ENV} is set but no job secret was given: {HOW_TO_FIX}")
    if rank == 0:
        print(f"hpcrl: warning: no job secret ({SECRET_ENV} / {SECRET_FILE_ENV}): the rendezvous store's keys are "
              f"unauthenticated, so any process that reaches it can steer this run (see docs/trust.md; "
              f"{REQUIRE_ENV}=1 refuses to start instead)", file=sys.stderr, flush=True)
