"""Planes and devices: the rank -> device rule, the N > G error before spawning, channel bounds, the
strict-planes mode, and detached PPO across declared devices (real processes, gloo)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from hpcrl.comm import DistSetupError, check_local_gpus, rank_device, spawn
from hpcrl.ppo.config import DetachedConfig
from hpcrl.ppo.role_planes import weight_backend
from hpcrl.ppo.run import train

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from comm_workers import channels  # noqa: E402

pytestmark = pytest.mark.timeout(120)
cuda = torch.device


@pytest.mark.parametrize("request_, source, local_rank, count, expected", [
    ("auto", "slurm", 2, 4, cuda("cuda", 2)),  # cuda:LOCAL_RANK
    ("auto", "torchrun", 3, 4, cuda("cuda", 3)),
    ("cuda", "slurm", 3, 1, cuda("cuda", 0)),  # per-task binding: each task sees its own GPU as cuda:0
    ("auto", "local", 5, 4, cuda("cuda", 1)),  # --nproc: rank mod GPUs
    ("auto", "local", 1, 0, cuda("cpu")),
    ("cpu", "slurm", 1, 8, cuda("cpu")),
    ("cuda:1", "single", 0, 2, cuda("cuda", 1)),
])
def test_rank_device_rule(request_, source, local_rank, count, expected):
    assert rank_device(request_, source, local_rank, count) == expected


@pytest.mark.parametrize("request_, source, local_rank, count, match", [
    ("cuda", "single", 0, 0, "--device cuda but no GPU is visible"),
    ("auto", "slurm", 4, 4, "LOCAL_RANK=4 but only 4 GPUs"),
    ("cuda:2", "single", 0, 2, "only 2 GPU"),
    ("tpu", "single", 0, 2, "expected auto, cpu, cuda"),
])
def test_rank_device_errors(request_, source, local_rank, count, match):
    with pytest.raises(DistSetupError, match=match):
        rank_device(request_, source, local_rank, count)


def test_more_local_ranks_than_gpus_is_an_error_naming_both_fixes():
    with pytest.raises(DistSetupError) as err:
        check_local_gpus(3, "auto", 2)
    assert "--nproc <= 2" in str(err.value) and "--device cpu" in str(err.value)
    check_local_gpus(2, "auto", 2)  # one GPU each
    check_local_gpus(4, "cpu", 1)  # gloo on CPU: any number
    check_local_gpus(4, "auto", 0)


def test_sac_nproc_beyond_gpus_fails_before_spawning(monkeypatch, capsys, tmp_path):
    import hpcrl.comm
    import hpcrl.sac.__main__ as cli

    # the entry point imports torch-side helpers only once its torch-free refusals have passed
    monkeypatch.setattr(hpcrl.comm, "cuda_count", lambda: 1)
    monkeypatch.setattr(hpcrl.comm, "spawn", lambda *a, **k: pytest.fail("spawned despite N > G"))
    code = cli.main(["--preset", "pendulum", "--nproc", "2", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "--nproc 2 local ranks on CUDA but 1 GPU(s)" in err and "--device cpu" in err


def test_ppo_trainers_beyond_gpus_fail_before_spawning(monkeypatch, capsys, tmp_path):
    import hpcrl.ppo.__main__ as cli

    monkeypatch.setattr(cli, "cuda_count", lambda: 1)
    monkeypatch.setattr(cli, "spawn", lambda *a, **k: pytest.fail("spawned despite 2 trainers on 1 GPU"))
    code = cli.main(["--trainers", "2", "--makers", "1", "--trainer-device", "auto", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "--trainers 2" in err and "--trainer-device cpu" in err


def test_weight_plane_is_nccl_only_with_a_gpu_each():
    # (host, device, GPU UUID): GPUs are told apart by UUID
    assert weight_backend([("a", "cuda:0", "u0"), ("a", "cuda:1", "u1"), ("b", "cuda:0", "u2")]) == "nccl"
    # one GPU per task: every task says cuda:0, the UUIDs differ
    assert weight_backend([("a", "cuda:0", "u0"), ("a", "cuda:0", "u1")]) == "nccl"
    assert weight_backend([("a", "cuda:0", "u0"), ("a", "cuda:1", "u0")]) == "gloo"  # a maker sharing trainer 0's GPU
    assert weight_backend([("a", "cuda:0", "u0"), ("b", "cpu", "")]) == "gloo"


def test_weight_header_bounds():
    from hpcrl.comm import Plane
    from hpcrl.ppo.channels import ChannelError, WeightChannel

    ch = WeightChannel(Plane.local("host"), Plane.local("host"), None, numel=1000, dtype=torch.float32,
                       bucket_numel=300, timeout_s=1.0)
    ch._check_header([3.0, 4.0, 0.0, 1000.0])  # 4 buckets of 300
    for bad in ([3.0, 4.0, 0.0, 10**12], [3.0, 1.0, 0.0, 1000.0], [-2.0, 4.0, 0.0, 1000.0], [float("nan"), 4, 0, 1000],
                [2.5, 4.0, 0.0, 1000.0]):
        with pytest.raises(ChannelError, match="weights header from rank 0 refused"):
            ch._check_header(bad)


def test_channel_bounds_name_the_sender_and_allocate_nothing():
    out = spawn(channels.bounds, 2, timeout_s=60)[0]
    for case in channels.BAD_HEADERS:
        assert out[case] is not None and "from rank 1 refused" in out[case], case
    assert "limit" in out["too large"] and "bytes" in out["negative size"]
    assert "the schema says" in out["wrong size"] and "unknown policy version 999" in out["unknown version"]
    assert "rank 1 is maker 0" in out["wrong maker"]
    assert all(c is not None and "credit from rank 1" in c for c in out["credits"])


def test_strict_planes_mode_poisons_only_the_default_group():
    out = spawn(channels.strict, 2, timeout_s=60, env={"HPCRL_STRICT_PLANES": "1"})
    for rank in out:
        assert "No backend type associated with device type cpu" in rank["default_group"]
        assert rank["host"] == rank["device"] == [2.0, 2.0]
        assert rank["device_plane_is_default"] is False
    production = spawn(channels.strict, 2, timeout_s=60, env={"HPCRL_STRICT_PLANES": "0"})
    assert all(r["default_group"] == "worked" and r["device_plane_is_default"] for r in production)


@pytest.mark.parametrize("makers, trainers", [(2, 1), (1, 2)])
def test_ppo_across_declared_devices(tmp_path, makers, trainers):
    """Trainers and makers on explicitly declared devices go through the code that moves experience to
    the trainer's device and stages weights through host memory. Both are cpu on this machine, so the
    moves are no-ops: what this proves is the flags and the planes they select (gloo weights, gloo
    trainers); benchmarks/gpu_check.sh runs the cuda/cuda and cuda/cpu mixes on a GPU."""
    cfg = DetachedConfig(workload="ppo_toy:ToyWorkload", makers=makers, trainers=trainers, run_dir=str(tmp_path),
                         total_steps=8, timeout_s=30, heartbeat_timeout_s=5, trainer_device="cpu", maker_device="cpu",
                         bucket_mb=1e-4)  # several buckets per version
    rows = spawn(train, makers + trainers, args=(cfg,), timeout_s=100)
    assert rows[0]["policy_version"] == 8 and rows[0]["checksum_mismatches"] == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["planes"] == {"trainers": "gloo", "weights": "gloo"}
    assert config["trainer_device"] == config["maker_device"] == "cpu"
