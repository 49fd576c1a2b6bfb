"""A maker's episodes, turn by turn, and the experience layout they are sent in.

:func:`run_turns` drives a batch of episodes: each turn generates for the live episodes only (their whole
context so far as the prompt; one engine call per round, seeded per round), hands each response to its
episode's ``step`` and appends the observation it returns; an episode stops at ``done``, at ``max_turns``
or when its tokens reach the episode budget (``truncated``). A step slower than ``--hf.turn-wait-s`` does not
hold the others: they take their next turn without it. One turn with a step that ends every episode
is the single-completion case (``--hf.reward-fn`` / ``--hf.reward-model``, scored afterwards).

:func:`layout` lays the episodes out as the trainers read them (:mod:`.hf_generate`): the prompt left-padded
to ``P`` then everything after it right-padded to ``E`` (the episode budget). ``action_mask`` is 1 on the
policy's tokens only, 0 on observation tokens and padding, so log-probs, KL, entropy, values, GAE and
advantages count policy tokens alone; ``turn_reward`` holds each turn's reward on that turn's last policy
token. With one turn it is exactly the single-completion layout. :func:`wire_spans` says how such a batch
travels: each row's attention span (its prompt and episode, contiguous), the padding rebuilt on arrival.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..ragged import Ragged
from .engine import Generation, SamplingParams
from .episodes import Outcome, Pending, wait_ready

__all__ = ["EPISODE_INFO", "Trace", "layout", "run_turns", "turn_seed", "wire_spans"]

EPISODE_INFO = ("turns", "tool_calls", "tool_errors", "truncated", "errors", "observation_tokens")
"""The columns of a multi-turn batch's ``episode_info [B, 6]``, per episode."""

Generate = Callable[[list[list[int]], SamplingParams, int], Generation]
Step = Callable[[list[int], list[list[int]], threading.Condition], list[Pending]]
"""``step(rows, responses, wake)``: the steps of the episodes ``rows`` (indices) on their responses' tokens,
started (:func:`~.episodes.launch`; ``wake`` notified as each returns)."""
Tokens = Callable[[int, object], list[int]]
"""``observation_ids(i, observation)``: the tokens episode ``i`` appends for an observation."""


@dataclass
class Trace:
    """One episode as it was played: its prompt, then its tokens (policy and observation), with the
    behaviour log-probs of the policy's, each turn's reward and where it ended."""

    prompt: list[int]
    tokens: list[Tensor] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    """Per segment of ``tokens``: the policy's (True) or an observation's."""
    logp: list[Tensor] = field(default_factory=list)
    rewards: list[tuple[int, float]] = field(default_factory=list)
    """``(position after the prompt of the turn's last policy token, reward)``."""
    length: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    done: bool = False
    truncated: bool = False
    error: str | None = None
    cut: str | None = None
    """Why a truncated episode was cut short, when an observation did not fit (logged once per kind)."""

    def context(self) -> list[int]:
        return self.prompt + (torch.cat(self.tokens).tolist() if self.tokens else [])

    def add(self, tokens: Tensor, logp: Tensor | None) -> None:
        self.tokens.append(tokens)
        self.policy.append(logp is not None)
        self.logp.append(logp if logp is not None else torch.zeros(len(tokens), dtype=torch.float32))
        self.length += len(tokens)

    def episode_return(self) -> float:
        return sum(r for _, r in self.rewards)

    def info(self) -> list[float]:
        """Its row of ``episode_info`` (:data:`EPISODE_INFO`)."""
        obs = sum(len(t) for t, p in zip(self.tokens, self.policy) if not p)
        return [float(self.turns), float(self.tool_calls), float(self.tool_errors), float(self.truncated),
                float(self.error is not None), float(obs)]


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn ``turn`` of a batch sampled from ``seed`` (turn 0: ``seed`` itself)."""
    return (seed + turn * 0x9E3779B97F4A7C15) % 2**62


def run_turns(traces: list[Trace], generate: Generate, step: Step, observation_ids: Tokens, params: SamplingParams,
              seed: int, max_turns: int, budget: int, wait_s: float = float("inf")) -> None:
    """Play the episodes of ``traces`` (their prompts set) to their ends, in rounds: each round generates
    for the episodes ready for a turn (one engine call, seeded per round) and starts their steps; it then
    waits for every step still running, at most ``wait_s`` (then for at least one). An episode whose step
    is slower goes on in a later round, so a slow tool holds its own episode, not the batch. When every
    step returns within ``wait_s`` the rounds are the turns, taken together: the run is reproducible."""
    pending: dict[int, Pending] = {}
    wake = threading.Condition()
    for round_ in itertools.count():
        ready = [i for i, t in enumerate(traces) if not t.done and i not in pending]
        if not ready and not pending:
            return
        if ready:
            room = max(budget - traces[i].length for i in ready)
            generation = generate([traces[i].context() for i in ready],
                                  dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room)),
                                  turn_seed(seed, round_))
            pending.update(zip(ready, step(ready, _take(traces, ready, generation, budget), wake)))
        for i in wait_ready(pending, wake, wait_s):
            t = traces[i]
            _follow(t, pending.pop(i).outcome(), observation_ids, i, budget, last_turn=t.turns == max_turns)


def _take(traces: list[Trace], rows: list[int], generation: Generation, budget: int) -> list[list[int]]:
    """Each row's response appended to its trace (cut at the episode budget: truncated); their tokens."""
    responses = []
    for k, i in enumerate(rows):
        t, lo, hi = traces[i], int(generation.offsets[k]), int(generation.offsets[k + 1])
        keep = min(hi - lo, budget - t.length)
        t.add(generation.tokens[lo:lo + keep].cpu(), generation.logp[lo:lo + keep].float().cpu())
        t.turns += 1
        t.truncated = keep < hi - lo
        responses.append(generation.tokens[lo:lo + keep].tolist())
    return responses


def _follow(t: Trace, outcome: Outcome, observation_ids: Tokens, i: int, budget: int, last_turn: bool) -> None:
    """One episode after its step: the reward on its last policy token, then its end or its observation."""
    t.rewards.append((t.length - 1, outcome.reward))
    t.tool_calls += outcome.tool_calls
    t.tool_errors += outcome.tool_errors
    t.error = outcome.error
    if outcome.done or t.truncated or last_turn or outcome.observation is None:
        t.done = True
        t.truncated = t.truncated or (last_turn and not outcome.done and outcome.error is None)
        return
    try:
        ids = observation_ids(i, outcome.observation)
    except ValueError as err:  # an observation the tokenizer cannot lay out: the episode ends
        t.done, t.error = True, str(err)
        return
    if t.length + len(ids) >= budget:  # no room for the observation and a response to it
        t.done = t.truncated = True
        t.cut = (f"observation: an observation of {len(ids)} tokens left no room for a response in the episode's "
                 f"{budget} tokens (--hf.max-episode-tokens); the episode ends truncated")
        return
    t.add(torch.tensor(ids, dtype=torch.int64), None)


def layout(traces: list[Trace], prompt_len: int, width: int, pad_id: int) -> dict[str, Tensor]:
    """The batch tensors of ``traces`` (see the module's docstring): ``tokens [B, P + E]``,
    ``attention_mask``, ``action_mask [B, E]``, ``behaviour_logp [B, E]``, ``turn_reward [B, E]``."""
    n = len(traces)
    tokens = torch.full((n, prompt_len + width), pad_id, dtype=torch.int64)
    attn = torch.zeros(n, prompt_len + width)
    amask, logp, reward = (torch.zeros(n, width) for _ in range(3))
    for r, t in enumerate(traces):
        p = len(t.prompt)
        tokens[r, prompt_len - p:prompt_len] = torch.tensor(t.prompt, dtype=torch.int64)
        attn[r, prompt_len - p:prompt_len + t.length] = 1.0
        at = 0
        for seg, pol, lp in zip(t.tokens, t.policy, t.logp):
            tokens[r, prompt_len + at:prompt_len + at + len(seg)] = seg
            logp[r, at:at + len(seg)] = lp
            amask[r, at:at + len(seg)] = float(pol)
            at += len(seg)
        for pos, value in t.rewards:
            if pos >= 0:
                reward[r, pos] += value
    return {"tokens": tokens, "attention_mask": attn, "action_mask": amask, "behaviour_logp": logp,
            "turn_reward": reward}


def wire_spans(prompt_len: int, pad_id: int, response_fields: tuple[str, ...]) -> Ragged:
    """:func:`layout`'s batch as it travels (:class:`~hpcrl.ppo.ragged.Ragged`): each row's ``attention_mask``
    run (its prompt, then its episode's policy and observation tokens) carries ``tokens`` (``pad_id`` around
    it) and the ``[B, E]`` fields named, whose column 0 is the mask's column ``prompt_len`` (0 past the
    episode: ``action_mask``, ``behaviour_logp``, ``turn_reward``, ``ref_logp``)."""
    return Ragged("attention_mask", (("tokens", 0, float(pad_id)), *((f, prompt_len, 0.0) for f in response_fields)))
