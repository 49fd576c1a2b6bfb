"""Verifiable-reward datasets of the ``hf`` workload: records with any fields reach a ``records``
reward function (a ``prompts`` one still gets strings), chat records go through the tokenizer's chat
template, a held-out set is evaluated every ``--hf.eval-every`` updates into ``eval_*`` metrics, and a
resumed run continues with the next record. Tiny models built here (hf_fixtures); no network."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import hf_fixtures as F  # noqa: E402
from hpcrl.core.config_check import ConfigError  # noqa: E402
from hpcrl.ppo.workloads.hf import HFWorkload  # noqa: E402
from hpcrl.ppo.workloads.hf_eval import pass_rate  # noqa: E402
from hpcrl.ppo.workloads.hf_prompts import epoch_order  # noqa: E402

ME = "test_hf_records"
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}yes{% endif %}")
SEEN: list[list] = []  # what the spies below were called with, in this process
SIZES = ["--hf.max-prompt-tokens", "8", "--hf.max-new-tokens", "4"]
LOG = "HPCRL_TEST_RECORDS_LOG"  # a file the ranks' records reward appends each call's record ids to


def records_spy(records: list[dict], responses: list[str]) -> list[float]:
    SEEN.append(records)
    return [float(r.split().count(rec["answer"])) / 8 for rec, r in zip(records, responses)]


def prompts_spy(prompts: list[str], responses: list[str]) -> list[float]:
    SEEN.append(prompts)
    return [0.0] * len(responses)


def texts_first(texts: list[str], responses: list[str]) -> list[float]:
    return [0.0] * len(responses)


def logged_ids(records: list[dict], responses: list[str]) -> list[float]:
    with open(os.environ[LOG], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "ids": [r["id"] for r in records]}) + "\n")
    return [float("yes" in r.split()) for r in responses]


def _records(path: Path, n: int = 24) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": "red blue " + F.WORDS[2 + i % 20], "answer": "yes", "tests": [i, i + 1],
                                "meta": {"source": "t", "k": i}, "id": i}) + "\n")
    return path


def _chat(path: Path) -> Path:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "red blue"}]
    path.write_text("".join(json.dumps({"messages": msgs, "answer": "yes", "id": i}) + "\n" for i in range(4)))
    return path


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("records")
    return {"llama": F.build_causal_lm(d / "llama"),
            "chat_llama": F.build_causal_lm(d / "chat", chat_template=TEMPLATE),
            "records": _records(d / "records.jsonl"), "chat": _chat(d / "chat.jsonl")}


def _wl(art, reward: str, **kw) -> HFWorkload:
    opts = dict(model=str(art["llama"]), reward_fn=f"{ME}:{reward}", prompts=str(art["records"]), max_prompt_tokens=8,
                max_new_tokens=4, batch_size=4)
    return HFWorkload(**{**opts, **kw})


def _one_batch(wl: HFWorkload) -> list:
    SEEN.clear()
    wl.make_collector(5).collect(wl.build_model(0, critic=False), torch.Generator().manual_seed(0))
    return SEEN[-1]


def test_records_reward_gets_every_field(art):
    wl = _wl(art, "records_spy")
    got = _one_batch(wl)
    rows = [json.loads(line) for line in art["records"].read_text().splitlines()]
    assert len(got) == 4 and all(isinstance(r, dict) and r == rows[r["id"]] for r in got), got
    assert set(got[0]) == {"prompt", "answer", "tests", "meta", "id"}
    got[0]["answer"] = "changed"  # a copy: the reward cannot change the dataset
    assert wl.task.records[got[0]["id"]]["answer"] == "yes"


def test_prompts_reward_gets_strings(art):
    got = _one_batch(_wl(art, "prompts_spy"))
    rows = {json.loads(line)["prompt"] for line in art["records"].read_text().splitlines()}
    assert len(got) == 4 and all(isinstance(p, str) and p in rows for p in got), got


def test_reward_with_neither_first_parameter_is_one_line(art, tmp_path):
    with pytest.raises(ConfigError) as err:
        _wl(art, "texts_first")
    msg = str(err.value)
    assert "first parameter is 'texts'" in msg and "records" in msg and "\n" not in msg, msg
    proc = F.run_ppo(["--workload", "hf", "--hf.model", str(art["llama"]), "--hf.reward-fn", f"{ME}:texts_first",
                      "--hf.prompts", str(art["records"]), *SIZES, "--run-dir", str(tmp_path / "run")], tmp_path, 120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "--hf.reward-fn" in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()


def test_chat_records_use_the_chat_template(art, tmp_path):
    wl = _wl(art, "prompts_spy", model=str(art["chat_llama"]), prompts=str(art["chat"]))
    want = "system: be brief user: red blue yes"  # TEMPLATE by hand, with the generation prompt
    assert wl.task.prompt_texts == [want] * 4
    assert wl.task.prompt_ids[0] == wl.task.tokenizer(want, add_special_tokens=False)["input_ids"]
    assert _one_batch(wl) == [want] * 4  # a prompts reward gets the text the actor saw
    # a tokenizer without a template: refused, one line, before any rank starts
    with pytest.raises(ConfigError, match="record 0 is chat-format .* no chat template") as err:
        _wl(art, "prompts_spy", prompts=str(art["chat"]))
    assert "\n" not in str(err.value)
    proc = F.run_ppo(["--workload", "hf", "--hf.model", str(art["llama"]), "--hf.reward-fn", f"{ME}:prompts_spy",
                      "--hf.prompts", str(art["chat"]), *SIZES, "--run-dir", str(tmp_path / "run")], tmp_path, 120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "no chat template" in lines[0], proc.stderr


def test_eval_options_are_checked(art, tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    for kw, want in [(dict(eval_every=5), "--eval-every 5: must be given with --eval-prompts"),
                     (dict(eval_prompts=str(art["records"])), "--eval-prompts"),
                     (dict(eval_prompts=str(tmp_path / "empty.jsonl"), eval_every=5), "no records in it")]:
        with pytest.raises(ConfigError, match=want):
            _wl(art, "records_spy", **kw)
    assert pass_rate([[0.0, 1.0], [0.5, 0.2], [1.0]], 1.0) == pytest.approx(2 / 3)  # any answer >= threshold


def test_bad_datasets_exit_2_with_one_line_before_any_rank_starts(art, tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "keyless.jsonl").write_text(json.dumps({"question": "red blue", "answer": "yes"}) + "\n")
    base = ["--workload", "hf", "--hf.model", str(art["llama"]), "--hf.reward-fn", f"{ME}:records_spy", *SIZES]
    for extra, want in [(["--hf.prompts", str(art["records"]), "--hf.eval-prompts", str(tmp_path / "empty.jsonl"),
                          "--hf.eval-every", "5"], "no records in it"),
                        (["--hf.prompts", str(tmp_path / "keyless.jsonl")], "--hf.prompt-key NAME")]:
        proc = F.run_ppo([*base, *extra, "--run-dir", str(tmp_path / "run")], tmp_path, 120)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and want in lines[0], proc.stderr[-2000:]
        assert lines[0].startswith("hpcrl.ppo: error:") and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_run_writes_eval_rows(art, tmp_path):
    run = tmp_path / "run"
    proc = F.run_ppo(["--workload", "hf", "--hf.model", str(art["llama"]), "--hf.reward-fn", f"{ME}:records_spy",
                      "--hf.prompts", str(art["records"]), "--hf.eval-prompts", str(art["records"]),
                      "--hf.eval-every", "5", "--hf.eval-samples", "2", "--hf.max-prompt-tokens", "8",
                      "--hf.max-new-tokens", "4", "--hf.batch-size", "8", "--makers", "1", "--trainers", "1",
                      "--total-steps", "10", "--ppo.lr", "1e-3", "--run-dir", str(run)], tmp_path, 120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["updates"]: r for r in rows if "eval_reward" in r}
    assert sorted(evals) == [5, 10], sorted(evals)
    for r in evals.values():
        assert math.isfinite(r["eval_reward"]) and 0 <= r["eval_pass_rate"] <= 1 and r["eval_records"] == 24, r
        assert math.isfinite(r["eval_sample_reward"])


@pytest.mark.slow
def test_resume_of_a_records_dataset_continues_with_the_next_record(art, tmp_path):
    run, log = tmp_path / "run", tmp_path / "ids.jsonl"
    common = ["--workload", "hf", "--hf.model", str(art["llama"]), "--hf.reward-fn", f"{ME}:logged_ids",
              "--hf.prompts", str(art["records"]), "--hf.max-prompt-tokens", "8", "--hf.max-new-tokens", "4",
              "--hf.batch-size", "4", "--makers", "1", "--trainers", "1", "--ppo.lr", "1e-3", "--run-dir", str(run)]
    first = F.run_ppo([*common, "--total-steps", "3"], tmp_path, 120, env={LOG: str(log)})
    assert first.returncode == 0, first.stderr[-2000:]
    second = F.run_ppo([*common, "--total-steps", "5", "--resume"], tmp_path, 120, env={LOG: str(log)})
    assert second.returncode == 0, second.stderr[-2000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    order = epoch_order(24, 0, 0)  # the run's record order (--seed 0): batch b is order[4b : 4b + 4]
    batch = [[order[i] for i in range(4 * b, 4 * b + 4)] for b in range(6)]
    pids = list(dict.fromkeys(c["pid"] for c in calls))
    by_pid = {p: [c["ids"] for c in calls if c["pid"] == p and len(c["ids"]) == 4] for p in pids}  # no probes
    makers = [ids for ids in by_pid.values() if ids]
    assert len(makers) == 2, by_pid
    assert makers[0][:3] == batch[:3], makers[0]  # the first run trained on batches 0-2 (maybe collected more)
    assert makers[1][:2] == batch[3:5], makers[1]  # the resumed run's maker starts at batch 3, the next record


def test_eval_does_not_change_training(art):
    from hpcrl.comm import GradAverager, Plane

    def train(wl: HFWorkload) -> tuple[list[torch.Tensor], list[dict]]:
        model = wl.build_model(0)
        cfg = wl.default_config()
        learner = wl.make_learner(model, cfg, GradAverager([p for p in model.parameters() if p.requires_grad],
                                                           plane=Plane.local("device")))
        collector, gen = wl.make_collector(3), torch.Generator().manual_seed(1)
        stats = [learner.update([collector.collect(model, gen)[0]], gen) for _ in range(2)]
        return [p.detach().clone() for p in model.parameters()], stats

    plain, _ = train(_wl(art, "records_spy"))
    evaluated, stats = train(_wl(art, "records_spy", eval_prompts=str(art["records"]), eval_every=1, eval_samples=1))
    assert all(torch.equal(a, b) for a, b in zip(plain, evaluated))  # no training stream is drawn from
    assert all(s["eval_records"] == 24 and 0 <= s["eval_pass_rate"] <= 1 for s in stats), stats


@pytest.mark.slow
def test_fsdp_trainers_evaluate_together(art, tmp_path):
    # transformers would all-reduce over the world (makers too) in generate for an FSDP module: a hang
    run = tmp_path / "run"
    proc = F.run_ppo(["--workload", "hf", "--hf.model", str(art["llama"]), "--hf.reward-fn", f"{ME}:records_spy",
                      "--hf.prompts", str(art["records"]), "--hf.eval-prompts", str(art["records"]),
                      "--hf.eval-every", "2", *SIZES, "--hf.batch-size", "8", "--makers", "1", "--trainers", "2",
                      "--strategy", "fsdp", "--total-steps", "2", "--timeout-s", "60", "--run-dir", str(run)],
                     tmp_path, 180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_reward" in r]
    assert evals and evals[0]["updates"] == 2 and evals[0]["eval_records"] == 24, rows
