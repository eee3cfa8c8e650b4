"""Reward composition: outcome + step penalty + tool-validity penalty + shaping.

    r = outcome_weight * outcome
        + step_penalty * steps
        + tool_penalty * invalid_calls
        + shaping_weight * shaping

Every component is logged separately (`RewardBreakdown.metrics`). The outcome
must dominate (a policy that finishes the task should always beat one that
farms shaping or avoids penalties by quitting early); `check_reward_dominance`
warns at start-up when it may not. Per-turn grades count only with
`shaping_weight > 0`; `note_unweighted_shaping` says so once when an
environment returns them under weight 0.

In `step_environment`, `outcome` is the mean score of the final grades
(returned with `(None, grades)`), `shaping` the mean score of per-turn grades
(returned with `(next_thread, grades)`), `steps` is 1 per environment step,
and `invalid_calls` counts the step's penalisable faults.

Local rewards (multi-agent): a grade may carry `agent_scores`, the same
criterion judged for each agent alone. `compose_local` composes agent i's
local reward from the same grades with each one's `agent_scores[i]` in place
of its joint score (the joint score where the grade has none), and the same
step and tool terms as the joint reward (faults are not attributed to an
agent). The rollout mixes it with the joint (team) reward by
`agents.team_weight`; an agent no grade of the step scores alone has no local
reward (None), and its local reward is the team reward.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Mapping, Optional

from mtrl_jax.envs.fault_report import show_notice_once


class RewardDominanceWarning(UserWarning):
  """Shaping or penalties can outweigh the outcome term."""


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """Weights of the reward components.

  Attributes:
    outcome_weight: multiplies the outcome score (in [0, 1]); > 0.
    step_penalty: added per environment step; <= 0 (e.g. -0.01).
    tool_penalty: added per invalid tool call / format error; <= 0 (e.g. -0.1).
    shaping_weight: multiplies per-turn grades; >= 0.
  """

  outcome_weight: float = 1.0
  step_penalty: float = 0.0
  tool_penalty: float = 0.0
  shaping_weight: float = 0.0

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"RewardConfig.{f.name}={v!r}; must be a finite number")
    if self.outcome_weight <= 0:
      raise ValueError(f"RewardConfig.outcome_weight={self.outcome_weight}; must be > 0")
    if self.step_penalty > 0:
      raise ValueError(
          f"RewardConfig.step_penalty={self.step_penalty}; must be <= 0 (it is added per step)"
      )
    if self.tool_penalty > 0:
      raise ValueError(
          f"RewardConfig.tool_penalty={self.tool_penalty}; must be <= 0 "
          "(it is added per invalid call)"
      )
    if self.shaping_weight < 0:
      raise ValueError(f"RewardConfig.shaping_weight={self.shaping_weight}; must be >= 0")


@dataclasses.dataclass(frozen=True)
class RewardBreakdown:
  """The weighted components of one reward and their sum."""

  outcome: float
  step: float
  tool: float
  shaping: float

  @property
  def total(self) -> float:
    return self.outcome + self.step + self.tool + self.shaping

  def metrics(self, prefix: str = "reward/") -> dict[str, float]:
    return {
        f"{prefix}outcome": self.outcome,
        f"{prefix}step_penalty": self.step,
        f"{prefix}tool_penalty": self.tool,
        f"{prefix}shaping": self.shaping,
        f"{prefix}total": self.total,
    }

  @classmethod
  def zero(cls) -> "RewardBreakdown":
    return cls(0.0, 0.0, 0.0, 0.0)


def compose_reward(
    cfg: RewardConfig,
    *,
    outcome: float = 0.0,
    steps: int = 0,
    invalid_calls: int = 0,
    shaping: float = 0.0,
) -> RewardBreakdown:
  """The reward `outcome_weight*outcome + step_penalty*steps + tool_penalty*invalid_calls
  + shaping_weight*shaping`, component by component.

  Args:
    cfg: the weights.
    outcome: outcome score (typically in [0, 1]; 0 when not finished).
    steps: environment steps taken.
    invalid_calls: penalisable faults (malformed / invalid tool calls).
    shaping: shaping score (per-turn grades).
  """
  if steps < 0 or invalid_calls < 0:
    raise ValueError(f"compose_reward: steps={steps}, invalid_calls={invalid_calls}; must be >= 0")
  return RewardBreakdown(
      outcome=cfg.outcome_weight * float(outcome),
      step=cfg.step_penalty * steps,
      tool=cfg.tool_penalty * invalid_calls,
      shaping=cfg.shaping_weight * float(shaping),
  )


def mean_score(grades: Mapping) -> Optional[float]:
  """Mean score of a name -> Grade mapping; None when empty."""
  if not grades:
    return None
  return sum(g.score for g in grades.values()) / len(grades)


def agent_mean_score(grades: Mapping, agent: int) -> Optional[float]:
  """Mean score of a name -> Grade mapping as `agent` is graded alone: each grade's
  `agent_scores[agent]`, its joint score where it has none; None when empty."""
  if not grades:
    return None
  return sum(g.agent_scores.get(agent, g.score) for g in grades.values()) / len(grades)


def compose_local(
    cfg: RewardConfig,
    num_agents: int,
    *,
    outcome_grades: Mapping,
    shaping_grades: Mapping,
    steps: int = 0,
    invalid_calls: int = 0,
) -> tuple:
  """Each agent's local reward of one step, composed like the joint one.

  Args:
    cfg: the weights.
    num_agents: N.
    outcome_grades: the step's final grades (name -> Grade).
    shaping_grades: the step's per-turn grades.
    steps, invalid_calls: as `compose_reward` (the joint action's).

  Returns:
    Per agent a `RewardBreakdown`, or None when no grade scores that agent alone.
  """
  graded = {a for g in (*outcome_grades.values(), *shaping_grades.values()) for a in g.agent_scores}
  return tuple(
      compose_reward(
          cfg,
          steps=steps,
          invalid_calls=invalid_calls,
          outcome=agent_mean_score(outcome_grades, i) or 0.0,
          shaping=agent_mean_score(shaping_grades, i) or 0.0,
      )
      if i in graded
      else None
      for i in range(num_agents)
  )


def note_unweighted_shaping(cfg: RewardConfig, shaping_grades: Mapping) -> bool:
  """Prints one line, once per run, the first time an environment returns per-turn
  grades while `reward.shaping_weight` is 0: they are logged and add nothing to the
  reward. A warning rather than a default weight, so existing runs stay as they are.

  Args:
    cfg: the reward weights.
    shaping_grades: the per-turn grades of one step (name -> Grade).

  Returns:
    True when the line was printed now.
  """
  if not shaping_grades or cfg.shaping_weight != 0:
    return False
  names = ", ".join(sorted(shaping_grades))
  return show_notice_once(
      "reward/unweighted_shaping",
      f"reward: the environment returns per-turn grades ({names}) but "
      "reward.shaping_weight=0, so they are logged and add nothing to the reward; set "
      "--config.reward.shaping_weight (e.g. 0.1; the start-up dominance check bounds it) "
      "to train on them (shown once)",
  )


def check_reward_dominance(
    cfg: RewardConfig,
    max_steps: int,
    max_invalid: int,
    outcome_range: tuple[float, float] = (0.0, 1.0),
    max_shaping: float = 1.0,
    max_graded: Optional[int] = None,
) -> list[str]:
  """Warns when shaping or penalties can outweigh the outcome term.

  What matters is the gap the outcome opens between a success and a failure,
  outcome_weight * (hi - lo) for outcome scores in outcome_range = (lo, hi)
  (a shift of the scores changes nothing), against the worst cases over one
  trajectory of at most max_steps steps:
    shaping: a policy that never succeeds but collects per-turn grades of
      max_shaping on every graded step (all max_steps, or max_graded when the
      environment grades fewer) earns shaping_weight * max_shaping *
      min(max_steps, max_graded) more than one that succeeds without any;
      that must stay below the gap.
    penalties: a success that takes max_steps steps with max_invalid invalid
      calls pays |step_penalty| * (max_steps - 1) + |tool_penalty| * max_invalid
      more than a failure after one clean step; if that reaches the gap,
      failing fast beats succeeding slowly.

  Args:
    cfg: the reward weights.
    max_steps: the turn cap.
    max_invalid: the invalid calls a success may make and still have to beat
      failing fast. A run passes 1 (a success after one rejected call):
      a success with more is what the tool penalty is meant to rank below
      quitting, so counting one per step would warn for every tool penalty.
    outcome_range: (lowest, highest) final-grade score, as the environment
      factory declares it (`EnvironmentFactory.outcome_range`).
    max_shaping: the largest per-turn grade.
    max_graded: the most steps of one trajectory that carry per-turn grades,
      as the factory declares it (`EnvironmentFactory.max_graded_turns`);
      None: every step may.

  Returns:
    The warning messages, each also issued once as a `RewardDominanceWarning`
    (not logged as well: the console shows each finding once).
  """
  lo, hi = (float(x) for x in outcome_range)
  if not hi > lo:
    raise ValueError(
        f"check_reward_dominance: outcome_range={outcome_range!r}; "
        "must be (lowest, highest) with lowest < highest"
    )
  if max_graded is not None and (
      isinstance(max_graded, bool) or not isinstance(max_graded, int) or max_graded < 0
  ):
    raise ValueError(
        f"check_reward_dominance: max_graded={max_graded!r}; must be None or an int >= 0"
    )
  gap = cfg.outcome_weight * (hi - lo)
  graded = max_steps if max_graded is None else min(max_steps, max_graded)
  shaping = cfg.shaping_weight * max_shaping * graded
  penalty = abs(cfg.step_penalty) * max(max_steps - 1, 0) + abs(cfg.tool_penalty) * max_invalid
  messages = []
  if shaping >= gap:
    messages.append(
        f"shaping can outweigh the outcome: shaping_weight * max_shaping * graded steps "
        f"({graded}) = "
        f"{shaping:.4g} >= outcome_weight * (max - min outcome) = {gap:.4g}; a policy can "
        "earn more by farming per-turn grades than by finishing the task"
    )
  if penalty >= gap:
    messages.append(
        f"penalties can outweigh the outcome: |step_penalty| * (max_steps - 1) + "
        f"|tool_penalty| * max_invalid = {penalty:.4g} >= outcome_weight * (max - min outcome)"
        f" = {gap:.4g}; failing early can beat succeeding"
    )
  for m in messages:
    warnings.warn(m, RewardDominanceWarning, stacklevel=2)
  return messages
