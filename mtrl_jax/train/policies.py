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

Checkpoint layout: a shared policy saves its tree as it is; stacked policies
save one subtree per agent, {"agent_0": ..., "agent_1": ...}.

With low-rank adapters (`model.lora`) a state's params are the adapters; what
the engine samples with and what is exported (`sampler_states`, `per_policy`)
are the plain weights with the adapters merged in (`TrainStep.merged`), merged
once per call, i.e. once per rollout. A fresh state's adapters start from
`model.lora.init_from` when set (`start_adapters`; read at each fresh start, never
on a resume), else fresh (B zero).
"""

from __future__ import annotations

import jax

from mtrl_jax import distributed
from mtrl_jax.rollout.batching import global_batch, make_agent_batches, make_train_batch
from mtrl_jax.rollout.policy import StackedStates
from mtrl_jax.train import export_lora
from mtrl_jax.train.stacked import agent_slice, stack_trees


def agent_labels(num_agents: int) -> list[str]:
  """Each agent's name in checkpoints, exports and metrics when agents have their own
  policies: agent_0, agent_1, ..."""
  return [f"agent_{a}" for a in range(num_agents)]


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

  def make_batch(self, tree, cfg):
    """(batch | None, metrics) of a tree; with several processes `tree` is this
    process's share and the batch global."""
    batch, m = self._batch(tree, cfg)
    if distributed.process_count() == 1:
      return batch, m
    return global_batch(batch, m, cfg, self.train_step.mesh)

  def start_adapters(self):
    """With `model.lora.init_from`, the adapters each policy starts from (read from its
    PEFT directory: `export_lora.init_dirs`); else None (fresh adapters)."""
    labels = agent_labels(len(self.models)) if self.per_agent else []
    return export_lora.start_adapters(self.train_step.model_cfg, labels)

  def saved_params_target(self):
    """The abstract saved parameters (the reference and behaviour trees of a checkpoint)."""
    return jax.tree.map(lambda s: s.params, self.saved_state_target(),
                        is_leaf=lambda x: hasattr(x, "opt_state"))

  def _batch(self, tree, cfg):
    raise NotImplementedError


class SharedPolicy(Policies):
  """One policy acting for every agent."""

  def init_state(self, params=None):
    start = self.start_adapters()
    return self.train_step.init_state(self.models[0] if params is None else params,
                                      seed=self.seed, adapters=start and start[0])

  def sampler_states(self, params):
    return self.train_step.merged(params)

  def one_for_all(self, params):
    return params

  def _batch(self, tree, cfg):
    return make_train_batch(tree, cfg)

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


class StackedPolicies(Policies):
  """One policy per agent, stacked on a leading agent axis."""

  per_agent = True

  @property
  def labels(self) -> list[str]:
    """Each agent's name in checkpoints, exports and metrics."""
    return agent_labels(len(self.models))

  def init_state(self, params=None):
    starts = self.models if params is None else [params] * len(self.models)
    return self.train_step.init_state(starts, seed=self.seed, adapters=self.start_adapters())

  def sampler_states(self, params):
    """Every agent's stacked params: one engine program samples for all of them."""
    return StackedStates(self.train_step.merged(params), len(self.models))

  def one_for_all(self, params):
    """One policy's params as every agent's (the SFT warm-up's check, before the agents
    part ways)."""
    return StackedStates(stack_trees([params] * len(self.models)), len(self.models))

  def _batch(self, tree, cfg):
    return make_agent_batches(tree, cfg)

  def train_metrics(self, device_metrics) -> dict:
    """`agent_<a>/train/<name>` per agent, and `train/<name>` the mean over agents."""
    m = self.train_step.fetch_metrics(device_metrics)
    out = {f"train/{k}": float(sum(r[k] for r in m) / len(m)) for k in m[0]}
    for label, row in zip(self.labels, m):
      out.update({f"{label}/train/{k}": v for k, v in row.items()})
    return out

  def to_saved(self, tree):
    return {label: agent_slice(tree, a) for a, label in enumerate(self.labels)}

  def state_from_saved(self, saved):
    return self.train_step.stack([saved[label] for label in self.labels])

  def params_from_saved(self, saved):
    return self.train_step.copy_params(stack_trees([saved[label] for label in self.labels]))

  def saved_state_target(self):
    one = self.train_step.inner.abstract_state()
    return {label: one for label in self.labels}

  def per_policy(self, params) -> list:
    merged = self.train_step.merged(params)
    return [agent_slice(merged, a) for a in range(len(self.models))]

