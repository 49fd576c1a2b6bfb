"""Multi-turn episodes (``--hf.env``, ``--hf.tools``): the token layout and loss mask of a 3-turn episode
played by a scripted policy, per-turn rewards, observation tokens carrying no loss / KL / entropy, GAE over
policy tokens only, tool calls that hang or raise, episodes that break mid-run, and the refusals before
ranks start. Environments and tools: tests/episode_fixtures.py; tiny real transformers models."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import episode_fixtures as E  # noqa: E402
import hf_fixtures as F  # noqa: E402
from hpcrl.core.config_check import ConfigError  # noqa: E402
from hpcrl.ppo import demo_task as T  # noqa: E402
from hpcrl.ppo.losses import token_gae  # noqa: E402
from hpcrl.ppo.workloads.engine import Generation  # noqa: E402
from hpcrl.ppo.workloads.hf import HFWorkload  # noqa: E402
from hpcrl.ppo.workloads.hf_env import EnvEpisodes  # noqa: E402
from hpcrl.ppo.workloads.rollout import EPISODE_INFO, layout, run_turns  # noqa: E402

TOOL_WORDS = ["<tool>", "</tool>", "<result>", "</result>", "<error>", "</error>", "add", "slow", "boom", "nope",
              "sum", *[str(i) for i in range(20)]]


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("multi_turn")
    corpus = F.corpus() + [" ".join(TOOL_WORDS)] * 4
    T.build_causal_lm(d / "tools", corpus)
    return {"llama": F.build_causal_lm(d / "llama"), "tools": d / "tools",
            "prompts": F.write_prompts(d / "prompts.jsonl", n=16)}


def _wl(art, model: str = "llama", **kw) -> HFWorkload:
    base = dict(model=str(art[model]), prompts=str(art["prompts"]), max_prompt_tokens=8, max_new_tokens=4,
                batch_size=2, env="episode_fixtures:Scripted", max_turns=3, max_episode_tokens=24)
    return HFWorkload(**{**base, **kw})


def scripted(tok, turns: list[str]):
    """A policy that says ``turns[t]`` (then EOS) at turn ``t``, whatever it is asked: behaviour log-probs
    -0.1, -0.2, ... per token of a response."""
    calls = []

    def generate(prompts, params, seed):
        ids = tok(turns[len(calls)], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = ids[:params.max_new_tokens]
        calls.append((prompts, params.max_new_tokens, seed))
        n = len(prompts)
        logp = torch.tensor([-0.1 * (j + 1) for j in range(len(ids))] * n)
        offsets = torch.arange(n + 1) * len(ids)
        return Generation(torch.tensor(ids * n), logp, offsets, ["stop"] * n)
    return generate, calls


def _play(wl: HFWorkload, turns: list[str]):
    env = EnvEpisodes(wl.options, wl.task)
    traces = env.start([wl.task.records[0], wl.task.records[1]])
    generate, calls = scripted(wl.task.tokenizer, turns)
    run_turns(traces, generate, env.step, env.observation_ids, wl.task.sampling, 7, wl.options.max_turns,
              wl.options.episode_tokens, wl.options.turn_wait_s)
    env.close()
    return traces, calls


def test_three_turn_episode_layout_mask_and_rewards(art):
    wl = _wl(art)
    tok, eos, P = wl.task.tokenizer, wl.task.eos_id, 8
    traces, calls = _play(wl, ["red", "dog cat", "yes"])
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = wl.task.prompt_ids[0]
    assert traces[0].prompt == prompt and len(calls) == 3
    # each turn's context: everything so far
    r1, o1, r2, o2, r3 = ids("red") + [eos], ids("red blue"), ids("dog cat") + [eos], ids("cat"), ids("yes") + [eos]
    assert calls[1][0][0] == prompt + r1 + o1 and calls[2][0][0] == prompt + r1 + o1 + r2 + o2
    assert [c[2] for c in calls][0] == 7 and len({c[2] for c in calls}) == 3  # a seed per turn
    b = layout(traces, P, 24, wl.task.pad_id)
    after = r1 + o1 + r2 + o2 + r3
    row = b["tokens"][0]
    assert row[P - len(prompt):P].tolist() == prompt and row[P:P + len(after)].tolist() == after
    assert bool((row[:P - len(prompt)] == wl.task.pad_id).all()) and bool((row[P + len(after):] == wl.task.pad_id).all())
    policy = [1.0] * len(r1) + [0.0] * len(o1) + [1.0] * len(r2) + [0.0] * len(o2) + [1.0] * len(r3)
    assert b["action_mask"][0].tolist() == policy + [0.0] * (24 - len(after))
    assert b["attention_mask"][0].tolist() == [0.0] * (P - len(prompt)) + [1.0] * (len(prompt) + len(after)) + \
        [0.0] * (24 - len(after))
    ends = [len(r1) - 1, len(r1 + o1 + r2) - 1, len(after) - 1]  # each turn's reward on its last policy token
    want = torch.zeros(24)
    want[ends] = torch.tensor(E.TURN_REWARDS)
    assert torch.equal(b["turn_reward"][0], want)
    lp = b["behaviour_logp"][0]
    assert bool((lp[torch.tensor(policy + [0.0] * (24 - len(after))) == 0] == 0).all())
    assert lp[:len(r1)].tolist() == pytest.approx([-0.1 * (j + 1) for j in range(len(r1))])
    assert traces[0].info() == [3.0, 0.0, 0.0, 0.0, 0.0, float(len(o1) + len(o2))]
    assert len(EPISODE_INFO) == len(traces[0].info())


def test_observation_tokens_carry_no_loss_kl_or_entropy(art):
    from hpcrl.comm import GradAverager, Plane

    wl = _wl(art)
    traces, _ = _play(wl, ["red", "dog cat", "yes"])
    batch = layout(traces, 8, 24, wl.task.pad_id)
    batch["score"] = batch["turn_reward"].sum(1)
    batch["maker_tokens_per_s"] = torch.ones(1)
    batch["episode_info"] = torch.tensor([t.info() for t in traces])
    obs = (batch["action_mask"] == 0) & (batch["attention_mask"][:, 8:] == 1)
    assert bool(obs.any())

    def train(garbage: bool, **ppo):
        b = {k: v.clone() for k, v in batch.items()}
        b["ref_logp"] = b["behaviour_logp"] - 0.05 * b["action_mask"]
        if garbage:  # numbers on observation columns must not matter
            b["behaviour_logp"][obs] = -7.0
            b["ref_logp"][obs] = -3.0
            b["turn_reward"][obs] = 5.0
        model = wl.build_model(0)
        cfg = dataclasses.replace(wl.default_config(), lr=1e-2, ent_coef=0.05, **ppo)
        learner = wl.make_learner(model, cfg, GradAverager([p for p in model.parameters() if p.requires_grad],
                                                           plane=Plane.local("device")))
        samples, rewards = learner._samples({k: v for k, v in b.items() if k != "maker_tokens_per_s"})
        stats = learner.update([b], torch.Generator().manual_seed(0))
        return samples, rewards, [p.detach().clone() for p in model.parameters()], stats

    samples, rewards, clean, stats = train(False)
    assert bool((samples.advantages[obs] == 0).all()) and bool((rewards[obs] == 0).all())
    assert bool((samples.advantages[batch["action_mask"] > 0] != 0).any())
    _, _, dirty, stats2 = train(True)
    assert all(torch.equal(a, b) for a, b in zip(clean, dirty))
    for k in ("turns", "observation_token_frac", "tool_call_rate", "truncated_frac", "episode_error_frac"):
        assert stats[k] == stats2[k], k
    assert stats["turns"] == 3.0 and 0 < stats["observation_token_frac"] < 1
    for ppo in (dict(trim_padding=True), dict(pack_sequences=True)):  # the padding-free forwards agree
        _, _, other, _ = train(False, **ppo)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(clean, other)), ppo


def test_gae_over_policy_tokens_skips_observations():
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 9), torch.randn(3, 9)
    prefix = torch.tensor([[1.0] * 5 + [0.0] * 4, [1.0] * 9, [1.0] * 2 + [0.0] * 7])
    a1, r1 = token_gae(rewards, values, prefix, 1.0, 0.95, False)
    gaps = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0, 0], [1] * 9, [1, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=torch.float32)
    a2, r2 = token_gae(rewards, values, gaps, 1.0, 0.95, False)
    for row in range(3):  # each row's policy tokens, gathered, give what a prefix mask of them gives
        cols = gaps[row].nonzero().squeeze(-1)
        n = len(cols)
        m = torch.zeros(1, 9)
        m[0, :n] = 1
        r, v = torch.zeros(1, 9), torch.zeros(1, 9)
        r[0, :n], v[0, :n] = rewards[row, cols], values[row, cols]
        want, _ = token_gae(r, v, m, 1.0, 0.95, False)
        assert torch.allclose(a2[row, cols], want[0, :n])
        assert bool((a2[row][gaps[row] == 0] == 0).all())
    assert torch.equal(a1[1], a2[1])


def test_tool_calls_that_hang_or_raise_are_survived_and_counted(art):
    wl = _wl(art, "tools", env=None, tools="add=episode_fixtures:add,slow=episode_fixtures:slow,"
             "boom=episode_fixtures:boom", reward_fn="episode_fixtures:says_seven", tool_timeout_s=1.0,
             max_turns=4, max_new_tokens=6, max_episode_tokens=40)
    t0 = time.monotonic()
    traces, _ = _play(wl, ["<tool> slow 1 </tool>", "<tool> boom 2 </tool>", "<tool> add 3 4 </tool>", "sum 7"])
    assert time.monotonic() - t0 < 15
    t = traces[0]
    assert t.error is None and t.turns == 4 and t.tool_calls == 3 and t.tool_errors == 2
    text = wl.task.tokenizer.decode(torch.cat(t.tokens).tolist())
    assert "<error>" in text and "<result> 7 </result>" in text
    assert t.rewards[-1][1] == 1.0 and sum(r for _, r in t.rewards) == 1.0  # the answer "sum 7" scored 1


@pytest.mark.parametrize("env,why", [("RaisesOnSecond", "step raised ValueError: second step broke"),
                                     ("WrongTypes", "reward is str"),
                                     ("SleepsOnSecond", "longer than --hf.step-timeout-s 1")])
def test_a_broken_episode_ends_with_its_reason_and_the_others_go_on(art, env, why):
    wl = _wl(art, env=f"episode_fixtures:{env}", step_timeout_s=1.0)
    t0 = time.monotonic()
    traces, calls = _play(wl, ["red", "dog", "yes"])
    assert time.monotonic() - t0 < 10
    for t in traces:
        assert t.done and why in t.error, t.error
        assert t.info()[EPISODE_INFO.index("errors")] == 1.0
    assert len(calls) == (1 if env == "WrongTypes" else 2)


@pytest.mark.parametrize("kw,want", [
    (dict(env="no_such_module:Env"), "--env no_such_module:Env: cannot import 'no_such_module'"),
    (dict(env="episode_fixtures:Nope"), "has no 'Nope'"),
    (dict(env="episode_fixtures:NoStep"), "has no step() method"),
    (dict(env="episode_fixtures:ResetsToNumber"), "reset() of record 0 returned int 42"),
    (dict(env=None, max_turns=3, reward_fn="hf_fixtures:target_fraction"), "--max-turns 3: must be 1 without"),
    (dict(reward_fn="hf_fixtures:target_fraction"), "episodes give their own rewards"),
    (dict(env=None, tools="episode_fixtures:add"), "scored by --reward-fn"),
    (dict(env=None, tools="no_such.mod:f", reward_fn="episode_fixtures:says_seven"), "no_such.mod"),
    (dict(max_episode_tokens=60), "more than the model's context of 64"),
])
def test_refusals_before_ranks_start(art, kw, want):
    with pytest.raises(ConfigError) as err:
        _wl(art, **kw)
    assert want in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_an_observation_past_the_budget_ends_the_episode_truncated_and_is_logged_once(art, capfd):
    wl = _wl(art, env="episode_fixtures:LongObservation", batch_size=3)
    traces, calls = _play(wl, ["red", "dog", "yes"])
    assert len(calls) == 1
    for t in traces:
        assert t.done and t.truncated and t.error is None and "observation of 80 tokens" in t.cut
        assert t.info()[EPISODE_INFO.index("truncated")] == 1.0 and t.info()[EPISODE_INFO.index("errors")] == 0.0
    collector = wl.make_collector(1)
    for _ in range(2):
        batch, _ = collector.collect(wl.build_model(0, critic=False), torch.Generator().manual_seed(0))
    collector.close()
    err = capfd.readouterr().err
    assert err.count("an episode ended early: observation: an observation of 80 tokens") == 1, err
    assert bool((batch["episode_info"][:, EPISODE_INFO.index("truncated")] == 1).all())


@pytest.mark.parametrize("kw", [dict(algo="ppo"), dict(algo="grpo", group_size=2), dict(algo="ppo", lora_rank=4),
                                dict(algo="ppo", micro_batch_tokens=40, micro_batch_size=2),
                                dict(algo="grpo", group_size=2, ref_on="trainers")],
                         ids=["ppo", "grpo", "lora", "token-budget", "ref-on-trainers"])
def test_collect_and_update_over_episodes(art, kw):
    from hpcrl.comm import GradAverager, Plane

    wl = _wl(art, env="episode_fixtures:UntilYes", max_turns=3, max_new_tokens=4, max_episode_tokens=20,
             batch_size=4, **kw)
    cfg = dataclasses.replace(wl.default_config(), lr=2e-3, pack_sequences="micro_batch_tokens" in kw)
    model = wl.build_model(0)
    collector = wl.make_collector(3)
    learner = wl.make_learner(model, cfg, GradAverager([p for p in model.parameters() if p.requires_grad],
                                                       plane=Plane.local("device")))
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        batch, stats = collector.collect(model, gen)
        assert batch["tokens"].shape[1] == 8 + 20 and batch["episode_info"].shape == (batch["tokens"].shape[0], 6)
        out = learner.update([batch], gen)
        assert 1 <= out["turns"] <= 3 and 0 <= out["observation_token_frac"] < 1, out
        assert all(v == v for v in out.values()), out  # finite (no NaN)
    collector.close()


def test_a_slow_step_holds_only_its_own_episode(art):
    wl = _wl(art, env="episode_fixtures:SlowForRecordZero", turn_wait_s=0.3)
    records = {r["id"]: r for r in wl.task.records}
    env = EnvEpisodes(wl.options, wl.task)
    traces = env.start([records[0], records[1]])
    generate, calls = scripted(wl.task.tokenizer, ["red"] * 6)
    t0 = time.monotonic()
    run_turns(traces, generate, env.step, env.observation_ids, wl.task.sampling, 7, 3, 24, wl.options.turn_wait_s)
    env.close()
    # round 0 both; rounds 1-2 the fast episode alone (its turns 2 and 3) while the slow step runs; then the
    # slow episode's turns 2 and 3
    assert [len(c[0]) for c in calls] == [2, 1, 1, 1, 1], [len(c[0]) for c in calls]
    assert calls[1][0][0][:len(traces[1].prompt)] == traces[1].prompt
    assert all(t.turns == 3 and [r for _, r in t.rewards] == list(E.TURN_REWARDS) for t in traces)
    assert time.monotonic() - t0 < 4


def test_a_chat_observation_is_what_the_template_appends_after_an_assistant_turn(tmp_path, art):
    template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
                "{% if add_generation_prompt %}assistant{% endif %}")
    chat = F.build_causal_lm(tmp_path / "chat", chat_template=template)
    wl = _wl(art, model="llama", env="episode_fixtures:Scripted")
    wl_chat = HFWorkload(**{**wl.kwargs(), "model": str(chat)})
    env = EnvEpisodes(wl_chat.options, wl_chat.task)
    tok = wl_chat.task.tokenizer
    got = env.observation_ids(0, [{"role": "user", "content": "red blue"}])
    assert got == tok("user red blue <eos> assistant", add_special_tokens=False)["input_ids"]
    assert env.observation_ids(1, [{"role": "user", "content": "cat"}]) == \
        tok("user cat <eos> assistant", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="chat template"):  # a tokenizer without one: the episode ends
        EnvEpisodes(wl.options, wl.task).observation_ids(0, [{"role": "user", "content": "red"}])
