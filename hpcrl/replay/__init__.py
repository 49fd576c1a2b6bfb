"""Rank-local per-env replay: storage + uniform sampler + n-step returns (fused in hpcrl._C)."""

from .hdf5 import load_shard, save_shard
from .sampler import Sampler
from .shard import Batch, ReplayShard

__all__ = ["ReplayShard", "Sampler", "Batch", "save_shard", "load_shard"]
