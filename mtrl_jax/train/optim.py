"""Optimizer: AdamW behind global-norm clipping, with a warm-up + decay schedule.

`OptimConfig` is a frozen, validated dataclass (hashable, built from the
ConfigDict at the top of the training loop); `make_optimizer` turns it into an
`optax.GradientTransformation` applied functionally to the parameter state.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import optax

_SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW hyper-parameters.

  Attributes:
    learning_rate: peak learning rate, reached at the end of warm-up.
    warmup_steps: linear warm-up from 0 to `learning_rate` over this many updates.
    total_steps: updates in the run; the cosine schedule reaches 0 here.
    schedule: 'constant' (after warm-up) or 'cosine' (decay to 0 at total_steps).
    weight_decay: decoupled weight decay, applied to matrices only (ndim >= 2),
      not to norm scales or biases.
    b1, b2, eps: Adam moments and denominator epsilon.
    grad_clip_norm: clip gradients to this global norm; 0 disables clipping.
  """

  learning_rate: float = 1e-5
  warmup_steps: int = 0
  total_steps: int = 1000
  schedule: str = "constant"
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  grad_clip_norm: float = 1.0

  def __post_init__(self):
    if self.schedule not in _SCHEDULES:
      raise ValueError(f"OptimConfig.schedule={self.schedule!r}; allowed: {list(_SCHEDULES)}")
    _check(self.learning_rate > 0 and math.isfinite(self.learning_rate), "learning_rate",
           self.learning_rate, "a finite number > 0")
    _check(int(self.warmup_steps) == self.warmup_steps and self.warmup_steps >= 0,
           "warmup_steps", self.warmup_steps, "an integer >= 0")
    _check(int(self.total_steps) == self.total_steps and self.total_steps >= 1,
           "total_steps", self.total_steps, "an integer >= 1")
    if self.schedule == "cosine":
      _check(self.warmup_steps < self.total_steps, "warmup_steps", self.warmup_steps,
             f"< total_steps={self.total_steps} with the cosine schedule")
    _check(self.weight_decay >= 0, "weight_decay", self.weight_decay, ">= 0")
    _check(0 <= self.b1 < 1, "b1", self.b1, "in [0, 1)")
    _check(0 <= self.b2 < 1, "b2", self.b2, "in [0, 1)")
    _check(self.eps > 0, "eps", self.eps, "> 0")
    _check(self.grad_clip_norm >= 0, "grad_clip_norm", self.grad_clip_norm,
           ">= 0 (0 disables clipping)")


def _check(ok: bool, name: str, value, allowed: str):
  if not ok:
    raise ValueError(f"OptimConfig.{name}={value!r}; allowed: {allowed}")


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
  """Learning rate as a function of the number of applied updates."""
  if cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps, end_value=0.0)
  if cfg.warmup_steps == 0:
    return optax.constant_schedule(cfg.learning_rate)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps),
       optax.constant_schedule(cfg.learning_rate)], [cfg.warmup_steps])


def _decay_mask(params):
  # Decaying norm scales / biases towards 0 only hurts; decay matrices only.
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  """Global-norm clipping followed by AdamW on `make_schedule(cfg)`.

  Args:
    cfg: optimizer hyper-parameters.
  Returns:
    An optax transformation for a parameter pytree (e.g. an `nnx.State`).
  """
  adamw = optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay, mask=_decay_mask)
  if cfg.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)
  return adamw
