"""hpcrl.comm: bootstrap precedence and errors, named barriers, gradient averaging modes, reductions, spawn.

Multi-rank tests start real processes (gloo on CPU, 2 ranks, one thread each) with small timeouts;
launcher-environment tests run in-process on a fake environment.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import hpcrl.comm as hd
from hpcrl.core.conventions import rendezvous_port
from hpcrl.comm import env as dist_env

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # comm_workers must be importable here and in spawned ranks

from comm_workers import fail, grad, ranks, shutdown  # noqa: E402
from torchrun_style import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(60)

LAUNCH_VARS = [
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT",
]


def clean_env() -> dict[str, str]:
    """os.environ without any launcher variable (the tests may themselves run under Slurm or MPI)."""
    return {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_"))
    }


@pytest.fixture
def no_launcher(monkeypatch):
    for k in list(os.environ):
        if k in LAUNCH_VARS or k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_")):
            monkeypatch.delenv(k)
    yield monkeypatch
    hd.shutdown()


# --- launcher detection (pure functions of the environment) -------------------------------------

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
SLURM = {
    "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
    "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "node[01-03,7],gpu5",
}


def test_torchrun_variables():
    info = hd.detect_launch(TORCHRUN)
    assert (info.source, info.rank, info.world_size, info.local_rank) == ("torchrun", 1, 2, 1)
    assert (info.master_addr, info.master_port) == ("10.0.0.1", 29500)
    assert not info.store_hosted_elsewhere
    # hpcrl's own local launchers use the same variables and say so; a forced source is honoured
    assert hd.detect_launch({**TORCHRUN, "HPCRL_LAUNCHER": "local"}).source == "local"
    assert hd.detect_launch(TORCHRUN, source="local").source == "local"


def test_torchrun_beats_slurm():
    info = hd.detect_launch({**SLURM, **TORCHRUN})
    assert info.source == "torchrun" and info.rank == 1


def test_slurm_variables_master_from_nodelist_and_port_from_job_id():
    info = hd.detect_launch(SLURM)
    assert (info.source, info.rank, info.world_size, info.local_rank) == ("slurm", 3, 4, 1)
    if shutil.which("scontrol") is None:  # with real Slurm installed, scontrol may reject fake names
        assert info.master_addr == "node01"
    assert info.master_port == rendezvous_port(123456, int(SLURM["SLURM_STEP_ID"])) == 20000 + 123456 % 10000
    # a later step of the same job (e.g. the next point of a scaling sweep) gets its own port
    assert hd.detect_launch({**SLURM, "SLURM_STEP_ID": "3"}).master_port == 20000 + (123456 + 3 * 7919) % 10000
    assert len({rendezvous_port(123456, s) for s in range(10000)}) == 10000  # no two steps of a job collide


def test_slurm_master_overrides_and_step_task_count():
    env = {**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "4242", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "16"}
    info = hd.detect_launch(env)
    assert (info.master_addr, info.master_port, info.world_size) == ("head", 4242, 8)


@pytest.mark.parametrize(
    "env, missing",
    [
        ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, ["MASTER_ADDR"]),
        ({"RANK": "0", "WORLD_SIZE": "2"}, ["LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]),
        ({"RANK": "0"}, ["WORLD_SIZE"]),
        ({k: v for k, v in SLURM.items() if k != "SLURM_NTASKS"}, ["SLURM_NTASKS"]),
        (
            {k: v for k, v in SLURM.items() if k not in ("SLURM_LOCALID", "SLURM_JOB_ID")},
            ["SLURM_LOCALID", "SLURM_JOB_ID"],
        ),
        ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, ["SLURM_JOB_NODELIST"]),
    ],
)
def test_partial_environment_names_the_missing_variable(env, missing):
    with pytest.raises(hd.DistSetupError) as err:
        hd.detect_launch(env)
    for var in missing:
        assert var in str(err.value)


def test_slurm_batch_script_without_srun_is_an_error():
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    with pytest.raises(hd.DistSetupError, match="srun"):
        hd.detect_launch(env)
    # A one-task allocation is just a single process.
    assert hd.detect_launch({**env, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).world_size == 1


@pytest.mark.parametrize(
    "env, text",
    [
        ({**TORCHRUN, "RANK": "x"}, "RANK='x' is not an integer"),
        ({**TORCHRUN, "RANK": "2"}, "inconsistent rank 2"),
    ],
)
def test_bad_values(env, text):
    with pytest.raises(hd.DistSetupError, match=text):
        hd.detect_launch(env)


def test_mpi_launcher_inside_slurm_batch_step_wins(monkeypatch):
    stub = hd.LaunchInfo(source="mpi", rank=0, world_size=2, local_rank=0, hostname="h")
    monkeypatch.setattr(dist_env, "_mpi", lambda env: stub)
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert hd.detect_launch({**batch, "PMI_SIZE": "2", "PMI_RANK": "0"}).source == "mpi"
    # srun --mpi=pmi2 sets both; they agree, so the Slurm variables are used.
    assert hd.detect_launch({**SLURM, "PMI_SIZE": "4", "PMI_RANK": "3"}).source == "slurm"
    assert hd.detect_launch({"OMPI_COMM_WORLD_SIZE": "2"}).source == "mpi"


def test_single_process_and_forced_source():
    assert hd.detect_launch({}).source == "single"
    assert hd.detect_launch(TORCHRUN, source="single").world_size == 1
    with pytest.raises(hd.DistSetupError, match="SLURM_PROCID"):
        hd.detect_launch({}, source="slurm")


def test_torchrun_world_of_one_needs_no_master():
    info = hd.detect_launch({"RANK": "0", "WORLD_SIZE": "1"})
    assert (info.world_size, info.master_addr) == (1, None)


# --- Slurm node lists ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
        ("vm", ["vm"]),
        ("node1,node2", ["node1", "node2"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]-ib", ["n098-ib", "n099-ib", "n100-ib", "n101-ib"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a[1,3],b[2-3],c", ["a1", "a3", "b2", "b3", "c"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert hd.expand_nodelist(nodelist) == hosts
    assert hd.first_host(nodelist, use_scontrol=False) == hosts[0]


@pytest.mark.parametrize("bad", ["node[1-3", "node1-3]", "n[3-1]", "n[a-b]", ""])
def test_expand_nodelist_rejects_bad_syntax(bad):
    with pytest.raises(ValueError):
        hd.expand_nodelist(bad)


# --- bootstrap in this process -------------------------------------------------------------------


def test_init_single_process(no_launcher):
    ctx = hd.init_distributed()
    assert (ctx.rank, ctx.world_size, ctx.source, ctx.is_distributed, ctx.backend) == (0, 1, "single", False, None)
    assert ctx.is_main and ctx.rank_seed(7) == 7 and hd.current() is ctx
    hd.barrier(ctx, "noop")  # no-op without peers
    assert hd.reduce_metrics({"a": 2.0, "b": torch.tensor(3.0)}, ctx.host_plane) == {"a": 2.0, "b": 3.0}


def test_init_partial_environment_fails_fast(no_launcher):
    no_launcher.setenv("RANK", "0")
    no_launcher.setenv("WORLD_SIZE", "2")
    t0 = time.monotonic()
    with pytest.raises(hd.DistSetupError, match="MASTER_ADDR"):
        hd.init_distributed(timeout_s=5)
    assert time.monotonic() - t0 < 2


def set_torchrun_env(monkeypatch, rank: int, port: int) -> None:
    launch = {"RANK": rank, "WORLD_SIZE": 2, "LOCAL_RANK": rank, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    for k, v in launch.items():
        monkeypatch.setenv(k, str(v))


def test_init_names_the_peer_that_never_came(no_launcher):
    set_torchrun_env(no_launcher, rank=0, port=free_port())
    with pytest.raises(hd.BarrierTimeoutError, match=r"'init'.*rank 1 did not arrive") as err:
        hd.init_distributed(timeout_s=1)
    assert err.value.missing == [1]
    assert hd.current() is None


def test_init_unreachable_master_names_the_address(no_launcher):
    port = free_port()  # nobody listens there
    set_torchrun_env(no_launcher, rank=1, port=port)
    t0 = time.monotonic()
    with pytest.raises(hd.DistSetupError, match=rf"rank 1 .*could not reach the rendezvous store at 127.0.0.1:{port}"):
        hd.init_distributed(timeout_s=1)
    assert time.monotonic() - t0 < 10


# --- gradient averaging: 2 ranks with half batches == 1 rank with the whole batch ---------------------


@pytest.fixture(scope="module")
def two_ranks():
    """One 2-rank run (gradient averaging in every mode, then barrier/divergence/reductions), in the production
    layout: the device plane is the default group (the other multi-rank tests run with strict planes)."""
    return hd.spawn(ranks.main, 2, timeout_s=80, env={"HPCRL_STRICT_PLANES": "0"})


@pytest.fixture(scope="module")
def grad_runs(two_ranks):
    return [r["grad"] for r in two_ranks]


@pytest.fixture(scope="module")
def misc_runs(two_ranks):
    return [r["misc"] for r in two_ranks]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["flat", "view", "ddp"])
def test_grad_average_matches_single_rank(grad_runs, mode):
    ref = grad.train(mode, rank=0, world=1)
    for r, run in enumerate(grad_runs):
        res = run[mode]
        assert res["collectives"] == [1] * grad.STEPS, f"rank {r}: one collective per all_reduce()"
        for g, g_ref in zip(res["grads"], ref["grads"]):
            torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
        for p, p_ref in zip(res["params"], ref["params"]):
            torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-6)
    # Replicas are bit-identical, not just close.
    for a, b in zip(grad_runs[0][mode]["params"], grad_runs[1][mode]["params"]):
        assert torch.equal(a, b)


def test_grad_average_modes_agree_bitwise(grad_runs):
    # W=2: pre-divided (DDP) and post-scaled (flat, view) sums are exactly the same numbers.
    for run in grad_runs:
        for mode in ("view", "ddp"):
            assert all(torch.equal(a, b) for a, b in zip(run["flat"]["params"], run[mode]["params"])), mode


def test_grad_average_view_mode_is_zero_copy_and_survives_set_to_none(grad_runs):
    for run in grad_runs:
        # Step 1 followed optimizer.zero_grad(set_to_none=True): grads were re-attached by copy.
        assert run["view"]["zero_copy"] == [True, False, True]
        assert run["flat"]["zero_copy"] == [False, False, False]


@pytest.mark.parametrize("mode", ["flat", "view"])
def test_grad_average_bf16(grad_runs, mode):
    ref = grad.train(mode, rank=0, world=1, dtype=torch.bfloat16)
    a, b = grad_runs[0][f"{mode}-bf16"], grad_runs[1][f"{mode}-bf16"]
    assert a["collectives"] == [1] * grad.STEPS
    for x, y, z in zip(a["params"], b["params"], ref["params"]):
        assert x.dtype == torch.bfloat16 and torch.equal(x, y)
        torch.testing.assert_close(x.float(), z.float(), rtol=0.05, atol=0.02)


def test_grad_average_single_rank_is_untouched():
    net, log_alpha = grad.make_model()
    averager = hd.GradAverager([*net.parameters(), log_alpha, log_alpha], "view", plane=hd.Plane.local("device"))  # dups dropped
    assert averager.world_size == 1 and len(averager.params) == 7
    assert averager.wrap(net) is net
    net(torch.randn(2, 6)).sum().backward()
    before = [p.grad.clone() for p in net.parameters()]
    averager.all_reduce()
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), before))
    with pytest.raises(ValueError, match="mode"):
        hd.GradAverager(net.parameters(), "ring", plane=hd.Plane.local("device"))


# --- barrier, divergence check, packed reductions (same 2-rank run) --------------------------------


@pytest.mark.timeout(90)
def test_rank_0_stops_waiting_for_an_expendable_rank_frozen_before_shutdown():
    """A detached-PPO maker frozen after its last sample but before its exit key (a soak's rare end-of-run
    hang): rank 0 used to wait the full shutdown timeout for it; its stalled heartbeat now drops it."""
    t0 = time.monotonic()
    out = hd.spawn(shutdown.main, 3, timeout_s=80, expendable=[2])
    assert out[2] is None  # stopped by the launcher, which the run told it was dropped
    assert out[0]["dropped"] == [2] and out[1]["dropped"] == []
    assert out[0]["waited_s"] < 4 * shutdown.HEARTBEAT_S, out[0]  # the full wait was 25 s
    assert time.monotonic() - t0 < 20


@pytest.mark.timeout(90)
def test_barrier_timeout_names_the_missing_rank(misc_runs):
    text, missing = misc_runs[0]["barrier"]
    assert missing == [1]
    assert "rank 1" in text and "'lonely'" in text and "1.5 s" in text


def test_divergence_check_names_rank_and_tensor(misc_runs):
    for run in misc_runs:  # every rank raises, so none is left waiting
        text, diverged = run["divergence"]
        assert diverged == [(1, "2.bias")]
        assert "rank 1: '2.bias'" in text


def test_packed_reductions(misc_runs):
    for run in misc_runs:
        assert (run["source"], run["backend"]) == ("local", "gloo")  # spawned by hpcrl.comm.spawn
        assert run["count"].dtype == torch.int64 and run["count"].tolist() == [3]
        assert run["total"].tolist() == [1.5, 1.5, 1.5]
        w, steps = run["bcast"]
        assert w.tolist() == [[0.0, 0.0], [0.0, 0.0]] and steps.tolist() == [10]
        assert run["metrics"] == {"episode_return": -200.0, "loss": 0.5, "sps": 150.0}
        assert run["reductions"] == {"samples": 30.0, "lag_max": 1.0, "lag_min": 0.0, "loss": 0.5}
        # a CPU tensor on a (declared) NCCL plane, metrics on the device plane: refused by name
        assert len(run["wrong_plane"]) == 2
        assert "device plane" in run["wrong_plane"][0] and "cpu" in run["wrong_plane"][0]
        assert "host plane" in run["wrong_plane"][1]


# --- spawn ---------------------------------------------------------------------------------------


def test_spawn_propagates_failure_and_kills_the_others():
    t0 = time.monotonic()
    with pytest.raises(hd.SpawnError, match="rank 1 failed") as err:
        hd.spawn(fail.main, 2, timeout_s=50)
    assert err.value.rank == 1 and err.value.exitcode == 1
    assert "ValueError: boom from rank 1" in str(err.value)
    assert time.monotonic() - t0 < 40  # rank 0, stuck in all_reduce, was killed, not waited for


# --- real launchers: fake Slurm task variables, mpiexec --------------------------------------------


def run_launched(cmds: list[list[str]], envs: list[dict[str, str]], timeout: float = 45) -> list[dict]:
    procs = [
        subprocess.Popen(cmd, env=e, cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for cmd, e in zip(cmds, envs)
    ]
    outs = []
    try:
        for p in procs:
            out, errtext = p.communicate(timeout=timeout)
            assert p.returncode == 0, errtext[-3000:]
            outs += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def test_slurm_variables_form_a_gloo_group():
    port = free_port(20000, 29999)
    base = {
        **clean_env(),
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]),
        "SLURM_NTASKS": "2",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": str(port - 20000),  # the derived port is the free one
        "SLURM_JOB_NODELIST": "localhost",
    }
    envs = [{**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)} for r in range(2)]
    cmd = [sys.executable, "-m", "comm_workers.launched"]
    outs = sorted(run_launched([cmd, cmd], envs), key=lambda o: o["rank"])
    assert [(o["rank"], o["world"], o["local_rank"], o["source"], o["sum"]) for o in outs] == [
        (0, 2, 0, "slurm", 3.0),
        (1, 2, 1, "slurm", 3.0),
    ]


def test_torchrun_launch_forms_a_gloo_group():
    env = {**clean_env(), "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "comm_workers.launched"]
    outs = sorted(run_launched([cmd], [env]), key=lambda o: o["rank"])
    assert [(o["rank"], o["world"], o["local_rank"], o["source"], o["sum"]) for o in outs] == [
        (0, 2, 0, "torchrun", 3.0),
        (1, 2, 1, "torchrun", 3.0),
    ]


MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich, or apt install openmpi-bin)")
def test_mpi_launch_forms_a_gloo_group():
    env = {**clean_env(), "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    cmd = [MPIEXEC, "-n", "2"]
    if "OMPI" in subprocess.run([MPIEXEC, "--version"], capture_output=True, text=True).stdout.upper():
        cmd += ["--allow-run-as-root", "--oversubscribe"]
    outs = run_launched([cmd + [sys.executable, "-m", "comm_workers.launched"]], [env], timeout=60)
    outs.sort(key=lambda o: o["rank"])
    assert [(o["rank"], o["world"], o["source"], o["sum"]) for o in outs] == [(0, 2, "mpi", 3.0), (1, 2, "mpi", 3.0)]


def test_heterogeneous_step_rendezvous_is_on_component_0():
    env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_STEP_NUM_TASKS": "3", "SLURM_LOCALID": "1",
           "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "node[1-2]",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "node2",
           "SLURM_JOB_NODELIST_HET_GROUP_1": "node1"}
    info = dist_env.detect_launch(env)
    assert (info.source, info.rank, info.world_size, info.master_addr) == ("slurm", 2, 3, "node2")
    plain = {k: v for k, v in env.items() if "HET" not in k}
    assert dist_env.detect_launch(plain).master_addr == "node1"
