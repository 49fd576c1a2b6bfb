"""FastSAC end to end: schedule, CLI, run directory, exact resume after a kill, bad configs, learning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpcrl.run import checkpoint
from hpcrl.comm import Plane
from hpcrl.sac import FastSAC, UpdateNoise, plan, preset
from hpcrl.sac.run import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sac_workers  # noqa: E402

TINY = ["--preset", "pendulum", "--num-envs", "4", "--batch-size", "32", "--actor-hidden", "32",
        "--critic-hidden", "32", "--num-atoms", "21", "--learning-starts", "4", "--random-steps", "4",
        "--num-updates", "2", "--log-every", "5", "--eval-episodes", "0"]


def run_cli(args, timeout=120, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(kw.pop("env", {}))
    return subprocess.run([sys.executable, "-m", "hpcrl.sac", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in ("time", "sps")} for row in rows]


@pytest.mark.parametrize("num_updates, policy_frequency", [(1, 1), (8, 4), (3, 2), (2, 5), (4, 1)])
def test_update_schedule_counts(num_updates, policy_frequency):
    cfg = preset("pendulum", actor_hidden=16, critic_hidden=16, num_atoms=5, num_updates=num_updates,
                 policy_frequency=policy_frequency)
    torch.manual_seed(0)
    agent = FastSAC(cfg, 3, 1, torch.tensor([-2.0]), torch.tensor([2.0]), torch.device("cpu"), plane=Plane.local("device"))
    batch, _ = sac_workers.global_data(0)
    batch = batch._replace(obs=batch.obs[:, :3], next_obs=batch.next_obs[:, :3], action=batch.action[:, :1])
    g = torch.Generator().manual_seed(0)
    env_steps = 5
    for _ in range(env_steps):  # the train loop's inner loop
        for _ in range(cfg.num_updates):
            agent.update(batch, UpdateNoise.draw(32, 1, g, torch.device("cpu")))
    critic = env_steps * num_updates
    steps = lambda opt: int(next(iter(opt.state.values()))["step"]) if opt.state else 0  # noqa: E731
    assert agent.counters.critic_steps == critic
    assert steps(agent.critic_opt) == critic
    assert steps(agent.alpha_opt) == critic  # alpha every critic step
    assert agent.counters.actor_steps == steps(agent.actor_opt) == critic // policy_frequency
    assert steps(agent.actor_opt) > 0 or critic < policy_frequency  # pf=1 updates the actor (holosoma bug 9.1.1)


def test_plan_validates_sizes_with_actionable_messages():
    assert plan(preset("pendulum", num_envs=8, batch_size=256), 2).batch_per_rank == 128
    with pytest.raises(ConfigError, match=r"num_envs=10 not divisible by world_size=4; use e.g. --num-envs 8, 12"):
        plan(preset("pendulum", num_envs=10), 4)
    with pytest.raises(ConfigError, match=r"batch_size=2 < world_size=4"):
        plan(preset("pendulum", num_envs=8, batch_size=2), 4)
    with pytest.raises(ConfigError, match="checkpoint_every=7 must be a multiple of log_every=5"):
        plan(preset("pendulum", checkpoint_every=7, log_every=5), 1)
    assert plan.__doc__ and "Validate" in plan.__doc__


def test_events_hook_sees_updates_rows_and_evals(tmp_path, monkeypatch):
    """train(cfg, events=cb): one UpdatesDone per learning env step, the metrics rows as written, the evals."""
    from hpcrl.run.metrics import finite_row
    from hpcrl.sac import events as ev
    from hpcrl.sac.__main__ import parse
    from hpcrl.sac.run import train

    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    seen: list = []
    cfg = parse(TINY + ["--total-env-steps", "40", "--checkpoint-every", "0", "--eval-every", "5",
                        "--eval-episodes", "1", "--run-dir", str(tmp_path)])
    train(cfg, events=seen.append)
    updates = [e for e in seen if isinstance(e, ev.UpdatesDone)]
    assert [e.vector_step for e in updates] == list(range(5, 11))  # learning_starts 4, 10 vector steps
    with pytest.warns(DeprecationWarning, match="vector_step"):
        assert updates[0].iteration == 5  # the field's old name still reads
    assert all(e.updates == 2 and e.seconds > 0 and e.rank == 0 for e in updates)
    rows = [finite_row({k: v for k, v in e.row.items() if k != "sps"}) for e in seen if isinstance(e, ev.RowLogged)]
    written = metrics(tmp_path)
    assert rows == [r for r in written if "eval_return" not in r]
    evals = [(e.env_steps, round(e.eval_return, 6)) for e in seen if isinstance(e, ev.EvalDone)]
    assert evals == [(r["env_steps"], r["eval_return"]) for r in written if "eval_return" in r]
    assert [s for s, _ in evals] == [20, 40]  # at --eval-every 5 and at the end


COMMON = TINY + ["--nproc", "2", "--total-env-steps", "240", "--checkpoint-every", "10"]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    ref = tmp_path_factory.mktemp("ref")
    done = run_cli(COMMON + ["--run-dir", str(ref)])
    return ref, done


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_run_dir_and_exact_resume_after_kill(tmp_path, reference_run):
    common = COMMON
    ref, done = reference_run
    assert done.returncode == 0, done.stderr
    config = json.loads((ref / "config.json").read_text())
    assert config["world_size"] == 2 and config["envs_per_rank"] == 2 and config["batch_per_rank"] == 16
    rows = metrics(ref)
    assert [r["env_steps"] for r in rows] == list(range(20, 241, 20))
    for key in ("env_steps", "updates", "episode_return", "critic_loss", "actor_loss", "alpha"):
        assert key in rows[-1]
    assert rows[-1]["updates"] == (60 - 4) * 2
    assert list((ref / "tb").glob("events.out.tfevents.*")), "no TensorBoard events"

    # Same job, SIGKILLed (the whole process group, mid-run) once its first checkpoint is committed.
    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.sac", *common, "--run-dir", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while checkpoint.latest(run) is None and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert checkpoint.latest(run) is not None, "no checkpoint was committed before the kill"
    resumed = run_cli(common + ["--run-dir", str(run), "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout
    assert metrics(run) == rows  # every logged number equals the uninterrupted run's


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigusr2_checkpoints_stops_and_resumes_exactly(tmp_path, reference_run):
    ref, _ = reference_run
    run = tmp_path / "preempted"
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.sac", *COMMON, "--checkpoint-every", "0",
                             "--run-dir", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGUSR2)  # what Slurm's --signal=USR2@<s> delivers to every task
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err  # EX_TEMPFAIL: stopped after a checkpoint, resumable
    assert "stop requested (SIGUSR2)" in out
    stopped_at = metrics(run)[-1]["env_steps"]
    assert stopped_at < 240, "the run finished before the signal arrived"
    # the stop is agreed every env step: the checkpoint is at the step after the signal, at or past the last row
    assert stopped_at // 4 <= int(checkpoint.latest(run).name.rsplit("_", 1)[1]) < 60
    resumed = run_cli(COMMON + ["--checkpoint-every", "0", "--run-dir", str(run), "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert metrics(run) == metrics(ref)


def test_bf16_autocast_update_is_finite_and_learns():
    cfg = sac_workers.small_config("flat")
    cfg = type(cfg)(**{**cfg.__dict__, "bf16": True})
    torch.manual_seed(0)
    agent = FastSAC(cfg, sac_workers.OBS, sac_workers.ACT, -torch.ones(2), torch.ones(2), torch.device("cpu"),
                    plane=Plane.local("device"))
    before = {k: v.clone() for k, v in agent.critic.state_dict().items()}
    for step in range(4):
        batch, noise = sac_workers.global_data(step)
        out = agent.update(batch, noise)
        assert all(torch.isfinite(v) for v in out.values()), out
    assert all(p.dtype == torch.float32 for p in agent.critic.parameters())  # master weights stay fp32
    assert any(not torch.equal(v, agent.critic.state_dict()[k]) for k, v in before.items())


def test_interrupted_checkpoint_never_replaces_the_last_good_one(tmp_path, monkeypatch):
    barrier = lambda name: None  # noqa: E731  (one rank)
    good = checkpoint.save(tmp_path, 10, 0, 1, {"x": torch.ones(2)}, {"a": torch.zeros(3)}, barrier)
    import hpcrl.run.checkpoint_write as ck  # where the rank files are written

    def crash(*a, **k):
        raise OSError("killed while writing (simulated)")

    monkeypatch.setattr(ck, "save_h5", crash)
    from hpcrl.core.diskfault import DiskFault

    with pytest.raises(DiskFault, match="simulated"):  # a failed write stops the run naming the cause
        checkpoint.save(tmp_path, 20, 0, 1, {"x": torch.full((2,), 2.0)}, {"a": torch.ones(3)}, barrier)
    assert checkpoint.latest(tmp_path) == good
    learner, mine = checkpoint.load(good, 0, 1, torch.device("cpu"))
    assert learner["x"].tolist() == [1.0, 1.0] and mine["a"].tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="written by 1 ranks but this job has 2"):
        checkpoint.load(good, 0, 2, torch.device("cpu"))


@pytest.mark.parametrize(
    "args, env, message, code",
    [
        (["--num-envs", "10", "--nproc", "4"], {}, "num_envs=10 not divisible by world_size=4", 2),
        (["--num-envs", "8", "--batch-size", "2", "--nproc", "4"], {}, "batch_size=2 < world_size=4", 2),
        (["--env", "no-such-env"], {}, "no-such-env", 2),
        ([], {"SLURM_PROCID": "0", "SLURM_JOB_ID": "7"}, "SLURM_NTASKS", 2),
    ],
)
def test_bad_configs_fail_fast_with_clear_errors(tmp_path, args, env, message, code):
    result = run_cli(["--preset", "pendulum", "--run-dir", str(tmp_path / "r"), *args], timeout=60, env=env)
    assert result.returncode == code, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pendulum_learns_with_two_ranks(tmp_path):
    """5,000 env steps: the preset's policy evaluates at about -180 (solved is -250 or better; a random policy
    scores about -1,200), and its training episodes rise too. Those are stochastic and end every 1,600 env steps
    (8 envs, 200 steps each), so the last one (steps 3,200-4,800) scored about -300 while it was still learning."""
    result = run_cli(["--preset", "pendulum", "--nproc", "2", "--run-dir", str(tmp_path / "p"),
                      "--checkpoint-every", "0", "--total-env-steps", "5000"], timeout=580)
    assert result.returncode == 0, result.stderr
    rows = metrics(tmp_path / "p")
    curve = [(r["env_steps"], r["episode_return"]) for r in rows if r.get("episode_return") is not None]
    final = rows[-1]
    assert final["eval_return"] > -300, f"eval return {final['eval_return']}; curve: {curve}"
    assert curve[-1][1] > -450 and curve[-1][1] > curve[0][1] + 500, f"training returns did not rise; curve: {curve}"
