"""The composition root of a run: every long-lived part, built once from an `Experiment`.

`build(exp)` makes the mesh, tokenizer and renderer, model, the policies
(`train.policies`: one shared, or one per agent stacked, with their train
step), environment factory, task sources, the rollout engine (and the policy
over it), transition, shape plan, batch config and the `Evaluator` shared by
the SFT stop check and held-out evaluation. The RL loop (`run.rl`), the SFT
warm-up (`run.warmup.warm_up`) and the saved-policy tools (`run.saved`) all
take their parts from here, so a part is built one way only. The `make_*`
builders are the pieces `build` uses; the tokenizer, renderer and task-source
ones live in `run.builders`, below both this module and validation
(`run.experiment`, `run.checks`), which builds each once to check that it
works.

`build` takes the experiment as validation left it (a from-scratch model's
vocabulary fitted to the tokenizer) and never changes it. Nothing here
compiles or writes a file: programs compile on first use (or in
`shapes.precompile`), files are the loop's business.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, Optional

import jax

from mtrl_jax import data, distributed, sharding
from mtrl_jax import metrics as metrics_lib
from mtrl_jax.envs import resolve_factory
from mtrl_jax.envs.reward import check_reward_dominance
from mtrl_jax.rollout.batching import BatchConfig
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.rollout.policy import EnginePolicy, TeamPolicy
from mtrl_jax.rollout.workers import StepWorkers
from mtrl_jax.run import shapes as shapes_lib
from mtrl_jax.run.builders import make_level_source, make_renderer, make_task_source, make_tokenizer
from mtrl_jax.run.evaluate import Evaluator
from mtrl_jax.sampling import DecodeEngine
from mtrl_jax.train.frozen_agents import PartlyFrozenTrainStep
from mtrl_jax.train.objectives import PolicyObjective
from mtrl_jax.train.policies import Policies, SharedPolicy, StackedPolicies
from mtrl_jax.train.separate_critic import SeparateCritic, make_critic_model
from mtrl_jax.train.stacked import StackedTrainStep
from mtrl_jax.train.step import TrainStep
from mtrl_jax.train.team import TeamPolicies

if TYPE_CHECKING:
  from mtrl_jax.run.experiment import Experiment


@dataclasses.dataclass
class Components:
  """The parts of one run (see the module docstring)."""

  exp: Experiment
  mesh: Any
  tokenizer: Any
  renderer: Any
  model: Any  # the top-level model: the architecture, and the shared policy's start
  policies: Policies  # models, train step, state and checkpoint layout
  factory: Any
  train_tasks: Any
  eval_tasks: Any
  shapes: shapes_lib.ShapePlan
  batch_cfg: BatchConfig
  # Decode slots shared by training rollouts and evaluations: one engine, or one per
  # group of a team of several architectures (`train.team`).
  engines: tuple[DecodeEngine, ...]
  rollout_policy: Any  # `EnginePolicy`, or `TeamPolicy` over the engines (training rollouts)
  transition: EnvTransition
  # Where environment steps run (`env.workers`): one pool for the run, its rollouts and
  # evaluations; the RL loop closes it at the end.
  workers: StepWorkers
  evaluator: Evaluator
  census: metrics_lib.CompileCensus  # compile counts of the run's jitted programs
  key: jax.Array  # PRNGKey(seed): per-step keys are fold_in(key, step)
  critic: Optional[SeparateCritic] = None  # a critic model of its own (critic.model)

  def compile_targets(self, params) -> tuple[list, list]:
    """What `shapes.precompile` compiles with the policies' `params`: (engine, the
    parameters it samples with, number of stop ids) per engine, and the update programs
    that train (none for a team's group of frozen agents)."""
    engines = self.rollout_policy.compile_targets(self.policies.sampler_states(params))
    return engines, self.policies.trained_steps()


def make_model(exp: Experiment, mesh, path: str = ""):
  """The policy model: from `path` (an agent's checkpoint), `model.path`, or the preset."""
  from mtrl_jax import models

  if path or exp.model.path:
    from mtrl_jax.models import loading

    return loading.from_pretrained(
        path or exp.model.path, mesh=mesh, value_head=exp.model.arch.value_head
    )
  return models.create_model(exp.model.arch, seed=exp.seed, mesh=mesh)


def make_factory(exp: Experiment):
  """The environment factory; warns when the reward weights let penalties or
  shaping outweigh the outcome range the factory declares."""
  factory = resolve_factory(exp.env.factory, **dict(exp.env.kwargs))
  steps = exp.env.limits.max_turns or 1
  with warnings.catch_warnings():
    warnings.simplefilter("always")
    # max_invalid=1: a success after one rejected call must beat failing fast
    # (a success with an invalid call on every step need not).
    check_reward_dominance(
        exp.reward,
        max_steps=steps,
        max_invalid=1,
        outcome_range=factory.outcome_range,
        max_graded=factory.max_graded_turns(dict(exp.tasks.kwargs)),
    )
  return factory


def make_train_stream(exp: Experiment, train_tasks):
  """The RL loop's task stream: a `data.CurriculumStream` when `curriculum.enabled`,
  else a `data.TaskStream` over `train_tasks`. Both checkpoint via state()/restore()."""
  if exp.curriculum.enabled:
    return data.CurriculumStream(
        lambda level: make_level_source(exp.tasks, exp.curriculum, level),
        exp.curriculum,
        seed=exp.seed,
    )
  return data.TaskStream(train_tasks, seed=exp.seed)


def make_policies(exp: Experiment, model, mesh, team=None, team_tokenizers=()) -> Policies:
  """The shared policy, or one policy per agent (each from its `agents.paths` entry or
  the top-level model), with the train step that updates them (frozen agents,
  `agents.trainable`: `train.frozen_agents`). With `model.lora` the step trains adapters
  over `model` (`models.lora.attach`), the policies' base. `team`: the groups of a team
  of several architectures (`exp.agents.team`, `run.groups`), each stacked on its own
  (`train.team`; each group's adapters over its own base), with each group's
  tokenizer in `team_tokenizers`."""
  # Several updates per batch, or rollouts a step behind: the clipped ratio uses
  # the trainer's own old logprobs (the loop adds them), the sampler's enter only
  # loss.is_correction.
  objective = PolicyObjective(
      exp.loss,
      temperature=exp.sampling.temperature,
      recompute_old=exp.rl.updates_per_step > 1 or exp.rl.max_staleness > 0,
      value_coef=exp.critic.value_coef if exp.critic.head else None,
      value_clip=exp.critic.value_clip,
  )
  trained = model
  if exp.model.lora.enabled:
    from mtrl_jax.models import lora

    trained = lora.attach(model, exp.model.lora, seed=exp.seed)
  if exp.agents.share_policy:
    step = TrainStep(trained, objective, exp.optim, mesh=mesh, step_cfg=exp.step)
    return SharedPolicy([model], step, seed=exp.seed)
  n = exp.tree.num_agents
  paths = exp.agents.paths or ("",) * n
  if team is None:
    models = [make_model(exp, mesh, path=p) if p else model for p in paths]
    return _stacked(exp, objective, trained, models, range(n), mesh)
  groups = []
  for group in team:
    models = [_agent_model(exp, mesh, a, group.arch, model) for a in group.agents]
    trained = models[0]
    if exp.model.lora.enabled:
      from mtrl_jax.models import lora

      trained = lora.attach(models[0], exp.model.lora, seed=exp.seed)
    groups.append(_stacked(exp, objective, trained, models, group.agents, mesh))
  return TeamPolicies(groups, [t.pad_id for t in team_tokenizers], seed=exp.seed)


def _stacked(exp: Experiment, objective, trained, models, agents, mesh) -> StackedPolicies:
  """The stacked policies of `agents` (team indices) over `trained` (their shared
  architecture, adapters attached) with their own starting `models`."""
  agents = tuple(agents)
  every = exp.agents.learning_rates or (exp.optim.learning_rate,) * exp.tree.num_agents
  rates = [every[a] for a in agents]
  trainable = [exp.agents.trainable[a] for a in agents] if exp.agents.trainable else []
  if all(trainable):  # every agent trains (empty: the default)
    step = StackedTrainStep(trained, objective, exp.optim, rates, mesh=mesh, step_cfg=exp.step)
  else:  # a team's group may be all frozen: it acts, and is never updated
    step = PartlyFrozenTrainStep(
        trained,
        objective,
        exp.optim,
        rates,
        trainable,
        mesh=mesh,
        step_cfg=exp.step,
        some_trained=len(agents) == exp.tree.num_agents,  # a team: checked by validation
    )
  return StackedPolicies(models, step, seed=exp.seed, agents=agents)


def _agent_model(exp: Experiment, mesh, a: int, arch, model):
  """Agent `a`'s starting model in a team: its checkpoint, its preset from scratch (the
  run's seed), or the top-level `model`."""
  from mtrl_jax import models

  path = exp.agents.paths[a] if exp.agents.paths else ""
  if path:
    return make_model(exp, mesh, path=path)
  if arch == exp.model.arch:
    return model
  return models.create_model(arch, seed=exp.seed, mesh=mesh)


def _group_tokenizer(exp: Experiment, group, tokenizer):
  """A team group's tokenizer: the run's, or its agents' checkpoint's (`run.groups`);
  its vocabulary must fit the group's architecture."""
  tok = tokenizer if group.tokenizer_dir == exp.model.path else None
  if tok is None:
    tok = make_tokenizer(exp.tokenizer, group.tokenizer_dir)
  if tok.vocab_size > group.arch.vocab_size:
    raise ValueError(
        f"agent {group.agents[0]}'s tokenizer vocab_size={tok.vocab_size} exceeds its "
        f"model's vocab_size={group.arch.vocab_size}; allowed: a checkpoint (agents.paths) "
        "whose vocabulary holds its tokenizer's"
    )
  return tok


def _engine_groups(exp: Experiment, team, tokenizer, renderer):
  """(members, archs, tokenizers, renderers): one entry per decode engine, the agents it
  samples for and their architecture, tokenizer and renderer (one engine for every agent
  without a team; one per group with one)."""
  if team is None:
    return [tuple(range(exp.tree.num_agents))], [exp.model.arch], [tokenizer], [renderer]
  tokenizers = [_group_tokenizer(exp, g, tokenizer) for g in team]
  renderers = [renderer if t is tokenizer else make_renderer(exp.tokenizer, t) for t in tokenizers]
  return [g.agents for g in team], [g.arch for g in team], tokenizers, renderers


def _rollout_policy(exp: Experiment, engines, members, tokenizers, renderers, fanout: int):
  """The policy the tree samples from: one engine's, or a team's over one per group."""
  engine_policies = [
      EnginePolicy(e, None, exp.sampling, stop_ids=r.fmt.stop_ids, pad_id=t.pad_id, fanout=fanout)
      for e, r, t in zip(engines, renderers, tokenizers)
  ]
  if not exp.agents.team:
    return engine_policies[0]
  return TeamPolicy(engine_policies, members)


def _batch_config(exp: Experiment, shapes, rows: int, pad_id: int) -> BatchConfig:
  """The tree -> batch settings of the run: its length and row buckets (`shapes`), rows a
  multiple of this process's batch shards (`rows`)."""
  return BatchConfig(
      packing=exp.rl.packing,
      length_buckets=exp.rl.length_buckets,
      row_buckets=shapes.train_rows,
      row_multiple=rows,
      pad_id=pad_id,
      # With a critic every valid sample trains: its value target teaches the critic.
      zero_variance_filter=exp.rl.zero_variance_filter and not exp.critic.enabled,
      keep_kl=exp.loss.kl_coef > 0,
      values=exp.critic.target if exp.critic.head else None,
  )


def build(exp: Experiment) -> Components:
  """Builds every part of the run described by a validated `exp`."""
  mesh = sharding.make_mesh(exp.mesh.shape(jax.device_count()))  # every process's devices
  # Rows each process brings to a batch: a multiple of its own batch shards.
  rows = distributed.local_batch_shards(mesh)
  tokenizer = make_tokenizer(exp.tokenizer, exp.model.path)
  if tokenizer.vocab_size > exp.model.arch.vocab_size:  # a checkpoint's own tokenizer
    raise ValueError(
        f"tokenizer vocab_size={tokenizer.vocab_size} exceeds the model's "
        f"vocab_size={exp.model.arch.vocab_size}"
    )
  renderer = make_renderer(exp.tokenizer, tokenizer)
  model = make_model(exp, mesh)
  factory = make_factory(exp)
  team = list(exp.agents.team) or None
  members, archs, tokenizers, renderers = _engine_groups(exp, team, tokenizer, renderer)
  policies = make_policies(exp, model, mesh, team, tokenizers)
  shapes = shapes_lib.plan_shapes(
      shapes_lib.per_process(exp, distributed.process_count()), rows, rows
  )
  batch_cfg = _batch_config(exp, shapes, rows, tokenizer.pad_id)
  stacked = team is not None or not exp.agents.share_policy
  engines = tuple(
      DecodeEngine(arch, shapes.engine, mesh=mesh, num_agents=len(m) if stacked else 1)
      for arch, m in zip(archs, members)
  )
  rollout_policy = _rollout_policy(exp, engines, members, tokenizers, renderers, shapes.fanout)
  agent_renderers = [None] * exp.tree.num_agents
  for m, r in zip(members, renderers):
    for a in m:
      agent_renderers[a] = r
  transition = EnvTransition(
      agent_renderers,
      exp.tree.num_agents,
      limits=exp.env.limits,
      reward_cfg=exp.reward,
      outcome_range=factory.outcome_range,
  )
  workers = StepWorkers(exp.env.workers, exp.env.max_concurrency, transition)
  evaluator = Evaluator(
      rollout_policy,
      transition,
      factory,
      exp.tree,
      exp.sampling,
      success_threshold=exp.eval.success_threshold,
      workers=workers,
  )
  census = metrics_lib.CompileCensus()
  for g, engine in enumerate(engines):
    census.register("engine" if g == 0 else f"engine_{g}", engine)
  census.register("train_step", policies.train_step)
  critic = None
  if exp.critic.separate:
    critic = SeparateCritic(
        exp, make_critic_model(exp, mesh, tokenizer.vocab_size), mesh, batch_cfg
    )
    census.register("critic_step", critic.step)
  return Components(
      exp=exp,
      mesh=mesh,
      tokenizer=tokenizer,
      renderer=renderer,
      model=model,
      policies=policies,
      factory=factory,
      train_tasks=make_task_source(exp.tasks, exp.tasks.train_split),
      eval_tasks=make_task_source(exp.tasks, exp.tasks.eval_split),
      shapes=shapes,
      batch_cfg=batch_cfg,
      engines=engines,
      rollout_policy=rollout_policy,
      transition=transition,
      workers=workers,
      evaluator=evaluator,
      census=census,
      key=jax.random.PRNGKey(exp.seed),
      critic=critic,
  )
