"""Compiling a train step's programs ahead of time, for `TrainStep` and `StackedTrainStep`.

`compile_step` lowers and compiles the update (and, with several updates per
batch, the old-logprob forward) for a batch's shapes without running them, so
an RL run compiles every shape bucket before its first step
(`train.shapes.precompile`) and its compile census stays flat.
"""

from __future__ import annotations

from typing import Optional

import jax
from flax import nnx

from mtrl_jax.rollout.train_batch import TrainBatch


def compile_step(
    step, batch: TrainBatch, with_ref: Optional[bool], rules, old_sharding, *extra_args
) -> None:
  """The body of `TrainStep.precompile` and `StackedTrainStep.precompile`: lowers
  and compiles `step`'s update for `batch`'s shapes (arrays or ShapeDtypeStructs).

  With several updates per batch (`recompute_old`) the batch also carries the
  trainer's old logprobs, shaped like old_logp and computed by a forward of
  their own, which is compiled too; `old_sharding(shape)` is the sharding
  `old_logprobs` returns, so the step's cache entry matches. `extra_args`
  follow the batch in the step's signature.
  """
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  mesh = step.mesh
  if getattr(step.objective, "recompute_old", False):
    like = batch.old_logp_BxK
    old = jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=old_sharding(like.shape))
    batch = batch.replace(trainer_old_logp_BxK=old)
    fwd = jax.tree.map(sds, batch.forward_part())
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
      step._old_fn_for(fwd).lower(step.abstract_state().params, _abstract_base(step), fwd).compile()
  batch = step._select(batch)
  no_ref = not (step.objective.needs_ref if with_ref is None else with_ref)
  fn = step._fn_for(batch, no_ref)
  abstract = jax.tree.map(
      lambda v: v if isinstance(v, jax.ShapeDtypeStruct) and v.sharding is not None else sds(v),
      batch,
  )
  state = step.abstract_state()
  frozen = _abstract_base(step) if step.lora else None if no_ref else state.params
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    fn.lower(state, frozen, abstract, *extra_args).compile()


def _abstract_base(step):
  """The abstract frozen base of a step with adapters (else None)."""
  sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  return jax.tree.map(sds, step.base, step.base_shardings) if step.lora else None


def compile_values(step, batch: TrainBatch, rules) -> None:
  """Lowers and compiles `step`'s value pass (`TrainStep.values`, or
  `StackedTrainStep.values` on [A, ...] batches) for a batch with the value
  fields (arrays or ShapeDtypeStructs): the rollout's value pass of a critic."""
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  fwd = jax.tree.map(sds, batch.forward_part().replace(value_pos_BxK=batch.value_pos_BxK))
  with jax.set_mesh(step.mesh), nnx.logical_axis_rules(rules):
    step._values_fn_for(fwd).lower(step.abstract_state().params, fwd).compile()
