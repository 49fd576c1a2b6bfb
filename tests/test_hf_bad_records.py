"""A bad record of a prompts file is named before any rank starts, in one line, exit 2: a line that is
not UTF-8 or not JSON by flag, file and line; a prompt over the context with a fix that can work on
that model; a reward function returning text instead of numbers by its name and what it returned.
``--hf.truncate-prompts`` cuts a huge prompt from its end with bounded work and warns once. Tiny
models built here (hf_fixtures, a context of 64 tokens); no network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import hf_fixtures as F  # noqa: E402
from hpcrl.run import rundir  # noqa: E402
from hpcrl.core.config_check import ConfigError  # noqa: E402
from hpcrl.ppo.workload import Workload  # noqa: E402
from hpcrl.ppo.workloads import make_workload  # noqa: E402
from hpcrl.ppo.workloads.hf_models import call_reward_fn  # noqa: E402
from hpcrl.ppo.workloads.hf_prompts import tail_tokens  # noqa: E402

ME = "test_hf_bad_records"
SIZES = ["--hf.max-prompt-tokens", "8", "--hf.max-new-tokens", "4"]
CONTEXT = 64  # F.build_causal_lm's max_positions


def zeros(prompts: list[str], responses: list[str]) -> list[float]:
    return [0.0] * len(responses)


def numeric_strings(prompts: list[str], responses: list[str]) -> list[str]:
    return ["0.5"] * len(responses)


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad_records")
    return {"llama": F.build_causal_lm(d / "llama"), "prompts": F.write_prompts(d / "prompts.jsonl", n=8)}


def _one_line_exit_2(art: dict[str, Path], tmp_path: Path, extra: list[str], reward: str = "zeros") -> str:
    proc = F.run_ppo(["--workload", "hf", "--hf.model", str(art["llama"]), "--hf.reward-fn", f"{ME}:{reward}",
                      *SIZES, *extra, "--run-dir", str(tmp_path / "run")], tmp_path, 120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("hpcrl.ppo: error: ") and not (tmp_path / "run").exists(), lines
    return lines[0]


def _words(n: int) -> str:
    return " ".join(F.WORDS[2 + i % 20] for i in range(n))


def test_a_line_that_is_not_utf8_or_json_is_named_by_flag_file_and_line(art, tmp_path):
    good = json.dumps({"prompt": "red blue"}).encode() + b"\n"
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(good + b"\n" + b'{"prompt": "caf\xe9 \xff"}\n')  # line 3: Latin-1, not UTF-8
    line = _one_line_exit_2(art, tmp_path, ["--hf.prompts", str(latin)])
    assert f"--hf.prompts {latin}: line 3 is not UTF-8 (byte 0xe9 at byte 16 of the line)" in line, line
    assert "codec" not in line, line
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(good * 4 + b'{"prompt": "red\n')
    line = _one_line_exit_2(art, tmp_path, ["--hf.prompts", str(art["prompts"]), "--hf.eval-prompts", str(broken),
                                            "--hf.eval-every", "5"])
    assert f"--hf.eval-prompts {broken}: line 5 is not JSON (" in line, line
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=f"--hf.prompts {deep}: line 1 is not JSON .nested too deeply"):
        _wl(art, prompts=str(deep))


def _wl(art: dict[str, Path], **kw) -> Workload:
    """The workload as ``--workload hf`` builds it (messages spell ``--hf.*``)."""
    opts = dict(model=str(art["llama"]), reward_fn=f"{ME}:zeros", prompts=str(art["prompts"]), max_prompt_tokens=8,
                max_new_tokens=4, batch_size=4)
    return make_workload("hf", **{**opts, **kw})


def test_a_prompt_over_the_context_gets_a_fix_that_can_work(art, tmp_path):
    fits = tmp_path / "fits.jsonl"  # 30 tokens: --hf.max-prompt-tokens 30 + 4 new tokens fit in 64
    fits.write_text(json.dumps({"prompt": "red"}) + "\n" + json.dumps({"prompt": _words(30)}) + "\n")
    with pytest.raises(ConfigError) as err:
        _wl(art, prompts=str(fits))
    msg = str(err.value)
    assert msg.startswith(f"--hf.prompts {fits}: 1 prompt(s) longer than --hf.max-prompt-tokens 8 (longest: "
                          "record 1, 30 tokens); raise --hf.max-prompt-tokens to 30, or pass "
                          "--hf.truncate-prompts"), msg
    assert _wl(art, prompts=str(fits), max_prompt_tokens=30).task.prompt_ids[1][-1] > 0  # the fix works
    over = tmp_path / "over.jsonl"  # 300 tokens: no --hf.max-prompt-tokens fits a context of 64
    over.write_text(json.dumps({"prompt": _words(300)}) + "\n")
    line = _one_line_exit_2(art, tmp_path, ["--hf.prompts", str(over)])
    assert f"--hf.prompts {over}: 1 prompt(s) longer than --hf.max-prompt-tokens 8 (longest: record 0, " in line
    assert "raise" not in line and "--hf.truncate-prompts" in line, line
    assert f"a model with a longer context (--hf.model's is {CONTEXT} tokens, --hf.max-new-tokens 4 included)" in line


def test_a_huge_prompt_is_cut_from_its_end_with_bounded_work(art):
    tok = _wl(art).task.tokenizer
    seen: list[int] = []

    def tokenize(text: str) -> list[int]:
        seen.append(len(text))
        return list(tok(text, add_special_tokens=True)["input_ids"])

    text = _words(2_000_000)  # ~11 MB
    ids, whole = tail_tokens(tokenize, text, 8)
    assert not whole and len(ids) > 8 and max(seen) < 10_000, seen
    moderate = _words(3000)
    assert tail_tokens(tokenize, moderate, 8)[0][-8:] == tokenize(moderate)[-8:]  # as the whole text gives them
    short = _words(5)
    assert tail_tokens(tokenize, short, 8) == (tokenize(short), True)


def test_truncation_warns_once_per_run(art, tmp_path, capsys, monkeypatch):
    huge = tmp_path / "huge.jsonl"
    huge.write_text(json.dumps({"prompt": "red"}) + "\n" + json.dumps({"prompt": _words(1_000_000)}) + "\n")
    for _ in range(2):  # the launcher builds the workload, and again for a single rank in the same process
        wl = _wl(art, prompts=str(huge), truncate_prompts=True)
    assert len(wl.task.prompt_ids[1]) == 8
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warned) == 1 and "(longest: record 1, at least " in warned[0], warned
    assert "truncated to their last 8 tokens" in warned[0], warned
    monkeypatch.setenv(rundir.LAUNCHED_PID_ENV, "1")  # a spawned rank: its launcher has warned
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"prompt": _words(40)}) + "\n")
    _wl(art, prompts=str(other), truncate_prompts=True)
    assert "warning" not in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_with_a_huge_prompt_truncated_warns_once(art, tmp_path):
    huge = tmp_path / "huge.jsonl"
    huge.write_text("".join(json.dumps({"prompt": _words(n)}) + "\n" for n in (3, 4, 1_000_000, 5)))
    proc = F.run_ppo(["--workload", "hf", "--hf.model", str(art["llama"]), "--hf.reward-fn", f"{ME}:zeros",
                      "--hf.prompts", str(huge), "--hf.truncate-prompts", "True", *SIZES, "--hf.batch-size", "4",
                      "--makers", "1", "--trainers", "1", "--total-steps", "1", "--run-dir", str(tmp_path / "run")],
                     tmp_path, 180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warned) == 1 and warned[0].startswith(f"hpcrl.ppo hf: warning: --hf.prompts {huge}: 1 prompt(s) "
                                                     "longer than --hf.max-prompt-tokens 8 (longest: record 2, at "
                                                     "least "), proc.stderr[-3000:]


def test_a_reward_of_strings_is_refused_in_one_line(art, tmp_path):
    where = "--reward-fn m:f on batch 3 (2 responses) returned "
    for out, got in [(["0.5", "1"], "the str '0.5' in a list"), ("12", "the str '12'"),
                     ((1.0, b"2"), "the bytes b'2' in a tuple")]:
        with pytest.raises(ConfigError, match="not numbers") as err:
            call_reward_fn(lambda p, r, out=out: out, "m:f", ["a", "b"], ["x", "y"], batch=3)
        assert str(err.value).startswith(where + got), str(err.value)
    assert call_reward_fn(lambda p, r: [True, 2], "m:f", ["a", "b"], ["x", "y"], batch=3) == [1.0, 2.0]
    line = _one_line_exit_2(art, tmp_path, ["--hf.prompts", str(art["prompts"])], reward="numeric_strings")
    assert f"--hf.reward-fn {ME}:numeric_strings on batch probe (2 responses) returned the str '0.5' in a list, " \
           "not numbers" in line, line
