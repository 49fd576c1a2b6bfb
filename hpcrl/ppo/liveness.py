"""Detached PPO's liveness: the job's heartbeats (:mod:`hpcrl.comm.heartbeat`, shared with FastSAC) and
what only makers can be told: that the trainers dropped them."""

from __future__ import annotations

from hpcrl.comm.heartbeat import (MAX_BEAT, Heartbeat, PeerLost, StoreUnresponsive, Watcher, bounded, describe,
                                  heartbeat_key, liveness_store, remember_hosts)

__all__ = ["MAX_BEAT", "Dropped", "Heartbeat", "PeerLost", "StoreUnresponsive", "Watcher", "bounded", "describe",
           "heartbeat_key", "liveness_store", "remember_hosts"]


class Dropped(RuntimeError):
    """This maker was declared lost by the trainers (it froze past the heartbeat timeout), or the run
    finished while it was away."""
