"""The ``hf`` workload's maker side: prompts -> the engine (:mod:`.engine`: responses with their behaviour
log-probs) -> reference log-probs (only with ``--ref-on makers``) -> scores, in fixed-shape batches
(:mod:`hpcrl.ppo.workloads.hf`) that travel without their padding (:meth:`HFCollector.ragged`)."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..ragged import Ragged
from ..workload import Collector
from .engine import Engine
from .hf_engine import make_engine
from .episodes import Done, Outcome
from .hf_env import EnvEpisodes
from .hf_generate import left_pad, token_logp
from .rollout import Trace, layout, run_turns, wire_spans
from .hf_prompts import PromptStream

if TYPE_CHECKING:
    from .hf_factory import HFActorCritic, HFModelFactory
    from .hf_options import HFOptions
    from .hf_task import HFTask

__all__ = ["HFCollector", "left_pad"]


class HFCollector(Collector):
    """Maker side: prompts -> the engine (responses, behaviour log-probs) -> reference log-probs -> scores.
    The task gives the prompts and the reward, the factory the network a maker generates with and its
    reference; the engine (``--engine``) is made over the maker's model at its first use."""

    def __init__(self, options: HFOptions, task: HFTask, models: HFModelFactory, rank_seed: int,
                 device: torch.device) -> None:
        self.options, self.task, self.models, self.device = options, task, models, device
        self.stream = PromptStream(len(task.prompt_ids), rank_seed)
        self.batches = 0
        self._sample_seed: int | None = None  # set by assign() for the next collect
        self._logged = False  # held_line once, after the first batch
        self.engine: Engine | None = None
        self._engine_model: HFActorCritic | None = None  # the model the engine was made over
        self.env = EnvEpisodes(options, task) if options.multi_turn else None
        self._reasons: set[str] = set()

    def assign(self, batch: int, seed: int) -> None:
        """The next collect serves the run's batch ``batch``: prompts ``[batch * B, (batch + 1) * B)`` of
        the run's prompt order (each epoch shuffled from ``seed``), sampled from a seed of its own,
        whichever maker collects it. So the makers split the dataset between them, and a resumed run
        continues with the first batch its trainers had not trained on, exactly as it would have
        (the maker calls this with the credit's batch number)."""
        self.stream.seek(batch * self.options.batch_size, seed)
        self._sample_seed = (seed * 2**32 + batch) % 2**62  # its sampling too: a resumed run is the same run

    def prompt_batch(self) -> tuple[list[int], list[list[int]]]:
        """The next batch's prompt indices and token ids (each prompt ``group_size`` times with GRPO)."""
        o, task = self.options, self.task
        idx = self.stream.take(o.batch_size)
        if o.algo == "grpo":
            idx = [i for i in idx for _ in range(o.group_size)]
        return idx, [task.prompt_ids[i] for i in idx]

    def engine_for(self, model: HFActorCritic) -> Engine:
        """The engine over ``model`` (made at its first use; re-made when handed another model)."""
        if self.engine is None or self._engine_model is not model:
            self.close_engine()
            self.engine = make_engine(self.options, model, self.models, self.task.eos_id, self.task.pad_id,
                                      self.device)
            self._engine_model = model
        return self.engine

    def load_weights(self, model: HFActorCritic, version: int) -> None:
        """The published tensors, by name, into the engine (the maker wrote them into ``model``)."""
        self.engine_for(model).load_weights(self.models.publish_named(model), version)

    def ragged(self) -> tuple[Ragged, ...]:
        """Only each row's prompt and episode travel (:func:`~.rollout.wire_spans`), not the padding."""
        sent = ("action_mask", "behaviour_logp", *(("turn_reward",) if self.env is not None else ()),
                *(("ref_logp",) if self.options.ref_on == "makers" else ()))
        return (wire_spans(self.options.max_prompt_tokens, self.task.pad_id, sent),)

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
        self.close_engine()

    def close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine = self._engine_model = None

    @torch.no_grad()
    def collect(self, model: HFActorCritic, generator: torch.Generator) -> tuple[dict[str, Tensor], dict[str, float]]:
        o, task = self.options, self.task
        device = next(model.actor.parameters()).device
        idx, prompts = self.prompt_batch()
        seed = int(torch.randint(2**62, (1,), generator=generator)) if self._sample_seed is None else self._sample_seed
        self._sample_seed = None
        engine = self.engine_for(model)
        t0 = time.perf_counter()
        if self.env is None:  # one turn; the reward scores the completions afterwards
            traces = [Trace(p) for p in prompts]
            run_turns(traces, engine.generate, _finished, _no_observation, task.sampling, seed, 1, o.max_new_tokens)
        else:
            traces = self.env.start([task.records[i] for i in idx])
            run_turns(traces, engine.generate, self.env.step, self.env.observation_ids, task.sampling, seed,
                      o.max_turns, o.episode_tokens, o.turn_wait_s)
            self._report(traces)
        gen_s = max(time.perf_counter() - t0, 1e-9)
        batch = {k: v.to(device) for k, v in layout(traces, o.max_prompt_tokens, o.episode_tokens, task.pad_id).items()}
        tokens, attn, amask = batch["tokens"], batch["attention_mask"], batch["action_mask"]
        turn_reward = batch.pop("turn_reward")
        if self.env is None:
            inputs = task.reward_inputs(idx, task.records, task.prompt_texts)  # records stay maker-side: never sent
            score = task.score(inputs, tokens, attn, tokens[:, o.max_prompt_tokens:], amask, self.batches)
        else:  # the episode's return; each turn's reward where the turn ended
            score = turn_reward.sum(1)
            batch["turn_reward"] = turn_reward
            batch["episode_info"] = torch.tensor([t.info() for t in traces], dtype=torch.float32, device=device)
        self.batches += 1
        n_tok = float(amask.sum())
        batch.update(score=score, maker_tokens_per_s=torch.tensor([n_tok / gen_s], dtype=torch.float32, device=device))
        n = float(tokens.shape[0])
        stats = {"reward_sum": float(score.sum()), "sequences": n, "episode_return_sum": float(score.sum()),
                 "episodes": n, "env_steps": n_tok, "generate_s": gen_s}
        if o.ref_on == "makers":  # else the trainers compute it (HFLearner.reference_logp): not sent
            # zeros outside the policy's tokens by a fill, not a product (x * 0 is -0.0 for x < 0): the
            # padding is then the +0.0 the wire rebuilds it with (wire_spans)
            ref_logp = token_logp(model.action_logits(tokens, attn, self.models.reference_model(device)),
                                  tokens[:, o.max_prompt_tokens:], o.temperature).masked_fill(amask == 0, 0.0)
            batch["ref_logp"] = ref_logp
            stats["kl_to_ref_sum"] = float((batch["behaviour_logp"] - ref_logp).sum())
        if not self._logged:
            self._logged = True
            print(self.held_line(model, engine), file=sys.stderr, flush=True)
        return batch, stats

    def _report(self, traces: list[Trace]) -> None:
        """Each kind of reason an episode was ended for, once per maker on stderr (the rows count them)."""
        for t in traces:
            why = t.error or t.cut
            kind = (why or "").split(":")[0]
            if why and kind not in self._reasons:
                self._reasons.add(kind)
                count = "episode_error_frac" if t.error else "truncated_frac"
                print(f"hpcrl.ppo hf maker: an episode ended early: {why} (counted in the rows as {count}; further "
                      "ones of this kind are not printed)", file=sys.stderr, flush=True)

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict(), "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
        self.batches = int(state["batches"])

    def held_line(self, model: HFActorCritic, engine: Engine) -> str:
        """The line a maker logs after its first batch: the engine, the models it holds (parameters of
        each) and the process's peak RSS so far (the reference, when held, was loaded by then)."""
        from ..replica import peak_rss_mib

        count = lambda m: f"{sum(p.numel() for p in m.parameters()) / 1e6:.2f}M parameters"  # noqa: E731
        held = [f"actor ({count(model.actor)})"]
        if self.options.maker_dtype != "fp32":  # the engine's reduced-precision copy
            held.append(f"its {self.options.maker_dtype} copy")
        held += [f"reference ({count(r)})" for r in self.models.references.values()]
        held += [f"reward model ({count(r)})" for r in self.task.reward_models.values()]
        return (f"hpcrl.ppo hf maker: engine {engine.capabilities().name}; holds {', '.join(held)}; ref_logp on "
                f"the {self.options.ref_on}; peak RSS {peak_rss_mib():.0f} MiB")


def _finished(rows: list[int], responses: list[list[int]], wake: object) -> list[Done]:
    """The single-completion step: every episode ends after its one response (scored afterwards)."""
    return [Done(Outcome(None, 0.0, True)) for _ in rows]


def _no_observation(i: int, obs: object) -> list[int]:
    raise AssertionError("single completions have no observations")
