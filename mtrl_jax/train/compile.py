"""Compiling a train step's programs ahead of time, for `TrainStep` and `StackedTrainStep`.

`lower_step` lowers the update (and, with several updates per batch, the
old-logprob forward) for a batch's shapes without running them; compiling what it
returns fills jax.jit's cache, so an RL run compiles every shape bucket before its
first step (`run.shapes.precompile`) and its compile census stays flat. Lowering
(tracing) is Python and holds the interpreter lock; compiling is XLA's and does
not, so `run.shapes.precompile` lowers one program after another and compiles
several at once where that helps.
"""

from __future__ import annotations

from typing import Optional

import jax
from flax import nnx

from mtrl_jax.rollout.train_batch import TrainBatch


def lower_step(
    step, batch: TrainBatch, with_ref: Optional[bool], rules, old_sharding, *extra_args
) -> list[jax.stages.Lowered]:
  """The body of `TrainStep.lower` and `StackedTrainStep.lower`: `step`'s update
  lowered for `batch`'s shapes (arrays or ShapeDtypeStructs), after the old-logprob
  forward where there is one.

  With several updates per batch (`recompute_old`) the batch also carries the
  trainer's old logprobs, shaped like old_logp and computed by a forward of
  their own, which is compiled too; `old_sharding(shape)` is the sharding
  `old_logprobs` returns, so the step's cache entry matches. `extra_args`
  follow the batch in the step's signature.
  """
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  mesh = step.mesh
  out = []
  if getattr(step.objective, "recompute_old", False):
    like = batch.old_logp_BxK
    old = jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=old_sharding(like.shape))
    batch = batch.replace(trainer_old_logp_BxK=old)
    fwd = jax.tree.map(sds, batch.forward_part())
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
      out.append(
          step._old_fn_for(fwd).lower(step.abstract_state().params, _abstract_base(step), fwd)
      )
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
    out.append(fn.lower(state, frozen, abstract, *extra_args))
  return out


def _abstract_base(step):
  """The abstract frozen base of a step with adapters (else None)."""
  sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  return jax.tree.map(sds, step.base, step.base_shardings) if step.lora else None


def lower_values(step, batch: TrainBatch, rules) -> jax.stages.Lowered:
  """`step`'s value pass (`TrainStep.values`, or `StackedTrainStep.values` on [A, ...]
  batches) lowered for a batch with the value fields (arrays or ShapeDtypeStructs):
  the rollout's value pass of a critic."""
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  fwd = jax.tree.map(sds, batch.forward_part().replace(value_pos_BxK=batch.value_pos_BxK))
  with jax.set_mesh(step.mesh), nnx.logical_axis_rules(rules):
    return step._values_fn_for(fwd).lower(step.abstract_state().params, fwd)
