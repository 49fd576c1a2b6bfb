"""What the packed-experience tests run in real ranks (importable by spawned processes; tests/test_wire_packed.py).

* :class:`RecordingHF` (``--workload wire_probe:RecordingHF``): the ``hf`` workload whose makers save their
  ragged declaration (``ragged.json``) and every batch as collected (``made-<batch>.pt``) and whose trainers
  save every batch as their learner gets it (``trained-<update>.pt``), under ``$WIRE_PROBE_DIR``: what the
  wire delivered, next to what was sent;
* :func:`payload_bounds`: rank 1 sends payloads with forged spans under headers of an acceptable size; rank 0
  receives them through :class:`~hpcrl.ppo.channels.ExperienceChannel` and returns what each raised.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.comm import init_distributed, shutdown
from hpcrl.ppo.channels import TAG_HEADER, TAG_PAYLOAD, ChannelError, ExperienceChannel, Header, Schema
from hpcrl.ppo.ragged import Ragged
from hpcrl.ppo.workloads.hf import HFCollector, HFLearner, HFWorkload
from hpcrl.ppo.workloads.rollout import Trace, layout, wire_spans


def _out() -> Path:
    return Path(os.environ["WIRE_PROBE_DIR"])


class RecordingCollector(HFCollector):
    def ragged(self) -> tuple[Ragged, ...]:
        declared = super().ragged()  # the maker reads it once, for its schema
        (_out() / "ragged.json").write_text(json.dumps([r.to_json() for r in declared]))
        return declared

    def assign(self, batch: int, seed: int) -> None:
        super().assign(batch, seed)
        self.number = batch

    def collect(self, model: Any, generator: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        batch, stats = super().collect(model, generator)
        torch.save({k: v.cpu() for k, v in batch.items()}, _out() / f"made-{self.number}.pt")
        return batch, stats


class RecordingLearner(HFLearner):
    def update(self, batches: list[dict[str, torch.Tensor]], generator: torch.Generator) -> dict[str, float]:
        (batch,) = batches  # --batches-per-step 1
        torch.save({k: v.cpu() for k, v in batch.items()}, _out() / f"trained-{self.updates}.pt")
        return super().update(batches, generator)


@dataclass
class RecordingHF(HFWorkload):
    def make_collector(self, rank_seed: int, device: Any = "cpu") -> HFCollector:
        return RecordingCollector(self.options, self.task, self.models, rank_seed, torch.device(device))

    def make_learner(self, model: Any, cfg: Any, grad_average: Any) -> HFLearner:
        return RecordingLearner(self.options, self.task, model, cfg, grad_average)


# ------------------------------------------------------------------------------ forged payloads

P, E, ROWS = 4, 6, 3


def small_schema() -> tuple[Schema, torch.Tensor]:
    """A three-row hf-layout schema (prompt 4, episode 6) and one good payload of it."""
    traces = [Trace([5, 6]), Trace([7]), Trace([8, 9, 10])]
    for t, n in zip(traces, (3, 0, 6)):
        if n:
            t.add(torch.arange(n) + 11, -torch.ones(n))
    batch = layout(traces, P, E, 0)
    batch.pop("turn_reward")
    batch["score"] = torch.ones(ROWS)
    stats = {"env_steps": 9.0}
    schema = Schema.of(batch, stats, (wire_spans(P, 0, ("action_mask", "behaviour_logp")),))
    return schema, schema.pack(batch, stats)


def forged() -> dict[str, torch.Tensor]:
    """Good payloads with their spans (int64 start[3], length[3] up front) changed."""
    _, good = small_schema()

    def with_spans(values: dict[int, int], extra: int = 0) -> torch.Tensor:
        buf = torch.cat([good, torch.zeros(extra, dtype=torch.uint8)])
        spans = buf[: 16 * ROWS].view(torch.int64)
        for i, v in values.items():
            spans[i] = v
        return buf

    return {"negative length": with_spans({3: -1}), "start past the width": with_spans({0: P + E + 1}),
            "span past the width": with_spans({4: P + E}),
            "spans longer than the values": with_spans({4: 2}),
            "values longer than the spans": with_spans({}, extra=12)}


def payload_bounds() -> dict:
    ctx = init_distributed(timeout_s=30)
    host = ctx.host_plane
    schema, _ = small_schema()
    out: dict = {}
    try:
        if ctx.rank == 1:
            for payload in forged().values():
                dist.send(Header(0, 0, 0, 0, 9, payload.numel()).tensor(), 0, group=host.group, tag=TAG_HEADER)
                dist.send(payload, 0, group=host.group, tag=TAG_PAYLOAD)
        else:
            channel = ExperienceChannel(host, schema=lambda src: schema, max_version=lambda: 3,
                                        maker_index=lambda r: r - 1)
            for case in forged():
                try:
                    channel.receive(1)
                    out[case] = None
                except ChannelError as err:
                    out[case] = str(err)
    finally:
        shutdown(timeout_s=15)
    return out
