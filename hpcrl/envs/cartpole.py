"""Batched pure-torch cart-pole tasks.

``CartPole``: discrete, equal to gymnasium 1.x ``CartPole-v1`` (Euler integration, tau=0.02, force
+-10, terminate when |x| > 2.4 or |theta| > 12 deg, reward 1 every step including the terminating
one, reset U[-0.05, 0.05]^4, 500-step time limit). Observation = state [x, x_dot, theta, theta_dot].

``CartPoleSwingUp``: continuous, dm_control ``cartpole-swingup``-style. The pole starts hanging down
and must be swung up and balanced; it never terminates. See the class docstring for the exact
dynamics, reward and limits.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .base import TorchVecEnv, check_action_shape


class _CartPoleDynamics:
    """Accelerations of the frictionless cart-pole, gymnasium's equations:

        temp     = (F + m_p l thdot^2 sin) / M
        thetaacc = (g sin - cos temp) / (l (4/3 - m_p cos^2 / M))
        xacc     = temp - m_p l thetaacc cos / M

    with the constants folded into 0-dim tensors and alpha=/value= arguments: in eager torch a
    Python-float operand costs an extra dispatch and copy per op, and a step at up to thousands of
    envs costs what its op count costs.
    """

    def __init__(
        self, gravity: float, masscart: float, masspole: float, length: float, device, dtype
    ) -> None:
        total = masscart + masspole
        self.pml_over_m = masspole * length / total
        self.den_coef = -length * masspole / total
        self.g = torch.tensor(gravity, device=device, dtype=dtype)
        self.den0 = torch.tensor(length * 4.0 / 3.0, device=device, dtype=dtype)
        self.total_mass = total

    def __call__(
        self, force_over_m: Tensor, sin: Tensor, cos: Tensor, theta_dot: Tensor
    ) -> tuple[Tensor, Tensor]:
        temp = torch.addcmul(force_over_m, theta_dot.square(), sin, value=self.pml_over_m)
        den = torch.addcmul(self.den0, cos, cos, value=self.den_coef)
        thetaacc = torch.addcmul(sin * self.g, cos, temp, value=-1.0).div_(den)
        xacc = torch.addcmul(temp, thetaacc, cos, value=-self.pml_over_m)
        return xacc, thetaacc


class CartPole(TorchVecEnv):
    state_dim = 4
    obs_dim = 4

    gravity = 9.8
    masscart = 1.0
    masspole = 0.1
    length = 0.5  # half the pole's length
    force_mag = 10.0
    tau = 0.02
    theta_threshold_radians = 12 * 2 * math.pi / 360
    x_threshold = 2.4

    def __init__(
        self,
        num_envs: int,
        device: torch.device | str = "cpu",
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        max_episode_steps: int = 500,
    ) -> None:
        super().__init__(
            num_envs, device=device, dtype=dtype, seed=seed, max_episode_steps=max_episode_steps
        )
        self.num_actions = 2  # 0: push left, 1: push right
        self._dyn = _CartPoleDynamics(
            self.gravity, self.masscart, self.masspole, self.length, self.device, dtype
        )
        f = self.force_mag / self._dyn.total_mass
        self._push = torch.tensor([-f, f], device=self.device, dtype=dtype)  # F / M per action
        self._half_width = torch.tensor(0.05, device=self.device, dtype=dtype)
        self._width = 2.0 * self._half_width

    def _initial_state(self) -> Tensor:
        # U[-0.05, 0.05]^4
        return self._rand(self.num_envs, 4).mul_(self._width).sub_(self._half_width)

    def _prepare_action(self, action: Tensor) -> Tensor:
        check_action_shape(action, ((self.num_envs,), (self.num_envs, 1)), "CartPole")
        # As gymnasium: action 1 pushes right, anything else left (values are not validated:
        # that would need a host read).
        return action.to(self.device).reshape(self.num_envs) == 1

    def _transition(self, state: Tensor, push_right: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x, x_dot, theta, theta_dot = state.unbind(-1)
        force_over_m = torch.where(push_right, self._push[1], self._push[0])
        xacc, thetaacc = self._dyn(force_over_m, torch.sin(theta), torch.cos(theta), theta_dot)
        # Explicit Euler (gymnasium's default "euler" integrator): positions use old velocities.
        new = torch.stack(
            [
                x.add(x_dot, alpha=self.tau),
                x_dot.add(xacc, alpha=self.tau),
                theta.add(theta_dot, alpha=self.tau),
                theta_dot.add(thetaacc, alpha=self.tau),
            ],
            dim=-1,
        )
        # |x| > t is exactly (x < -t) | (x > t), with fewer ops.
        terminated = (new[:, 0].abs() > self.x_threshold) | (
            new[:, 2].abs() > self.theta_threshold_radians
        )
        reward = torch.ones_like(x)  # 1 on every step, including the terminating one
        return new, reward, terminated

    def _observation(self, state: Tensor) -> Tensor:
        return state.clone()  # a copy: callers may keep obs while the env state moves on


# dm_control.utils.rewards.tolerance with bounds=(0, 0), gaussian sigmoid, value_at_margin=0.1:
# exp(-0.5 (|x| / margin * s)^2) with s = sqrt(-2 ln 0.1), i.e. exp(ln(0.1) (x / margin)^2).
def _gaussian_tolerance_coef(margin: float) -> float:
    return math.log(0.1) / margin**2


class CartPoleSwingUp(TorchVecEnv):
    """Continuous cart-pole swing-up in the style of dm_control ``cartpole-swingup``.

    * State [x, x_dot, theta, theta_dot], theta = 0 upright, kept wrapped to [-pi, pi).
    * Dynamics: the classic frictionless cart-pole equations (as in CartPole above) with
      dm_control's model numbers: cart 1 kg, pole 0.1 kg with its centre of mass 0.5 m from the
      hinge, g = 9.81, force = 10 * clip(a, -1, 1) N, dt = 0.01 s, semi-implicit Euler.
      The cart lives on a rail |x| <= 1.8 m (dm_control's slider range); hitting an end stops the
      cart inelastically (position clamped, outward velocity zeroed). No termination.
    * Reset: x, x_dot, theta_dot ~ 0.01 N(0, 1); theta = pi + 0.01 N(0, 1) (hanging down).
    * Observation (5): [x, cos theta, sin theta, x_dot, theta_dot].
    * Reward in [0, 1] on the post-step state, dm_control's smooth reward:
      ``upright * centered * small_control * small_velocity`` with upright = (cos theta + 1) / 2,
      centered = (1 + tol_gauss(x, margin 2)) / 2, small_control = (4 + tol_quad(a, margin 1)) / 5,
      small_velocity = (1 + tol_gauss(theta_dot, margin 5)) / 2 (tol_gauss is 1 at 0 and 0.1 at the
      margin; tol_quad is 1 - (a/margin)^2, 0 beyond the margin).
    * Time limit 1000 steps (10 s, as dm_control), so returns lie in [0, 1000]. Measured: a
      uniform-random policy gets about 17; a scripted energy-pumping + LQR controller about 820
      (checked in tests/test_envs.py), comparable to what SAC reaches on dm_control's version.
    """

    state_dim = 4
    obs_dim = 5

    gravity = 9.81
    masscart = 1.0
    masspole = 0.1
    length = 0.5  # hinge to the pole's centre of mass
    force_mag = 10.0  # dm_control's actuator gear
    dt = 0.01
    x_limit = 1.8

    def __init__(
        self,
        num_envs: int,
        device: torch.device | str = "cpu",
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        max_episode_steps: int = 1000,
    ) -> None:
        super().__init__(
            num_envs, device=device, dtype=dtype, seed=seed, max_episode_steps=max_episode_steps
        )
        self.action_dim = 1
        self.action_low = torch.full((1,), -1.0, device=self.device, dtype=dtype)
        self.action_high = torch.full((1,), 1.0, device=self.device, dtype=dtype)
        self._dyn = _CartPoleDynamics(
            self.gravity, self.masscart, self.masspole, self.length, self.device, dtype
        )

        def c(v: float) -> Tensor:
            return torch.tensor(v, device=self.device, dtype=dtype)

        self._force_over_m = c(self.force_mag / self._dyn.total_mass)
        self._pi, self._two_pi, self._one = c(math.pi), c(2.0 * math.pi), c(1.0)
        self._x_coef = c(_gaussian_tolerance_coef(2.0))
        self._v_coef = c(_gaussian_tolerance_coef(5.0))
        self._reset_offset = torch.tensor([0.0, 0.0, math.pi, 0.0], device=self.device, dtype=dtype)

    def _initial_state(self) -> Tensor:
        s = torch.add(self._reset_offset, self._randn(self.num_envs, 4), alpha=0.01)
        s[:, 2] = self._wrap(s[:, 2])
        return s

    def _prepare_action(self, action: Tensor) -> Tensor:
        check_action_shape(action, ((self.num_envs, 1), (self.num_envs,)), "CartPoleSwingUp")
        return action.to(self.device, self.dtype).reshape(self.num_envs).clamp(-1.0, 1.0)

    def _transition(self, state: Tensor, a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x, x_dot, theta, theta_dot = state.unbind(-1)
        xacc, thetaacc = self._dyn(
            a * self._force_over_m, torch.sin(theta), torch.cos(theta), theta_dot
        )
        # Semi-implicit Euler: velocities first, positions from the new velocities (energy-stable).
        x_dot = x_dot.add(xacc, alpha=self.dt)
        theta_dot = theta_dot.add(thetaacc, alpha=self.dt)
        x = x.add(x_dot, alpha=self.dt)
        theta = self._wrap(theta.add(theta_dot, alpha=self.dt))
        # Rail ends: clamp the cart and stop it if it was moving outward.
        x_dot = x_dot.masked_fill((x.abs() > self.x_limit) & (x * x_dot > 0), 0.0)
        x = x.clamp(-self.x_limit, self.x_limit)

        # (1 + cos)/2 * (1 + g(x))/2 * (1 + g(thdot))/2 * (4 + 1 - a^2)/5; a is within [-1, 1],
        # so the quadratic tolerance is just 1 - a^2.
        upright = torch.cos(theta).add_(self._one)
        centered = torch.exp(x.square().mul_(self._x_coef)).add_(self._one)
        small_velocity = torch.exp(theta_dot.square().mul_(self._v_coef)).add_(self._one)
        small_control = torch.addcmul(self._one, a, a, value=-0.2)
        reward = (upright * centered).mul_(small_velocity).mul_(small_control).mul_(0.125)
        terminated = torch.zeros_like(x, dtype=torch.bool)
        return torch.stack([x, x_dot, theta, theta_dot], dim=-1), reward, terminated

    def _observation(self, state: Tensor) -> Tensor:
        x, x_dot, theta, theta_dot = state.unbind(-1)
        return torch.stack([x, torch.cos(theta), torch.sin(theta), x_dot, theta_dot], dim=-1)

    def _wrap(self, angle: Tensor) -> Tensor:
        return (angle + self._pi).remainder_(self._two_pi).sub_(self._pi)

    # Left/right symmetry: (x, x_dot, theta, theta_dot, a) -> (-x, -x_dot, -theta, -theta_dot, -a) maps
    # the dynamics and the reward onto themselves, so a mirrored transition is a transition of this env
    # (tests/test_sac_recipe.py steps one to check). In observation terms cos(theta) stays, the rest flip.
    _MIRROR_SIGN = (-1.0, 1.0, -1.0, -1.0, -1.0)

    def mirror_obs(self, obs: Tensor) -> Tensor:
        return obs * obs.new_tensor(self._MIRROR_SIGN)

    def mirror_action(self, action: Tensor) -> Tensor:
        return -action
