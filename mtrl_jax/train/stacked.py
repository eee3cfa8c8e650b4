"""Separate policies of one architecture, updated by one program.

CoMLRL's multi-agent setting trains one LLM per agent. When the agents share
an architecture, their `TrainState`s (parameters, AdamW moments, step
counters) are stacked along a leading agent axis A and one jitted program
maps the ordinary train step over it (`jax.vmap` of `TrainStep._step`):

  state_A, ref_A, batch_A  ->  A independent updates  ->  new state_A, metrics_A

Each agent sees only its own rows (`rollout.batching.make_agent_batches`
stacks one batch per agent, padded to a common shape), its own reference
and its own optimizer state, so agent i's update never depends on agent j's
tokens, advantages or parameters. Per-agent learning rates share the
schedule's shape: AdamW's update is linear in the learning rate, so agent a's
update is the base update times lr_a / lr_base (`update_scale`). The
schedule's numbers (`optim.ScheduleArgs`) and the scales are arguments of the
program, shared by every agent and one per agent.

The stacked axis is replicated over the mesh: every device holds every
agent's shard of the usual parameter layout (fsdp / tensor splits apply
within an agent).

With low-rank adapters (`models.lora`) only the adapters and their AdamW
state are stacked: the A agents' adapters sit over one shared frozen base
(`TrainStep.base`, not mapped), which is also every agent's KL reference.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mtrl_jax import sharding
from mtrl_jax.models import lora as lora_lib
from mtrl_jax.rollout.train_batch import TrainBatch, as_arrays
from mtrl_jax.train.compile import lower_step
from mtrl_jax.train.step import StepConfig, TrainState, TrainStep


def _stack_sharding(s: NamedSharding) -> NamedSharding:
  return NamedSharding(s.mesh, P(None, *s.spec))


def stack_trees(trees: Sequence[Any]):
  """[tree_0, tree_1, ...] -> one tree with a leading agent axis on every leaf."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def agent_slice(tree, a: int):
  """Agent `a`'s tree of a stacked tree."""
  return jax.tree.map(lambda x: x[a], tree)


class StackedTrainStep:
  """A jitted, sharded update of A stacked agents' `TrainState`s by one objective.

  Args:
    model: one agent's model (the shared architecture; weights are taken by
      `init_state`).
    objective: as for `TrainStep`.
    optim_cfg: the optimizer (its learning rate is the base rate).
    learning_rates: one base learning rate per agent (same schedule shape).
    mesh, step_cfg, rules: as for `TrainStep`.
  """

  def __init__(
      self,
      model,
      objective,
      optim_cfg,
      learning_rates: Sequence[float],
      mesh=None,
      step_cfg: StepConfig = StepConfig(),
      rules=sharding.TRAIN_RULES,
  ):
    if len(learning_rates) < 1:
      raise ValueError("StackedTrainStep: learning_rates is empty; allowed: one rate per agent")
    if optim_cfg.learning_rate <= 0 or any(lr <= 0 for lr in learning_rates):
      raise ValueError(
          f"StackedTrainStep learning_rates={list(learning_rates)} (base "
          f"{optim_cfg.learning_rate}); allowed: positive rates"
      )
    self.inner = TrainStep(model, objective, optim_cfg, mesh=mesh, step_cfg=step_cfg, rules=rules)
    self.num_agents = len(learning_rates)
    self.scales = np.asarray([lr / optim_cfg.learning_rate for lr in learning_rates], np.float32)
    self.mesh, self.step_cfg, self.objective = self.inner.mesh, step_cfg, self.inner.objective
    self.model_cfg = self.inner.model_cfg
    self.lora, self.base_shardings = self.inner.lora, self.inner.base_shardings
    self.state_shardings = jax.tree.map(_stack_sharding, self.inner.state_shardings)
    self.param_shardings = jax.tree.map(_stack_sharding, self.inner.param_shardings)
    self._jitted: dict[Any, Any] = {}
    self._stack_fn = self._copy_fn = self._merge_fn = None

  @property
  def num_compiles(self) -> int:
    return self.inner.num_compiles

  @property
  def base(self):
    """The frozen base every agent's adapters adapt (None without adapters)."""
    return self.inner.base

  def set_base(self, base) -> None:
    self.inner.set_base(base)

  # ------------------------------------------------------------ state
  def init_state(
      self, models_or_params: Sequence[Any], seed: int = 0, adapters: Sequence[Any] = None
  ) -> TrainState:
    """Stacked fresh states, one per agent's model (or parameter state); with adapters,
    agent a's start from `adapters[a]` (None: fresh)."""
    if len(models_or_params) != self.num_agents:
      raise ValueError(f"init_state: {len(models_or_params)} models for {self.num_agents} agents")
    adapters = [None] * self.num_agents if adapters is None else adapters
    states = [
        self.inner.init_state(m, seed=seed, adapters=a) for m, a in zip(models_or_params, adapters)
    ]
    return self.stack(states)

  def stack(self, states: Sequence[TrainState]) -> TrainState:
    """Per-agent states -> one stacked state, born with the stacked shardings."""
    if self._stack_fn is None:
      self._stack_fn = jax.jit(lambda *s: stack_trees(s), out_shardings=self.state_shardings)
    return self._stack_fn(*states)

  def abstract_state(self) -> TrainState:
    """Stacked ShapeDtypeStructs with shardings (a checkpoint restore target)."""
    a = self.num_agents
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct((a,) + x.shape, x.dtype, sharding=s),
        self.inner.abstract_state(),
        self.state_shardings,
    )

  def copy_params(self, params):
    """A separate copy of stacked parameters (the frozen references)."""
    if self._copy_fn is None:
      self._copy_fn = jax.jit(
          lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.param_shardings
      )
    return self._copy_fn(params)

  def merged(self, params):
    """Every agent's plain parameters [A, ...] (`TrainStep.merged` per agent)."""
    if self.lora is None:
      return params
    if self._merge_fn is None:
      merge = lambda b, a: lora_lib.merge(b, a, self.lora)
      self._merge_fn = jax.jit(
          jax.vmap(merge, in_axes=(None, 0)),
          out_shardings=jax.tree.map(_stack_sharding, self.base_shardings),
      )
    return self._merge_fn(self.base, params)

  # ------------------------------------------------------------ step
  def _select(self, batch_A: TrainBatch) -> TrainBatch:
    out = self.inner._select(batch_A, rows_axis=1)
    for k, v in as_arrays(out).items():
      if np.shape(v)[0] != self.num_agents:
        raise ValueError(
            f"stacked batch {k} has leading size {np.shape(v)[0]}; expected "
            f"{self.num_agents} agents"
        )
    return out

  def __call__(self, state: TrainState, ref_params, batch: TrainBatch):
    """One update of every agent: `state` (donated), `ref_params` [A, ...] or None,
    `batch` a `TrainBatch` of [A, B, ...] fields. Returns (new state, metrics {name: [A]})."""
    batch = self._select(batch)
    frozen = self.inner.frozen_arg(ref_params, self.objective.needs_ref)
    fn = self._fn_for(batch, not self.objective.needs_ref)
    with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.inner.rules):
      return fn(state, frozen, batch, self.inner.schedule_args, self.scales)

  def old_logprobs(self, params, batch_A: TrainBatch) -> TrainBatch:
    """`batch_A` with every agent's own logprobs of its rows at its `params` [A, ...]
    (no gradient) as `trainer_old_logp_BxK` [A, B, K], which several updates per batch
    read (`TrainStep.old_logprobs`, mapped over the agent axis)."""
    fwd = batch_A.forward_part()
    with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.inner.rules):
      old = self._old_fn_for(fwd)(params, self.base, fwd)
    return batch_A.replace(trainer_old_logp_BxK=old)

  def values(self, params, batch_A: TrainBatch):
    """Every agent's critic values [A, B, K] of its rows at its `params` (no gradient;
    `TrainStep.values` mapped over the agent axis)."""
    fwd = batch_A.forward_part().replace(value_pos_BxK=batch_A.value_pos_BxK)
    with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.inner.rules):
      return self._values_fn_for(fwd)(params, fwd)

  def _values_fn_for(self, fwd: TrainBatch):
    key = ("values",) + fwd.program_key(rows_axis=1)
    if key not in self._jitted:
      self._jitted[key] = jax.jit(
          jax.vmap(self.inner._values),
          in_shardings=(self.param_shardings, self._batch_shardings(fwd)),
          out_shardings=self._logp_sharding(fwd.tokens_BxL.shape[1]),
      )
    return self._jitted[key]

  def _logp_sharding(self, rows: int) -> NamedSharding:
    # Stacked per-token logprobs [A, B, K], B = `rows` split like the batch rows.
    return _stack_sharding(sharding.batch_sharding(self.mesh, 2, rows))

  def _batch_shardings(self, batch_A):
    return jax.tree.map(
        lambda v: _stack_sharding(sharding.batch_sharding(self.mesh, len(v.shape) - 1, v.shape[1])),
        batch_A,
    )

  def _old_fn_for(self, fwd):
    key = ("old_logprobs",) + fwd.program_key(rows_axis=1)
    fn = self._jitted.get(key)
    if fn is None:
      fn = jax.jit(
          self._mapped_old_logp,
          in_shardings=(self.param_shardings, self.base_shardings, self._batch_shardings(fwd)),
          out_shardings=self._logp_sharding(fwd.tokens_BxL.shape[1]),
      )
      self._jitted[key] = fn
    return fn

  def _fn_for(self, batch, no_ref: bool):
    key = (no_ref,) + batch.program_key(rows_axis=1)
    fn = self._jitted.get(key)
    if fn is None:
      rep = sharding.replicated(self.mesh)
      frozen = self.base_shardings if self.lora else None if no_ref else self.param_shardings
      fn = jax.jit(
          functools.partial(self._stacked_step, with_ref=not no_ref),
          in_shardings=(self.state_shardings, frozen, self._batch_shardings(batch), rep, rep),
          out_shardings=(self.state_shardings, rep),
          donate_argnums=(0,),
          compiler_options=dict(self.step_cfg.compiler_options) or None,
      )
      self._jitted[key] = fn
    return fn

  def _stacked_step(self, state, frozen, batch, schedule_args, scales, *, with_ref: bool):
    one = lambda s, r, b, h, c: self.inner._step(s, r, b, h, update_scale=c, with_ref=with_ref)
    frozen_axis = None if frozen is None or self.lora else 0  # the base is shared
    return jax.vmap(one, in_axes=(0, frozen_axis, 0, None, 0))(
        state, frozen, batch, schedule_args, scales
    )

  def _mapped_old_logp(self, params, base, fwd):
    # Traced body of `old_logprobs`: the single-agent forward mapped over the agent axis.
    return jax.vmap(self.inner._old_logp, in_axes=(0, None, 0))(params, base, fwd)

  def precompile(self, batch: TrainBatch, with_ref=None) -> None:
    """Compiles the step for this stacked batch's shapes (arrays or ShapeDtypeStructs);
    with several updates per batch also the old-logprob forward (as `TrainStep`)."""
    for lowered in self.lower(batch, with_ref):
      lowered.compile()

  def lower(self, batch: TrainBatch, with_ref=None) -> list:
    """`precompile`'s programs lowered, not yet compiled (`train.compile.lower_step`)."""
    return lower_step(
        self,
        batch,
        with_ref,
        self.inner.rules,
        lambda shape: self._logp_sharding(shape[1]),
        self.inner.schedule_args,
        self.scales,
    )

  def fetch_metrics(self, metrics: Mapping[str, Any]) -> list[dict[str, float]]:
    """Host floats per agent (raises NonFiniteError under 'halt' for any agent)."""
    host = jax.device_get(dict(metrics))
    return [
        self.inner.fetch_metrics({k: v[a] for k, v in host.items()}) for a in range(self.num_agents)
    ]
