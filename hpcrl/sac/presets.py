"""FastSAC's presets: named sets of :class:`hpcrl.sac.config.SACConfig` field values (``--preset``)."""

from __future__ import annotations

MUJOCO_CPU: dict = dict(
    # 4 envs x 1 update per vector step = update-to-data 1 (CleanRL's / the SAC paper's one gradient step per
    # transition): few envs keep the policy fresh per sample; batch 256 as CleanRL (its SAC and the SAC paper).
    num_envs=4, num_updates=4, batch_size=256,
    # 1M transitions like CleanRL's buffer (250,000 per env), the budget of the halfcheetah preset.
    total_env_steps=1_000_000, buffer_size=250_000,
    # 1,000 random transitions (250 vector steps) before the first update; CleanRL waits 5,000: starting
    # early is much of what wins at 25k env steps (docs/mujoco_cpu.md's ablation).
    learning_starts=250, random_steps=250,
    # CleanRL's sac_continuous_action.py: gamma 0.99, tau 0.005, q_lr 1e-3 (critic and alpha), policy_lr 3e-4,
    # policy_frequency 2, log-std max 2, target entropy -|A|, plain Adam (no weight decay).
    gamma=0.99, tau=0.005, critic_lr=1e-3, alpha_lr=1e-3, actor_lr=3e-4, policy_frequency=2, log_std_max=2.0,
    weight_decay=0.0, target_entropy_ratio=1.0,
    # alpha starts at 0.1 (CleanRL: 1.0), learned from there: less random early behaviour at few samples.
    alpha_init=0.1,
    # widths 256/128/64 (networks.py halves twice): CleanRL's 256 first layer; wider critics cost wall time
    # on one thread.
    actor_hidden=256, critic_hidden=256,
    # discounted returns (gamma 0.99) of HalfCheetah (at most ~12/step -> ~1,200) and Hopper (~3.5/step ->
    # ~350), down to ~-1/step -> -100: [-250, 1250] covers both unscaled (101 atoms, 15 per atom).
    v_min=-250.0, v_max=1250.0, reward_scale=1.0,
    # eval every 5,000 env steps (vs_cleanrl.py's protocol passes its own), 5 episodes.
    log_every=125, checkpoint_every=12_500, eval_episodes=5, eval_every=1250,
)
"""Shared values of the halfcheetah-cpu and hopper-cpu presets."""


PRESETS: dict[str, dict] = {
    # holosoma's defaults for massively parallel humanoid locomotion.
    "holosoma": {},
    # Small networks and a Pendulum-sized value range: solves Pendulum on a CPU in about a minute.
    "pendulum": dict(
        env="pendulum", num_envs=8, total_env_steps=8_000, batch_size=256, buffer_size=4096, gamma=0.98,
        learning_starts=64, random_steps=64, num_updates=4, policy_frequency=2, tau=0.01, critic_lr=1e-3,
        actor_lr=1e-3, alpha_lr=1e-3, weight_decay=0.0, alpha_init=0.1, target_entropy_ratio=1.0,
        actor_hidden=128, critic_hidden=128, v_min=-100.0, v_max=10.0, reward_scale=0.1, log_std_max=2.0,
        log_every=25, checkpoint_every=500, eval_episodes=4,
    ),
    # gymnasium HalfCheetah-v5 on CPU ranks. Algorithm values from FastTD3's BaseArgs
    # (younggyoseo/FastTD3 fast_td3/hyperparams.py: gamma 0.99, tau 0.1, num_updates 2, policy_frequency 2,
    # distributional critic over [-250, 250], lr 3e-4, bf16 AMP off here: CPU) on holosoma's FastSAC learner
    # (docs/holosoma.md); sizes cut to what a few CPU cores step: 16 envs, a 1M-transition replay (62,500 per
    # env), global batch 4096, and CleanRL's 5,000 random warm-up transitions.
    "halfcheetah": dict(
        env="gym:HalfCheetah-v5", num_envs=16, total_env_steps=1_000_000, batch_size=4096, buffer_size=62_500,
        gamma=0.99, tau=0.1, num_updates=2, policy_frequency=2, learning_starts=313, random_steps=313,
        v_min=-250.0, v_max=250.0, critic_hidden=512, actor_hidden=256, alpha_init=0.001, target_entropy_ratio=0.0,
        weight_decay=0.001, log_every=100, checkpoint_every=5000, eval_episodes=4, eval_every=2000,
    ),
    # gymnasium MuJoCo on ONE CPU thread (benchmarks/sac/vs_cleanrl.py, docs/mujoco_cpu.md): sample-efficient
    # standard SAC rather than FastTD3's GPU sizes, on hpcrl's learner (C51 critic with LayerNorm, 2 Q heads,
    # obs normalisation). See MUJOCO_CPU below for where each value comes from.
    # HalfCheetah never terminates and learns fast per sample here: 2 updates per vector step of 4 envs
    # (update-to-data 0.5) halve the update time and still lead CleanRL at 25k and 50k env steps.
    "halfcheetah-cpu": dict(MUJOCO_CPU, env="gym:HalfCheetah-v5", num_updates=2),
    # Hopper terminates when it falls (an alive bonus): without clipped double Q its returns collapsed after
    # ~20k steps (overestimated values of falling states); an actor step per critic step as CleanRL
    # (2 every 2 steps). docs/mujoco_cpu.md's ablation: 50k return 254 -> 846 (cdq) -> 1,545 (both).
    "hopper-cpu": dict(MUJOCO_CPU, env="gym:Hopper-v5", cdq=True, policy_frequency=1),
    # MuJoCo Playground's DM-suite CartpoleBalance (the Playground task that runs without the menagerie
    # files). FastTD3's Playground arguments (younggyoseo/FastTD3 fast_td3/hyperparams.py, MuJoCoPlaygroundArgs:
    # gamma 0.97, a 10,240-slot replay per env, return support [-10, 10]) on holosoma's learner; 128 envs
    # instead of 1024 for a CPU, and rewards (in [0, 1] per step, up to 1/(1 - 0.97) = 33 discounted) scaled
    # by 0.25 into that support.
    "playground": dict(
        env="playground:CartpoleBalance", num_envs=128, total_env_steps=500_000, batch_size=4096,
        buffer_size=10_240, gamma=0.97, tau=0.1, num_updates=2, policy_frequency=2, v_min=-10.0, v_max=10.0,
        reward_scale=0.25, critic_hidden=512, actor_hidden=256, learning_starts=10, random_steps=10,
        log_every=20, checkpoint_every=400, eval_episodes=4, eval_every=400,
    ),
}
