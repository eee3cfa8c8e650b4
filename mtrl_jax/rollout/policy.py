"""The policy as the tree engine drives it: a `DecodeEngine` with the run's parameters.

`RolloutPolicy` is what `rollout.engine.expand_tree` needs: runs of
requests over decode slots (`start`, `submit`, `step`, `release`,
`finish`), and `separate`, whether each agent samples with its own
parameters (which decides how sampling keys are named, `call_key`).
`EnginePolicy` serves it with `mtrl_jax.sampling.engine.DecodeEngine`: a
shared policy has one parameter set for every agent; separate policies are
`StackedStates`, parameters stacked on an agent axis, and every agent's
requests run in the same compiled programs. Tests drive the engine with
`mtrl_jax.testing.FakePolicy`, a deterministic stand-in.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import numpy as np

from mtrl_jax.sampling.engine import DecodeEngine
from mtrl_jax.sampling.slots import Request, Sample


class RolloutPolicy(Protocol):
  """What the tree engine needs from a policy (see the module docstring)."""

  separate: bool

  def start(self, fanout: int) -> None:
    """Begins a rollout whose requests ask for at most `fanout` samples."""

  def submit(self, req: Request) -> None:
    ...

  def step(self, expect_more: bool = False) -> tuple[list[Sample], bool]:
    ...

  def release(self, handle) -> None:
    ...

  @property
  def busy(self) -> bool:
    ...

  def finish(self) -> dict:
    """Ends the rollout; returns the run's counters (`DecodeEngine.stats`)."""


@dataclasses.dataclass(frozen=True)
class StackedStates:
  """Separate policies' parameters, stacked on a leading agent axis (one engine program)."""

  params: Any
  num_agents: int


def key_data(key) -> np.ndarray:
  """Raw uint32 [2] data of a PRNG key (typed or raw)."""
  if jax.dtypes.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  return np.asarray(key, np.uint32).reshape(2)


def call_key(level_key, param_set: int) -> np.ndarray:
  """Raw key data of the samples of one parameter set at a level (or sub-step round):
  fold_in(level key, s), s = the agent for separate policies, 0 for a shared one. A
  rollout computes it once per (level, round, s) and reuses it for every request there:
  an eager key operation per request would cost a device round trip each."""
  return key_data(jax.random.fold_in(level_key, param_set))


def request_rows(
    agent: int, index: int, num_agents: int, num_samples: int, separate: bool
) -> np.ndarray:
  """Rows (uint32 [num_samples]) of the samples of one (node or action, agent) under their
  `call_key`.

  `index` is the node's (or, for a tool continuation, the action's) position
  in its level of the complete tree. Keys follow the level-by-level sampler
  this engine replaced: one call per parameter set s keyed `call_key`, whose row
  p * G + g was sample g of its p-th prompt: p = index * N + agent with a
  shared policy (every agent's prompts in one call), p = index with separate
  ones. A complete tree therefore draws the same tokens as that sampler did.
  """
  g = np.arange(num_samples, dtype=np.int64)
  if separate:
    rows = index * num_samples + g
  else:
    rows = (index * num_agents + agent) * num_samples + g
  if rows.max() >= 2**32:
    raise ValueError(
        f"sample row {int(rows.max())} does not fit 32 bits: the complete tree "
        "has too many nodes per level for its sampling keys"
    )
  return rows.astype(np.uint32)


class EnginePolicy:
  """`RolloutPolicy` over a `DecodeEngine`.

  Args:
    engine: the run's `DecodeEngine` (its `num_agents` is 1 for a shared
      policy, N for stacked separate policies).
    states: the parameters (`set_states`).
    sampling: the `SamplingConfig` of every request.
    stop_ids: token ids that end a completion (kept in it).
    pad_id: padding id.
    fanout: the fanout every run is started with (at least what a
      rollout asks for): a run passes its G, so its evaluations (G = 1) use
      the training rollouts' compiled admit programs.
  """

  def __init__(
      self, engine: DecodeEngine, states, sampling, *, stop_ids, pad_id: int, fanout: int = 1
  ):
    self.engine = engine
    self.sampling = sampling
    self.stop_ids = tuple(int(s) for s in stop_ids)
    self.pad_id = int(pad_id)
    self.fanout = int(fanout)
    self.set_states(states)

  def set_states(self, states) -> None:
    """Swaps in new parameters (after an update); shapes are unchanged, so no recompile.
    None: none yet (set them before the first rollout)."""
    if states is None:
      self.separate, self.states = self.engine.num_agents > 1, None
      return
    self.separate = isinstance(states, StackedStates)
    expected = states.num_agents if self.separate else 1
    if self.engine.num_agents != expected:
      raise ValueError(
          f"EnginePolicy: the engine has {self.engine.num_agents} parameter "
          f"sets, the states {expected}"
      )
    self.states = states

  def like(self, states, sampling, fanout: int) -> EnginePolicy:
    """A policy over the same engine with other parameters, sampling and fanout (the
    evaluations' greedy or independent single-path rollouts)."""
    return EnginePolicy(
        self.engine, states, sampling, stop_ids=self.stop_ids, pad_id=self.pad_id, fanout=fanout
    )

  def compile_targets(self, states) -> list[tuple]:
    """What `run.shapes.precompile` compiles for `states` (as `set_states` takes them):
    [(the engine, the parameters it samples with, number of stop ids)]."""
    return [(self.engine, _engine_params(states), len(self.stop_ids))]

  def start(self, fanout: int) -> None:
    self.engine.start(
        _engine_params(self.states),
        self.sampling,
        self.stop_ids,
        self.pad_id,
        fanout=max(fanout, self.fanout),
    )

  def submit(self, req: Request) -> None:
    if not self.separate and req.agent:
      req = dataclasses.replace(req, agent=0)  # a shared policy: one parameter set
    self.engine.submit(req)

  def step(self, expect_more: bool = False):
    return self.engine.step(expect_more)

  def release(self, handle) -> None:
    self.engine.release(handle)

  @property
  def busy(self) -> bool:
    return self.engine.busy

  def finish(self) -> dict:
    return dict(self.engine.stats)


def _engine_params(states):
  """The parameters an engine samples with: stacked separate policies' stacked tree, or
  a shared policy's."""
  return states.params if isinstance(states, StackedStates) else states


@dataclasses.dataclass(frozen=True)
class TeamStates:
  """A team of several architectures' parameters: one engine state per group (a plain
  parameter tree for a group of one agent, else `StackedStates`), in group order."""

  groups: tuple


@dataclasses.dataclass(frozen=True)
class TeamHandle:
  """A team's sample cache: `handle`, of the engine of group `group`."""

  group: int
  handle: Any


class TeamPolicy:
  """`RolloutPolicy` of a team whose agent groups sample on engines of their own.

  Each group of agents that share an architecture and tokenizer
  (`run.groups`) has an `EnginePolicy` over its own `DecodeEngine`, with its
  chat format's stop ids and its tokenizer's padding. A request of agent a goes
  to a's group as that group's agent `members[g].index(a)`; keys are named by
  the team's agent (`separate`), so an agent draws the same tokens as it would
  stacked with agents of its own architecture. `step` runs one chunk on every
  engine with work; samples come back in engine order, each sample's handle a
  `TeamHandle` naming the group whose engine holds its cache (where `release`
  and a request naming it as parent go).

  Args:
    policies: one `EnginePolicy` per group.
    members: each group's agents (team indices).
  """

  separate = True

  def __init__(self, policies, members):
    self.policies, self.members = list(policies), [tuple(m) for m in members]
    self.route = {a: (g, i) for g, agents in enumerate(members) for i, a in enumerate(agents)}

  def like(self, states: TeamStates, sampling, fanout: int) -> TeamPolicy:
    """As `EnginePolicy.like`, group by group."""
    return TeamPolicy(
        [p.like(s, sampling, fanout) for p, s in zip(self.policies, states.groups)],
        self.members,
    )

  def set_states(self, states: TeamStates | None) -> None:
    for g, policy in enumerate(self.policies):
      policy.set_states(None if states is None else states.groups[g])

  def compile_targets(self, states: TeamStates) -> list[tuple]:
    """As `EnginePolicy.compile_targets`, one per group's engine in group order."""
    return [t for p, s in zip(self.policies, states.groups) for t in p.compile_targets(s)]

  def start(self, fanout: int) -> None:
    for policy in self.policies:
      policy.start(fanout)

  def submit(self, req: Request) -> None:
    g, local = self.route[req.agent]
    parent = None if req.parent is None else req.parent.handle
    self.policies[g].submit(dataclasses.replace(req, agent=local, parent=parent))

  def step(self, expect_more: bool = False):
    out, go_on = [], False
    working = [g for g, p in enumerate(self.policies) if p.busy] or [0]
    for g in working:
      samples, more = self.policies[g].step(expect_more)
      out += [dataclasses.replace(s, handle=TeamHandle(g, s.handle)) for s in samples]
      go_on = go_on or more
    return out, go_on or any(p.busy for p in self.policies)

  def release(self, handle: TeamHandle) -> None:
    self.policies[handle.group].release(handle.handle)

  @property
  def busy(self) -> bool:
    return any(p.busy for p in self.policies)

  def finish(self) -> dict:
    """Every engine's counters, summed."""
    total: dict = {}
    for policy in self.policies:
      for k, v in policy.finish().items():
        total[k] = total.get(k, 0) + v
    return total
