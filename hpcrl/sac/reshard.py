"""Re-deal a FastSAC checkpoint written by W ranks to W' ranks: pure functions over rank state dicts.

What a run is made of is global: ``num_envs`` envs, each with its state, its episode in progress and its
replay ring (head, count, n-step window: the replay is stored per env), plus the replicated learner and
normaliser (``learner.pt``, untouched). Rank r of W holds global envs [r*E/W, (r+1)*E/W); new rank r' of
W' takes envs [r'*E/W', (r'+1)*E/W') by slicing each old rank's per-env state (:func:`pieces`) and
concatenating in env order. Kept exactly: every env's physical state, elapsed steps, running return and
length, and every stored transition (the multiset over all ranks is the same; each env's ring keeps its
order). What is per rank and not per env, and what happens to it:

- the rank's sampling generator (random actions, update noise) and the replay sampler's (seed, offset):
  re-derived from :func:`stream_seed` (the run's seed, the new rank, W', the vector step), offset 0;
- a pure-torch env's generator (it draws the reset states of all of a rank's envs at once): re-derived
  the same way, so episodes in progress continue exactly and the next reset states are fresh draws;
- the episode accumulators since the last metrics row (return sum, length sum, count) and the window's
  dropped-transition count: summed onto new rank 0 (the logged row sums or count-weights them);
- the window's per-update metrics: their mean over the old ranks on every new rank (the row averages
  over ranks, so it is unchanged up to rounding);
- the env's shared state (the same on every rank after its per-step reduction): old rank 0's.

Which transitions are sampled therefore changes (statistically equivalent: uniform over the same replay).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hpcrl.run.checkpoint import CheckpointError

__all__ = ["Piece", "ReshardError", "Target", "merge_env", "merge_replay", "pieces", "rank_state", "stream_seed",
           "valid_world_sizes"]

# The three re-derived streams must not coincide (CUDA generators and the sampler are both Philox).
_SAMPLER_SALT, _ENV_SALT = 0x9E3779B97F4A7C15, 0x5EED

GeneratorState = Callable[[int], torch.Tensor]  # seed -> the state of a generator of the env's device


class ReshardError(CheckpointError):
    """The checkpoint cannot be re-dealt to this world size: exit 2 with this line."""


@dataclass(frozen=True)
class Piece:
    """Envs [lo, hi) of old rank ``rank`` (local indices), in global env order."""

    rank: int
    lo: int
    hi: int


def valid_world_sizes(num_envs: int, batch_size: int) -> list[int]:
    """World sizes a run can reshard to: each rank needs whole envs and a whole share of the batch."""
    g = math.gcd(num_envs, batch_size)
    return [w for w in range(1, g + 1) if g % w == 0]


def pieces(num_envs: int, old_world: int, new_world: int, new_rank: int) -> list[Piece]:
    """The old ranks' env slices that make up ``new_rank``'s envs, in global order."""
    old_per, new_per = num_envs // old_world, num_envs // new_world
    lo, hi = new_rank * new_per, (new_rank + 1) * new_per
    out = []
    for r in range(lo // old_per, (hi - 1) // old_per + 1):
        a, b = max(lo, r * old_per), min(hi, (r + 1) * old_per)
        out.append(Piece(r, a - r * old_per, b - r * old_per))
    return out


def stream_seed(seed: int, rank: int, world_size: int, step: int) -> int:
    """A per-rank stream seed after a reshard: blake2b of "seed/rank/world/step", 63 bits."""
    digest = hashlib.blake2b(f"hpcrl-reshard/{seed}/{rank}/{world_size}/{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# -- replay -------------------------------------------------------------------------------------------
_RING = ("obs", "action", "reward", "flags", "final_ref")


def merge_replay(parts: list[tuple[dict[str, Any], Piece]]) -> dict[str, Any]:
    """One :meth:`ReplayShard.state_dict` holding the given envs of several shards (same ``ptr``).

    Ring columns are sliced per env; the final-observation pool is rebuilt in the order the shard
    allocates it (oldest write first, env order within a write), so its ring invariants hold."""
    first = parts[0][0]
    ptr, capacity = int(first["ptr"]), int(first["capacity"])
    if any(int(s["ptr"]) != ptr for s, _ in parts):
        raise ReshardError("replay shards of the checkpoint hold different numbers of vector steps; "
                           "it cannot be resharded")
    out: dict[str, Any] = {k: first[k] for k in ("capacity", "obs_dim", "action_dim", "n_step", "gamma")}
    out["critic_obs_dim"] = first.get("critic_obs_dim", 0)
    filled = min(ptr, capacity)
    for name in _RING:
        out[name] = torch.cat([torch.as_tensor(s[name])[:filled, p.lo:p.hi] for s, p in parts], 1).clone()
    out["head_next_obs"] = torch.cat([torch.as_tensor(s["head_next_obs"])[p.lo:p.hi] for s, p in parts]).clone()
    num_envs = out["obs"].shape[1]
    out["num_envs"] = num_envs
    pools = [torch.as_tensor(s["final_pool"]) for s, _ in parts]
    owner = torch.cat([torch.full((p.hi - p.lo,), i, dtype=torch.int64) for i, (_, p) in enumerate(parts)])
    order = (ptr - filled + torch.arange(filled)) % capacity  # slots, oldest write first
    refs = out["final_ref"][order]
    ended = refs >= 0  # row-major (slot, env): the order the shard allocated pool rows in
    live = int(ended.sum())
    new_refs = torch.full_like(out["final_ref"], -1)
    new_refs[order] = torch.where(ended, torch.cumsum(ended.flatten(), 0).reshape(ended.shape) - 1, -1)
    size = max(num_envs, live)
    pool = torch.zeros(size, out["obs"].shape[2], dtype=torch.float32)
    src, from_piece = refs[ended], owner[ended.nonzero()[:, 1]]
    for i, old_pool in enumerate(pools):
        pool[:live][from_piece == i] = old_pool[src[from_piece == i]]
    per_slot = torch.zeros(capacity, dtype=torch.int64)
    per_slot[order] = ended.sum(1)
    out.update(final_ref=new_refs, final_pool=pool, ptr=ptr, pool_cursor=live % size, pool_live=live,
               pool_per_slot=per_slot)
    return out


# -- envs ---------------------------------------------------------------------------------------------
def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors).clone()


def merge_env(parts: list[tuple[dict[str, Any], Piece]], new_seed: int, generator_state: GeneratorState
              ) -> dict[str, Any]:
    """One env state dict holding the given envs: pure-torch envs (batched state and elapsed, one
    generator, re-derived) and gymnasium vector envs (one entry per sub-env); others are refused."""
    first = parts[0][0]
    torch_env, gym_env = {"state", "elapsed", "generator", "started"}, {"envs", "obs", "seeded"}
    if torch_env <= set(first):
        return {"state": _cat([s["state"][p.lo:p.hi] for s, p in parts]),
                "elapsed": _cat([torch.as_tensor(s["elapsed"]).reshape(-1)[p.lo:p.hi] for s, p in parts]),
                "generator": generator_state(new_seed), "started": first["started"], **_same(parts, torch_env)}
    if gym_env <= set(first):
        subs = [s["envs"][k] for s, p in parts for k in sorted(s["envs"])[p.lo:p.hi]]
        obs = None if first["obs"] is None else _cat([s["obs"][p.lo:p.hi] for s, p in parts])
        return {"envs": {f"{i:05d}": item for i, item in enumerate(subs)}, "obs": obs, "seeded": first["seeded"],
                **_same(parts, gym_env)}
    raise ReshardError(f"this env's checkpoint state (keys {sorted(first)}) is not stored per env, so the checkpoint "
                       "cannot be resharded; resume with the world size it was written by")


def _same(parts: list[tuple[dict[str, Any], Piece]], known: set[str]) -> dict[str, Any]:
    """An env subclass's extra state (e.g. a curriculum level): kept when every old rank holds the same
    value (shared state, reduced every vector step); a value that differs may be per env: refused."""
    first = parts[0][0]
    out = {}
    for key in sorted(set(first) - known):
        values = [s[key] for s, _ in parts]
        same = all(torch.equal(torch.as_tensor(v), torch.as_tensor(values[0])) if isinstance(v, torch.Tensor)
                   else v == values[0] for v in values)
        if not same:
            raise ReshardError(f"the env's checkpoint state {key!r} differs between ranks, so it cannot be re-dealt; "
                               "resume with the world size the checkpoint was written by")
        out[key] = values[0]
    return out


def _owns(old_rank: int, old_world: int, new_world: int, new_rank: int) -> bool:
    """Whether ``new_rank`` holds old rank ``old_rank``'s first env: the one new rank its per-rank sums go to."""
    return old_rank * new_world // old_world == new_rank


def _merge_stats(parts: list[tuple[dict[str, Any], Piece]], owned: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    stats = [(s["episode_stats"], p) for s, p in parts]
    zero = torch.zeros_like(torch.as_tensor(stats[0][0]["sum"]))
    return {"running_return": _cat([s["running_return"][p.lo:p.hi] for s, p in stats]),
            "running_length": _cat([s["running_length"][p.lo:p.hi] for s, p in stats]),
            "sum": sum((torch.as_tensor(s["episode_stats"]["sum"]) for s in owned), zero).clone()}


def _merge_window(states: list[dict[str, Any]], owned: list[dict[str, Any]]) -> dict[str, Any]:
    """A stop checkpoint's mid-window metrics: per-update means over the old ranks this rank takes envs
    from (so the mean over ranks is kept when W' divides W or W divides W'); dropped counts of the
    old ranks it owns."""
    if "window" not in states[0]:
        return {}
    window = {k: torch.stack([torch.as_tensor(s["window"][k]) for s in states]).mean(0) for k in states[0]["window"]}
    return {"window": window, "window_iters": states[0]["window_iters"],
            "dropped": sum(int(s["dropped"]) for s in owned)}


@dataclass(frozen=True)
class Target:
    """Where a checkpoint goes: the global env count, the old and new world sizes, this new rank, and
    what re-derives its streams (the run's seed, the vector step, a generator-state factory for the env's device)."""

    num_envs: int
    old_world: int
    new_world: int
    rank: int
    seed: int
    step: int
    generator_state: GeneratorState


def rank_state(olds: dict[int, dict[str, Any]], to: Target) -> dict[str, Any]:
    """New rank ``to.rank``'s state (the layout :func:`hpcrl.sac.state.save` writes) from the old rank
    states ``olds`` (at least those :func:`hpcrl.run.checkpoint.source_ranks` names, keyed by old rank)."""
    if to.num_envs % to.old_world or to.num_envs % to.new_world:
        raise ReshardError(f"num_envs={to.num_envs} must be divisible by both world sizes "
                           f"({to.old_world}, {to.new_world})")
    parts = [(olds[p.rank], p) for p in pieces(to.num_envs, to.old_world, to.new_world, to.rank)]
    used = sorted({p.rank for _, p in parts})
    states = [olds[r] for r in used]
    owned = [olds[r] for r in used if _owns(r, to.old_world, to.new_world, to.rank)]
    for key in ("replay", "env", "episode_stats", "generator", "obs"):
        if any(key not in s for s in states):
            raise _too_old(repr(key), to)
    try:
        return _rank_state(parts, states, owned, to)
    except KeyError as err:  # a piece inside them (e.g. a replay column) that an older version did not write
        raise _too_old(repr(err.args[0]) if err.args else "a piece a reshard needs", to) from None


def _too_old(what: str, to: Target) -> ReshardError:
    return ReshardError(f"the checkpoint's rank files hold no {what} (written by an older hpcrl), so they cannot be "
                        f"re-dealt to {to.new_world} rank(s); resume with the {to.old_world} rank(s) that wrote it")


def _rank_state(parts: list[tuple[dict[str, Any], Piece]], states: list[dict[str, Any]],
                owned: list[dict[str, Any]], to: Target) -> dict[str, Any]:
    seed = stream_seed(to.seed, to.rank, to.new_world, to.step)
    out: dict[str, Any] = {
        "replay": merge_replay([(s["replay"], p) for s, p in parts]),
        "env": merge_env([(s["env"], p) for s, p in parts], seed ^ _ENV_SALT, to.generator_state),
        "episode_stats": _merge_stats(parts, owned),
        "generator": to.generator_state(seed), "sampler": {"seed": seed ^ _SAMPLER_SALT, "offset": 0},
        "obs": _cat([s["obs"][p.lo:p.hi] for s, p in parts]),
        **_merge_window(states, owned)}
    if "critic_obs" in states[0]:
        out["critic_obs"] = _cat([s["critic_obs"][p.lo:p.hi] for s, p in parts])
    if states[0].get("shared_state"):
        out["shared_state"] = states[0]["shared_state"]  # the same on every rank (reduced every vector step)
    return out
