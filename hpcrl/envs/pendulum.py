"""Batched pure-torch Pendulum, equal to gymnasium 1.x ``Pendulum-v1``.

Same constants (g=10, m=l=1, dt=0.05, max speed 8, max torque 2), same reward
``-(angle_normalize(th)^2 + 0.1 thdot^2 + 0.001 u^2)`` on the pre-step state and the clipped torque,
same observation ``[cos th, sin th, thdot]``, same reset distribution (th ~ U[-pi, pi],
thdot ~ U[-1, 1]) and the same 200-step time limit (truncation). Pendulum never terminates.

One deliberate difference: the angle is kept wrapped to [-pi, pi) after each step. Observation and
reward depend on it only through cos/sin/angle_normalize, so nothing observable changes, but a
float32 angle that grows without bound (a spinning pendulum) would lose precision.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .base import TorchVecEnv, check_action_shape


class Pendulum(TorchVecEnv):
    state_dim = 2  # [th, thdot]
    obs_dim = 3

    max_speed = 8.0
    max_torque = 2.0
    dt = 0.05
    m = 1.0
    l = 1.0  # noqa: E741  (gymnasium's name)

    def __init__(
        self,
        num_envs: int,
        device: torch.device | str = "cpu",
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        g: float = 10.0,
        max_episode_steps: int = 200,
    ) -> None:
        super().__init__(
            num_envs, device=device, dtype=dtype, seed=seed, max_episode_steps=max_episode_steps
        )
        self.g = float(g)
        self.action_dim = 1
        self.action_low = torch.full((1,), -self.max_torque, device=self.device, dtype=dtype)
        self.action_high = torch.full((1,), self.max_torque, device=self.device, dtype=dtype)
        # Made once: building it per step would be a host-to-device copy on GPU.
        self._reset_high = torch.tensor([math.pi, 1.0], device=self.device, dtype=dtype)
        self._reset_span = 2.0 * self._reset_high
        self._pi = torch.tensor(math.pi, device=self.device, dtype=dtype)
        self._two_pi = torch.tensor(2.0 * math.pi, device=self.device, dtype=dtype)

    def _initial_state(self) -> Tensor:
        # U[-high, high] as rand * 2 high - high.
        return self._rand(self.num_envs, 2).mul_(self._reset_span).sub_(self._reset_high)

    def _prepare_action(self, action: Tensor) -> Tensor:
        check_action_shape(action, ((self.num_envs, 1), (self.num_envs,)), "Pendulum")
        u = action.to(self.device, self.dtype).reshape(self.num_envs)
        return u.clamp(-self.max_torque, self.max_torque)

    # The arithmetic below is gymnasium's, with constants folded into alpha=/value= arguments and
    # 0-dim tensors: a Python-float operand costs an extra dispatch and copy per op in eager torch,
    # and at up to thousands of envs a step costs what its op count costs.
    def _transition(self, state: Tensor, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        th, thdot = state.unbind(-1)
        # costs = angle_normalize(th)^2 + 0.1 thdot^2 + 0.001 u^2
        costs = torch.addcmul(self._wrap(th).square(), thdot, thdot, value=0.1)
        costs.addcmul_(u, u, value=0.001)
        # newthdot = clip(thdot + (3g/(2l) sin th + 3/(m l^2) u) dt, -max_speed, max_speed)
        newthdot = thdot.add(torch.sin(th), alpha=3.0 * self.g / (2.0 * self.l) * self.dt)
        newthdot.add_(u, alpha=3.0 / (self.m * self.l**2) * self.dt)
        newthdot.clamp_(-self.max_speed, self.max_speed)
        newth = self._wrap(th.add(newthdot, alpha=self.dt))
        terminated = torch.zeros_like(th, dtype=torch.bool)
        return torch.stack([newth, newthdot], dim=-1), costs.neg_(), terminated

    def _observation(self, state: Tensor) -> Tensor:
        th, thdot = state.unbind(-1)
        return torch.stack([torch.cos(th), torch.sin(th), thdot], dim=-1)

    def _wrap(self, x: Tensor) -> Tensor:
        """gymnasium's angle_normalize: ((x + pi) mod 2 pi) - pi, result in [-pi, pi)."""
        # torch's remainder follows Python/NumPy semantics (result has the divisor's sign).
        return (x + self._pi).remainder_(self._two_pi).sub_(self._pi)
