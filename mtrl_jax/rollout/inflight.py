"""A rollout's nodes and joint actions while their samples and steps are under way.

`NodeRun` holds a node's samples as they finish (and their caches' handles,
with how many unresolved actions still use each), `ActRun` one joint
action's steps; `RolloutTimes` is the wall-clock split of a rollout, and
`action_seed` names an environment step's seed. Used by `rollout.engine`.
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np

from mtrl_jax.rollout.tree import Node
from mtrl_jax.seeds import call_seed


def action_seed(level_seed: int, root: int, full_id: int, action: int, substep: int = 0) -> int:
  """Seed of one environment step: (level seed, root, node, joint action, sub-step).

  `level_seed` is `call_seed(level_key, 'env')`; the node is named by its
  `full_id`, so the seed names the same step in every run with the same key,
  whatever the worker threads and the engine's schedule do.
  """
  return call_seed(level_seed, root, full_id, action, substep)


def takes_seed(transition) -> bool:
  try:
    params = inspect.signature(transition.step).parameters
  except (TypeError, ValueError):
    return False
  return "seed" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


class NodeRun:
  """A node while its samples and actions are under way."""

  def __init__(self, node: Node, joint_BxN: np.ndarray, g: int):
    self.node, self.joint, self.g = node, joint_BxN, g
    n = joint_BxN.shape[1]
    self.comps = [[None] * g for _ in range(n)]
    self.handles = [[None] * g for _ in range(n)]
    self.left = n * g  # samples not yet finished
    self.uses = np.zeros((n, g), np.int64)  # unresolved actions per sample
    for i in range(n):
      np.add.at(self.uses[i], joint_BxN[:, i], 1)
    self.acts = [ActRun(self, j) for j in range(joint_BxN.shape[0])]
    self.first_steps = len(self.acts)  # first steps not yet returned
    self.unresolved = len(self.acts)


class ActRun:
  """A joint action while its (sub-)steps are under way."""

  def __init__(self, nr: NodeRun, j: int):
    self.nr, self.j = nr, j
    self.waiting = nr.joint.shape[1]  # its samples not yet finished
    self.steps: list = []
    self.next_state = None
    self.limit_reached = False
    self.context = None  # the tokens between the last segment and the next (a continuation)
    self.segment = None  # the latest continuation segment

  @property
  def samples(self):
    return [(i, int(self.nr.joint[self.j, i])) for i in range(self.nr.joint.shape[1])]

  def completions(self):
    return [self.nr.comps[i][g] for i, g in self.samples]


@dataclasses.dataclass
class RolloutTimes:
  """Wall-clock split of one `expand_tree` call (seconds).

  generation: in engine steps (admission + decode chunks);
  environment: with at least one environment step in flight;
  overlap: engine steps while environment steps were in flight;
  device_idle: the engine had nothing to run, waiting for environments;
  env_waiting: engine steps while no environment step was in flight.
  """

  total: float = 0.0
  generation: float = 0.0
  environment: float = 0.0
  overlap: float = 0.0
  device_idle: float = 0.0
  env_waiting: float = 0.0
