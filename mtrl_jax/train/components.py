"""The composition root of a run: every long-lived part, built once from an `Experiment`.

`build(exp)` makes the mesh, tokenizer and renderer, model, environment
factory, task sources, sampler (and the timed policy over it), transition,
train step, shape plan, batch config and the `Evaluator` shared by the SFT
stop check and held-out evaluation. The RL loop (`train.rl`), the SFT warm-up
(`train.sft.warm_up`) and the saved-policy tools (`train.saved`) all take
their parts from here, so a part is built one way only.

Nothing here compiles or writes a file: programs compile on first use (or in
`shapes.precompile`), files are the loop's business.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from mtrl_jax import metrics as metrics_lib, sharding
from mtrl_jax.rollout.batching import BatchConfig
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.rollout.policy import TimedPolicy
from mtrl_jax.sampling import Sampler
from mtrl_jax.train import experiment as exp_lib
from mtrl_jax.train import shapes as shapes_lib
from mtrl_jax.train.evaluate import Evaluator
from mtrl_jax.train.objectives import PolicyObjective
from mtrl_jax.train.step import TrainStep


@dataclasses.dataclass
class Components:
  """The parts of one run (see the module docstring)."""

  exp: exp_lib.Experiment  # vocabulary fitted to the tokenizer
  mesh: Any
  tokenizer: Any
  renderer: Any
  model: Any
  factory: Any
  train_tasks: Any
  eval_tasks: Any
  train_step: TrainStep
  shapes: shapes_lib.ShapePlan
  batch_cfg: BatchConfig
  sampler: Sampler
  policy: TimedPolicy  # the sampler as the rollout's policy, timing generation
  transition: EnvTransition
  evaluator: Evaluator
  census: metrics_lib.CompileCensus  # compile counts of the run's jitted programs
  key: jax.Array  # PRNGKey(seed): per-step keys are fold_in(key, step)

  @property
  def row_multiple(self) -> int:
    """Rows of every batch divide evenly over the data-parallel devices."""
    return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

  def checkpoint_target(self) -> dict:
    """Abstract tree of a latest-N checkpoint: {"train": state[, "ref": params]}."""
    target = {"train": self.train_step.abstract_state()}
    if self.exp.loss.kl_coef > 0:
      target["ref"] = self.train_step.abstract_state().params
    return target


def build(exp: exp_lib.Experiment) -> Components:
  """Builds every part of the run described by a validated `exp`."""
  mesh = sharding.make_mesh(exp.mesh.shape(jax.device_count()))
  rows = mesh.shape["data"] * mesh.shape["fsdp"]
  tokenizer, renderer = exp_lib.make_tokenizer(exp)
  exp = exp_lib.fit_vocab(exp, tokenizer)
  model = exp_lib.make_model(exp, mesh)
  factory = exp_lib.make_factory(exp)
  objective = PolicyObjective(exp.loss, temperature=exp.sampling.temperature)
  train_step = TrainStep(model, objective, exp.optim, mesh=mesh, step_cfg=exp.step)
  shapes = shapes_lib.plan_shapes(exp, rows, rows)
  batch_cfg = BatchConfig(
      packing=exp.rl.packing, length_buckets=exp.rl.length_buckets,
      row_buckets=shapes.train_rows, row_multiple=rows, pad_id=tokenizer.pad_id,
      zero_variance_filter=exp.rl.zero_variance_filter, keep_kl=exp.loss.kl_coef > 0)
  sampler = Sampler(exp.model, mesh=mesh, batch_buckets=shapes.sampler_rows,
                    prompt_buckets=shapes.prompt_lens)
  policy = TimedPolicy(sampler, None, exp.sampling, stop_ids=renderer.fmt.stop_ids,
                       pad_id=tokenizer.pad_id)
  transition = EnvTransition(renderer, exp.tree.num_agents, limits=exp.limits,
                             reward_cfg=exp.reward)
  evaluator = Evaluator(sampler, renderer, transition, factory, exp.tree, exp.sampling,
                        success_threshold=exp.eval.success_threshold)
  census = metrics_lib.CompileCensus()
  census.register("sampler", sampler)
  census.register("train_step", train_step)
  return Components(
      exp=exp, mesh=mesh, tokenizer=tokenizer, renderer=renderer, model=model,
      factory=factory, train_tasks=exp_lib.make_task_source(exp, exp.train_split),
      eval_tasks=exp_lib.make_task_source(exp, exp.eval_split), train_step=train_step,
      shapes=shapes, batch_cfg=batch_cfg, sampler=sampler, policy=policy,
      transition=transition, evaluator=evaluator, census=census,
      key=jax.random.PRNGKey(exp.seed))
