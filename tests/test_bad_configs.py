"""Bounded inputs, one exit code: every bad value is refused before any rank starts, in one line that
names the flag, the bad value, the valid range and what to change; the CLIs exit 2 without a traceback.

Most cases call the checks in-process (``SACConfig.check``, ``DetachedConfig.check``, ``JobRequest``
through ``hpcrl.launch.__main__.main``); a handful run the real CLIs. The launcher cases also cover its
batch script: no newline or control character in a field or a trainer argument can end a line of it.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.core.conventions import EXIT_BAD_CONFIG
from hpcrl.launch import JobRequest, LaunchError, render
from hpcrl.launch.__main__ import main as launch_main
from hpcrl.launch.sbatch import ALLOC_TASKS_LINE
from hpcrl.ppo.config import MAX_CREDITS, MAX_LAG, DetachedConfig
from hpcrl.ppo.workloads.options import LMOptions, PPOOptions, VectorEnvOptions
from hpcrl.sac.config import PRESETS, SACConfig, preset

TESTS = Path(__file__).resolve().parent
NAN, INF = float("nan"), float("inf")
# until hpcrl.sac.run.plan / hpcrl.ppo.run.validate call cfg.check() (its ConfigError means exit 2), the
# CLIs accept these values; the marks come off once they do


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def one_line(message: str) -> str:
    assert "\n" not in message.strip() and "Traceback" not in message, message
    return message


def assert_bad_cli(rc: int, stderr: str, *parts: str) -> None:
    """Exit 2, one line on stderr, no traceback, and the line holds every part (flag, value, fix)."""
    assert rc == EXIT_BAD_CONFIG, (rc, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr[-3000:]
    for part in parts:
        assert part in lines[0], (part, lines[0])


def run_module(module: str, args: list[str], tmp_path: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]))
    try:
        return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired as err:  # a bad value accepted: the run went ahead
        raise AssertionError(f"python -m {module} {args} still running after {timeout} s") from err


@pytest.fixture
def no_launcher(monkeypatch):
    """In-process CLI calls see a plain process (no launcher variables of an enclosing job)."""
    for key in list(os.environ):
        if key.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_")) or key in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                            "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(key)


# -- FastSAC: SACConfig.check() ----------------------------------------------------------------------------

SAC_BAD = [
    (dict(tau=5.0), "--tau 5: must be in (0, 1]"),
    (dict(tau=0.0), "--tau 0: must be in (0, 1]"),
    (dict(tau=NAN), "--tau nan: must be in (0, 1]"),
    (dict(num_atoms=1), "--num-atoms 1: must be >= 2"),
    (dict(v_min=20.0, v_max=20.0), "--v-min 20 --v-max 20: must be --v-min < --v-max"),
    (dict(v_max=INF), "--v-max inf: must be a finite number"),
    (dict(v_min=NAN), "--v-min nan: must be a finite number"),
    (dict(gamma=0.0), "--gamma 0: must be in (0, 1]"),
    (dict(gamma=1.5), "--gamma 1.5: must be in (0, 1]"),
    (dict(critic_lr=0.0), "--critic-lr 0: must be > 0"),
    (dict(actor_lr=-1e-3), "--actor-lr -0.001: must be > 0"),
    (dict(alpha_lr=NAN), "--alpha-lr nan: must be > 0"),
    (dict(alpha_init=0.0), "--alpha-init 0: must be > 0"),
    (dict(weight_decay=-0.1), "--weight-decay -0.1: must be >= 0"),
    (dict(nproc=0), "--nproc 0: must be >= 1"),
    (dict(threads=0), "--threads 0: must be >= 1"),
    (dict(timeout_s=0.0), "--timeout-s 0: must be in (0, 604800]"),
    (dict(timeout_s=INF), "--timeout-s inf: must be in (0, 604800]"),
    (dict(num_envs=0), "--num-envs 0: must be >= 1"),
    (dict(batch_size=0), "--batch-size 0: must be >= 1"),
    (dict(total_env_steps=0), "--total-env-steps 0: must be >= 1"),
    (dict(n_step=0), "--n-step 0: must be >= 1"),
    (dict(n_step=3, buffer_size=2), "--buffer-size 2: must be >= 3 (replay transitions per env; not below --n-step 3)"),
    (dict(num_q=0), "--num-q 0: must be >= 1"),
    (dict(actor_hidden=2), "--actor-hidden 2: must be >= 4"),
    (dict(critic_hidden=0), "--critic-hidden 0: must be >= 4"),
    (dict(log_std_min=1.0, log_std_max=0.0), "--log-std-min 1 --log-std-max 0: must be --log-std-min < --log-std-max"),
    (dict(target_entropy_ratio=NAN), "--target-entropy-ratio nan: must be a finite number"),
    (dict(reward_scale=0.0), "--reward-scale 0: must be finite and not 0"),
    (dict(reward_scale=-INF), "--reward-scale -inf: must be a finite number"),
    (dict(device="gpu"), "--device 'gpu': must be one of auto, cpu, cuda or cuda:K"),
    (dict(device="cuda:x"), "--device 'cuda:x': must be one of auto, cpu, cuda or cuda:K"),
    (dict(grad_average="allreduce"), "--grad-average 'allreduce': must be one of flat, view, ddp"),
    (dict(env=""), "--env '': must be a non-empty string"),
    (dict(env="pendulum\nrm -rf /"), "--env 'pendulum\\nrm -rf /': must be free of control characters"),
    (dict(run_dir="runs/a\x00b"), "--run-dir 'runs/a\\x00b': must be free of control characters"),
    (dict(seed=-1), "--seed -1: must be in [0, 2147483647]"),
    (dict(learning_starts=-1), "--learning-starts -1: must be >= 0"),
    (dict(random_steps=-5), "--random-steps -5: must be >= 0"),
    (dict(num_updates=0), "--num-updates 0: must be >= 1"),
    (dict(policy_frequency=0), "--policy-frequency 0: must be >= 1"),
    (dict(log_every=0), "--log-every 0: must be >= 1"),
    (dict(checkpoint_every=-1), "--checkpoint-every -1: must be >= 0"),
    (dict(keep_checkpoints=0), "--keep-checkpoints 0: must be >= 1"),
    (dict(check_replicas_every=-1), "--check-replicas-every -1: must be >= 0"),
    (dict(eval_episodes=-1), "--eval-episodes -1: must be >= 0"),
    (dict(num_envs=8.5), "--num-envs 8.5: must be an integer >= 1"),
    (dict(resume="yes"), "--resume 'yes': must be True or False; pass --resume or --no-resume"),
]


@pytest.mark.parametrize("overrides, message", SAC_BAD, ids=[next(iter(kw)) + f"={list(kw.values())[0]!r}"
                                                             for kw, _ in SAC_BAD])
def test_sac_check_refuses(overrides, message):
    cfg = preset("pendulum", **overrides)
    with pytest.raises(ValueError) as info:
        cfg.check()
    assert type(info.value).__name__ == "ConfigError"  # the name the entry points map to exit 2
    text = one_line(str(info.value))
    assert text.startswith(message), text
    assert "; " in text and ("e.g. " in text or "pass " in text or "lower " in text), text  # says what to change


def test_sac_every_field_is_checked():
    """A field added without a range check fails here: a value of the wrong type must be refused by name."""
    for f in dataclasses.fields(SACConfig):
        cfg = dataclasses.replace(SACConfig(), **{f.name: object()})
        with pytest.raises(ValueError, match=f"^{_flag(f.name)} "):
            cfg.check()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_sac_presets_and_edges_pass(name):
    preset(name).check()
    SACConfig().check()
    preset(name, tau=1.0, gamma=1.0, num_atoms=2, num_q=1, actor_hidden=4, n_step=5, buffer_size=5, device="cuda:3",
           checkpoint_every=0, check_replicas_every=0, learning_starts=0, reward_scale=-1.0, target_entropy_ratio=-2.0,
           weight_decay=0.0, seed=2**31 - 1).check()


# -- FastSAC CLI ---------------------------------------------------------------------------------------------

# 4 envs x 1 vector step, no update: if a bad value were accepted, the run would end at once
SAC_TINY = ["--preset", "pendulum", "--num-envs", "4", "--batch-size", "8", "--total-env-steps", "4",
            "--learning-starts", "8", "--actor-hidden", "8", "--critic-hidden", "8", "--num-atoms", "5",
            "--eval-episodes", "0", "--log-every", "1", "--checkpoint-every", "0", "--device", "cpu"]


@pytest.fixture
def cli_in_process(monkeypatch, no_launcher):
    """Before spawning, the CLIs make the parent ignore the stop signals: not this test process."""
    import signal

    monkeypatch.setattr(signal, "signal", lambda *args: None)


@pytest.mark.parametrize("args, parts", [
    (["--tau", "5"], ["--tau 5", "(0, 1]"]),
    (["--num-atoms", "1"], ["--num-atoms 1", ">= 2"]),
    (["--alpha-init", "0"], ["--alpha-init 0", "> 0"]),
])
def test_sac_cli_in_process_exits_2_before_spawning(args, parts, monkeypatch, capsys, cli_in_process):
    import hpcrl.comm
    import hpcrl.sac.__main__ as sac_main

    def spawned(*a, **kw):
        raise AssertionError("ranks were spawned for a bad configuration")

    monkeypatch.setattr(hpcrl.comm, "spawn", spawned)  # the entry point imports it once the config passed
    rc = sac_main.main(SAC_TINY + ["--nproc", "2", *args])
    assert_bad_cli(rc, capsys.readouterr().err, "hpcrl.sac: error:", *parts)


@pytest.mark.parametrize("args, parts", [
    (["--nproc", "0"], ["--nproc 0", ">= 1"]),
    (["--tau", "5"], ["--tau 5", "(0, 1]"]),
])
def test_sac_cli_exits_2(args, parts, tmp_path):
    proc = run_module("hpcrl.sac", SAC_TINY + ["--run-dir", str(tmp_path / "run"), *args], tmp_path)
    assert_bad_cli(proc.returncode, proc.stderr, "hpcrl.sac: error:", *parts)


# -- detached PPO: DetachedConfig.check() --------------------------------------------------------------------

PPO_BAD = [
    (dict(lag=1_000_000), f"--lag 1000000: must be in [0, {MAX_LAG}]"),
    (dict(lag=-1), f"--lag -1: must be in [0, {MAX_LAG}]"),
    (dict(lag=3, max_lag=1), "--max-lag 1: must be >= 3"),
    (dict(batches_per_step=0), "--batches-per-step 0: must be >= 1"),
    (dict(lag=MAX_LAG, batches_per_step=100), f"--batches-per-step 100: must be <= {MAX_CREDITS // (MAX_LAG + 1)}"),
    (dict(makers=0), "--makers 0: must be >= 1"),
    (dict(trainers=0), "--trainers 0: must be >= 1"),
    (dict(total_steps=0), "--total-steps 0: must be >= 1"),
    (dict(bucket_mb=0.0), "--bucket-mb 0: must be >= 0.0001 and finite"),
    (dict(bucket_mb=-1.0), "--bucket-mb -1: must be >= 0.0001 and finite"),
    (dict(bucket_mb=NAN), "--bucket-mb nan: must be >= 0.0001 and finite"),
    (dict(bucket_mb=INF), "--bucket-mb inf: must be >= 0.0001 and finite"),
    (dict(heartbeat_timeout_s=0.0), "--heartbeat-timeout-s 0: must be >= 1"),
    (dict(heartbeat_timeout_s=NAN), "--heartbeat-timeout-s nan: must be >= 1"),
    (dict(heartbeat_timeout_s=200.0), "--heartbeat-timeout-s 200: must be <= --timeout-s 120"),
    (dict(timeout_s=0.0), "--timeout-s 0: must be in (0, 604800]"),
    (dict(timeout_s=-INF), "--timeout-s -inf: must be in (0, 604800]"),
    (dict(threads=0), "--threads 0: must be >= 1"),
    (dict(strategy="zero3"), "--strategy 'zero3': must be one of ddp, fsdp"),
    (dict(strategy="fsdp"), "--strategy fsdp: shards a transformer layer by layer"),
    (dict(offload=True), "--offload: offloads FSDP shards to host memory; e.g. add --strategy fsdp"),
    (dict(trainer_dtype="bf16"), "--trainer-dtype bf16: mixed precision is FSDP's"),
    (dict(checkpoint_every=-1), "--checkpoint-every -1: must be >= 0"),
    (dict(trainer_device="tpu"), "--trainer-device 'tpu': must be one of auto, cpu, cuda or cuda:K"),
    (dict(maker_device="cuda:"), "--maker-device 'cuda:': must be one of auto, cpu, cuda or cuda:K"),
    (dict(target_return=NAN), "--target-return nan: must be a finite number"),
    (dict(seed=-1), "--seed -1: must be in [0, 2147483647]"),
    (dict(workload=""), "--workload '': must be a non-empty string"),
    (dict(workload="cartpole\n"), "--workload 'cartpole\\n': must be free of control characters"),
    (dict(run_dir="runs/\x1b[2Jppo"), "--run-dir 'runs/\\x1b[2Jppo': must be free of control characters"),
    (dict(total_steps=True), "--total-steps True: must be an integer >= 1"),
    # typed workload options (--env.*, --lm.*) and PPO hyper-parameters (--ppo.*)
    (dict(env=VectorEnvOptions(num_envs=0)), "--env.num-envs 0: must be in [1, 65536]"),
    (dict(env=VectorEnvOptions(rollout_len=-3)), "--env.rollout-len -3: must be in [1, 100000]"),
    (dict(env=VectorEnvOptions(hidden=0)), "--env.hidden 0: must be in [1, 8192]"),
    (dict(env=VectorEnvOptions(init_log_std=NAN)), "--env.init-log-std nan: must be in [-5, 2]"),
    (dict(workload="lm", lm=LMOptions(lora_rank=-1)), "--lm.lora-rank -1: must be in [0, 32]"),
    (dict(workload="lm", lm=LMOptions(lora_alpha=0.0)), "--lm.lora-alpha 0: must be > 0 and finite"),
    (dict(workload="lm", lm=LMOptions(n_heads=3)), "--lm.n-heads 3: must be a divisor of --lm.d-model 32"),
    (dict(workload="lm", lm=LMOptions(batch_size=0)), "--lm.batch-size 0: must be in [1, 65536]"),
    (dict(workload="lm", lm=LMOptions(target_token=16)), "--lm.target-token 16: must be in [0, 15]"),
    (dict(workload="lm", lm=LMOptions(noise=1.5)), "--lm.noise 1.5: must be in [0, 1]"),
    (dict(workload="lm", lm=LMOptions(steps=())), "--lm.steps (): must be one or more integers in [0, 16)"),
    (dict(workload="lm", lm=LMOptions(kl_estimator="k2")), "--lm.kl-estimator 'k2': must be one of k1, k3"),
    (dict(workload="lm", lm=LMOptions(prompt_len=4000, gen_len=200)), "--lm.gen-len 200: must be in [1, 96]"),
    (dict(ppo=PPOOptions(lr=0.0)), "--ppo.lr 0: must be in (0, 1]"),
    (dict(ppo=PPOOptions(lr=NAN)), "--ppo.lr nan: must be in (0, 1]"),
    (dict(ppo=PPOOptions(gamma=1.5)), "--ppo.gamma 1.5: must be in [0, 1]"),
    (dict(ppo=PPOOptions(gae_lambda=-0.1)), "--ppo.gae-lambda -0.1: must be in [0, 1]"),
    (dict(ppo=PPOOptions(epochs=0)), "--ppo.epochs 0: must be in [1, 1000]"),
    (dict(ppo=PPOOptions(minibatches=0)), "--ppo.minibatches 0: must be in [1, 65536]"),
    (dict(ppo=PPOOptions(clip_coef=0.0)), "--ppo.clip-coef 0: must be in (0, 10]"),
    (dict(ppo=PPOOptions(value_clip_coef=-INF)), "--ppo.value-clip-coef -inf: must be in (0, 1000]"),
    (dict(ppo=PPOOptions(truncated_is=0.5)), "--ppo.truncated-is 0.5: must be in [1, 1000]"),
    (dict(ppo=PPOOptions(ent_coef=-0.01)), "--ppo.ent-coef -0.01: must be in [0, 10]"),
    (dict(ppo=PPOOptions(max_grad_norm=0.0)), "--ppo.max-grad-norm 0: must be in (0, 1000]"),
    (dict(ppo=PPOOptions(kl_coef=-1.0)), "--ppo.kl-coef -1: must be in [0, 100]"),
    (dict(ppo=PPOOptions(anneal_updates=-1)), "--ppo.anneal-updates -1: must be in [0, 10000000]"),
    (dict(ppo=PPOOptions(adam_eps=0.0)), "--ppo.adam-eps 0: must be in (0, 1]"),
    # loss variants the workload's learner would refuse after building its model: refused before spawn
    (dict(ppo=PPOOptions(kl_target=6.0)), "--ppo.kl-target 6.0: applies to the token workloads"),
    (dict(ppo=PPOOptions(advantage="rloo")), "--ppo.advantage rloo: applies to the token workloads"),
    (dict(ppo=PPOOptions(anneal_updates=10, lr_schedule="cosine", decay_updates=100)),
     "--ppo.anneal-updates with --ppo.lr-schedule / --ppo.warmup-updates: two learning-rate schedules"),
    (dict(workload="lm", ppo=PPOOptions(advantage="dr-grpo")), "--ppo.advantage dr-grpo: a group baseline needs"),
    # an option group that is not the workload's, and flags only a plugin workload takes
    (dict(lm=LMOptions(lora_rank=4)), "--lm.lora-rank 4: applies to --workload lm, not --workload cartpole"),
    (dict(workload="lm", env=VectorEnvOptions(num_envs=4)), "--env.num-envs 4: applies to --workload cartpole"),
    (dict(plugin_args=("--num-envs", "4")), "unrecognized option(s) --num-envs 4 for --workload cartpole"),
]


@pytest.mark.parametrize("overrides, message", PPO_BAD, ids=[message.split(":")[0] for _, message in PPO_BAD])
def test_ppo_check_refuses(overrides, message):
    cfg = DetachedConfig(**overrides)
    with pytest.raises(ValueError) as info:
        cfg.check()
    assert type(info.value).__name__ == "ConfigError"
    text = one_line(str(info.value))
    assert text.startswith(message), text
    assert "; " in text and any(fix in text for fix in ("e.g. ", "lower ", "drop it", "see ")), text


def test_ppo_every_field_is_checked():
    for f in dataclasses.fields(DetachedConfig):
        cfg = dataclasses.replace(DetachedConfig(), **{f.name: object()})
        with pytest.raises(ValueError, match=f"^{_flag(f.name)} "):
            cfg.check()


def test_ppo_defaults_and_edges_pass():
    DetachedConfig().check()
    DetachedConfig(lag=0, max_lag=0).check()
    DetachedConfig(lag=MAX_LAG, batches_per_step=MAX_CREDITS // (MAX_LAG + 1), max_lag=10**6).check()
    DetachedConfig(bucket_mb=1e-4, heartbeat_timeout_s=5, timeout_s=5, target_return=475.0, trainer_device="cuda:1",
                   maker_device="cpu", workload="ppo_toy:ToyWorkload", plugin_args=("--rollout-s", "0.01")).check()
    DetachedConfig(workload="lm", lm=LMOptions(lora_rank=32, n_heads=32, steps=(0, 15)),
                   ppo=PPOOptions(truncated_is=INF, value_clip_coef=INF, gamma=1.0, ent_coef=0.0)).check()
    DetachedConfig(workload="swingup", env=VectorEnvOptions(num_envs=1, rollout_len=1, init_log_std=-5.0),
                   ppo=PPOOptions(anneal_updates=0, truncated_is=1.0)).check()


# -- detached PPO CLI ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, parts", [
    (["--lag", "1000000"], ["--lag 1000000", "[0, 64]"]),
    (["--bucket-mb", "0"], ["--bucket-mb 0", ">= 0.0001"]),
    (["--heartbeat-timeout-s", "0"], ["--heartbeat-timeout-s 0", ">= 1"]),
    (["--bucket-mb", "-1"], ["--bucket-mb -1", ">= 0.0001"]),
])
def test_ppo_cli_in_process_exits_2_before_spawning(args, parts, monkeypatch, capsys, cli_in_process):
    import hpcrl.ppo.__main__ as ppo_main

    def started(*a, **kw):
        raise AssertionError("ranks were started for a bad configuration")

    monkeypatch.setattr(ppo_main, "spawn", started)
    monkeypatch.setattr(ppo_main, "train", started)
    rc = ppo_main.main(["--trainer-device", "cpu", "--maker-device", "cpu", *args])
    assert_bad_cli(rc, capsys.readouterr().err, "hpcrl.ppo: error:", *parts)


@pytest.mark.parametrize("args, parts", [
    (["--ppo.lr", "fast"], ["Error parsing --ppo.lr", "'fast'", "see python -m hpcrl.ppo --help"]),
    (["--lagg", "3"], ["unrecognized option(s) --lagg 3", "--help"]),
    (["--workload", "nope"], ["--workload nope: unknown workload 'nope'", "cartpole"]),
    (["--workload", "no_such_module:Cls"], ["--workload 'no_such_module:Cls'", "importable package.module:Class"]),
    (["--workload", "ppo_toy:ToyWorkload", "--rollout-s", "slow"], ["Error parsing --rollout-s", "'slow'",
                                                                    "--workload ppo_toy:ToyWorkload --help"]),
    (["--workload", "ppo_toy:ToyWorkload", "--num-envs", "4"], ["Unrecognized options: --num-envs, 4"]),
    (["--workload", "lm", "--lm.n-heads", "5"], ["--lm.n-heads 5", "divisor of --lm.d-model 32"]),
    (["--env.num-envs", "0"], ["--env.num-envs 0", "[1, 65536]"]),
    (["--ppo.truncated-is", "0.5"], ["--ppo.truncated-is 0.5", "[1, 1000]", "or inf for off"]),
])
def test_ppo_cli_typed_options_exit_2_in_one_line(args, parts, monkeypatch, capsys, cli_in_process):
    import hpcrl.ppo.__main__ as ppo_main

    def started(*a, **kw):
        raise AssertionError("ranks were started for a bad configuration")

    monkeypatch.setattr(ppo_main, "spawn", started)
    monkeypatch.setattr(ppo_main, "train", started)
    monkeypatch.syspath_prepend(str(TESTS))  # ppo_toy
    rc = ppo_main.main(["--trainer-device", "cpu", "--maker-device", "cpu", *args])
    assert_bad_cli(rc, capsys.readouterr().err, "hpcrl.ppo: error:", *parts)


@pytest.mark.parametrize("inside", [False, True], ids=["file", "under-a-file"])
def test_ppo_run_dir_that_is_a_file_exits_2_before_spawning(tmp_path, inside):
    """A --run-dir that is (or is under) an existing file: one line, exit 2, no rank started."""
    (tmp_path / "taken").write_text("not a directory")
    run_dir = tmp_path / "taken" / "run" if inside else tmp_path / "taken"
    proc = run_module("hpcrl.ppo", ["--run-dir", str(run_dir), "--makers", "1", "--trainers", "1",
                                    "--trainer-device", "cpu", "--maker-device", "cpu", "--total-steps", "2"], tmp_path)
    assert_bad_cli(proc.returncode, proc.stderr, "hpcrl.ppo: error:", f"--run-dir '{run_dir}'", "existing file",
                   "pass another --run-dir")
    assert proc.stdout == ""  # no rank printed its start line
    assert (tmp_path / "taken").read_text() == "not a directory"


def test_ppo_cli_bad_device_exits_2(tmp_path):
    proc = run_module("hpcrl.ppo", ["--trainer-device", "tpu", "--run-dir", str(tmp_path / "run")], tmp_path)
    assert_bad_cli(proc.returncode, proc.stderr, "hpcrl.ppo: error:", "--trainer-device 'tpu'", "cuda:K")


def test_ppo_cli_bad_batches_per_step_exits_2(tmp_path):
    proc = run_module("hpcrl.ppo", ["--batches-per-step", "0", "--trainer-device", "cpu", "--maker-device", "cpu",
                                    "--run-dir", str(tmp_path / "run")], tmp_path)
    assert_bad_cli(proc.returncode, proc.stderr, "hpcrl.ppo: error:", "--batches-per-step 0", ">= 1")


# -- launcher: JobRequest, the batch script, python -m hpcrl.launch -------------------------------------------

LAUNCH_BAD = [
    (["--nodes", "0"], ["nodes=0 (--nodes)", ">= 1", "pass --nodes 1 or more"]),
    (["--gpus-per-node", "-1"], ["gpus_per_node=-1 (--gpus-per-node)", ">= 0"]),
    (["--tasks-per-node", "0"], ["tasks_per_node=0 (--tasks-per-node)", ">= 1"]),
    (["--time", "0"], ["time_min=0 (--time)", ">= 1"]),
    (["--cpus-per-task", "0"], ["cpus_per_task=0 (--cpus-per-task)", ">= 1"]),
    (["--signal-delay", "0"], ["signal_delay_s=0 (--signal-delay)", ">= 1"]),
    (["--partition", "debug\n#SBATCH --uid=0"], ["partition='debug\\n#SBATCH --uid=0' (--partition)", "'\\n'",
                                                 "remove them"]),
    (["--partition", "debug\recho hi"], ["(--partition)", "'\\r'", "control character"]),
    (["--partition", "debug gpu"], ["partition='debug gpu' (--partition)", "Slurm partition name", "sinfo"]),
    (["--partition", "debug;touch${IFS}x"], ["(--partition)", "Slurm partition name"]),
    (["--partition", "debug\u2028x"], ["(--partition)", "'\\u2028'", "control character"]),
    (["--folder", "/tmp/logs\necho pwned"], ["folder='/tmp/logs\\necho pwned' (--folder)", "'\\n' at position 9"]),
    (["--folder", "/tmp/my logs/%j"], ["(--folder)", "'/tmp/my logs/%j'", "' '", "#SBATCH --output="]),
    (["--folder", "/tmp/logs#x"], ["(--folder)", "'#'", "starts a comment"]),
    (["--folder", "/tmp/it's"], ["(--folder)", "\"'\"", "strips quotes"]),
    (["--folder", "/tmp/a\\b"], ["(--folder)", "'\\\\'", "backslashes"]),
    (["--folder", "/tmp/tab\tx"], ["(--folder)", "'\\t'", "control character"]),
    (["--folder", ""], ["folder='' (--folder)", "non-empty path"]),
    (["--run-dir", "/tmp/run\n-%j"], ["run_dir='/tmp/run\\n-%j' (--run-dir)", "control character"]),
    (["--run-dir", "/tmp/{user}-%j"], ["(--run-dir)", "{algo} is the only placeholder", "{{ and }}"]),
    (["--run-dir", "/tmp/{-%j"], ["(--run-dir)", "{algo} is the only placeholder"]),
    (["--", "--env", "pendulum\nsrun rm -rf ~"], ["trainer argument 'pendulum\\nsrun rm -rf ~'",
                                                  "control character"]),
    (["--", "--env", "a\x00b"], ["trainer argument '", "'\\x00'"]),
    (["--", "--tau", "\x1b[31m5"], ["trainer argument '", "'\\x1b'"]),
]


@pytest.mark.parametrize("args, parts", LAUNCH_BAD,
                         ids=[repr(a[1] if len(a) > 1 else a[0])[:40] for a, _ in LAUNCH_BAD])
def test_launch_cli_refuses(args, parts, tmp_path, capsys):
    trainer = args[args.index("--"):] if "--" in args else []
    own = args[:args.index("--")] if "--" in args else args
    if "--run-dir" not in own:
        own = own + ["--run-dir", str(tmp_path / "run-%j")]
    if "--folder" not in own:
        own = own + ["--folder", str(tmp_path / "logs" / "%j")]
    rc = launch_main(["sac", *own, "--local", "--dry-run", *trainer])  # --local: no sinfo, same checks
    assert_bad_cli(rc, capsys.readouterr().err, "hpcrl.launch: error:", *parts)
    assert not (tmp_path / "logs").exists()


def test_launch_algo_with_a_newline_is_refused(tmp_path, capsys):
    rc = launch_main(["sac\nid", "--run-dir", str(tmp_path / "r"), "--folder", str(tmp_path / "l"), "--local",
                      "--dry-run"])
    assert_bad_cli(rc, capsys.readouterr().err, "algo='sac\\nid' (ALGO)", "control character")


def test_launch_flag_errors_exit_2_with_one_line(capsys):
    assert launch_main(["sac", "--nodes", "two", "--dry-run"]) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--nodes" in err and "'two'" in err and "e.g. --nodes 1" in err
    assert launch_main(["sac", "--node", "2", "--dry-run"]) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--nodes" in err.split("perhaps you meant")[1]
    assert launch_main(["sac", "--local", "--slurm", "--dry-run"]) == EXIT_BAD_CONFIG
    assert "--local --slurm" in capsys.readouterr().err


@pytest.mark.parametrize("fields, message", [
    (dict(folder="/x\n#SBATCH --uid=0"), r"folder='/x\\n#SBATCH --uid=0' \(--folder\) holds the control character"),
    (dict(partition="gpu\nsrun id"), r"partition='gpu\\nsrun id' \(--partition\)"),
    (dict(folder="/shared/my logs"), r"'#SBATCH --output=' cannot carry"),
    (dict(nodes=1.5), r"nodes=1.5 \(--nodes\): must be an integer >= 1"),
    (dict(tasks_per_node=True), r"tasks_per_node=True \(--tasks-per-node\): must be an integer"),
])
def test_render_refuses_a_request_nobody_checked(fields, message):
    """render() (and the Slurm executor's parameters) check the values themselves: no script from a bad request."""
    with pytest.raises(LaunchError, match=message):
        render(JobRequest(**fields))


def test_trainer_arguments_never_enter_the_batch_script(tmp_path):
    """They travel pickled in the submitit task and reach the trainer as argv, without a shell."""
    odd = ("--env", "$(touch pwned)`id`;echo hi", "--run-name", "a b 'c' \"d\" #e")
    request = JobRequest(trainer_args=odd, folder=str(tmp_path / "logs" / "%j"), run_dir=str(tmp_path / "r-%j"))
    request.check()
    script = render(request)
    assert not any(arg in script for arg in odd[1::2])
    fixed = (ALLOC_TASKS_LINE,)  # the setup line that recounts tasks after a resize holds no argument
    assert all(line.startswith(("#", "export ", "srun ")) or line in fixed for line in script.splitlines() if line)


@pytest.mark.parametrize("args, parts", [
    (["--folder", "/tmp/logs\necho pwned"], ["(--folder)", "'\\n'"]),
    (["--nodes", "0"], ["nodes=0 (--nodes)", ">= 1"]),
    (["--", "--env", "x\ny"], ["trainer argument '", "control character"]),
])
def test_launch_cli_subprocess_exits_2(args, parts, tmp_path):
    proc = run_module("hpcrl.launch", ["sac", "--dry-run", "--local", "--run-dir", str(tmp_path / "r-%j"), *args],
                      tmp_path)
    assert_bad_cli(proc.returncode, proc.stderr, "hpcrl.launch: error:", *parts)
    assert proc.stdout == ""
