"""The ``hf`` workload's environments: a batch of episodes as a maker plays them (:class:`EnvEpisodes`), and
the built-in tool episodes (:class:`ToolEpisode`, ``--hf.tools``).

:class:`EnvEpisodes` builds one episode per row from its record (``--hf.env``'s factory, or tool episodes),
turns their observations into tokens (text as it is; chat messages through the tokenizer's chat template,
as what the template appends for them after an assistant turn) and steps them all at once, each bounded
(:func:`~.episodes.launch`).

Tool calls (:class:`ToolEpisode`): a response holding ``<tool>NAME ARGUMENT</tool>`` (the closing tag may be
cut off by the end of the response) calls the tool ``NAME`` with the text ``ARGUMENT`` in a worker process
(:class:`~.tool_runner.ToolRunner`, stopped after ``--hf.tool-timeout-s``); the policy sees ``<result> TEXT
</result>`` or ``<error> WHY </error>`` next. A response without a call is the episode's answer, scored by
``--hf.reward-fn`` (given the record, or its prompt text, and that response).
"""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING, Any

from . import hf_models as M
from .episodes import Episode, EpisodeFactory, Observation, Pending, import_factory, launch, probe
from .rollout import Trace
from .tool_runner import ToolRunner, check_tools, parse_tools

if TYPE_CHECKING:
    from .hf_options import HFOptions
    from .hf_task import HFTask

__all__ = ["CALL", "EnvEpisodes", "ToolEpisode", "check_env"]

CALL = re.compile(r"<tool>\s*([A-Za-z_][\w.-]*)\s*(.*?)\s*(?:</tool>|$)", re.DOTALL)
"""A tool call in a response: the first ``<tool>NAME ARGUMENT</tool>``."""
_CHAT_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class ToolEpisode:
    """One record's episode with tools: the record's prompt, then tool calls until an answer."""

    def __init__(self, record: dict[str, Any], prompt: Observation, runner: ToolRunner, task: HFTask) -> None:
        self.record, self.prompt, self.runner, self.task = record, prompt, runner, task

    def reset(self) -> Observation:
        return self.prompt

    def step(self, response: str) -> tuple[Observation | None, float, bool, dict[str, int]]:
        call = CALL.search(response)
        if call is None:  # the answer
            return None, self.task.score_answer(self.record, self.prompt_text(), response), True, {}
        result = self.runner.call(call.group(1), call.group(2))
        text = f"<result> {result.text} </result>" if result.status == "ok" else f"<error> {result.text} </error>"
        obs: Observation = [{"role": "tool", "content": text}] if isinstance(self.prompt, list) else text
        return obs, 0.0, False, {"tool_calls": 1, "tool_errors": int(result.status != "ok")}

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[-1]["content"]


def tool_factory(options: HFOptions, task: HFTask, runner: ToolRunner) -> EpisodeFactory:
    """Tool episodes of the records (their ``--prompt-key`` text, or their chat ``messages``)."""
    key = options.prompt_key
    return lambda record: ToolEpisode(record, record[key] if isinstance(record.get(key), str)
                                      else list(record["messages"]), runner, task)


def check_env(options: HFOptions, task: HFTask) -> None:
    """Before ranks start: the factory imports and resets record 0; the tools import."""
    if options.env is not None:
        probe(import_factory(options.env, options.flag("env")), task.records[0], options.env, options.flag("env"))
    if options.tools is not None:
        check_tools(parse_tools(options.tools))


class EnvEpisodes:
    """A maker's environment: the episodes of each batch, their prompt and observation tokens, their steps."""

    def __init__(self, options: HFOptions, task: HFTask) -> None:
        self.options, self.task = options, task
        self.runner: ToolRunner | None = None
        if options.tools is not None:
            self.runner = ToolRunner(parse_tools(options.tools), options.tool_timeout_s, options.tool_workers)
            self.factory = tool_factory(options, task, self.runner)
        else:
            self.factory = import_factory(options.env or "", options.flag("env"))
        self.episodes: list[Episode | None] = []
        self._chat_base: list[int] | None = None  # the template's tokens of a fixed user + assistant exchange

    def start(self, records: list[dict[str, Any]]) -> list[Trace]:
        """One episode per record (fresh copies), reset; a trace per episode with its prompt's tokens. An
        episode that cannot start (its factory or reset raises, a prompt over ``--max-prompt-tokens``
        without ``--truncate-prompts``) gets a finished trace with the reason: no tokens, no reward."""
        self.episodes, traces = [], []
        for record in records:
            try:
                episode = self.factory(dict(record))
                ids = self.prompt_ids(episode.reset())
                self.episodes.append(episode)
                traces.append(Trace(ids))
            except Exception as err:  # the user's factory or reset, or a prompt too long: this episode ends
                self.episodes.append(None)
                traces.append(Trace([self.task.eos_id], done=True, error=f"episode start: {type(err).__name__}: {err}"))
        return traces

    def step(self, rows: list[int], responses: list[list[int]], wake: threading.Condition) -> list[Pending]:
        """The steps of episodes ``rows`` on their responses, started (each in a thread of its own)."""
        decode = self.task.tokenizer.decode
        calls = [(lambda e=self.episodes[i], r=decode(ids, skip_special_tokens=True): e.step(r))
                 for i, ids in zip(rows, responses)]
        return launch(calls, self.options.step_timeout_s, wake)

    def prompt_ids(self, obs: Observation) -> list[int]:
        """The first observation's tokens, as a dataset prompt's (templated; cut or refused past the width)."""
        o, tok = self.options, self.task.tokenizer
        if isinstance(obs, str):
            text = M.format_prompt(tok, obs, o.chat_template)
            templated = bool(o.chat_template and getattr(tok, "chat_template", None))
        else:
            text, templated = tok.apply_chat_template(obs, tokenize=False, add_generation_prompt=True), True
        ids = list(tok(text, add_special_tokens=not templated)["input_ids"])
        if not ids:
            raise ValueError("the first observation tokenizes to nothing")
        if len(ids) > o.max_prompt_tokens:
            if not o.truncate_prompts:
                raise ValueError(f"the first observation has {len(ids)} tokens, over --max-prompt-tokens "
                                 f"{o.max_prompt_tokens} (or pass --truncate-prompts)")
            ids = ids[-o.max_prompt_tokens:]
        return ids

    def observation_ids(self, i: int, obs: Observation) -> list[int]:
        """A later observation's tokens: text as it is, messages as the chat template appends them."""
        tok = self.task.tokenizer
        if isinstance(obs, str):
            return list(tok(obs, add_special_tokens=False)["input_ids"])
        if not getattr(tok, "chat_template", None):
            raise ValueError("a chat observation needs the tokenizer's chat template; return text instead")
        if self._chat_base is None:  # the same for every observation: rendered once
            self._chat_base = _ids(tok.apply_chat_template(_CHAT_BASE, tokenize=True))
        base = self._chat_base
        full = _ids(tok.apply_chat_template(_CHAT_BASE + list(obs), tokenize=True, add_generation_prompt=True))
        if full[:len(base)] != base:
            raise ValueError("the chat template does not extend a conversation by appending to it; return text")
        return full[len(base):]

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


def _ids(out: Any) -> list[int]:
    """``apply_chat_template(tokenize=True)``'s ids (a list, or a mapping holding ``input_ids``)."""
    return list(out["input_ids"] if hasattr(out, "keys") else out)
