"""A trained FastSAC policy outside training: Policy == the agent's deterministic action (bit-exact),
snapshots, resolve, play (returns, video), ONNX export verified with onnxruntime. One real tiny run."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcrl.run import checkpoint, rundir
from hpcrl.comm import Plane
from hpcrl.sac.agent import FastSAC
from hpcrl.sac.config import SACConfig
from hpcrl.sac.normalizer import ObsNormalizer
from hpcrl.sac.policy import Policy, PolicyError, load, load_policy, policy_from_checkpoint, resolve, save_policy

TINY = ["--preset", "pendulum", "--num-envs", "4", "--total-env-steps", "400", "--learning-starts", "20",
        "--random-steps", "0", "--batch-size", "64", "--actor-hidden", "32", "--critic-hidden", "32",
        "--num-atoms", "11", "--num-updates", "2", "--log-every", "10", "--checkpoint-every", "50",
        "--eval-episodes", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def cli(module: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A real FastSAC run: 100 vector steps x 4 envs, a checkpoint at vector step 50."""
    run_dir = tmp_path_factory.mktemp("policy") / "run"
    proc = cli("hpcrl.sac", *TINY, "--run-dir", run_dir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert checkpoint.latest(run_dir) is not None
    return run_dir


def agent_from_checkpoint(run_dir: Path) -> tuple[FastSAC, ObsNormalizer, dict]:
    """The training-side objects, rebuilt from the checkpoint as a resume would."""
    saved = json.loads((run_dir / "config.json").read_text())
    names = {f.name for f in dataclasses.fields(SACConfig)}
    cfg = SACConfig(**{k: v for k, v in saved.items() if k in names})
    learner = torch.load(checkpoint.latest(run_dir) / checkpoint.LEARNER, weights_only=True)
    cpu = torch.device("cpu")
    agent = FastSAC(cfg, 3, 1, torch.tensor([-2.0]), torch.tensor([2.0]), cpu, plane=Plane.local("device", cpu))
    agent.load_learner_state(learner["agent"])
    normalizer = ObsNormalizer(3, enabled=cfg.obs_normalization)
    normalizer.load_state_dict(learner["normalizer"])
    return agent, normalizer, saved


def random_obs(n: int, seed: int = 0) -> torch.Tensor:
    return 3.0 * torch.randn(n, 3, generator=torch.Generator().manual_seed(seed))


def test_policy_equals_the_agents_deterministic_action_bit_exact(run):
    agent, normalizer, _ = agent_from_checkpoint(run)
    assert float(normalizer.count) > 0  # the normaliser is really in the path
    before = {k: v.clone() for k, v in agent.actor.state_dict().items()}
    policy = Policy.from_agent(agent, normalizer)
    obs = random_obs(256)
    want = agent.actor.act(normalizer(obs), deterministic=True)
    got = policy(obs)
    assert torch.equal(got, want)
    assert got.shape == (256, 1) and bool((got.abs() <= 2.0).all())
    assert not got.requires_grad
    # a copy: changing the policy leaves the training agent alone
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    assert all(torch.equal(v, agent.actor.state_dict()[k]) for k, v in before.items())
    assert not torch.equal(policy(obs), want)


def test_snapshot_round_trip_is_self_contained_and_private(run, tmp_path):
    policy, _ = policy_from_checkpoint(checkpoint.latest(run))
    path = tmp_path / "policy.pt"
    meta = {"env": "pendulum", "env_steps": 200, "eval_return": -1234.5, "seed": 0}
    save_policy(path, policy, meta)
    assert stat.S_IMODE(path.stat().st_mode) == rundir.file_mode()
    assert not list(tmp_path.glob(".*tmp*"))  # the temp file was renamed, not left behind
    loaded, got_meta = load_policy(path)
    assert got_meta == meta
    obs = random_obs(64, seed=1)
    assert torch.equal(loaded(obs), policy(obs))
    (tmp_path / "junk.pt").write_bytes(b"not a policy")
    with pytest.raises(PolicyError, match="not a policy snapshot"):
        load_policy(tmp_path / "junk.pt")
    torch.save({"format": "something else"}, tmp_path / "other.pt")
    with pytest.raises(PolicyError, match="format 'something else'"):
        load_policy(tmp_path / "other.pt")


def test_policy_from_checkpoint_uses_the_runs_config(run):
    agent, normalizer, saved = agent_from_checkpoint(run)
    step = checkpoint.latest(run)
    policy, meta = policy_from_checkpoint(step)
    obs = random_obs(128, seed=2)
    assert torch.equal(policy(obs), agent.actor.act(normalizer(obs), deterministic=True))
    manifest = checkpoint.read_manifest(step)
    assert meta["env"] == "pendulum" and meta["seed"] == 0
    assert meta["env_steps"] == manifest["step"] * saved["num_envs"]  # transitions, not vector steps
    assert policy.init_args["hidden"] == 32


def test_resolve_best_final_latest_and_missing(run, tmp_path):
    # own snapshots, so this holds whatever the trainer writes into best/ and final/
    target = tmp_path / "run"
    target.mkdir()
    policy, meta = policy_from_checkpoint(checkpoint.latest(run))
    with pytest.raises(PolicyError, match=r"no best policy .*available: nothing"):
        resolve(target)
    (target / "final").mkdir()
    save_policy(target / "final" / "policy.pt", policy, {**meta, "kind": "final"})
    with pytest.raises(PolicyError, match=r"no best policy .*available: final"):
        resolve(target, "best")
    assert resolve(target, "final") == target / "final" / "policy.pt"
    (target / "best").mkdir()
    save_policy(target / "best" / "policy.pt", policy, {**meta, "kind": "best"})
    assert resolve(target) == target / "best" / "policy.pt"
    assert load(target)[1]["kind"] == "best"
    assert resolve(run, "latest") == checkpoint.latest(run)
    assert resolve(target / "final" / "policy.pt", "best") == target / "final" / "policy.pt"  # a file is itself
    with pytest.raises(PolicyError, match="no usable checkpoint"):
        resolve(target, "latest")
    with pytest.raises(PolicyError, match="no such run dir"):
        resolve(tmp_path / "absent")
    with pytest.raises(PolicyError, match="--which"):
        resolve(target, "newest")


def test_play_prints_returns_and_refuses_bad_paths(run, tmp_path):
    proc = cli("hpcrl.sac.play", run, "--which", "latest", "--episodes", "3", "--seed", "5")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    returns = [float(line.split()[-1]) for line in lines if line.startswith("episode ")]
    assert len(returns) == 3 and all(-2000 < r < 0 for r in returns)  # Pendulum: 200 steps of reward in [-16.3, 0]
    assert "± " in lines[-1] and "over 3 episode(s)" in lines[-1]
    mean = float(lines[-1].split()[1])
    assert mean == pytest.approx(sum(returns) / 3, abs=0.02)


def test_play_refuses_bad_input_in_one_line(run, tmp_path, capsys):
    from hpcrl.sac import play

    for args, message in ([tmp_path / "absent"], "no such run dir"), ([tmp_path], "available: nothing"), \
                         ([run, "--episodes", "0"], "--episodes 0"), \
                         ([run, "--which", "latest", "--env", "cartpole_swingup"], "obs_dim 5"), \
                         ([run, "--which", "latest", "--video", tmp_path / "p.mp4"], "cannot render"):
        assert play.main([str(a) for a in args]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "p.mp4").exists()


@pytest.mark.slow
def test_play_video_writes_mp4_or_says_it_cannot_render(tmp_path):
    pytest.importorskip("gymnasium")
    pytest.importorskip("mujoco")
    pytest.importorskip("mediapy")
    # InvertedPendulum-v5: obs 4, action 1 in [-3, 3]; an untrained policy is enough to record frames
    policy = Policy(4, 1, 16, [-3.0], [3.0])
    snap = tmp_path / "inv.pt"
    save_policy(snap, policy, {"env": "gym:InvertedPendulum-v5", "env_steps": 0})
    video = tmp_path / "inv.mp4"
    proc = cli("hpcrl.sac.play", snap, "--episodes", "2", "--video", video, timeout=180)
    if proc.returncode == 0:
        data = video.read_bytes()
        assert data[4:8] == b"ftyp" and len(data) > 1000  # an MP4 container with content
        assert f"video: {video}" in proc.stdout
    else:  # no OpenGL here (no EGL, no OSMesa): the clear one-line error instead
        assert proc.returncode == 2, proc.stderr
        assert "cannot render" in proc.stderr and "Traceback" not in proc.stderr
        assert not video.exists()


def _ort_actions(path: Path, obs: torch.Tensor):
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["obs"]
    assert [o.name for o in session.get_outputs()] == ["action"]
    assert isinstance(session.get_inputs()[0].shape[0], str)  # a dynamic (named) batch axis
    return torch.from_numpy(session.run(["action"], {"obs": obs.numpy()})[0])


@pytest.mark.slow
def test_export_onnx_matches_torch_within_1e5(run, tmp_path, capsys):
    pytest.importorskip("onnxscript")
    from hpcrl.sac import export

    out = tmp_path / "policy.onnx"
    proc = cli("hpcrl.sac.export", run, "--which", "latest", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert "max abs diff" in proc.stdout and " ok" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["policy.onnx"]  # one file, no external data, no temp left
    policy, _ = policy_from_checkpoint(checkpoint.latest(run))
    for n in (64, 5):  # the export used a batch of 8
        obs = policy.obs_mean + policy.obs_std * 3.0 * torch.randn(n, 3, generator=torch.Generator().manual_seed(n))
        got = _ort_actions(out, obs)
        assert got.shape == (n, 1)
        assert float((got - policy(obs)).abs().max()) <= 1e-5

    # verification that fails loudly: exit 1, --out left as it was
    before = out.read_bytes()
    assert export.main([str(run), "--which", "latest", "--out", str(out), "--tolerance", "1e-30",
                        "--exporter", "torchscript"]) == 1
    assert "nothing written" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert export.main([str(run), "--out", str(tmp_path / "x.txt")]) == 2
    assert "--out" in capsys.readouterr().err

    # the older exporter, in process: the same actions
    path = tmp_path / "ts.onnx"
    export.export_onnx(policy, path, exporter="torchscript")
    worst, count = export.verify_onnx(path, policy)
    assert count == 68 and worst <= 1e-5


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory) -> Path:
    """A real detached-PPO cartpole run (2 updates, a checkpoint at the end)."""
    run_dir = tmp_path_factory.mktemp("ppo") / "run"
    proc = cli("hpcrl.ppo", "--workload", "cartpole", "--makers", "1", "--trainers", "1", "--total-steps", "2",
               "--env.num-envs", "2", "--env.rollout-len", "8", "--ppo.epochs", "1", "--run-dir", run_dir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert checkpoint.latest(run_dir) is not None
    return run_dir


def test_play_and_export_on_a_ppo_run_say_so_in_one_line(ppo_run, tmp_path):
    step = checkpoint.latest(ppo_run)
    for module, args in (("hpcrl.sac.play", [ppo_run]), ("hpcrl.sac.play", [ppo_run, "--which", "latest"]),
                         ("hpcrl.sac.play", [step]),
                         ("hpcrl.sac.export", [ppo_run, "--which", "latest", "--out", tmp_path / "x.onnx"])):
        proc = cli(module, *args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (module, args, proc.stderr[-2000:])
        assert "a PPO run (--workload cartpole), not a FastSAC run" in lines[0] and "read_full" in lines[0], lines
        assert "--which" not in lines[0]  # no suggestion that leads to another error
    assert not (tmp_path / "x.onnx").exists()


def test_an_hf_ppo_run_points_at_its_transformers_actor(ppo_run, tmp_path):
    cfg = json.loads((ppo_run / "config.json").read_text())
    hf_run = tmp_path / "hf_run"
    hf_run.mkdir()
    (hf_run / "config.json").write_text(json.dumps({**cfg, "workload": "hf"}))
    with pytest.raises(PolicyError, match=r"written at the run's first checkpoint"):
        load(hf_run, "latest")
    (hf_run / "hf" / "actor").mkdir(parents=True)
    with pytest.raises(PolicyError, match=rf"its actor is the transformers directory {hf_run / 'hf' / 'actor'} "):
        resolve(hf_run, "best")
