"""A critic model of its own (`critic.model='separate'`): value pass, batch, update, state.

The critic is a `Transformer` with a value head (`ModelConfig.value_head`)
built from `critic.path`, `critic.preset` (fresh weights, the policy's
vocabulary) or, by default, the policy's starting model. It reads the
policies' token ids, trains by its own `TrainStep` on `ValueObjective` (the
clipped value loss alone, no LM head) with AdamW at `critic.learning_rate` on
the policy's schedule, and its train state is checkpointed beside the
policy's (`run.run_state`: the tree's "critic").

Inputs, by `critic.kind`:
  * 'independent': each agent's own history. The tree is packed as for a
    shared policy (every agent's actions in one batch, `rollout.batching`), so
    one critic values every agent (CoMLRL's IAC with parameter sharing);
  * 'centralized': the joint history (`rollout.joint_rows`: every agent's
    context, and for Q the joint action, one causal row each): CoMLRL's MAAC.

Per step: `values` (one forward, no gradient, the parameters the rollout's
step starts from) gives every sampled action's value, `rollout.critic` turns
them into advantages and targets, `batch` packs the targets, and `update` runs
`rl.updates_per_step` updates; its metrics are `critic/<name>`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax

from mtrl_jax.rollout import joint_rows
from mtrl_jax.rollout.batching import BatchConfig, critic_values, make_train_batch
from mtrl_jax.train.objectives import ValueObjective
from mtrl_jax.train.step import StepConfig, TrainStep


def make_critic_model(exp, mesh, tokenizer_vocab: int):
  """The critic's starting model (see the module docstring), with a zero value head.

  Raises:
    ValueError (one line) when the critic's vocabulary cannot hold the tokenizer's ids.
  """
  from mtrl_jax import models
  from mtrl_jax.models import loading

  c = exp.critic
  path = c.path or ("" if c.preset else exp.model.path)
  if path:
    model = loading.from_pretrained(path, mesh=mesh, value_head=True)
  else:
    arch = (
        models.get_preset(c.preset).replace(vocab_size=exp.model.arch.vocab_size)
        if c.preset
        else exp.model.arch
    )
    model = models.create_model(arch.replace(value_head=True, lora=None), seed=exp.seed, mesh=mesh)
  if model.cfg.vocab_size < tokenizer_vocab:
    raise ValueError(
        f"config critic.path={c.path!r}: vocab_size={model.cfg.vocab_size} cannot "
        f"hold the tokenizer's {tokenizer_vocab} ids; allowed: a model whose "
        "vocabulary holds the policies' tokenizer"
    )
  return model


class SeparateCritic:
  """A critic with its own model and optimizer (see the module docstring).

  Args:
    exp: the validated experiment (`critic`, `optim`, `rl`, `step`, `seed`).
    model: the critic's starting model (`make_critic_model`).
    mesh: the training mesh.
    batch_cfg: the policies' batch config (length buckets, rows, pad id).
  """

  def __init__(self, exp, model, mesh, batch_cfg: BatchConfig):
    c = exp.critic
    self.kind, self.target, self.seed, self.model = c.kind, c.target, exp.seed, model
    self.updates = exp.rl.updates_per_step
    self.step = TrainStep(
        model,
        ValueObjective(value_coef=c.value_coef, value_clip=c.value_clip),
        dataclasses.replace(exp.optim, learning_rate=c.learning_rate),
        mesh=mesh,
        step_cfg=StepConfig(
            nonfinite=exp.step.nonfinite, compiler_options=exp.step.compiler_options
        ),
    )
    # Every valid action teaches the critic; the value fields of the critic's target.
    self.batch_cfg = dataclasses.replace(
        batch_cfg, zero_variance_filter=False, keep_kl=False, values=c.target
    )

  def init_state(self):
    """A fresh train state of the critic (step 0, zero moments)."""
    return self.step.init_state(self.model, seed=self.seed)

  def abstract_state(self):
    """The critic's state as a checkpoint restore target."""
    return self.step.abstract_state()

  def values(self, params, tree) -> tuple[list, Any]:
    """(per node [N, G] values of every trained action at `params`, the rows they came
    from: joint rows, or None for the packed tree); one forward, no gradient."""
    fn = lambda b: jax.device_get(self.step.values(params, b))
    if self.kind == "centralized":
      return joint_rows.joint_values(
          tree,
          self.target,
          fn,
          pad_id=self.batch_cfg.pad_id,
          row_multiple=self.batch_cfg.row_multiple,
      )
    return critic_values(tree, self.batch_cfg, fn, per_agent=False), None

  def batch(self, tree, values: list, targets: list, rows) -> Optional[Any]:
    """The critic's train batch: its value targets and the rollout's values (clipping) at
    every trained action (or joint row); None when nothing trains."""
    if self.kind == "centralized":
      if not rows:
        return None
      return joint_rows.rows_batch(
          rows,
          pad_id=self.batch_cfg.pad_id,
          row_multiple=self.batch_cfg.row_multiple,
          targets_R=joint_rows.row_targets(tree, rows, targets),
          old_values_R=joint_rows.row_targets(tree, rows, values),
      )
    batch, _ = make_train_batch(tree, self.batch_cfg, (values, targets))
    return batch

  def update(self, state, batch) -> tuple[Any, dict]:
    """`rl.updates_per_step` updates of the critic on `batch`; (state, `critic/*` metrics
    of the last one)."""
    for _ in range(self.updates):
      state, m = self.step(state, None, batch)
    return state, {f"critic/{k}": v for k, v in self.step.fetch_metrics(m).items()}
