"""Optimizer: AdamW behind global-norm clipping, with a warm-up + decay schedule.

`OptimConfig` is a frozen, validated dataclass (hashable, built from the
ConfigDict at the top of the training loop); `make_optimizer` turns it into an
`optax.GradientTransformation` applied functionally to the parameter state.

The schedule's numbers (peak rate, warm-up, total updates: `ScheduleArgs`) are
arguments of the compiled update, not constants in it: a run resumed with
another `rl.steps` runs the programs it compiled before (the persistent
compilation cache hits). The learning rate is evaluated on the device at the
optimizer's own count of applied updates (a skipped update does not advance
it; the host would have to read that count before every update), from a
`ScheduleState` in the optimizer state that records where the cosine was last
anchored:

  anchor (a, phi, T): for counts c >= a the cosine's phase runs linearly from
  phi at c = a to 1 at c = T, lr(c) = peak * (1 + cos(pi * phase)) / 2; before
  the warm-up's end W, lr(c) = peak * c / W.

A fresh state anchors at (W, 0, T) on its first update: exactly `make_schedule`'s
`optax.warmup_cosine_decay_schedule`. An update that finds another total T'
than its anchor's re-anchors there (`anchored`): with the cosine under way
(W < c < T) at (c, phase(c), T'), so the rate goes on from the value it had
and decays to 0 at T' (the remaining cosine stretched or squeezed); in the
warm-up, or once the old cosine had ended (c >= T, rate 0), at (W, 0, T'):
the new total's own curve. The anchor is saved with the optimizer state, so
later resumes continue from it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
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
    _check(
        self.learning_rate > 0 and math.isfinite(self.learning_rate),
        "learning_rate",
        self.learning_rate,
        "a finite number > 0",
    )
    _check(
        int(self.warmup_steps) == self.warmup_steps and self.warmup_steps >= 0,
        "warmup_steps",
        self.warmup_steps,
        "an integer >= 0",
    )
    _check(
        int(self.total_steps) == self.total_steps and self.total_steps >= 1,
        "total_steps",
        self.total_steps,
        "an integer >= 1",
    )
    if self.schedule == "cosine":
      _check(
          self.warmup_steps < self.total_steps,
          "warmup_steps",
          self.warmup_steps,
          f"< total_steps={self.total_steps} with the cosine schedule",
      )
    _check(self.weight_decay >= 0, "weight_decay", self.weight_decay, ">= 0")
    _check(0 <= self.b1 < 1, "b1", self.b1, "in [0, 1)")
    _check(0 <= self.b2 < 1, "b2", self.b2, "in [0, 1)")
    _check(self.eps > 0, "eps", self.eps, "> 0")
    _check(
        self.grad_clip_norm >= 0,
        "grad_clip_norm",
        self.grad_clip_norm,
        ">= 0 (0 disables clipping)",
    )


def _check(ok: bool, name: str, value, allowed: str):
  if not ok:
    raise ValueError(f"OptimConfig.{name}={value!r}; allowed: {allowed}")


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
  """Learning rate as a function of the number of applied updates, for a run that
  keeps its total (what `make_optimizer`'s updates apply until a resume changes it)."""
  if cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps,
        end_value=0.0,
    )
  if cfg.warmup_steps == 0:
    return optax.constant_schedule(cfg.learning_rate)
  return optax.join_schedules(
      [
          optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps),
          optax.constant_schedule(cfg.learning_rate),
      ],
      [cfg.warmup_steps],
  )


class ScheduleArgs(NamedTuple):
  """The schedule's numbers, passed to the compiled update as arguments.

  Attributes:
    learning_rate: float32 peak rate.
    warmup_steps: int32 warm-up updates.
    total_steps: int32 updates of the run (the cosine reaches 0 there).
  """

  learning_rate: Any
  warmup_steps: Any
  total_steps: Any


def schedule_args(cfg: OptimConfig) -> ScheduleArgs:
  """`cfg`'s schedule numbers as host scalars (the update's arguments)."""
  return ScheduleArgs(
      np.float32(cfg.learning_rate), np.int32(cfg.warmup_steps), np.int32(cfg.total_steps)
  )


class ScheduleState(NamedTuple):
  """The schedule's part of the optimizer state (module docstring).

  Attributes:
    count: int32 applied updates.
    anchor_count, anchor_phase, anchor_total: the anchor (a, phi, T); T = 0
      before the first update (not anchored yet).
  """

  count: jax.Array
  anchor_count: jax.Array
  anchor_phase: jax.Array
  anchor_total: jax.Array


def _angle(s: ScheduleState, c):
  """pi * the cosine's phase at count `c` on `s`'s anchor (c >= a; pi past T)."""
  span = s.anchor_total - s.anchor_count
  t = jnp.clip(c - s.anchor_count, 0, jnp.maximum(span, 0)).astype(jnp.float32)
  run = jnp.pi * (1 - s.anchor_phase)
  # (pi * t) / span when phi = 0: optax's cosine, rounding included.
  return (
      jnp.where(span > 0, run * t / jnp.maximum(span, 1).astype(jnp.float32), run)
      + jnp.pi * s.anchor_phase
  )


def anchored(s: ScheduleState, args: ScheduleArgs) -> ScheduleState:
  """`s` anchored for the total `args.total_steps` (unchanged when it already is)."""
  c, w = s.count, jnp.asarray(args.warmup_steps, jnp.int32)
  total = jnp.asarray(args.total_steps, jnp.int32)
  same = s.anchor_total == total
  under_way = (c > w) & (c < s.anchor_total)  # the old cosine had begun and not ended
  phase = _angle(s, c) / jnp.pi
  return s._replace(
      anchor_count=jnp.where(same, s.anchor_count, jnp.where(under_way, c, w)),
      anchor_phase=jnp.where(same, s.anchor_phase, jnp.where(under_way, phase, 0.0)),
      anchor_total=total,
  )


def schedule_value(s: ScheduleState, args: ScheduleArgs, cosine: bool):
  """The rate at `s.count` on `s`'s anchor (`anchored` first); the warm-up and the
  cosine in optax's arithmetic, so an unchanged run's rate is `make_schedule`'s."""
  c, peak = s.count, jnp.asarray(args.learning_rate, jnp.float32)
  w = jnp.asarray(args.warmup_steps, jnp.int32)
  warm = (0.0 - peak) * (1 - jnp.clip(c, 0, w) / jnp.maximum(w, 1)) + peak
  after = peak * (0.5 * (1 + jnp.cos(_angle(s, c)))) if cosine else peak
  return jnp.where(c < w, warm, after)


def scale_by_run_schedule(
    cfg: OptimConfig, args: ScheduleArgs = None
) -> optax.GradientTransformation:
  """Scales updates by minus the rate (optax's `scale_by_learning_rate`), re-anchoring
  the schedule for `args` (default `cfg`'s numbers; traced arguments in the step)."""
  args = schedule_args(cfg) if args is None else args
  cosine = cfg.schedule == "cosine"

  def init(params):
    del params
    zero = jnp.zeros([], jnp.int32)
    return ScheduleState(zero, zero, jnp.zeros([], jnp.float32), zero)

  def update(updates, state, params=None):
    del params
    s = anchored(state, args)
    step_size = -1 * schedule_value(s, args, cosine)
    updates = jax.tree.map(lambda g: jnp.array(step_size, dtype=g.dtype) * g, updates)
    return updates, s._replace(count=optax.safe_increment(s.count))

  return optax.GradientTransformation(init, update)


def learning_rate(opt_state, cfg: OptimConfig, args: ScheduleArgs = None):
  """The rate the next update of `opt_state` applies (for `args`; default `cfg`'s)."""
  args = schedule_args(cfg) if args is None else args
  found = [
      x
      for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ScheduleState))
      if isinstance(x, ScheduleState)
  ]
  return (
      schedule_value(anchored(found[0], args), args, cfg.schedule == "cosine") if found else jnp.nan
  )


def _decay_mask(params):
  # Decaying norm scales / biases towards 0 only hurts; decay matrices only.
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: OptimConfig, args: ScheduleArgs = None) -> optax.GradientTransformation:
  """Global-norm clipping followed by AdamW on the run's schedule (module docstring).

  Args:
    cfg: optimizer hyper-parameters.
    args: the schedule's numbers (default `cfg`'s); the train step passes them
      as arguments of its program. The state's structure does not depend on them.
  Returns:
    An optax transformation for a parameter pytree (e.g. an `nnx.State`); its
    updates equal `optax.adamw(make_schedule(cfg), ...)`'s while the total stays.
  """
  adamw = optax.chain(
      optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
      optax.add_decayed_weights(cfg.weight_decay, _decay_mask),
      scale_by_run_schedule(cfg, args),
  )
  if cfg.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)
  return adamw
