"""Rank functions for channel bounds and strict-planes tests (importable by spawned processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpcrl.comm import init_distributed, shutdown
from hpcrl.ppo.channels import TAG_CREDIT, TAG_HEADER, ChannelError, CreditChannel, ExperienceChannel, Schema

SCHEMA = Schema((("obs", (4, 3), "float32"),), ("env_steps",))
# (maker, credit, seq, version, samples, nbytes): what rank 1 announces to rank 0, one case per line
BAD_HEADERS = {
    "too large": [0, 0, 0, 0, 8, 1 << 40],
    "negative size": [0, 0, 0, 0, 8, -5],
    "wrong size": [0, 0, 0, 0, 8, SCHEMA.nbytes + 4],
    "unknown version": [0, 0, 0, 999, 8, SCHEMA.nbytes],
    "wrong maker": [3, 0, 0, 0, 8, SCHEMA.nbytes],
}


def bounds() -> dict:
    """Rank 1 (a "maker") sends bad headers and a bad credit; rank 0 receives them through the channels.
    The payload is never sent: a channel that tried to receive (or allocate) it would hang here."""
    ctx = init_distributed(timeout_s=30)
    host = ctx.host_plane
    out: dict = {}
    try:
        if ctx.rank == 1:
            for values in BAD_HEADERS.values():
                dist.send(torch.tensor(values, dtype=torch.int64), 0, group=host.group, tag=TAG_HEADER)
            dist.send(torch.tensor([5, 0, 0], dtype=torch.int64), 0, group=host.group, tag=TAG_CREDIT)  # trainer 5?
            dist.send(torch.tensor([0, -3, 0], dtype=torch.int64), 0, group=host.group, tag=TAG_CREDIT)
        else:
            channel = ExperienceChannel(host, schema=lambda src: SCHEMA, max_version=lambda: 3, maker_index=lambda r: r - 1,
                                        max_bytes=1 << 30)
            for case in BAD_HEADERS:
                try:
                    channel.receive(1)
                    out[case] = None
                except ChannelError as err:
                    out[case] = str(err)
            credits = CreditChannel(host, trainers=1)
            out["credits"] = []
            for _ in range(2):
                try:
                    credits.receive()
                    out["credits"].append(None)
                except ChannelError as err:
                    out["credits"].append(str(err))
    finally:
        shutdown(timeout_s=15)
    return out


def strict() -> dict:
    """Under HPCRL_STRICT_PLANES=1: a CPU tensor on the default group raises; both planes work."""
    ctx = init_distributed(timeout_s=30)
    out: dict = {}
    try:
        try:
            dist.all_reduce(torch.ones(1))
            out["default_group"] = "worked"
        except RuntimeError as err:
            out["default_group"] = str(err)
        for name, plane in (("host", ctx.host_plane), ("device", ctx.device_plane)):
            x = torch.ones(2)
            dist.all_reduce(x, group=plane.group)
            out[name] = x.tolist()
        out["device_plane_is_default"] = ctx.device_plane.group is dist.distributed_c10d._get_default_group()
    finally:
        shutdown(timeout_s=15)
    return out
