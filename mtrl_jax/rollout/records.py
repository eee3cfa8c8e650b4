"""Typed records of a rollout: what a step of an environment reported, and what an action did.

`Transition.step` answers one joint action with an `ActionOutcome`: the state
to continue from (None when the episode ended) and a `StepRecord`. The tree
engine completes each step's record (`done`, the `finish_reason` of the
segment it answered) and keeps an action's records in an `ActionRecord`: one
step, or one per tool sub-step under `branch_on='user_turn'`. Statistics
(`rollout.stats`) and the dump (`rollout.dump`, the one place they are
serialised) read these attributes; nothing parses a dict back by key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Protocol, Sequence

from mtrl_jax.envs.faults import Fault, FaultKind

REWARD_PARTS = ("outcome", "step_penalty", "tool_penalty", "shaping")


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """One environment step of an action.

  Attributes:
    reward: r of this step (the composed score; 0 when masked).
    valid: False for an infrastructure fault: the action is masked, never rewarded.
    continues_turn: the environment answered with tool turns only and waits
      for the same policy turn to go on (see `TreeConfig.branch_on`).
    truncated: the framework ended the episode (turn cap, token budget, sub-step limit).
    parts: the reward's components as composed (`REWARD_PARTS`); empty when
      the transition composes no reward of its own (scripted transitions).
    faults: every fault of the step (`mtrl_jax.envs.Fault`), classified.
    details: JSON-able extras for the dump (grades, the environment's new
      turns, counters).
    done: the episode ended at this step (no next state); set by the engine.
    finish_reason: 'stop' | 'length' of the sampled segment this step
      answered; set by the engine.
    local_rewards: per agent its local reward (`envs.reward.compose_local`),
      None for an agent no grade scored alone; () when none was composed.
    cut: the environment would have gone on, but the step was at the tree's
      last turn: the episode was graded as ended there (`envs.cuts`).
  """

  reward: float
  valid: bool = True
  continues_turn: bool = False
  truncated: bool = False
  parts: Mapping[str, float] = dataclasses.field(default_factory=dict)
  faults: tuple = ()
  details: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  done: bool = False
  finish_reason: str = ""
  local_rewards: tuple = ()
  cut: bool = False

  @property
  def outcome(self) -> float:
    """The outcome component of the reward (0 when none was composed)."""
    return float(self.parts.get("outcome", 0.0))

  def local(self, agent: int) -> float:
    """`agent`'s local reward of this step: its own, else the step's (team) reward."""
    mine = self.local_rewards[agent] if agent < len(self.local_rewards) else None
    return self.reward if mine is None else mine

  def to_json(self) -> dict:
    out = {
        "reward": float(self.reward),
        "valid": self.valid,
        "done": self.done,
        "truncated": self.truncated,
        "continues_turn": self.continues_turn,
        "finish_reason": self.finish_reason,
        "parts": {k: float(v) for k, v in self.parts.items()},
        "faults": [f.to_dict() for f in self.faults],
        **dict(self.details),
    }
    if any(r is not None for r in self.local_rewards):
      out["local_rewards"] = [None if r is None else float(r) for r in self.local_rewards]
    if self.cut:  # records of episodes that ended within the tree stay as they were
      out["cut"] = True
    return out


@dataclasses.dataclass(frozen=True)
class ActionOutcome:
  """What `Transition.step` returns: where the branch goes on, and the step's record.

  Attributes:
    next_state: the state to continue from, or None when the episode ended.
    step: the step's `StepRecord` (reward, validity, faults, details).
  """

  next_state: Any
  step: StepRecord

  def __post_init__(self):
    if not isinstance(self.step, StepRecord):
      raise TypeError(f"ActionOutcome.step is {type(self.step).__name__}; expected StepRecord")
    if self.step.continues_turn and self.next_state is None:
      raise ValueError("ActionOutcome: continues_turn=True needs a next_state")


@dataclasses.dataclass(frozen=True)
class ActionRecord:
  """Every step of one joint action (one, or one per tool sub-step).

  Attributes:
    steps: the steps in order; each answered one sampled segment.
    limit_reached: the environment still waited for the policy after
      `TreeConfig.max_substeps` continuations: the action ended as a truncation.
  """

  steps: tuple
  limit_reached: bool = False

  @property
  def reward(self) -> float:
    """r of the action: the sum of its steps' rewards."""
    return float(sum(s.reward for s in self.steps))

  @property
  def valid(self) -> bool:
    """False when any step was masked (an infrastructure fault)."""
    return all(s.valid for s in self.steps)

  @property
  def substeps(self) -> int:
    """Continuation segments sampled after the first."""
    return len(self.steps) - 1

  @property
  def ended(self) -> bool:
    """The episode ended with this action (the environment stopped, or a truncation)."""
    return self.steps[-1].done or self.limit_reached

  @property
  def cut(self) -> bool:
    """The tree cut the episode at this action: graded as ended (`StepRecord.cut`)."""
    return self.steps[-1].cut

  @property
  def outcome(self) -> float:
    """The outcome of the action's last step (what success is judged on)."""
    return self.steps[-1].outcome

  def local_rewards(self, num_agents: int) -> list[float]:
    """Per agent the sum of its steps' local rewards (a step's team reward where the
    agent had none: then exactly `reward`)."""
    return [float(sum(s.local(i) for s in self.steps)) for i in range(num_agents)]

  def local_graded(self, num_agents: int) -> list[bool]:
    """Per agent: some step of the action scored it alone."""
    return [
        any(i < len(s.local_rewards) and s.local_rewards[i] is not None for s in self.steps)
        for i in range(num_agents)
    ]

  @property
  def faults(self) -> list[Fault]:
    out = [f for s in self.steps for f in s.faults]
    if self.limit_reached:
      out.append(
          Fault(
              FaultKind.TRUNCATION,
              "framework",
              f"sub-step limit reached ({self.substeps} continuations): the "
              "environment still waited for the policy",
          )
      )
    return out

  def parts(self) -> dict[str, float]:
    """The reward components summed over the steps ({} when no step composed any)."""
    if not any(s.parts for s in self.steps):
      return {}
    return {k: float(sum(s.parts.get(k, 0.0) for s in self.steps)) for k in REWARD_PARTS}

  def to_json(self) -> dict:
    return {
        "reward": self.reward,
        "valid": self.valid,
        "ended": self.ended,
        "limit_reached": self.limit_reached,
        "faults": [f.to_dict() for f in self.faults],
        "steps": [s.to_json() for s in self.steps],
    }


class Transition(Protocol):
  """The environment side of a tree, in terms of opaque node states."""

  def prompts(self, state: Any) -> list[list[int]]:
    """Prompt token ids (full context) of each agent at a node with `state`.

    A state reached by a step must extend the stepped state's prompt plus the
    sampled ids verbatim (token-in, token-out); the engine checks it for
    sub-step continuations, and extends the sample's KV cache by the rest.
    """
    ...

  def step(self, state: Any, actions: Sequence[Any]) -> ActionOutcome:
    """Applies one joint action (one single-segment `Completion` per agent) to `state`.

    Must not mutate `state`: siblings branch from the same state. It runs on
    a worker thread, concurrently with other steps. A transition whose `step`
    accepts a `seed` keyword gets the step's seed (an int named by (step key,
    root, node, action, sub-step); see `rollout.inflight.action_seed`) for the
    model calls its environment makes.
    """
    ...

  # Optional: `close(state)` releases a state's resources. The engine owns
  # every state it is given or returned (root states included) and calls it
  # once no branch will step the state again.
  #
  # Optional: `cut(out, num_turns) -> ActionOutcome` grades an episode the tree
  # cuts (a step at the last turn whose `out.next_state` goes on) as ended:
  # no next state (its state closed), `StepRecord.cut` set. Runs on the step's
  # worker thread. Without it the branch just ends (the action is not ended).


def step_record(out: Optional[ActionOutcome]) -> StepRecord:
  """`out.step`, with a clear error when a transition returned something else."""
  if not isinstance(out, ActionOutcome):
    raise TypeError(f"Transition.step returned {type(out).__name__}; expected ActionOutcome")
  return out.step
