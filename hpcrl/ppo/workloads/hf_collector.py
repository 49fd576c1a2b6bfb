"""The ``hf`` workload's maker side: prompts -> generate (KV cache) -> behaviour / reference
log-probs (the reference's only with ``--ref-on makers``) -> scores, in fixed-shape batches
(:mod:`hpcrl.ppo.workloads.hf`)."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..workload import Collector
from .hf_generate import generate_by_length, left_pad, token_logp
from .hf_prompts import PromptStream

if TYPE_CHECKING:
    from .hf_factory import HFActorCritic, HFModelFactory
    from .hf_options import HFOptions
    from .hf_task import HFTask

__all__ = ["HFCollector", "left_pad"]


class HFCollector(Collector):
    """Maker side: prompts -> generate (KV cache) -> behaviour / reference log-probs -> scores. The task
    gives the prompts and the reward, the factory the network a maker generates with and its reference."""

    def __init__(self, options: HFOptions, task: HFTask, models: HFModelFactory, rank_seed: int,
                 device: torch.device) -> None:
        self.options, self.task, self.models, self.device = options, task, models, device
        self.stream = PromptStream(len(task.prompt_ids), rank_seed)
        self.batches = 0
        self._sample_seed: int | None = None  # set by assign() for the next collect
        self._logged = False  # held_line once, after the first batch

    def assign(self, batch: int, seed: int) -> None:
        """The next collect serves the run's batch ``batch``: prompts ``[batch * B, (batch + 1) * B)`` of
        the run's prompt order (each epoch shuffled from ``seed``), sampled from a seed of its own,
        whichever maker collects it. So the makers split the dataset between them, and a resumed run
        continues with the first batch its trainers had not trained on, exactly as it would have
        (the maker calls this with the credit's batch number)."""
        self.stream.seek(batch * self.options.batch_size, seed)
        self._sample_seed = (seed * 2**32 + batch) % 2**62  # its sampling too: a resumed run is the same run

    def prompt_batch(self) -> tuple[list[int], Tensor, Tensor]:
        o, task = self.options, self.task
        idx = self.stream.take(o.batch_size)
        if o.algo == "grpo":
            idx = [i for i in idx for _ in range(o.group_size)]
        ids, mask = left_pad([task.prompt_ids[i] for i in idx], o.max_prompt_tokens, task.pad_id)
        return idx, ids, mask

    @torch.no_grad()
    def collect(self, model: HFActorCritic, generator: torch.Generator) -> tuple[dict[str, Tensor], dict[str, float]]:
        o, task = self.options, self.task
        device = next(model.actor.parameters()).device
        idx, prompt, pmask = self.prompt_batch()
        prompt, pmask = prompt.to(device), pmask.to(device)
        seed = int(torch.randint(2**62, (1,), generator=generator)) if self._sample_seed is None else self._sample_seed
        self._sample_seed = None
        model.actor.eval()
        net = self.models.maker_actor(model)
        t0 = time.perf_counter()
        response, amask = generate_by_length(net, prompt, pmask.long(), task.sampling, task.eos_id, task.pad_id,
                                             seed, o.generate_buckets)
        gen_s = max(time.perf_counter() - t0, 1e-9)
        tokens = torch.cat([prompt, response.to(device)], 1)
        attn = torch.cat([pmask, amask.to(device)], 1)
        amask = amask.to(device)
        logp = token_logp(model.action_logits(tokens, attn, net), response, o.temperature) * amask
        inputs = task.reward_inputs(idx, task.records, task.prompt_texts)  # records stay maker-side: never sent
        score = task.score(inputs, tokens, attn, response, amask, self.batches)
        self.batches += 1
        n_tok = float(amask.sum())
        batch = {"tokens": tokens, "attention_mask": attn, "action_mask": amask, "behaviour_logp": logp,
                 "score": score,
                 "maker_tokens_per_s": torch.tensor([n_tok / gen_s], dtype=torch.float32, device=device)}
        n = float(tokens.shape[0])
        stats = {"reward_sum": float(score.sum()), "sequences": n, "episode_return_sum": float(score.sum()),
                 "episodes": n, "env_steps": n_tok, "generate_s": gen_s}
        if o.ref_on == "makers":  # else the trainers compute it (HFLearner.reference_logp): not sent
            ref_logp = token_logp(model.action_logits(tokens, attn, self.models.reference_model(device)), response,
                                  o.temperature) * amask
            batch["ref_logp"] = ref_logp
            stats["kl_to_ref_sum"] = float((logp - ref_logp).sum())
        if not self._logged:
            self._logged = True
            print(self.held_line(model, net), file=sys.stderr, flush=True)
        return batch, stats

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict(), "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
        self.batches = int(state["batches"])


    def held_line(self, model: HFActorCritic, net: torch.nn.Module) -> str:
        """The line a maker logs after its first batch: the models it holds (parameters of each) and the
        process's peak RSS so far (the reference, when held, was loaded by then)."""
        from ..replica import peak_rss_mib

        count = lambda m: f"{sum(p.numel() for p in m.parameters()) / 1e6:.2f}M parameters"  # noqa: E731
        held = [f"actor ({count(model.actor)})"]
        if net is not model.actor:
            held.append(f"its {self.options.maker_dtype} copy")
        held += [f"reference ({count(r)})" for r in self.models.references.values()]
        held += [f"reward model ({count(r)})" for r in self.task.reward_models.values()]
        return (f"hpcrl.ppo hf maker: holds {', '.join(held)}; ref_logp on the {self.options.ref_on}; "
                f"peak RSS {peak_rss_mib():.0f} MiB")
