"""The arithmetic of one train update, traced inside `TrainStep`'s jitted program.

Forward, the `Objective`'s terms (`mtrl_jax.train.objectives`), exact
micro-batch accumulation, AdamW, and the non-finite skip. Micro-batches sum
numerators, denominators and gradients of the numerator, then divide once, so
the update equals the full-batch one. An update whose loss or gradient is not
finite, or whose batch has no trained token, keeps the parameters and the
optimizer state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mtrl_jax import sharding
from mtrl_jax.train import optim
from mtrl_jax.train.forward import forward_logprobs, forward_values


def split_microbatches(batch, num: int, mesh, batch_axes):
  """[B, ...] -> [M, B/M, ...], micro-batch m = rows m, m+M, m+2M, ...

  The strided split keeps every micro-batch spread over all data shards
  (a contiguous split would put each micro-batch on a few devices only).
  """

  def one(x):
    b = x.shape[0]
    y = jnp.swapaxes(x.reshape(b // num, num, *x.shape[1:]), 0, 1)
    spec = P(None, batch_axes, *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, spec))

  return jax.tree.map(one, batch)


def one_update(
    state,
    ref_params,
    batch,
    *,
    graphdef,
    objective,
    step_cfg,
    optim_cfg,
    schedule_args,
    mesh,
    param_shardings,
    update_scale=None,
    frozen=None,
    ref_graphdef=None,
):
  """One update of `state` (a `train.step.TrainState`) on `batch`; traced, not jitted.

  Args:
    state: the current state.
    ref_params: frozen reference parameters, or None when the objective needs
      no reference logprobs.
    batch: a `rollout.train_batch.TrainBatch` ([B, ...] fields).
    graphdef: the model's graph (`nnx.split(model, nnx.Param)[0]`).
    objective: the `Objective` minimised.
    step_cfg: the `StepConfig` (micro-batches, logprob chunking, entropy).
    optim_cfg, schedule_args: the optimizer (`train.optim.make_optimizer`) and its
      schedule's numbers (`train.optim.ScheduleArgs`, arguments of the program).
    mesh, param_shardings: the training mesh and the parameters' shardings.
    update_scale: a scalar multiplying the optimizer's updates (default 1):
      AdamW's update is linear in the learning rate, so it sets another base
      learning rate on the same schedule (`train.stacked`).
    frozen, ref_graphdef: low-rank adapters (`models.lora`): `state.params` are
      the adapters, `frozen` the base they adapt (no gradient, no optimizer
      state), and the reference forward runs `ref_params` on `ref_graphdef`
      (the base's graph: adapters off). None: full fine-tuning.
  Returns:
    (new_state, metrics): metrics a dict of float32 scalars.
  """
  obj, cfg = objective, step_cfg
  want_entropy = cfg.report_entropy and cfg.logprob_chunk_size is None
  temperature = getattr(obj, "temperature", 1.0)
  # A critic's value loss is a second ratio (`PolicyObjective.value_terms`): both
  # denominators are counts known from the whole batch's masks, so each
  # micro-batch adds num / den of each term exactly (the critic-free path below
  # keeps its single division at the end, bit for bit).
  critic = getattr(obj, "value_coef", None) is not None
  values_only = getattr(obj, "values_only", False)  # `objectives.ValueObjective`
  if critic:
    inv_dens = (
        1.0 / jnp.maximum(obj.den(batch), 1.0),
        1.0 / jnp.maximum(obj.value_den(batch), 1.0),
    )

  def num_fn(params, mb, ref_logp):
    full = params if frozen is None else nnx.merge_state(params, frozen)
    if values_only:  # a separate critic: the value head alone, no LM head
      logp = entropy = None
      values = forward_values(graphdef, full, mb)
    else:
      logp, entropy, values = forward_logprobs(
          graphdef, full, mb, cfg.logprob_chunk_size, want_entropy, temperature
      )
    num, den, sums = obj.terms(logp, ref_logp, entropy, mb)
    if critic:
      vnum, vsums = obj.value_terms(values, mb)
      num = num * inv_dens[0] + obj.value_coef * vnum * inv_dens[1]
      sums = {**sums, **vsums}
    return num, (den, sums)

  def grad_fn(params, mb):
    # The reference forward runs outside the differentiated function: no
    # gradient work, and its variables stay at this trace level (nnx.remat
    # refuses variables captured from an outer trace).
    ref_logp = None
    if ref_params is not None:
      ref_logp, _, _ = forward_logprobs(
          ref_graphdef or graphdef,
          ref_params,
          mb.replace(value_pos_BxK=None),
          cfg.logprob_chunk_size,
          False,
          temperature,
      )
      ref_logp = jax.lax.stop_gradient(ref_logp)
    return jax.value_and_grad(num_fn, has_aux=True)(params, mb, ref_logp)

  grads, num, den, sums = _accumulate(
      grad_fn, state.params, batch, cfg.num_microbatches, mesh, param_shardings, obj.merge
  )
  if critic:  # each micro-batch's num is already divided (above)
    loss = num
  else:
    inv_den = 1.0 / jnp.maximum(den, 1.0)  # dens are counts: exact, 0 when empty
    loss = num * inv_den
    grads = jax.tree.map(lambda g: g * inv_den, grads)
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  apply = finite & (den > 0)  # an empty batch (no trained token) changes nothing

  new_state, lr = _apply(state, grads, apply, finite, optim_cfg, schedule_args, update_scale)
  metrics = dict(obj.finalize(sums))
  metrics.update(
      loss=loss,
      grad_norm=grad_norm,
      learning_rate=lr,
      skipped=(~finite).astype(jnp.float32),
      empty_batch=(den <= 0).astype(jnp.float32),
      num_skipped=new_state.num_skipped,
      step=state.step,
  )
  metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
  return new_state, metrics


def _accumulate(grad_fn, params, batch, m: int, mesh, param_shardings, merge):
  """(grads, num, den, sums) of `grad_fn` over `batch` in `m` micro-batches: their
  gradients, numerators and denominators added, their metric sums merged (`merge`)."""
  if m == 1:
    (num, (den, sums)), grads = grad_fn(params, batch)
    return grads, num, den, sums
  b = batch.tokens_BxL.shape[0]
  axes = sharding.batch_sharding(mesh, 2, b // m).spec[0]
  mbs = split_microbatches(batch, m, mesh, axes)

  def body(carry, mb):
    g_acc, num_acc, den_acc = carry
    (num, (den, sums)), g = grad_fn(params, mb)
    return (jax.tree.map(jnp.add, g_acc, g), num_acc + num, den_acc + den), sums

  zeros = jax.tree.map(jnp.zeros_like, params)
  zeros = jax.lax.with_sharding_constraint(zeros, param_shardings)
  init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
  (grads, num, den), sums_M = jax.lax.scan(body, init, mbs)
  sums = functools.reduce(merge, [jax.tree.map(lambda x, i=i: x[i], sums_M) for i in range(m)])
  return grads, num, den, sums


def _apply(state, grads, apply, finite, optim_cfg, schedule_args, update_scale):
  """(new_state, learning rate): the optimizer's step on `grads` where `apply` (the
  state unchanged elsewhere), its skip counter raised where the update is not `finite`."""
  tx = optim.make_optimizer(optim_cfg, schedule_args)
  updates, new_opt = tx.update(grads, state.opt_state, state.params)
  lr = optim.learning_rate(state.opt_state, optim_cfg, schedule_args)
  if update_scale is not None:
    updates = jax.tree.map(lambda u: (u * update_scale).astype(u.dtype), updates)
    lr = lr * update_scale
  new_params = optax.apply_updates(state.params, updates)
  pick = lambda new, old: jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)
  new_state = state.replace(
      step=state.step + 1,
      params=pick(new_params, state.params),
      opt_state=pick(new_opt, state.opt_state),
      num_skipped=state.num_skipped + (~finite).astype(jnp.int32),
  )
  return new_state, lr
