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
`remat`, `attention`, `embed_init` and the dtypes are the top-level model's for every agent.

An agent's tokenizer: with `tokenizer.kind='hf'` an agent from a checkpoint
reads that directory's tokenizer.json when it has one (its own vocabulary),
else the top-level `model.path`'s; with the byte tokenizer every agent shares
it. Every agent renders in `tokenizer.chat_format`.

Validation reads each agent's checkpoint once (`read_checkpoints`: its
config.json, whether it holds a tokenizer.json), works the groups out from
that (`team_groups`) and keeps a team's in `exp.agents.team`; the composition
root, the exports and `is_team` read them there.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Optional

from mtrl_jax.models.config import ModelConfig, get_preset

if TYPE_CHECKING:
  from mtrl_jax.run.experiment import Experiment


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


@dataclasses.dataclass(frozen=True)
class Checkpoints:
  """What the agents' checkpoints (`agents.paths`) say, read once (`read_checkpoints`).

  Attributes:
    archs: per agent its checkpoint's config.json architecture as written (None for
      an agent without a checkpoint).
    tokenizer_dirs: per agent the directory its HF tokenizer is read from ('' for
      the byte tokenizer).
  """

  archs: tuple[Optional[ModelConfig], ...]
  tokenizer_dirs: tuple[str, ...]


def read_checkpoints(exp: Experiment) -> Checkpoints:
  """Reads each agent checkpoint's config.json and looks for its tokenizer.json."""
  paths = exp.agents.paths or ("",) * exp.tree.num_agents
  return Checkpoints(
      tuple(ModelConfig.from_hf_json(p) if p else None for p in paths),
      tuple(_tokenizer_dir(exp, p) for p in paths),
  )


def _tokenizer_dir(exp: Experiment, path: str) -> str:
  """The directory the HF tokenizer of an agent from checkpoint `path` ('': none) is read
  from ('' for the byte tokenizer)."""
  if exp.tokenizer.kind != "hf":
    return ""
  if path and os.path.isfile(os.path.join(path, "tokenizer.json")):
    return path
  return exp.model.path


def agent_arch(exp: Experiment, a: int, read: Checkpoints) -> ModelConfig:
  """Agent `a`'s architecture (see the module docstring); `read`: the agents'
  checkpoints."""
  m = exp.model.arch
  same = dict(
      remat=m.remat,
      attention=m.attention,
      dtype=m.dtype,
      param_dtype=m.param_dtype,
      embed_init=m.embed_init,  # how a preset built from scratch draws its embedding
  )
  preset = exp.agents.presets[a] if exp.agents.presets else ""
  if read.archs[a] is not None:
    return read.archs[a].replace(value_head=m.value_head, **same)
  if preset:
    return get_preset(preset).replace(vocab_size=m.vocab_size, value_head=m.value_head, **same)
  return m


def agent_groups(exp: Experiment, read: Optional[Checkpoints] = None) -> list[AgentGroup]:
  """The agents' groups in order of their first agent; one group of every agent when all
  share the top-level architecture and tokenizer (and for a shared policy). `read`:
  the agents' checkpoints (None: read them now)."""
  n = exp.tree.num_agents
  if exp.agents.share_policy:
    return [AgentGroup(tuple(range(n)), exp.model.arch, _tokenizer_dir(exp, ""))]
  read = read_checkpoints(exp) if read is None else read
  keys: dict = {}
  for a in range(n):
    keys.setdefault((agent_arch(exp, a, read), read.tokenizer_dirs[a]), []).append(a)
  return [AgentGroup(tuple(agents), arch, tok) for (arch, tok), agents in keys.items()]


def team_groups(exp: Experiment, read: Optional[Checkpoints] = None) -> tuple[AgentGroup, ...]:
  """The groups of a team of several architectures (`agent_groups`), or () when every
  agent has the top-level model's architecture and tokenizer (and for a shared
  policy): validation's answer, kept as `exp.agents.team`."""
  if exp.agents.share_policy:
    return ()
  groups = agent_groups(exp, read)
  top = (exp.model.arch, exp.model.path if exp.tokenizer.kind == "hf" else "")
  if len(groups) > 1 or (groups[0].arch, groups[0].tokenizer_dir) != top:
    return tuple(groups)
  return ()


def is_team(exp: Experiment) -> bool:
  """Whether some agent's architecture or tokenizer is not the top-level model's: the
  agents are then trained as a team of groups (`train.team`), one program each."""
  return bool(exp.agents.team)


def agent_tokenizer_dir(exp: Experiment, a: int) -> str:
  """The directory agent `a`'s HF tokenizer was read from ('' for the byte tokenizer):
  its team group's, else the top-level model's."""
  for group in exp.agents.team:
    if a in group.agents:
      return group.tokenizer_dir
  return exp.model.path if exp.tokenizer.kind == "hf" else ""
