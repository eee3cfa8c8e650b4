"""The policies a run trains: one shared by every agent, or one per agent, stacked.

`agents.share_policy=True` gives a `SharedPolicy`: one model, one `TrainStep`,
role prompts telling the agents apart. False gives `StackedPolicies`
(`train/stacked.py`): one train state per agent stacked on a leading agent
axis, updated by one `StackedTrainStep` program, sampled by one engine with a
KV pool per agent. Both answer the same questions, so the RL loop, the SFT
warm-up, checkpoints and saved runs never ask which one they hold:

  init_state(params=None)    a fresh train state (from `params`, or the built models)
  sampler_states(params)     what the rollout engine samples with
  one_for_all(params)        one policy's params acting for every agent
  make_batch(tree, cfg)      the train batch of a tree (one per agent, stacked)
  train_metrics(m)           `train/<name>` (and `agent_<a>/train/<name>`)
  to_saved(tree)             a state or params in the checkpoint layout
  state_from_saved(saved)    ... and back; also `params_from_saved`
  saved_state_target()       the abstract saved state (a restore target)
  per_policy(params)         one parameter tree per policy (export, `models()`)
  agent_params(params)       one policy's params each, unmerged (adapters: PEFT export)
  warm_starts(model)         (model, agent) of each start the SFT warm-up trains
  warmed(params)             those starts' trained params, as `init_state` and
                             `one_for_all` take them
  trained_steps()            the update programs that train (what start-up precompiles)

Checkpoint layout: a shared policy saves its tree as it is; stacked policies
save one subtree per agent, {"agent_0": ..., "agent_1": ...}. A team of several
architectures (`train.team.TeamPolicies`) is one `StackedPolicies` per group of
agents and saves the same layout.

Frozen agents (`agents.trainable`, `train.frozen_agents`): a frozen agent acts
with its own weights and never updates. It starts from its own model even
after an SFT warm-up (the warm-up trains the shared start of the trained agents
only, and its stop check samples the frozen agents with their own weights);
its samples are left out of the packed batch (its stacked rows are padding,
which the update never reads); it has no `agent_<a>/train/*` or
`agent_<a>/batch/*` metrics (absent, not zero), and `train/*` is the mean over
the trained agents; its saved train state has opt_state None.

With low-rank adapters (`model.lora`) a state's params are the adapters; what
the engine samples with and what is exported (`sampler_states`, `per_policy`)
are the plain weights with the adapters merged in (`TrainStep.merged`), merged
once per call, i.e. once per rollout. A fresh state's adapters start from
`model.lora.init_from` when set (`start_adapters`; read at each fresh start, never
on a resume), else fresh (B zero).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from mtrl_jax import distributed
from mtrl_jax.rollout.batching import (
    critic_values,
    global_batch,
    make_agent_batches,
    make_train_batch,
)
from mtrl_jax.rollout.policy import StackedStates
from mtrl_jax.train import export_lora
from mtrl_jax.train.stacked import agent_slice, stack_trees
from mtrl_jax.train.step import TrainState


def agent_labels(num_agents: int) -> list[str]:
  """Each agent's name in checkpoints, exports and metrics when agents have their own
  policies: agent_0, agent_1, ..."""
  return [f"agent_{a}" for a in range(num_agents)]


def without_agents(tree, trainable):
  """A view of a finalized `tree` whose frozen agents' samples (`trainable[a]` False)
  have weight 0, so batching packs none of them; `tree` itself is unchanged (its
  metrics and dumps still see every sample)."""
  frozen_Nx1 = ~np.asarray(trainable, bool)[:, None]
  view = copy.copy(tree)
  view.nodes = [
      dataclasses.replace(n, weight_NxG=np.where(frozen_Nx1, 0.0, n.weight_NxG)) for n in tree.nodes
  ]
  return view


class Policies:
  """What the two layouts share (see the module docstring).

  Attributes:
    models: one model per policy (architecture and starting weights).
    train_step: the `TrainStep` or `StackedTrainStep` updating them.
    seed: the train state's seed.
    per_agent: True when each agent has its own policy (exported per agent).
  """

  per_agent = False

  def __init__(self, models: list, train_step, seed: int):
    self.models, self.train_step, self.seed = list(models), train_step, seed

  def make_batch(self, tree, cfg, critic=None):
    """(batch | None, metrics) of a tree; with several processes `tree` is this
    process's share and the batch global. `critic`: per node (values, value targets)
    of a value critic (`critic_values`, `rollout.critic`)."""
    batch, m = self._batch(tree, cfg, critic)
    if distributed.process_count() == 1:
      return batch, m
    return global_batch(batch, m, cfg, self.train_step.mesh)

  def warm_starts(self, model) -> list[tuple]:
    """What the SFT warm-up trains: [(the run's top-level `model`, agent 0)], one shared
    start (its rows rendered as that agent's)."""
    return [(model, 0)]

  def warmed(self, params: list):
    """The SFT warm-up's trained params, one per `warm_starts` entry, as `init_state` and
    `one_for_all` take them: the one start's."""
    (one,) = params
    return one

  def trained_steps(self) -> list:
    """The update programs that train (`shapes.precompile` compiles them): the train
    step."""
    return [self.train_step]

  def start_adapters(self):
    """With `model.lora.init_from`, the adapters each policy starts from (read from its
    PEFT directory: `export_lora.init_dirs`); else None (fresh adapters)."""
    labels = self.labels if self.per_agent else []
    return export_lora.start_adapters(self.train_step.model_cfg, labels)

  def saved_params_target(self):
    """The abstract saved parameters (the reference and behaviour trees of a checkpoint)."""
    return jax.tree.map(
        lambda s: s.params, self.saved_state_target(), is_leaf=lambda x: hasattr(x, "opt_state")
    )

  def critic_values(self, params, tree, cfg) -> list:
    """A value critic's value of every sampled action of `tree` at `params`, per node
    [N, G] (one value pass: `rollout.batching.critic_values`)."""
    return critic_values(
        tree,
        cfg,
        lambda b: jax.device_get(self.train_step.values(params, b)),
        per_agent=self.per_agent,
    )

  def _batch(self, tree, cfg, critic):
    raise NotImplementedError


class SharedPolicy(Policies):
  """One policy acting for every agent."""

  def init_state(self, params=None):
    start = self.start_adapters()
    return self.train_step.init_state(
        self.models[0] if params is None else params, seed=self.seed, adapters=start and start[0]
    )

  def sampler_states(self, params):
    return self.train_step.merged(params)

  def one_for_all(self, params):
    return params

  def _batch(self, tree, cfg, critic):
    return make_train_batch(tree, cfg, critic)

  def train_metrics(self, device_metrics) -> dict:
    return {f"train/{k}": v for k, v in self.train_step.fetch_metrics(device_metrics).items()}

  def to_saved(self, tree):
    return tree

  def state_from_saved(self, saved):
    return saved

  def params_from_saved(self, saved):
    return saved

  def saved_state_target(self):
    return self.train_step.abstract_state()

  def per_policy(self, params) -> list:
    return [self.train_step.merged(params)]

  def agent_params(self, params) -> list:
    return [params]


class StackedPolicies(Policies):
  """One policy per agent, stacked on a leading agent axis.

  `agents`: the team indices of the stacked agents (empty: 0 .. A-1); a group of
  a team of several architectures (`train.team`) names its members.
  """

  per_agent = True

  def __init__(self, models: list, train_step, seed: int, agents: Sequence[int] = ()):
    super().__init__(models, train_step, seed)
    self.agents = tuple(agents) or tuple(range(len(self.models)))

  @property
  def labels(self) -> list[str]:
    """Each agent's name in checkpoints, exports and metrics."""
    return [f"agent_{a}" for a in self.agents]

  @property
  def trainable(self) -> tuple[bool, ...]:
    """Whether each agent trains (`agents.trainable`: a frozen agent acts, never updates)."""
    return getattr(self.train_step, "trainable", (True,) * len(self.models))

  def trained_steps(self) -> list:
    """The train step, or none when every agent is frozen (a team's group: it acts and is
    never updated)."""
    return [self.train_step] if any(self.trainable) else []

  def init_state(self, params=None):
    """A fresh state from every agent's model, or (after the SFT warm-up) from `params`
    for the trained agents and their own model for the frozen ones."""
    starts = (
        self.models
        if params is None
        else [params if t else m for m, t in zip(self.models, self.trainable)]
    )
    return self.train_step.init_state(starts, seed=self.seed, adapters=self.start_adapters())

  def sampler_states(self, params):
    """Every agent's stacked params: one engine program samples for all of them."""
    return StackedStates(self.train_step.merged(params), len(self.models))

  def one_for_all(self, params):
    """One policy's params as every trained agent's, a frozen agent keeping its own (the
    SFT warm-up's check, before the agents part ways)."""
    trees = [params if t else nnx.state(m, nnx.Param) for m, t in zip(self.models, self.trainable)]
    return StackedStates(stack_trees(trees), len(self.models))

  def _batch(self, tree, cfg, critic):
    batch, m, _ = self.sized_batch(tree, cfg, critic)
    return batch, m

  def sized_batch(self, tree, cfg, critic=None):
    """(batch | None, metrics, token slots) of a tree: `make_batch`'s on this process, and
    the token slots of the rows the update reads (the trained agents' rows times their
    length; 0 without a batch), whose share that is not trained is
    `batch/padding_fraction`."""
    if all(self.trainable):
      batch, m = make_agent_batches(tree, cfg, critic, agents=self.agents)
      return batch, m, _token_slots(batch, len(self.models))
    trainable = [True] * tree.cfg.num_agents  # other groups' agents are never packed here
    for a, t in zip(self.agents, self.trainable):
      trainable[a] = t
    batch, m = make_agent_batches(without_agents(tree, trainable), cfg, agents=self.agents)
    frozen = [label for label, t in zip(self.labels, self.trainable) if not t]
    m = {k: v for k, v in m.items() if not k.startswith(tuple(f"{f}/" for f in frozen))}
    if "batch/padding_fraction" in m:  # over the trained agents' rows, the ones updated
      n, t = len(self.models), sum(self.trainable)
      m["batch/padding_fraction"] = 1.0 - (1.0 - m["batch/padding_fraction"]) * n / t
    return batch, m, _token_slots(batch, sum(self.trainable))

  def train_metrics(self, device_metrics) -> dict:
    """`agent_<a>/train/<name>` per trained agent, and `train/<name>` the mean over them
    (a frozen agent has none)."""
    m = self.train_step.fetch_metrics(device_metrics)
    out = {f"train/{k}": float(sum(r[k] for r in m) / len(m)) for k in m[0]}
    trained = [label for label, t in zip(self.labels, self.trainable) if t]
    for label, row in zip(trained, m):
      out.update({f"{label}/train/{k}": v for k, v in row.items()})
    return out

  def to_saved(self, tree):
    if isinstance(tree, TrainState) and not all(self.trainable):  # opt_state: trained only
      return {label: self.train_step.agent_state(tree, a) for a, label in enumerate(self.labels)}
    return {label: agent_slice(tree, a) for a, label in enumerate(self.labels)}

  def state_from_saved(self, saved):
    return self.train_step.stack([saved[label] for label in self.labels])

  def params_from_saved(self, saved):
    return self.train_step.copy_params(stack_trees([saved[label] for label in self.labels]))

  def saved_state_target(self):
    one = self.train_step.inner.abstract_state()
    return {
        label: one if t else one.replace(opt_state=None)
        for label, t in zip(self.labels, self.trainable)
    }

  def per_policy(self, params) -> list:
    merged = self.train_step.merged(params)
    return [agent_slice(merged, a) for a in range(len(self.models))]

  def agent_params(self, params) -> list:
    return [agent_slice(params, a) for a in range(len(self.models))]


def _token_slots(batch, agents: int) -> int:
  """The token slots of `agents` agents' rows of a stacked `batch` (0 for None)."""
  return 0 if batch is None else agents * int(np.prod(batch.tokens_BxL.shape[1:]))
