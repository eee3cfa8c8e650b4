"""The base config of an ENVGRPO / ENVGSPO run, built from the config dataclasses.

`configs/base.py` (and through it every task config) and the recipe API
(`mtrl_jax.run.recipes`) start from `base_config()`; it lives in the package
so that a notebook or an installed copy has it without the repository's
`configs/` folder.

Each default is written once. A group's fields and defaults are those of its
dataclass (`GROUPS`), which documents every field; where a run wants other
values than the library's own defaults, `RUN_CHOICES` says so, each with its
reason. `tests/train/test_defaults.py` holds the base config to exactly this.
"""

from __future__ import annotations

import dataclasses
import typing

import ml_collections
from ml_collections import config_dict

from mtrl_jax import data, distributed, sharding
from mtrl_jax.envs.reward import RewardConfig
from mtrl_jax.losses import LossConfig
from mtrl_jax.rollout import TreeConfig
from mtrl_jax.run.config import (
    AgentsConfig,
    CheckpointConfig,
    EngineGroup,
    EvalConfig,
    RLConfig,
    SFTConfig,
)
from mtrl_jax.run.critic_config import CriticGroup
from mtrl_jax.run.inputs import EnvConfig, ModelGroup, TasksConfig, TokenizerConfig
from mtrl_jax.sampling import SamplingConfig
from mtrl_jax.train.optim import OptimConfig
from mtrl_jax.train.step import StepConfig

# Config group -> (its dataclass, dataclass fields that are not config fields: resolved
# by validation, or set only by library callers). The groups appear in this order.
GROUPS = {
    "model": (ModelGroup, ("arch",)),
    "tokenizer": (TokenizerConfig, ()),
    "mesh": (sharding.MeshConfig, ()),  # -1 takes the remaining devices
    "env": (EnvConfig, ()),
    "tasks": (TasksConfig, ()),
    "tree": (TreeConfig, ("team_weight",)),  # team_weight: from agents.team_weight
    "sampling": (SamplingConfig, ("greedy",)),  # greedy: evaluations set it themselves
    "engine": (EngineGroup, ()),
    "reward": (RewardConfig, ()),
    "loss": (LossConfig, ()),
    # total_steps: every RL update of the run (validation derives it); Adam's b1, b2, eps
    # keep their defaults.
    "optim": (OptimConfig, ("total_steps", "b1", "b2", "eps")),
    "step": (StepConfig, ("logprob_chunk_size", "report_entropy", "compiler_options")),
    "sft": (SFTConfig, ()),
    "rl": (RLConfig, ()),
    "eval": (EvalConfig, ()),
    "agents": (AgentsConfig, ("team",)),  # team: the agents' groups (`run.groups`)
    "critic": (CriticGroup, ()),
    "curriculum": (data.CurriculumConfig, ()),
    "checkpoint": (CheckpointConfig, ()),
    "distributed": (distributed.DistributedConfig, ()),
}

# Where a run departs from a dataclass's library default (or the dataclass has none).
RUN_CHOICES = {
    "tree": dict(
        num_turns=2,  # T: tree depth (user turns with branch_on='user_turn')
        num_generations=4,  # G: samples per agent per node
        branch_on="user_turn",  # a tool call continues its turn instead of branching
    ),
    "sampling": dict(max_new_tokens=48),  # per policy message: compact episodes stay short
    "reward": dict(
        step_penalty=-0.05,  # per environment step: shorter successful episodes win
        tool_penalty=-0.2,  # per invalid tool call / format error
    ),
    "loss": dict(
        clip_eps_high=0.28,  # clip-higher (DAPO): unlikely tokens may gain more per update
        max_len=0,  # seq-mean-token-sum-norm's length; 0: the largest rl.length_buckets entry
    ),
    "optim": dict(learning_rate=1e-4),
}


def _default(field: dataclasses.Field, hints: dict):
  if field.default is not dataclasses.MISSING:
    value = field.default
  elif field.default_factory is not dataclasses.MISSING:
    value = field.default_factory()
  else:
    raise ValueError(f"{field.name} has no default; give it one in RUN_CHOICES")
  if value is None:  # a typed placeholder, so that --config.x=y can set it
    kind = next(t for t in typing.get_args(hints[field.name]) if t is not type(None))
    return config_dict.placeholder(kind)
  return value


def group_defaults(name: str) -> dict:
  """The base config's group `name`: its dataclass's defaults, then `RUN_CHOICES`."""
  cls, internal = GROUPS[name]
  hints = typing.get_type_hints(cls)
  choices = RUN_CHOICES.get(name, {})
  return {
      f.name: choices[f.name] if f.name in choices else _default(f, hints)
      for f in dataclasses.fields(cls)
      if f.init and f.name not in internal
  }


def base_config() -> ml_collections.ConfigDict:
  """The base ConfigDict of a run; task configs override it."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # parameter init, sampling and data order all derive from it
  for name in GROUPS:
    c[name] = group_defaults(name)
  return c
