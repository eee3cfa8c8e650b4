"""Which agents share a program: each agent's architecture and tokenizer, grouped.

With one policy per agent (`agents.share_policy=False`) every agent's model
comes from its `agents.paths` entry (a checkpoint), its `agents.presets`
entry (from scratch), or the top-level `model`. Agents whose architecture and
tokenizer are equal form one group: their train states are stacked and one
program updates them (`train.stacked`), one engine parameter set samples for
them. A team of several groups (agents of different widths, depths or
vocabularies) gets one engine and one update program per group
(`train.team`).

An agent's architecture:
  path     the checkpoint's config.json;
  preset   the preset, with the top-level model's vocabulary (the tokenizer is
           the run's: a from-scratch model's vocabulary is fitted to it);
  neither  the top-level model's.
`remat`, `attention` and the dtypes are the top-level model's for every agent.

An agent's tokenizer: with `tokenizer.kind='hf'` an agent from a checkpoint
reads that directory's tokenizer.json when it has one (its own vocabulary),
else the top-level `model.path`'s; with the byte tokenizer every agent shares
it. Every agent renders in `tokenizer.chat_format`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from mtrl_jax.models.config import ModelConfig, get_preset

if TYPE_CHECKING:
  from mtrl_jax.train.experiment import Experiment


@dataclasses.dataclass(frozen=True)
class AgentGroup:
  """Agents that share an architecture and a tokenizer.

  Attributes:
    agents: the agents' indices in the team, ascending.
    arch: their architecture.
    tokenizer_dir: the directory of their HF tokenizer ('' for the byte
      tokenizer, or the top-level model's when it is `model.path`).
  """

  agents: tuple[int, ...]
  arch: ModelConfig
  tokenizer_dir: str


def agent_arch(exp: Experiment, a: int) -> ModelConfig:
  """Agent `a`'s architecture (see the module docstring)."""
  m = exp.model.arch
  same = dict(remat=m.remat, attention=m.attention, dtype=m.dtype, param_dtype=m.param_dtype)
  path = exp.agents.paths[a] if exp.agents.paths else ""
  preset = exp.agents.presets[a] if exp.agents.presets else ""
  if path:
    return ModelConfig.from_hf_json(path).replace(value_head=m.value_head, **same)
  if preset:
    return get_preset(preset).replace(vocab_size=m.vocab_size, value_head=m.value_head, **same)
  return m


def tokenizer_dir(exp: Experiment, a: int) -> str:
  """The directory agent `a`'s HF tokenizer is read from ('' for the byte tokenizer)."""
  if exp.tokenizer.kind != "hf":
    return ""
  path = exp.agents.paths[a] if exp.agents.paths else ""
  if path and os.path.isfile(os.path.join(path, "tokenizer.json")):
    return path
  return exp.model.path


def agent_groups(exp: Experiment) -> list[AgentGroup]:
  """The team's groups in order of their first agent; one group of every agent when all
  share the top-level architecture and tokenizer (and for a shared policy)."""
  n = exp.tree.num_agents
  if exp.agents.share_policy:
    return [AgentGroup(tuple(range(n)), exp.model.arch, tokenizer_dir(exp, 0))]
  keys: dict = {}
  for a in range(n):
    keys.setdefault((agent_arch(exp, a), tokenizer_dir(exp, a)), []).append(a)
  return [AgentGroup(tuple(agents), arch, tok) for (arch, tok), agents in keys.items()]


def is_team(exp: Experiment) -> bool:
  """Whether some agent's architecture or tokenizer is not the top-level model's: the
  agents are then trained as a team of groups (`train.team`), one program each."""
  groups = agent_groups(exp)
  top = (exp.model.arch, exp.model.path if exp.tokenizer.kind == "hf" else "")
  return len(groups) > 1 or (groups[0].arch, groups[0].tokenizer_dir) != top
