"""Detached PPO plumbing with real processes (gloo): topology, wire formats, N:M runs, sample
accounting, staleness bound, weight publishing, and peers dying."""

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

from hpcrl.comm import spawn
from hpcrl.ppo.config import DetachedConfig
from hpcrl.ppo.run import train
from hpcrl.ppo.topology import Topology
from hpcrl.ppo.channels import Schema, checksum

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from torchrun_style import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("makers, trainers", [(1, 1), (2, 1), (1, 2), (3, 2), (2, 3), (5, 3), (4, 4)])
def test_modulo_rule_links_everyone(makers, trainers):
    top = Topology(trainers, makers)
    for t in range(trainers):
        assert top.makers_of(t), f"trainer {t} has no maker"
    for m in range(makers):
        assert any(m in top.makers_of(t) for t in range(trainers)), f"maker {m} has no trainer"


def test_rerouting_over_live_makers():
    top = Topology(2, 3)  # 3 makers : 2 trainers -> {0, 2}, {1}
    assert [top.makers_of(t) for t in range(2)] == [[0, 2], [1]]
    assert [top.makers_of(t, live=[0, 2]) for t in range(2)] == [[0], [2]]  # maker 1 died
    assert [top.makers_of(t, live=[2]) for t in range(2)] == [[2], [2]]


def test_schema_round_trip_and_checksum():
    batch = {"obs": torch.randn(3, 4), "act": torch.tensor([1, 0, 1]), "done": torch.tensor([True, False, True]),
             "behaviour_logp": torch.randn(3).double()}
    stats = {"env_steps": 3.0, "episodes": 1.0}
    schema = Schema.of(batch, stats)
    assert Schema.from_json(schema.to_json()) == schema
    buf = schema.pack(batch, stats)
    assert buf.dtype == torch.uint8 and buf.numel() == schema.nbytes
    out, out_stats = schema.unpack(buf)
    assert out_stats == stats
    for k in batch:
        assert torch.equal(out[k], batch[k]) and out[k].dtype == batch[k].dtype
    with pytest.raises(ValueError, match="act"):
        schema.pack({**batch, "act": torch.zeros(4, dtype=torch.int64)}, stats)
    x = torch.randn(1000)
    assert checksum(x) == checksum(x.clone()) and checksum(x[torch.randperm(1000)]) == checksum(x)
    y = x.clone()
    y[17] = torch.nextafter(y[17], torch.tensor(1e9))
    assert checksum(y) != checksum(x)


def toy_config(tmp_path, makers, trainers, **kw) -> DetachedConfig:
    kw = {"total_steps": 12, "timeout_s": 30, "heartbeat_timeout_s": 5, **kw}
    return DetachedConfig(workload="ppo_toy:ToyWorkload", makers=makers, trainers=trainers, run_dir=str(tmp_path), **kw)


@pytest.mark.parametrize("makers, trainers, lag", [(2, 1, 1), (1, 2, 1), (3, 2, 2)])
def test_topologies_complete_with_every_sample_accounted(tmp_path, makers, trainers, lag):
    cfg = toy_config(tmp_path, makers, trainers, lag=lag, plugin_args=("--rollout-s", "0.01"))
    rows = spawn(train, makers + trainers, args=(cfg,), timeout_s=100)
    final = rows[0]
    assert final["policy_version"] == 12
    assert final["samples_produced"] == final["samples_consumed"] + final["dropped_stale"] + final["dropped_shutdown"]
    assert final["lost_in_flight"] == 0 and final["makers_lost"] == 0
    assert final["samples_consumed"] == 12 * trainers * 8  # every trainer consumed the same amount each step
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(r["lag_max"] for r in metrics) <= lag
    assert min(r["lag_min"] for r in metrics) >= 0  # no experience from a version the trainer doesn't have
    assert final["checksum_mismatches"] == 0  # makers ran exactly a published version's weights
    assert all(r["produced"] > 0 for r in rows[trainers:]), "a maker produced nothing"


@pytest.mark.parametrize("makers, rollout_s, train_s, idle_side", [(2, 0.02, 0.15, "maker"), (1, 0.15, 0.01, "trainer")])
def test_idle_fractions_name_the_side_that_waits(tmp_path, makers, rollout_s, train_s, idle_side):
    # Sleep-controlled costs: slow updates leave the makers waiting for credits, slow rollouts the trainer.
    cfg = toy_config(tmp_path, makers, 1, lag=1, total_steps=10,
                     plugin_args=("--rollout-s", str(rollout_s), "--train-s", str(train_s)))
    spawn(train, makers + 1, args=(cfg,), timeout_s=100)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][2:-1]
    maker = sum(r["maker_idle_frac"] for r in rows) / len(rows)
    trainer = sum(r["trainer_idle_frac"] for r in rows) / len(rows)
    assert 0.0 <= maker <= 1.0 and 0.0 <= trainer <= 1.0
    if idle_side == "maker":
        assert maker > 0.6 and trainer < 0.4, (maker, trainer)
    else:
        assert maker < 0.4 and trainer > 0.6, (maker, trainer)


def test_events_hook_sees_batches_rows_publishes_and_rollouts(tmp_path):
    import ppo_toy

    log_dir = tmp_path / "events"
    log_dir.mkdir()
    cfg = toy_config(tmp_path / "run", 2, 1, lag=1, total_steps=6)
    spawn(train, 3, args=(cfg, ppo_toy.EventLog(str(log_dir))), timeout_s=100)
    events = [json.loads(line) for f in log_dir.iterdir() for line in f.read_text().splitlines()]
    kinds = {k: [e for e in events if e["kind"] == k] for k in ("BatchReceived", "RowLogged", "WeightsPublished",
                                                                 "RolloutDone")}
    assert [e["row"]["policy_version"] for e in kinds["RowLogged"]] == list(range(1, 7))
    assert len([e for e in kinds["BatchReceived"] if not e["stale"]]) == 6
    # a batch over the lag cap (1) is a legitimate event too (a slow step let one age): reported, then dropped
    assert all((e["lag"] > 1) == e["stale"] and e["lag"] >= 0 and e["wait_s"] >= 0 for e in kinds["BatchReceived"])
    published = [e["version"] for e in kinds["WeightsPublished"]]
    assert published == sorted(published) and published[-1] == 6
    assert all(e["transport"] == "broadcast" and e["makers"] == 2 for e in kinds["WeightsPublished"])
    assert {e["maker"] for e in kinds["RolloutDone"]} == {0, 1}
    assert all(e["wait_start"] <= e["collect_start"] <= e["time"] for e in kinds["RolloutDone"])


def test_idle_receives_outlive_the_timeout(tmp_path):
    # A credit backlog keeps the maker's credit receive (and the trainer's experience receive) posted
    # for longer than --timeout-s: the exchange plane must not time those out (gloo would close the
    # connection), liveness is the heartbeats' job.
    cfg = toy_config(tmp_path, 1, 1, lag=1, total_steps=3, batches_per_step=3, timeout_s=5,
                     plugin_args=("--rollout-s", "1.2"))
    rows = spawn(train, 2, args=(cfg,), timeout_s=100)
    assert rows[0]["policy_version"] == 3
    assert rows[0]["samples_produced"] == rows[0]["samples_consumed"] + rows[0]["dropped_shutdown"]


def test_trainable_only_publish_keeps_the_frozen_base(tmp_path):
    cfg = toy_config(tmp_path, 2, 1, lag=1, plugin_args=("--trainable-only",))
    rows = spawn(train, 3, args=(cfg,), timeout_s=100)
    assert rows[0]["checksum_mismatches"] == 0  # full-model checksums equal: base untouched, head published


def test_accounts_carry_over_a_stopped_job_and_say_where_they_start_after_a_killed_one(tmp_path):
    from hpcrl.ppo import accounts

    job = {"samples_produced": 40.0, "samples_consumed": 32.0, "dropped_shutdown": 8.0, "dropped_stale": 0.0,
           "lost_in_flight": 0.0, "makers_lost": 1.0}
    fresh = accounts.carried(None, 0)
    assert fresh["accounts_since_update"] == 0 and fresh["samples_produced"] == 0
    accounts.store(tmp_path, accounts.combine(fresh, job))
    assert (tmp_path / accounts.ACCOUNTS).stat().st_mode & 0o077 == 0
    total = accounts.combine(accounts.carried(tmp_path, 4), job)
    assert total == {**{k: 2 * v for k, v in job.items()}, "accounts_since_update": 0}
    # a checkpoint without them (its job was killed): this job's accounts only, and from which update
    assert accounts.carried(tmp_path / "none", 7) == {**dict.fromkeys(accounts.KEYS, 0.0), "accounts_since_update": 7}


def test_trainer_checkpoint_and_resume_continue_the_version_count(tmp_path):
    spawn(train, 2, args=(toy_config(tmp_path, 1, 1, total_steps=5),), timeout_s=100)
    rows = spawn(train, 2, args=(toy_config(tmp_path, 1, 1, total_steps=9, resume=True),), timeout_s=100)
    assert rows[0]["policy_version"] == 9
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    versions = [r["policy_version"] for r in metrics if "samples_produced" not in r]
    assert versions == list(range(1, 10))  # no step lost or repeated across the restart
    assert rows[0]["checksum_mismatches"] == 0  # makers were brought to the resumed weights
    assert rows[0]["samples_produced"] == rows[0]["samples_consumed"] + rows[0]["dropped_shutdown"] + rows[0]["dropped_stale"]
    # a closing row per finished job; the resumed one's accounts cover the whole run
    closing = [r for r in metrics if "samples_produced" in r]
    assert [r["policy_version"] for r in closing] == [5, 9] and metrics[-1] is closing[-1]
    assert closing[-1]["samples_consumed"] == closing[-1]["env_steps"] and closing[-1]["accounts_since_update"] == 0
    assert closing[-1]["samples_produced"] > closing[0]["samples_produced"]


def _launch(tmp_path, makers, trainers, extra):
    """Independent processes, torchrun-style variables, no supervisor: peers may die alone."""
    port, world = free_port(), makers + trainers
    procs = []
    for rank in range(world):
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1",
               "PYTHONFAULTHANDLER": "1"}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "hpcrl.ppo", "--workload", "ppo_toy:ToyWorkload", "--makers", str(makers),
             "--trainers", str(trainers), "--run-dir", str(tmp_path), "--heartbeat-timeout-s", "3", *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _wait_rows(tmp_path, n, procs, timeout=60):
    deadline = time.time() + timeout
    path = tmp_path / "metrics.jsonl"
    while time.time() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    raise AssertionError("the run did not log enough rows: " + "".join(p.communicate()[1][-2000:] for p in procs))


def test_dead_maker_is_dropped_and_training_continues(tmp_path):
    procs = _launch(tmp_path, 2, 1, ["--total-steps", "40", "--timeout-s", "30",
                                     "--rollout-s", "0.05"])
    try:
        _wait_rows(tmp_path, 3, procs)
        procs[2].send_signal(signal.SIGKILL)  # maker 1
        out, err = procs[0].communicate(timeout=90)
        assert procs[0].returncode == 0, err[-3000:]
        assert procs[1].wait(timeout=30) == 0
        assert "weights go point-to-point" in out, out[-2000:]
    finally:
        for p in procs:
            p.kill()
    final = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["policy_version"] == 40 and final["makers_lost"] == 1
    assert final["samples_produced"] == (final["samples_consumed"] + final["dropped_stale"] + final["dropped_shutdown"]
                                         + final["lost_in_flight"])
    assert final["lost_in_flight"] >= 0
    # the lost maker broke the weight broadcast: the survivor got its weights point-to-point
    assert final["checksum_mismatches"] == 0


def _final_row(tmp_path):
    return json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.mark.extended  # chaos at random moments; the fast tier keeps a killed maker and a frozen trainer
@pytest.mark.timeout(150)
def test_chaos_frozen_and_killed_makers_are_dropped_and_the_rest_finish(tmp_path):
    """3 makers : 1 trainer. Maker 0 is frozen (SIGSTOP) past the heartbeat timeout and woken again,
    maker 2 is killed, at random moments; maker 1 carries the run to the end."""
    import random

    rng = random.Random(int(time.time()))
    # long enough that the run outlives the freeze (a run ending during it is the next test's case)
    procs = _launch(tmp_path, 3, 1, ["--total-steps", "400", "--timeout-s", "30", "--rollout-s", "0.03"])
    frozen, killed = procs[1], procs[3]
    try:
        _wait_rows(tmp_path, rng.randint(2, 8), procs)
        frozen.send_signal(signal.SIGSTOP)
        time.sleep(rng.uniform(0.0, 1.0))
        killed.send_signal(signal.SIGKILL)
        time.sleep(3 + 2.0)  # past the heartbeat timeout: the trainer drops both
        frozen.send_signal(signal.SIGCONT)  # wakes up dropped: must leave on its own, cleanly
        t0 = time.time()
        out, err = procs[0].communicate(timeout=100)
        assert procs[0].returncode == 0, err[-3000:]
        assert procs[2].wait(timeout=30) == 0
        woke_out, woke_err = frozen.communicate(timeout=60)  # 30 s was exceeded once on a loaded machine
        assert frozen.returncode == 0, woke_err[-2000:]
        assert time.time() - t0 < 60
    finally:
        for p in procs:
            p.kill()
    final = _final_row(tmp_path)
    assert final["policy_version"] == 400
    # Both are lost: the killed one, and the frozen one, dropped past its heartbeat timeout (it says so when
    # it wakes). About 1 run in 10 the frozen one used to finish normally instead: the trainer's main thread
    # sat in a credit send to it (a gloo send completes only once the receiver posts its receive), so it
    # stopped watching heartbeats until the maker woke up. Credits are posted without waiting now.
    assert final["makers_lost"] == 2
    assert "the trainers dropped this maker" in woke_out, woke_out
    assert final["samples_produced"] == (final["samples_consumed"] + final["dropped_stale"] + final["dropped_shutdown"]
                                         + final["lost_in_flight"])


def test_frozen_trainer_hosting_the_store_is_named_by_every_maker(tmp_path):
    procs = _launch(tmp_path, 2, 1, ["--total-steps", "1000", "--timeout-s", "60",
                                     "--rollout-s", "0.02"])
    try:
        _wait_rows(tmp_path, 2, procs)
        t0 = time.time()
        procs[0].send_signal(signal.SIGSTOP)  # trainer 0 hosts the rendezvous store here
        for maker in procs[1:]:
            _, err = maker.communicate(timeout=60)
            assert maker.returncode == 1
            assert "trainer rank 0" in err, err[-2000:]
        assert time.time() - t0 < 3 + 10  # heartbeat timeout (3 s) plus polling, not --timeout-s (60 s)
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
            p.kill()


def test_dead_trainer_stops_makers_with_a_named_error(tmp_path):
    procs = _launch(tmp_path, 2, 1, ["--total-steps", "1000", "--timeout-s", "20",
                                     "--rollout-s", "0.02"])
    try:
        _wait_rows(tmp_path, 2, procs)
        t0 = time.time()
        procs[0].send_signal(signal.SIGKILL)
        for maker in procs[1:]:
            _, err = maker.communicate(timeout=60)
            assert maker.returncode == 1
            assert "trainer rank 0" in err, err[-2000:]
        assert time.time() - t0 < 40
    finally:
        for p in procs:
            p.kill()


def test_sigusr2_stops_with_a_checkpoint_and_resume_finishes(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "PYTHONPATH": str(TESTS)}
    args = [sys.executable, "-m", "hpcrl.ppo", "--workload", "ppo_toy:ToyWorkload", "--makers", "2", "--trainers",
            "1", "--run-dir", str(tmp_path), "--total-steps", "60", "--rollout-s", "0.05"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _wait_rows(tmp_path, 3, [proc])
        os.killpg(proc.pid, signal.SIGUSR2)  # what Slurm's --signal=USR2@<s> delivers to every task
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-2000:]
    assert "stop requested" in out
    # the closing line of an interrupted run says so, never "done"
    assert "hpcrl: stopped (SIGUSR2) after" in err and "resume with --resume" in err and "hpcrl: done" not in err
    stopped_rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    stopped = stopped_rows[-1]
    assert stopped["policy_version"] < 60
    # a stopped job writes no closing row: its accounts wait with its last checkpoint
    assert not [r for r in stopped_rows if "samples_produced" in r]
    (kept,) = (tmp_path / "checkpoints").glob("step_*/accounts.json")
    first = json.loads(kept.read_text())
    assert first["samples_consumed"] == stopped["env_steps"] and first["accounts_since_update"] == 0
    resumed = subprocess.run(args + ["--resume"], env=env, capture_output=True, text=True, timeout=90)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    versions = [r["policy_version"] for r in rows if "samples_produced" not in r]
    assert versions == list(range(1, 61))
    # one closing row, the last, accounting for both jobs
    closing = [i for i, r in enumerate(rows) if "samples_produced" in r]
    assert closing == [len(rows) - 1]
    final = rows[-1]
    assert final["accounts_since_update"] == 0 and final["samples_consumed"] == final["env_steps"] == 60 * 8
    assert final["samples_produced"] == (final["samples_consumed"] + final["dropped_stale"] + final["dropped_shutdown"]
                                         + final["lost_in_flight"])
    assert final["samples_produced"] > first["samples_produced"] and final["dropped_shutdown"] >= first["dropped_shutdown"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert len(config["hosts"]["trainers"]) == 1 and len(config["hosts"]["makers"]) == 2
