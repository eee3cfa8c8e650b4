"""A scripted, text-free transition for the engine tests (token lists as state)."""

import dataclasses
import time
from typing import Callable, Optional

import numpy as np

from mtrl_jax.rollout import ActionOutcome

FEEDBACK = 7  # token the scripted environment appends after each completion
TOOL = 6  # token it appends when it asks the policy to continue (a tool result)


@dataclasses.dataclass(frozen=True)
class TokState:
  """Per-agent full histories (prompt ids), the root index, turn and sub-step."""

  root: int
  turn: int
  histories: tuple
  sub: int = 0  # tool continuations so far within this turn


class ScriptedTransition:
  """Appends each agent's completion and a feedback token to its own history.

  reward(state, actions) -> float decides r; stop(state, actions) -> bool ends
  the episode on that action; fault(state, actions) -> bool marks an
  infrastructure fault; continues(state, actions) -> bool answers with a
  tool token and waits for the policy (`continues_turn`); sleep_s simulates a
  slow tool.
  """

  def __init__(self, reward: Optional[Callable] = None, stop: Optional[Callable] = None,
               fault: Optional[Callable] = None, sleep_s: float = 0.0,
               continues: Optional[Callable] = None):
    self.reward = reward or (lambda s, a: float(sum(int(c.ids.sum()) for c in a) % 5) / 4)
    self.stop = stop or (lambda s, a: False)
    self.fault = fault or (lambda s, a: False)
    self.continues = continues or (lambda s, a: False)
    self.sleep_s = sleep_s

  @staticmethod
  def roots(num_roots: int, num_agents: int) -> list:
    return [TokState(r, 0, tuple((3, 10 + r, 20 + i) for i in range(num_agents)))
            for r in range(num_roots)]

  def prompts(self, state):
    return [list(h) for h in state.histories]

  def step(self, state, actions):
    if self.sleep_s:
      time.sleep(self.sleep_s)
    r = self.reward(state, actions)
    if self.fault(state, actions):
      return ActionOutcome(None, 0.0, valid=False, info={"fault": "infrastructure"})
    if self.stop(state, actions):
      return ActionOutcome(None, r, info={"stopped": True})
    if self.continues(state, actions):
      hist = tuple(h + tuple(int(t) for t in c.ids) + (TOOL,)
                   for h, c in zip(state.histories, actions))
      return ActionOutcome(TokState(state.root, state.turn, hist, state.sub + 1), r,
                           info={"r": r, "tool": True}, continues_turn=True)
    hist = tuple(h + tuple(int(t) for t in c.ids) + (FEEDBACK,)
                 for h, c in zip(state.histories, actions))
    return ActionOutcome(TokState(state.root, state.turn + 1, hist), r, info={"r": r})


def total_ids(actions) -> int:
  return int(np.sum([c.ids.sum() for c in actions]))
