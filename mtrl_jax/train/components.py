"""The composition root of a run: every long-lived part, built once from an `Experiment`.

`build(exp)` makes the mesh, tokenizer and renderer, model, environment
factory, task sources, the rollout engine (and the policy over it),
transition, train step, shape plan, batch config and the `Evaluator` shared
by the SFT stop check and held-out evaluation. The RL loop (`train.rl`), the SFT warm-up
(`train.sft.warm_up`) and the saved-policy tools (`train.saved`) all take
their parts from here, so a part is built one way only.

Nothing here compiles or writes a file: programs compile on first use (or in
`shapes.precompile`), files are the loop's business.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from mtrl_jax import distributed, metrics as metrics_lib, sharding
from mtrl_jax.rollout.batching import (BatchConfig, global_batch, make_agent_batches,
                                       make_train_batch)
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.rollout.policy import EnginePolicy, StackedStates
from mtrl_jax.sampling import DecodeEngine
from mtrl_jax.train import experiment as exp_lib
from mtrl_jax.train import shapes as shapes_lib
from mtrl_jax.train.evaluate import Evaluator
from mtrl_jax.train.objectives import PolicyObjective
from mtrl_jax.train.stacked import StackedTrainStep, agent_slice, stack_trees
from mtrl_jax.train.step import TrainStep


@dataclasses.dataclass
class Components:
  """The parts of one run (see the module docstring)."""

  exp: exp_lib.Experiment  # vocabulary fitted to the tokenizer
  mesh: Any
  tokenizer: Any
  renderer: Any
  model: Any
  models: list  # one per policy: [model] when shared, one per agent when separate
  factory: Any
  train_tasks: Any
  eval_tasks: Any
  train_step: Any  # TrainStep (shared policy) or StackedTrainStep (one policy per agent)
  shapes: shapes_lib.ShapePlan
  batch_cfg: BatchConfig
  engine: DecodeEngine  # decode slots shared by training rollouts and evaluations
  policy: EnginePolicy  # the engine with the policy's parameters (training rollouts)
  transition: EnvTransition
  evaluator: Evaluator
  census: metrics_lib.CompileCensus  # compile counts of the run's jitted programs
  key: jax.Array  # PRNGKey(seed): per-step keys are fold_in(key, step)

  @property
  def row_multiple(self) -> int:
    """Rows of every batch divide evenly over the data-parallel devices."""
    return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

  @property
  def separate(self) -> bool:
    """One policy per agent (stacked state) rather than one shared policy."""
    return not self.exp.agents.share_policy

  def init_state(self, params=None):
    """A fresh train state from `params` (every agent's start) or the built models."""
    seed = self.exp.seed
    if not self.separate:
      return self.train_step.init_state(self.model if params is None else params, seed=seed)
    starts = self.models if params is None else [params] * len(self.models)
    return self.train_step.init_state(starts, seed=seed)

  def policy_states(self, params):
    """What the engine samples with: the shared params, or every agent's stacked (one
    engine program for all agents)."""
    if not self.separate:
      return params
    return StackedStates(params, len(self.models))

  def policy_states_of_one(self, params):
    """`policy_states` of one policy's params acting for every agent (the SFT warm-up's
    check, before the agents part ways)."""
    if not self.separate:
      return params
    return StackedStates(stack_trees([params] * len(self.models)), len(self.models))

  def make_batch(self, tree):
    """The train batch of a tree: one batch, or one per agent stacked on axis 0.
    With several processes, `tree` is this process's share and the batch global."""
    batch, m = (make_agent_batches if self.separate else make_train_batch)(tree, self.batch_cfg)
    if distributed.process_count() == 1:
      return batch, m
    return global_batch(batch, m, self.batch_cfg, self.mesh)

  def train_metrics(self, device_metrics) -> dict:
    """`train/<name>`; with separate policies also `agent_<a>/train/<name>`, and
    `train/<name>` is the mean over agents."""
    m = self.train_step.fetch_metrics(device_metrics)
    if not self.separate:
      return {f"train/{k}": v for k, v in m.items()}
    out = {f"train/{k}": float(sum(r[k] for r in m) / len(m)) for k in m[0]}
    for a, row in enumerate(m):
      out.update({f"agent_{a}/train/{k}": v for k, v in row.items()})
    return out

  # ------------------------------------------------------------ checkpoints
  # Separate policies save one subtree per agent ({"agent_0": ..., "agent_1": ...}).
  def to_saved(self, state):
    if not self.separate:
      return state
    return {f"agent_{a}": agent_slice(state, a) for a in range(len(self.models))}

  def from_saved(self, saved):
    if not self.separate:
      return saved
    return self.train_step.stack([saved[f"agent_{a}"] for a in range(len(self.models))])

  def state_target(self):
    """Abstract tree of a saved train state (the best checkpoint holds one)."""
    if not self.separate:
      return self.train_step.abstract_state()
    one = self.train_step.inner.abstract_state()
    return {f"agent_{a}": one for a in range(len(self.models))}

  def _param_trees(self) -> list[str]:
    """Parameter trees a latest-N checkpoint holds beside the train state: the frozen
    reference (KL on) and the next rollout's behaviour parameters (max_staleness 1)."""
    return (["ref"] * (self.exp.loss.kl_coef > 0)
            + ["behaviour"] * (self.exp.rl.max_staleness > 0))

  def checkpoint_target(self) -> dict:
    """Abstract tree of a latest-N checkpoint: {"train": state[, "ref"][, "behaviour"]}."""
    target = {"train": self.state_target()}
    params = jax.tree.map(lambda s: s.params, self.state_target(),
                          is_leaf=lambda x: hasattr(x, "opt_state"))
    target.update({name: params for name in self._param_trees()})
    return target

  def checkpoint_tree(self, state, ref, behaviour=None) -> dict:
    tree = {"train": self.to_saved(state)}
    for name, params in (("ref", ref), ("behaviour", behaviour)):
      if name in self._param_trees():
        tree[name] = params if not self.separate else {
            f"agent_{a}": agent_slice(params, a) for a in range(len(self.models))}
    return tree

  def from_checkpoint(self, restored) -> tuple[Any, Any, Any]:
    """(train state, reference params, behaviour params; None where not kept) of a
    restored latest-N checkpoint."""
    state = self.from_saved(restored["train"])
    out = []
    for name in ("ref", "behaviour"):
      params = restored.get(name)
      if params is not None and self.separate:
        params = self.train_step.copy_params(
            jax.tree.map(lambda *x: jax.numpy.stack(x),
                         *[params[f"agent_{a}"] for a in range(len(self.models))]))
      out.append(params)
    return (state, *out)


def build(exp: exp_lib.Experiment) -> Components:
  """Builds every part of the run described by a validated `exp`."""
  mesh = sharding.make_mesh(exp.mesh.shape(jax.device_count()))  # every process's devices
  # Rows each process brings to a batch: a multiple of its own batch shards.
  rows = distributed.local_batch_shards(mesh)
  tokenizer, renderer = exp_lib.make_tokenizer(exp)
  exp = exp_lib.fit_vocab(exp, tokenizer)
  model = exp_lib.make_model(exp, mesh)
  factory = exp_lib.make_factory(exp)
  # Several updates per batch, or rollouts a step behind: the clipped ratio uses
  # the trainer's own old logprobs (the loop adds them), the sampler's enter only
  # loss.is_correction.
  objective = PolicyObjective(exp.loss, temperature=exp.sampling.temperature,
                              recompute_old=exp.rl.updates_per_step > 1
                              or exp.rl.max_staleness > 0)
  if exp.agents.share_policy:
    models = [model]
    train_step = TrainStep(model, objective, exp.optim, mesh=mesh, step_cfg=exp.step)
  else:
    n = exp.tree.num_agents
    paths = exp.agents.paths or ("",) * n
    models = [exp_lib.make_model(exp, mesh, path=p) if p else model for p in paths]
    rates = exp.agents.learning_rates or (exp.optim.learning_rate,) * n
    train_step = StackedTrainStep(model, objective, exp.optim, rates, mesh=mesh,
                                  step_cfg=exp.step)
  shapes = shapes_lib.plan_shapes(shapes_lib.per_process(exp, distributed.process_count()),
                                  rows, rows)
  batch_cfg = BatchConfig(
      packing=exp.rl.packing, length_buckets=exp.rl.length_buckets,
      row_buckets=shapes.train_rows, row_multiple=rows, pad_id=tokenizer.pad_id,
      zero_variance_filter=exp.rl.zero_variance_filter, keep_kl=exp.loss.kl_coef > 0)
  engine = DecodeEngine(exp.model, shapes.engine, mesh=mesh,
                        num_agents=1 if exp.agents.share_policy else exp.tree.num_agents)
  policy = EnginePolicy(engine, None, exp.sampling, stop_ids=renderer.fmt.stop_ids,
                        pad_id=tokenizer.pad_id, fanout=shapes.fanout)
  transition = EnvTransition(renderer, exp.tree.num_agents, limits=exp.limits,
                             reward_cfg=exp.reward)
  evaluator = Evaluator(engine, renderer, transition, factory, exp.tree, exp.sampling,
                        success_threshold=exp.eval.success_threshold)
  census = metrics_lib.CompileCensus()
  census.register("engine", engine)
  census.register("train_step", train_step)
  return Components(
      exp=exp, mesh=mesh, tokenizer=tokenizer, renderer=renderer, model=model, models=models,
      factory=factory, train_tasks=exp_lib.make_task_source(exp, exp.train_split),
      eval_tasks=exp_lib.make_task_source(exp, exp.eval_split), train_step=train_step,
      shapes=shapes, batch_cfg=batch_cfg, engine=engine, policy=policy,
      transition=transition, evaluator=evaluator, census=census,
      key=jax.random.PRNGKey(exp.seed))
