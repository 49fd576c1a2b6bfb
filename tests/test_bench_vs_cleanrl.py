"""benchmarks/sac/vs_cleanrl.py: the real CleanRL SAC (unmodified, in its own venv) against hpcrl.

CleanRL's source is not in the repository: benchmarks/peers/sources.py gets it at run time (pinned
commit, sha-256 checked). The harness's tests run without it; the two that run the real script skip, with
the line saying how to get it, where it is absent and cannot be fetched (``HPCRL_CLEANRL_SRC=DIR``: a checkout at
the pinned commit, for a machine without network). The quick mode runs both systems on
Pendulum-v1 for a few hundred env steps and merges them; the peer venv (.venv-peers) is built once by
tools/peer_venv.sh when it is missing (a minute or two)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import schema  # noqa: E402
import dataclasses  # noqa: E402

from benchmarks.peers import pinned  # noqa: E402
from benchmarks.peers.sources import CLEANRL, LEANRL, PeerSourceError, PeerSourceMissing  # noqa: E402
from benchmarks.sac import vs_cleanrl  # noqa: E402


def located(peer: pinned.Pinned) -> Path:
    """The peer's checked source (fetched into the cache when absent); a skip with the reason where it is absent
    and cannot be fetched (a source that differs from the pinned files fails)."""
    try:
        return peer.locate()
    except PeerSourceMissing as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def cleanrl_src() -> Path:
    return located(CLEANRL)


@pytest.fixture(scope="session")
def leanrl_src() -> Path:
    return located(LEANRL)


@pytest.fixture(scope="session")
def peer_venv() -> Path:
    subprocess.run(["bash", "tools/peer_venv.sh"], cwd=REPO, check=True, timeout=1200)  # at once when complete
    return vs_cleanrl.PEER_PYTHON


def fake_source(root: Path) -> Path:
    """A folder shaped like CleanRL's checkout whose files are not upstream's."""
    for name in CLEANRL.files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"not {name}\n")
    return root


def test_the_pinned_peer_is_documented() -> None:
    """The pinned commit and every file's digest are in benchmarks/README.md."""
    readme = (REPO / "benchmarks" / "README.md").read_text()
    for peer in (CLEANRL, LEANRL):
        assert peer.commit in readme and peer.repo in readme
        for name, digest in peer.files.items():
            assert f"`{digest}`" in readme, name
        assert peer.script in peer.files


def test_a_cached_source_with_a_wrong_digest_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(CLEANRL.env_var, raising=False)
    fake_source(CLEANRL.cache_dir())
    with pytest.raises(PeerSourceError, match="refusing to run CleanRL") as refused:
        CLEANRL.locate()
    assert not isinstance(refused.value, PeerSourceMissing)  # a real-peer test fails on it, not skips
    a = ["--quick", "--system", "cleanrl", "--out", str(tmp_path / "out")]
    assert vs_cleanrl.main(a) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "refusing to run CleanRL" in err
    assert sorted(CLEANRL.mismatches(CLEANRL.cache_dir())) == sorted(CLEANRL.files)


def test_a_given_source_is_checked_and_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--cleanrl-src DIR: its files are checked against the recorded digests (here the fake's own)."""
    src = fake_source(tmp_path / "checkout")
    with pytest.raises(PeerSourceError, match="differ from vwxyzjn/cleanrl"):
        CLEANRL.locate(src)
    peer = dataclasses.replace(CLEANRL, files={n: pinned.sha256(src / n) for n in CLEANRL.files})
    assert peer.locate(src) == src.resolve()
    (src / peer.script).write_text("edited\n")
    assert peer.mismatches(src) == [peer.script]


def test_a_missing_source_that_cannot_be_fetched_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(CLEANRL.env_var, raising=False)
    monkeypatch.setattr(pinned.Pinned, "raw_url", property(lambda peer: (tmp_path / "no-such-mirror").as_uri()))
    with pytest.raises(PeerSourceMissing, match="cannot fetch"):
        CLEANRL.locate()
    assert not CLEANRL.cache_dir().exists()  # nothing half-fetched is left to be taken as the source
    assert vs_cleanrl.main(["--quick", "--system", "cleanrl", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "git clone https://github.com/vwxyzjn/cleanrl" in err
    assert CLEANRL.commit in err and "--cleanrl-src" in err
    with pytest.raises(PeerSourceMissing, match="is not in"):
        CLEANRL.locate(tmp_path / "empty")


def test_a_fetch_is_checked_before_it_lands_in_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mirror serving files other than the pinned ones leaves the cache empty."""
    mirror = fake_source(tmp_path / "mirror")
    dest = tmp_path / "cache" / CLEANRL.commit
    with pytest.raises(PeerSourceError, match="refusing"):
        CLEANRL.fetch(dest, mirror.as_uri())
    assert not dest.exists() and list((tmp_path / "cache").glob("*")) == []
    peer = dataclasses.replace(CLEANRL, files={n: pinned.sha256(mirror / n) for n in CLEANRL.files})
    assert peer.fetch(dest, mirror.as_uri()) == dest
    assert peer.mismatches(dest) == []


def test_evals_are_filed_under_the_nearest_point() -> None:
    points = [{"env_steps_actual": s, "eval_return": float(s)} for s in (4992, 9984, 49920, 50000, 30)]
    got = vs_cleanrl.snap(points, 5000)
    assert [p["env_steps"] for p in got] == [5000, 10000, 50000]
    assert got[-1]["env_steps_actual"] == 50000  # of two at one point, the nearer


def test_cleanrl_hook_moves_past_a_skipped_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """A log past two eval points evaluates once, filed under the later, and the next point follows it."""
    spec = importlib.util.spec_from_file_location("run_cleanrl", REPO / "benchmarks" / "peers" / "run_cleanrl.py")
    rc = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "run_cleanrl", rc)  # its dataclasses look their module up
    spec.loader.exec_module(rc)
    monkeypatch.setattr(rc, "evaluate", lambda *args: [1.0, 3.0])
    curve = rc.Curve(eval_every=100, episodes=2, env_id="Pendulum-v1", seed=0)
    curve.clock.start = 0.0
    rc.eval_at(curve, None, 250, 200)
    assert curve.next_point() == 300 and curve.points[-1]["eval_return"] == 2.0


def test_hpcrl_wall_time_leaves_the_evals_out() -> None:
    rows = [{"time": 1.0, "env_steps": 100}, {"time": 1.5, "env_steps": 100, "eval_return": -5.0},
            {"time": 3.0, "env_steps": 200}, {"time": 3.25, "env_steps": 200, "eval_return": -4.0}]
    got = vs_cleanrl.hpcrl_points(rows)
    assert [(p["env_steps_actual"], p["wall_s"], p["eval_s"]) for p in got] == [(100, 1.0, 0.5), (200, 2.5, 0.25)]


def test_targets_time_hpcrl_to_cleanrls_final_return() -> None:
    peer = {"env_steps": [100, 200], "return_mean": [10.0, 50.0], "wall_s_mean": [5.0, 20.0]}
    ours = {"env_steps": [100, 200], "return_mean": [60.0, 70.0], "wall_s_mean": [4.0, 8.0]}
    got = vs_cleanrl.targets(peer, ours, 200)
    assert got["at_100"] == {"cleanrl": 10.0, "hpcrl": 60.0, "hpcrl_minus_cleanrl": 50.0}
    assert got["time_to_cleanrl_final"]["hpcrl_wall_s"] == 4.0 and got["time_to_cleanrl_final"]["ratio"] == 0.2
    flat = {**peer, "return_mean": [50.0, 10.0]}  # CleanRL ended below its first eval: no goal to time
    assert "time_to_cleanrl_final" not in vs_cleanrl.targets(flat, ours, 200)
    assert "time_to_solve" not in got  # a task without a solved return


def fake_part(system: str, seed: int, returns: list[float], wall: list[float], startup: float) -> dict:
    steps = [1000 * (i + 1) for i in range(len(returns))]
    return {"header": {"config": {"system": system, "label": system}},
            "results": {"seed": seed, "system": system, "env_id": "Pendulum-v1", "command": system,
                        "load_before": [0.0], "load_after": [0.0], "startup_s": startup,
                        "curve": {"env_steps": steps, "eval_return": returns, "wall_s": wall,
                                  "launch_s": [startup + w for w in wall]}}}


def test_pendulum_time_to_solve_is_each_seeds_first_point_above_the_solved_return_on_both_clocks() -> None:
    goal = vs_cleanrl.SOLVED["pendulum"]
    peer = vs_cleanrl.aggregate([fake_part("cleanrl", 0, [-900.0, -300.0, -200.0], [4.0, 8.0, 12.0], 3.0),
                                 fake_part("cleanrl", 1, [-900.0, -240.0, -200.0], [4.0, 8.0, 12.0], 5.0)], goal)
    assert peer["solved"] == [{"seed": 0, "env_steps": 3000, "wall_s": 12.0, "launch_s": 15.0},
                              {"seed": 1, "env_steps": 2000, "wall_s": 8.0, "launch_s": 13.0}]
    assert peer["time_to_solve"] == {"env_steps": 2500, "wall_s": 10.0, "launch_s": 14.0}
    assert peer["launch_s_mean"] == [8.0, 12.0, 16.0]  # the startup moves the from-launch clock only
    ours = vs_cleanrl.aggregate([fake_part("hpcrl", 0, [-800.0, -240.0, -150.0], [1.0, 2.0, 3.0], 3.0)], goal)
    got = vs_cleanrl.targets(peer, ours, 3000)["time_to_solve"]
    assert got == {"cleanrl_env_steps": 2500, "cleanrl_wall_s": 10.0, "cleanrl_launch_s": 14.0, "hpcrl_env_steps": 2000,
                   "hpcrl_wall_s": 2.0, "hpcrl_launch_s": 5.0, "speedup": 5.0, "speedup_from_launch": 2.8}
    # a seed that never solves: no time for the label (a mean over the seeds that did would flatter it)
    never = vs_cleanrl.aggregate([fake_part("hpcrl", 0, [-800.0, -240.0, -150.0], [1.0, 2.0, 3.0], 3.0),
                                  fake_part("hpcrl", 1, [-900.0, -800.0, -700.0], [1.0, 2.0, 3.0], 3.0)], goal)
    assert never["time_to_solve"] is None and never["solved"][1] == {"seed": 1}
    assert vs_cleanrl.targets(peer, never, 3000)["time_to_solve"]["speedup"] is None


def test_quick_runs_leanrl_compiled_and_times_it_from_launch(tmp_path: Path, leanrl_src: Path,
                                                               peer_venv: Path) -> None:
    """LeanRL's compiled script through the runner: evaluated on the way, both clocks, its packages recorded."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "benchmarks/sac/vs_cleanrl.py", "--quick", "--system", "leanrl",
                           "--seed", "1", "--out", str(out), "--peer-python", str(peer_venv),
                           "--leanrl-src", str(leanrl_src), "--leanrl-flags=--learning-starts 120"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((out / "vs_cleanrl" / "pendulum-leanrl-seed1.json").read_text())
    r = doc["results"]
    assert r["command"].startswith("python leanrl/sac_continuous_action_torchcompile.py --env-id Pendulum-v1")
    assert "--compile" in r["command"].split() and r["peer"]["commit"] == LEANRL.commit
    assert {"tensordict", "torchrl"} <= set(r["versions"])
    assert r["curve"]["env_steps"] == [200, 400] and all(math.isfinite(x) for x in r["curve"]["eval_return"])
    assert 0 < r["startup_s"] < 120  # interpreter, imports, env and networks: before the training clock
    assert [round(x - r["startup_s"], 2) for x in r["curve"]["launch_s"]] == [round(x, 2) for x in r["curve"]["wall_s"]]


def test_quick_runs_both_systems_and_merges(tmp_path: Path, cleanrl_src: Path, peer_venv: Path) -> None:
    out = tmp_path / "out"
    for system in ("cleanrl", "hpcrl"):
        proc = subprocess.run([sys.executable, "benchmarks/sac/vs_cleanrl.py", "--quick", "--system", system,
                               "--seed", "1", "--out", str(out), "--peer-python", str(peer_venv),
                               "--cleanrl-src", str(cleanrl_src),
                               *(["--cleanrl-flags=--learning-starts 120"] if system == "cleanrl" else [])],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert (out / "vs_cleanrl" / f"pendulum-{system}-seed1.json").exists()
    proc = subprocess.run([sys.executable, "benchmarks/sac/vs_cleanrl.py", "--merge", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((out / "vs_cleanrl.json").read_text())
    assert schema.validate(doc) == []
    assert doc["benchmark"] == "vs_cleanrl"
    task = doc["results"]["tasks"]["pendulum"]
    for system, env_id in (("cleanrl", "Pendulum-v1"), ("hpcrl", "Pendulum-v1")):
        agg = task[system]
        assert agg["env_id"] == env_id and agg["seeds"] == [1]
        assert agg["env_steps"] == [200, 400]
        assert all(math.isfinite(r) for r in agg["return_mean"])
        assert all(w > 0 for w in agg["wall_s_mean"])
    assert task["cleanrl"]["versions"]["gymnasium"] == "0.29.1"
    assert task["cleanrl"]["command"].startswith("python cleanrl/sac_continuous_action.py --env-id Pendulum-v1")
    assert task["cleanrl"]["command"].endswith("--learning-starts 120")  # after the quick sizes' 100: it wins
    assert {"at_200", "at_400", "time_to_solve"} <= set(task["targets"]["hpcrl"])
    for system in ("cleanrl", "hpcrl"):  # both clocks: from launch is later by the start-up
        agg = task[system]
        assert all(launch > wall for launch, wall in zip(agg["launch_s_mean"], agg["wall_s_mean"]))
    assert doc["results"]["peer"]["files"] == CLEANRL.files
    assert (out / "vs_cleanrl.png").stat().st_size > 10_000


@pytest.mark.parametrize("task, update_to_data, cdq, policy_frequency",
                         [("halfcheetah", 0.5, False, 2), ("hopper", 1.0, True, 1)])
def test_cpu_presets_validate_and_fit_the_protocol(task: str, update_to_data: float, cdq: bool,
                                                   policy_frequency: int) -> None:
    """halfcheetah-cpu / hopper-cpu: valid, the task's v5 env, the update-to-data ratio (critic updates per
    transition) and learner of docs/mujoco_cpu.md, and the harness's protocol (eval every 5,000 env steps,
    5 episodes, 50k steps) parses."""
    from hpcrl.sac.config import preset

    cfg = preset(f"{task}-cpu")
    cfg.check()
    assert cfg.env == vs_cleanrl.TASKS[task][1]
    assert cfg.num_updates / cfg.num_envs == update_to_data and cfg.batch_size == 256
    assert (cfg.cdq, cfg.policy_frequency) == (cdq, policy_frequency)
    assert cfg.buffer_size * cfg.num_envs >= 50_000 and cfg.target_entropy_ratio == 1.0
    a = vs_cleanrl.parse_args(["--task", task, "--system", "hpcrl", "--hpcrl-preset", f"{task}-cpu"])
    argv, got = vs_cleanrl.hpcrl_argv(a)
    got.check()
    assert (got.preset, got.total_env_steps, got.eval_every * got.num_envs, got.eval_episodes) == \
        (f"{task}-cpu", 50_000, 5_000, 5)


def test_the_ladder_times_the_peers_interleaved_with_its_rungs(cleanrl_src: Path, leanrl_src: Path,
                                                               peer_venv: Path) -> None:
    """benchmarks/sac/sac_ladder.py --cleanrl --leanrl: the real scripts, paced past their warm-up, timed per loop
    iteration in the same rounds as hpcrl's update at equal work (policy_frequency 1) and at the preset's."""
    sys.path.insert(0, str(REPO / "benchmarks" / "sac"))
    import sac_ladder

    got = sac_ladder.bench_peers({"cleanrl": cleanrl_src, "leanrl": leanrl_src}, quick=True, repeats=2,
                                 min_repeat_s=0.02, rungs=("flat_pf1", "flat"))
    assert set(got["hpcrl"]) == {"flat_pf1", "flat"} and set(got["peers"]) == {"cleanrl", "leanrl"}
    assert got["peers"]["cleanrl"]["command"] == (
        "python cleanrl/sac_continuous_action.py --env-id Pendulum-v1 --total-timesteps 240 --learning-starts 100 "
        "--no-cuda --seed 0")
    assert got["peers"]["leanrl"]["command"].endswith("--seed 0 --compile")
    for peer in got["peers"].values():
        assert len(peer["samples_s"]) == 2 and 1e-4 < peer["step_s"] < 1.0 and 0 < peer["env_share"] < 0.5
        assert 0 < peer["cpu_step_s"] < 2 * peer["step_s"]
    pf1, pf2 = got["hpcrl"]["flat_pf1"], got["hpcrl"]["flat"]
    assert len(pf1["samples_s"]) == 2 and (pf1["policy_frequency"], pf2["policy_frequency"]) == (1, 2)
    assert pf1["update_s"] > pf2["update_s"]  # an actor step in every update costs more than in every second one


def test_a_stalled_peer_is_an_error_that_names_it(tmp_path: Path) -> None:
    """A paced peer that sends no timing within the bound: an error naming the peer and its log, not a hang."""
    sys.path.insert(0, str(REPO / "benchmarks" / "sac"))
    import sac_ladder

    script = "import sys, time; print('still compiling', file=sys.stderr, flush=True); time.sleep(60)"
    peer = sac_ladder.PacedPeer("cleanrl", [sys.executable, "-c", script], tmp_path / "cleanrl.log")
    with pytest.raises(RuntimeError, match=r"(?s)the cleanrl peer sent no timing in 1 s.*still compiling"):
        peer.segment(timeout_s=1.0)
    assert peer.proc.returncode is not None  # killed, not left behind
