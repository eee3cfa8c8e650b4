"""Frozen agents in a team of separate policies (`agents.trainable`).

A frozen agent acts through the engine with its own weights (its
`agents.paths` checkpoint, or the top-level model) but is never updated.
`PartlyFrozenTrainStep` is a `StackedTrainStep` whose state keeps every
agent's parameters on the agent axis A (the engine samples all of them, the
checkpoints and exports read them), but AdamW state for the T trained agents
only:

  state.params, .step, .rng, .num_skipped   [A, ...]  every agent
  state.opt_state                           [T, ...]  trained agents, in agent order

One update gathers the trained agents' rows of the state, the reference, the
stacked batch [A, B, ...] and the rate scales, runs the ordinary stacked
update on those T agents, and scatters the T new rows back. A frozen agent's
rows are never written, so its parameters stay bit-identical to its starting
weights whatever the update computes (no multiply by zero, no select: its
rows are not in the update at all), it has no optimizer state, and no
forward or backward runs on its (all-padding, `train.policies`) batch rows.
The old-logprob forward of several updates per batch gathers likewise and
returns zeros in a frozen agent's rows, which the update never reads.

Metrics come back for the trained agents only ([T]); `fetch_metrics` gives
one dict per trained agent, in agent order (`trained`).

Costs kept: the frozen agent's reference row (the run's state copies the
stacked parameters whole; the update never reads it) and its all-padding batch
rows' transfer to the device.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtrl_jax import sharding
from mtrl_jax.train.stacked import StackedTrainStep, stack_trees
from mtrl_jax.train.step import StepConfig, TrainState


def check_trainable(
    trainable: Sequence[bool], num_agents: int, some_trained: bool = True
) -> tuple[bool, ...]:
  """`trainable` as a tuple, one bool per agent with at least one True (unless not
  `some_trained`: a group of a team, `train.team`, may be all frozen); raises a
  one-line ValueError otherwise."""
  trainable = tuple(trainable)
  if len(trainable) != num_agents or not all(isinstance(t, bool) for t in trainable):
    raise ValueError(
        f"agents.trainable={trainable!r}; allowed: True or False, one per agent ({num_agents})"
    )
  if some_trained and not any(trainable):
    raise ValueError(
        f"agents.trainable={trainable!r} freezes every agent: a run that trains "
        "nothing; allowed: at least one True"
    )
  return trainable


class PartlyFrozenTrainStep(StackedTrainStep):
  """A `StackedTrainStep` whose frozen agents act but never update (module docstring).

  Args:
    model, objective, optim_cfg, learning_rates, mesh, step_cfg, rules: as for
      `StackedTrainStep` (a frozen agent's learning rate is never used).
    trainable: one bool per agent, at least one True unless not `some_trained`
      (a group of a team whose agents are all frozen: its state has no optimizer
      state and it is never called).
  """

  def __init__(
      self,
      model,
      objective,
      optim_cfg,
      learning_rates: Sequence[float],
      trainable: Sequence[bool],
      mesh=None,
      step_cfg: StepConfig = StepConfig(),
      rules=sharding.TRAIN_RULES,
      some_trained: bool = True,
  ):
    super().__init__(
        model, objective, optim_cfg, learning_rates, mesh=mesh, step_cfg=step_cfg, rules=rules
    )
    self.trainable = check_trainable(trainable, self.num_agents, some_trained)
    self.trained = tuple(a for a, t in enumerate(self.trainable) if t)
    self._trained_T = np.asarray(self.trained, np.int32)

  # ------------------------------------------------------------ state
  def init_state(
      self, models_or_params: Sequence[Any], seed: int = 0, adapters: Sequence[Any] = None
  ) -> TrainState:
    """As `StackedTrainStep.init_state`; a frozen agent gets its parameters (with
    adapters: its start adapters) and no optimizer state."""
    if len(models_or_params) != self.num_agents:
      raise ValueError(f"init_state: {len(models_or_params)} models for {self.num_agents} agents")
    adapters = [None] * self.num_agents if adapters is None else adapters
    states = [
        self.inner.init_state(m, seed=seed, adapters=ad) if t else self._frozen_state(m, seed, ad)
        for m, ad, t in zip(models_or_params, adapters, self.trainable)
    ]
    return self.stack(states)

  def _frozen_state(self, model_or_params, seed: int, adapters) -> TrainState:
    # `TrainStep.init_state` without the optimizer state.
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=self.inner.start_params(model_or_params, adapters),
        opt_state=None,
        rng=jax.random.PRNGKey(seed),
        num_skipped=jnp.zeros((), jnp.int32),
    )

  def stack(self, states: Sequence[TrainState]) -> TrainState:
    """Per-agent states (a frozen agent's opt_state None or ignored) -> one state:
    every agent's parameters, counters and keys, the trained agents' AdamW state."""
    if self._stack_fn is None:

      def stack(*s):
        every = stack_trees([x.replace(opt_state=None) for x in s])
        if not self.trained:
          return every
        return every.replace(opt_state=stack_trees([s[a].opt_state for a in self.trained]))

      out = self.state_shardings if self.trained else self.state_shardings.replace(opt_state=None)
      self._stack_fn = jax.jit(stack, out_shardings=out)
    return self._stack_fn(*states)

  def abstract_state(self) -> TrainState:
    """Stacked ShapeDtypeStructs with shardings: [A, ...], opt_state [T, ...]."""
    one, shardings = self.inner.abstract_state(), self.state_shardings

    def stacked(n):
      return lambda x, s: jax.ShapeDtypeStruct((n,) + x.shape, x.dtype, sharding=s)

    every = jax.tree.map(
        stacked(self.num_agents), one.replace(opt_state=None), shardings.replace(opt_state=None)
    )
    if not self.trained:
      return every
    return every.replace(
        opt_state=jax.tree.map(stacked(len(self.trained)), one.opt_state, shardings.opt_state)
    )

  def agent_state(self, state: TrainState, a: int) -> TrainState:
    """Agent `a`'s state of a stacked one (a frozen agent's opt_state: None)."""
    take = lambda tree, i: jax.tree.map(lambda x: x[i], tree)
    opt = take(state.opt_state, self.trained.index(a)) if self.trainable[a] else None
    return TrainState(
        step=state.step[a],
        params=take(state.params, a),
        opt_state=opt,
        rng=state.rng[a],
        num_skipped=state.num_skipped[a],
    )

  # ------------------------------------------------------------ step
  def _take(self, tree):
    # The trained agents' rows of a stacked tree (traced: a gather on the agent axis).
    return jax.tree.map(lambda x: x[self._trained_T], tree)

  def _put(self, full, part):
    # `full` with the trained agents' rows replaced by `part`'s; other rows untouched.
    return jax.tree.map(
        lambda f, p: f.at[self._trained_T].set(p, indices_are_sorted=True, unique_indices=True),
        full,
        part,
    )

  def _stacked_step(self, state, frozen, batch, schedule_args, scales, *, with_ref: bool):
    sub = TrainState(
        step=self._take(state.step),
        params=self._take(state.params),
        opt_state=state.opt_state,
        rng=self._take(state.rng),
        num_skipped=self._take(state.num_skipped),
    )
    ref = frozen if frozen is None or self.lora else self._take(frozen)  # the base is shared
    new, metrics_T = super()._stacked_step(
        sub, ref, self._take(batch), schedule_args, self._take(scales), with_ref=with_ref
    )
    return (
        TrainState(
            step=self._put(state.step, new.step),
            params=self._put(state.params, new.params),
            opt_state=new.opt_state,
            rng=self._put(state.rng, new.rng),
            num_skipped=self._put(state.num_skipped, new.num_skipped),
        ),
        metrics_T,
    )

  def _mapped_old_logp(self, params, base, fwd):
    old_T = super()._mapped_old_logp(self._take(params), base, self._take(fwd))
    zeros = jnp.zeros((self.num_agents,) + old_T.shape[1:], old_T.dtype)
    return self._put(zeros, old_T)

  def fetch_metrics(self, metrics: Mapping[str, Any]) -> list[dict[str, float]]:
    """Host floats per trained agent, in agent order (raises NonFiniteError under
    'halt' for any of them)."""
    host = jax.device_get(dict(metrics))
    return [
        self.inner.fetch_metrics({k: v[i] for k, v in host.items()})
        for i in range(len(self.trained))
    ]
