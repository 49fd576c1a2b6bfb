"""A barrier on the rendezvous store that says WHO is missing when it times out.

A gloo/NCCL barrier that times out only reports "timeout"; here every rank sets its own key and the
waiters list the keys that never appeared, so the error names the absent ranks (and their hosts,
when they got far enough to register one).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Sequence

from .context import DistContext
from .secret import HOW_TO_FIX, UntrustedKeyError, UntrustedPeerError, unverified_text

__all__ = ["BarrierTimeoutError", "barrier", "host_of", "hosts", "register_host"]


class BarrierTimeoutError(TimeoutError):
    """Some ranks did not reach a barrier in time; ``missing`` lists them."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


def _host_key(rank: int) -> str:
    return f"host/{rank}"


def register_host(ctx: DistContext) -> None:
    """Publish this rank's hostname so later barrier errors can say where a missing rank ran."""
    assert ctx.store is not None
    ctx.store.set(_host_key(ctx.rank), ctx.hostname)


def hosts(ctx: DistContext) -> list[str]:
    """Hostname of every rank, in rank order (after init: every rank registered before the init barrier)."""
    if ctx.store is None:
        return [ctx.hostname]
    return [_hostname(v) for v in ctx.store.multi_get([_host_key(r) for r in range(ctx.world_size)])]


def host_of(ctx: DistContext, rank: int) -> str:
    """The hostname ``rank`` registered, or "" when it never got that far (or the store is gone)."""
    if ctx.store is None:
        return ctx.hostname if rank == ctx.rank else ""
    try:
        return _hostname(ctx.store.get(_host_key(rank))) if ctx.store.check([_host_key(rank)]) else ""
    except RuntimeError:  # gone, or not signed with the job secret: no name rather than a forged one
        return ""


def unverified_host_of(ctx: DistContext, rank: int) -> str:
    """For an error message on a rank that cannot verify (no secret): the host name as written, unverified."""
    raw = getattr(ctx.store, "raw", ctx.store)
    try:
        return unverified_text(bytes(raw.get(_host_key(rank)))) if raw.check([_host_key(rank)]) else ""
    except RuntimeError:
        return ""


def _hostname(raw: bytes) -> str:
    # A host name is at most 255 characters; a longer or unprintable value is cut, not trusted to size anything.
    return "".join(c for c in raw[:255].decode(errors="replace") if c.isprintable())


def _describe(ctx: DistContext, ranks: list[int]) -> str:
    return ", ".join(f"rank {r}" + (f" ({h})" if (h := host_of(ctx, r)) else "") for r in ranks)


def _unsigned(ctx: DistContext, keys: list[str], members: list[int]) -> str:
    """"rank 3 (node2) wrote a key that does not verify with this rank's job secret" for every such rank."""
    bad = []
    for k, r in zip(keys, members):
        try:
            ctx.store.get(k)  # type: ignore[union-attr]
        except UntrustedKeyError:
            bad.append(r)
    who = _describe(ctx, bad) if bad else "a peer"
    return (f"{who} wrote a barrier key that does not verify with this rank's job secret (it lacks the secret, has "
            "another one, or is an impostor in its place; if every peer is named, this rank's secret is the odd one)")


def barrier(ctx: DistContext, name: str, timeout_s: float | None = None, ranks: Sequence[int] | None = None) -> None:
    """Wait until every rank of ``ranks`` (default: the world) has called ``barrier(ctx, name, ...,
    ranks)``: a no-op for one rank. On the store, not on a plane: it names who is missing.

    Raises :class:`BarrierTimeoutError` naming the ranks that did not arrive within ``timeout_s``
    (default: the context's timeout). Those ranks must call barriers of one name in the same order;
    the same name may be reused any number of times.
    """
    members = list(range(ctx.world_size)) if ranks is None else sorted(ranks)
    if not ctx.is_distributed or len(members) < 2:
        return
    store = ctx.store
    assert store is not None
    gen = ctx.barrier_generations.get(name, 0)
    ctx.barrier_generations[name] = gen + 1

    def key(g: int, r: int) -> str:
        return f"barrier/{name}/{g}/{r}"

    store.set(key(gen, ctx.rank), "1")
    if gen >= 2:
        # Reaching generation g means every rank has left generation g-2 (it set its g-1 key after
        # leaving g-2), so nobody still waits on our g-2 key: drop it to keep the store small.
        store.delete_key(key(gen - 2, ctx.rank))
    timeout = ctx.timeout if timeout_s is None else timedelta(seconds=timeout_s)
    try:
        store.wait([key(gen, r) for r in members], timeout)
    except UntrustedKeyError as err:  # a rank (or an impostor in its place) without the job secret
        raise UntrustedPeerError(f"barrier {name!r} on rank {ctx.rank} ({ctx.hostname}): "
                                 f"{_unsigned(ctx, [key(gen, r) for r in members], members)}: {HOW_TO_FIX}") from None
    except RuntimeError as err:  # DistStoreError on timeout, DistNetworkError if the store is gone
        where = f"barrier {name!r} on rank {ctx.rank} of {len(members)} ({ctx.hostname})"
        try:
            missing = [r for r in members if not store.check([key(gen, r)])]
            who = _describe(ctx, missing)
        except RuntimeError:
            raise BarrierTimeoutError(
                f"{where}: lost the rendezvous store (hosted by rank 0 / the launcher): {err}", []
            ) from err
        if not missing:
            raise BarrierTimeoutError(f"{where}: store wait failed: {err}", []) from err
        raise BarrierTimeoutError(
            f"{where} timed out after {timeout.total_seconds():g} s: {who} did not arrive "
            "(crashed, hung, or never started?)",
            missing,
        ) from err
