"""A team of agents of several architectures: one update program and engine per group.

Agents that share an architecture and a tokenizer form a group
(`run.groups`); each group is a `StackedPolicies` of its own (its agents
stacked, one `StackedTrainStep` or `PartlyFrozenTrainStep` program, one
`DecodeEngine` parameter set with its own stop ids and padding).
`TeamPolicies` answers the questions `train.policies.Policies` answers by
asking each group and joining the answers in team order:

  train state   `TeamState`: one stacked `TrainState` per group;
  parameters    a tuple, one stacked tree per group;
  batch         a tuple, one stacked `TrainBatch` per group (None for a group
                with nothing to train this step: its update is skipped);
  sampling      `rollout.policy.TeamStates` for a `rollout.policy.TeamPolicy`;
  checkpoints   the stacked layout, {"agent_0": ..., "agent_1": ...}, so a
                saved team restores, exports (`DIR/agent_<a>`, each agent with
                its own architecture and tokenizer) and is read by the tools
                like stacked agents.

Metrics: `agent_<a>/train/*` and `agent_<a>/batch/*` per trained agent as for
stacked agents; `train/<name>` is the mean over every trained agent of the
team; `batch/*` counts the team's rows and tokens (`batch/rows` and
`batch/length` are the largest group's).

The SFT warm-up trains one start per group (`warm_starts`: its first agent's
model, on the rows its tokenizer renders). A team cannot carry a value critic
or start from saved adapters (validation refuses each in one line,
`run.experiment.check_agents`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from flax import struct

from mtrl_jax.rollout.policy import TeamStates
from mtrl_jax.train.policies import Policies, StackedPolicies, agent_labels
from mtrl_jax.train.stacked import agent_slice


@struct.dataclass
class TeamState:
  """One stacked `TrainState` per group, in group order."""

  groups: tuple

  @property
  def params(self) -> tuple:
    """Every group's stacked parameters."""
    return tuple(s.params for s in self.groups)


class TeamTrainStep:
  """The groups' update programs, called one after another.

  Args:
    steps: one `StackedTrainStep` (or `PartlyFrozenTrainStep`) per group.
  """

  def __init__(self, steps: Sequence):
    self.steps = list(steps)
    first = self.steps[0]
    self.objective, self.mesh, self.lora = first.objective, first.mesh, first.lora

  @property
  def num_compiles(self) -> int:
    return sum(s.num_compiles for s in self.steps)

  @property
  def base(self):
    """Each group's frozen base (None without adapters)."""
    return None if self.lora is None else tuple(s.base for s in self.steps)

  @property
  def base_shardings(self):
    return tuple(s.base_shardings for s in self.steps)

  def set_base(self, base) -> None:
    for s, b in zip(self.steps, base):
      s.set_base(b)

  def copy_params(self, params: tuple) -> tuple:
    return tuple(s.copy_params(p) for s, p in zip(self.steps, params))

  def merged(self, params: tuple) -> tuple:
    return tuple(s.merged(p) for s, p in zip(self.steps, params))

  def __call__(self, state: TeamState, ref_params, batch: tuple):
    """One update of every group with a batch; (new state, metrics per group: None for a
    group without a batch, whose state is unchanged)."""
    states, metrics = [], []
    for g, (step, s, b) in enumerate(zip(self.steps, state.groups, batch)):
      if b is None:
        states.append(s)
        metrics.append(None)
        continue
      new, m = step(s, None if ref_params is None else ref_params[g], b)
      states.append(new)
      metrics.append(m)
    return TeamState(tuple(states)), tuple(metrics)

  def old_logprobs(self, params: tuple, batch: tuple) -> tuple:
    return tuple(
        b if b is None else s.old_logprobs(p, b) for s, p, b in zip(self.steps, params, batch)
    )


class TeamPolicies(Policies):
  """Groups of stacked policies acting as one team (see the module docstring).

  Args:
    groups: one `StackedPolicies` per group, each naming its team agents.
    pad_ids: each group's tokenizer's padding id (its batches' padding).
  """

  per_agent = True

  def __init__(self, groups: Sequence[StackedPolicies], pad_ids: Sequence[int], seed: int):
    self.groups, self.pad_ids = list(groups), tuple(pad_ids)
    order = sorted((a, g, i) for g, p in enumerate(groups) for i, a in enumerate(p.agents))
    self._where = [(g, i) for _, g, i in order]  # team agent -> (group, index in it)
    models = [self.groups[g].models[i] for g, i in self._where]
    super().__init__(models, TeamTrainStep([p.train_step for p in groups]), seed)

  @property
  def labels(self) -> list[str]:
    return agent_labels(len(self.models))

  @property
  def trainable(self) -> tuple[bool, ...]:
    return tuple(self.groups[g].trainable[i] for g, i in self._where)

  def init_state(self, params=None):
    """A fresh state from every agent's model or, after the warm-up, from each group's
    warmed-up start (`params`: one per group) for its trained agents."""
    params = [None] * len(self.groups) if params is None else params
    return TeamState(tuple(p.init_state(x) for p, x in zip(self.groups, params)))

  def warm_starts(self, model) -> list[tuple]:
    """One start per group: its first agent's model, its rows rendered as that agent's."""
    return [(p.models[0], p.agents[0]) for p in self.groups]

  def warmed(self, params: list) -> tuple:
    """The warm-up's params, one per group (a team of one group too)."""
    return tuple(params)

  def trained_steps(self) -> list:
    """Every group's update program but an all-frozen group's, in group order."""
    return [s for p in self.groups for s in p.trained_steps()]

  def sampler_states(self, params: tuple) -> TeamStates:
    """Each group's engine state: its agents stacked, or one agent's plain parameters."""
    return TeamStates(
        tuple(_engine_state(p.sampler_states(x)) for p, x in zip(self.groups, params))
    )

  def one_for_all(self, params) -> TeamStates:
    """Each group's warm-up params acting for its trained agents (`params`: one per
    group), a frozen agent keeping its own: the warm-up's stop check."""
    return TeamStates(tuple(_engine_state(p.one_for_all(x)) for p, x in zip(self.groups, params)))

  def _batch(self, tree, cfg, critic):
    batches, metrics, slots = [], [], []
    for p, pad in zip(self.groups, self.pad_ids):
      b, m, n = p.sized_batch(tree, dataclasses.replace(cfg, pad_id=pad), critic)
      batches.append(b)
      metrics.append(m)
      slots.append(n)
    batch = None if all(b is None for b in batches) else tuple(batches)
    return batch, _team_batch_metrics(metrics, slots)

  def train_metrics(self, device_metrics: tuple) -> dict:
    out = {}
    for p, m in zip(self.groups, device_metrics):
      if m is not None:
        out.update({k: v for k, v in p.train_metrics(m).items() if k.startswith("agent_")})
    names = {k.split("/", 2)[2] for k in out}
    for name in sorted(names):
      rows = [v for k, v in out.items() if k.endswith(f"/train/{name}")]
      out[f"train/{name}"] = float(sum(rows) / len(rows))
    return out

  def to_saved(self, tree):
    parts = tree.groups if isinstance(tree, TeamState) else tree
    out = {}
    for p, x in zip(self.groups, parts):
      out.update(p.to_saved(x))
    return {label: out[label] for label in self.labels}

  def state_from_saved(self, saved) -> TeamState:
    return TeamState(tuple(p.state_from_saved(saved) for p in self.groups))

  def params_from_saved(self, saved) -> tuple:
    return tuple(p.params_from_saved(saved) for p in self.groups)

  def saved_state_target(self):
    out = {}
    for p in self.groups:
      out.update(p.saved_state_target())
    return {label: out[label] for label in self.labels}

  def per_policy(self, params: tuple) -> list:
    each = [p.per_policy(x) for p, x in zip(self.groups, params)]
    return [each[g][i] for g, i in self._where]

  def agent_params(self, params: tuple) -> list:
    each = [p.agent_params(x) for p, x in zip(self.groups, params)]
    return [each[g][i] for g, i in self._where]

  def critic_values(self, params, tree, cfg):
    raise ValueError("a team of several architectures has no value critic")


def _engine_state(stacked):
  """A group's `StackedStates` as its engine takes them: one agent's plain parameters
  (an engine of one parameter set) or the stacked ones."""
  return agent_slice(stacked.params, 0) if stacked.num_agents == 1 else stacked


def _team_batch_metrics(groups: list[dict], slots: list[int]) -> dict:
  """The team's `batch/*` of its groups' metrics and token slots (`StackedPolicies.
  sized_batch`; module docstring)."""
  out = {k: v for m in groups for k, v in m.items() if k.startswith("agent_")}
  out["batch/zero_variance_groups"] = groups[0]["batch/zero_variance_groups"]
  out["batch/actions"] = float(sum(m["batch/actions"] for m in groups))
  packed = [m for m in groups if "batch/rows" in m]
  if not packed:
    return out
  for k in ("batch/rows", "batch/length"):
    out[k] = max(m[k] for m in packed)
  for k in ("batch/tokens_trained", "batch/tokens_rows_equivalent"):
    out[k] = float(sum(m[k] for m in packed))
  out["batch/padding_fraction"] = 1.0 - out["batch/tokens_trained"] / float(sum(slots))
  return out
