"""hpcrl.ppo.demo_tools: the ``sum A B`` tool-use task (the ``add`` tool, the records reward, held-out pairs,
the pre-training format, the built model's tokenizer) and one short real ``python -m hpcrl.ppo`` run of its
with-tool command in which the policy calls the tool and sees its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpcrl.ppo import demo_tools as D


def _env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**clean, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> D.Built:
    pytest.importorskip("transformers")
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return D.build(tmp_path_factory.mktemp("demo-tools"), seed=0, pretrain_steps=40)
    finally:
        torch.set_num_threads(threads)


def test_add_sums_two_integers_and_refuses_anything_else():
    assert D.add("12 30") == "42" and D.add(" 0   7 ") == "7" and D.add("49 49") == "98"
    for bad in ("", "12", "12 30 1", "twelve 30", "1.5 2", "12,30"):
        with pytest.raises(ValueError, match="two integers"):
            D.add(bad)


def test_reward_is_one_when_the_last_word_is_the_answer():
    rec = {"prompt": "sum 12 30", "answer": 42, "id": 0}
    responses = ["42", "the answer is 42", "42 12", "", "<tool> add 12 30 </tool>", "4 2", " 42 \n"]
    assert D.reward([rec] * len(responses), responses) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_records_hold_out_unordered_pairs_never_trained_on():
    train, held = D.split_pairs(seed=0)
    assert len(held) == D.EVAL_RECORDS and len(set(held)) == len(held)
    assert not {frozenset(p) for p in held} & {frozenset(p) for p in train}  # neither order of a held-out sum
    assert len(train) + sum(2 - (a == b) for a, b in held) == D.NUMBERS ** 2  # every ordered pair, once
    assert D.split_pairs(seed=0) == (train, held) and D.split_pairs(seed=1)[1] != held
    recs = D.task_records(held[:2])
    a, b = held[0]
    assert recs[0] == {"prompt": f"sum {a} {b}", "answer": a + b, "id": 0} and recs[1]["id"] == 1


def test_pretraining_corpus_is_the_format_with_undecided_answers():
    train, _ = D.split_pairs(seed=0)
    corpus = D.format_corpus(train, 2000, seed=1)
    tools = [line.split() for line in corpus if "<tool>" in line]
    direct = [line.split() for line in corpus if "<tool>" not in line]
    assert 0.4 < len(tools) / len(corpus) < 0.6
    for w in tools:  # sum A B <tool> add A B </tool> <eos> <result> S </result> X <eos>
        a, b = int(w[1]), int(w[2])
        assert w[0] == "sum" and w[3:9] == ["<tool>", "add", w[1], w[2], "</tool>", "<eos>"]
        assert w[9:12] == ["<result>", str(a + b), "</result>"] and w[13] == "<eos>" and len(w) == 14
        assert w[12] in (w[1], w[2], str(a + b))
    answers = [w[12] for w in tools]
    right = sum(x == w[10] for x, w in zip(answers, tools)) / len(tools)
    assert 0.12 < right < 0.3, right  # the result is the answer only some of the time: RL must learn to copy it
    for w in direct:  # sum A B X <eos>, X any number
        assert len(w) == 5 and w[0] == "sum" and w[4] == "<eos>" and 0 <= int(w[3]) <= 2 * (D.NUMBERS - 1)
    assert {(int(w[1]), int(w[2])) for w in tools + direct} <= set(train)  # never a held-out pair


def test_built_model_tokenizer_round_trips_an_episode(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built.model)
    for text in (D.transcript(12, 30, 42), D.transcript(49, 49, 98), D.transcript(0, 0, 0, tool=False),
                 "sum 3 4 <tool> add 3 </tool> <eos> <error> </error> 7 <eos>"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids and len(ids) == len(text.split()) and tok.decode(ids) == text, (text, ids)
        assert ids.count(tok.eos_token_id) == text.split().count("<eos>")  # <eos> in a line is the EOS token
    assert all(tok.convert_tokens_to_ids(w) != tok.unk_token_id for w in D.vocabulary())
    mask = D.policy_mask(tok(D.transcript(1, 2, 3), add_special_tokens=False)["input_ids"], tok)
    assert mask == [False] * 3 + [True] * 6 + [False] * 3 + [True] * 2  # no loss on the prompt nor the result
    assert len(D.read_jsonl(built.train)) == D.TRAIN_RECORDS and len(D.read_jsonl(built.eval)) == D.EVAL_RECORDS


def test_with_tool_command_runs_and_calls_the_tool(built, tmp_path):
    cmd = D.command(built, tools=True, total_steps=2, run_dir=tmp_path / "run", eval_every=2)
    base = D.command(built, tools=False, total_steps=2, run_dir=tmp_path / "run", eval_every=2)
    assert "--hf.tools" in cmd and "--hf.tools" not in base and base[base.index("--hf.max-turns") + 1] == "1"
    at, one = cmd.index("--hf.tools"), base.index("--hf.max-turns")
    assert cmd[at:at + len(D.TOOL_ARGS)] == list(D.TOOL_ARGS) and base[one:one + 2] == ["--hf.max-turns", "1"]
    assert cmd[:at] + cmd[at + len(D.TOOL_ARGS):] == base[:one] + base[one + 2:]  # the same run but the tool
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "score" in r]
    assert {r["updates"] for r in updates} == {1, 2}, rows
    assert all(r["tool_call_rate"] > 0 and r["observation_token_frac"] > 0 and r["episode_error_frac"] == 0
               for r in updates), updates
    [ev] = [r for r in rows if "eval_pass_rate" in r]
    assert ev["eval_records"] == D.EVAL_RECORDS and 0 <= ev["eval_pass_rate"] <= 1


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
