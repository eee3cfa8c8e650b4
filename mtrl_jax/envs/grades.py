"""Grades: what an environment's `react_to` returns with a finished (or graded) turn.

A `Grade` is a score with its reason and named components, and optionally the
same criterion judged for each agent alone (`agent_scores`: the local grades
of a multi-agent joint action, mixed with the joint score by
`agents.team_weight`; `mtrl_jax.envs.reward.compose_local`). Environments may
return a Grade, a number, a bool, `(score, reason)`, a sequence or a mapping of
them; `normalize_grades` turns any of these into an ordered name -> Grade dict
for reward composition (`mtrl_jax.envs.reward`). Graders (`mtrl_jax.graders`)
produce Grades; the type lives here, in the environment API, because the step
runner consumes it. `mtrl_jax.graders` re-exports every name.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class Grade:
  """A score with its reason and named components.

  Attributes:
    score: the scalar used for reward (graders here produce [0, 1]).
    reason: a short human-readable explanation, logged with the trajectory.
    components: named sub-scores (e.g. each part of a CombinedGrader).
    agent_scores: agent index -> the score of the same criterion judged on that
      agent's own message (its local grade, e.g. its own answer right or not);
      an agent without an entry is graded by the joint `score`. Empty: a
      joint grade only.
  """

  score: float
  reason: str = ""
  components: Mapping[str, float] = dataclasses.field(default_factory=dict)
  agent_scores: Mapping[int, float] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    try:
      score = float(self.score)
    except (TypeError, ValueError):
      raise TypeError(f"Grade.score must be a number, got {self.score!r}") from None
    if not math.isfinite(score):
      raise ValueError(f"Grade.score must be finite, got {score}")
    object.__setattr__(self, "score", score)
    object.__setattr__(self, "components", {k: float(v) for k, v in self.components.items()})
    scores = {}
    for agent, value in dict(self.agent_scores).items():
      if isinstance(agent, bool) or not isinstance(agent, numbers.Integral) or agent < 0:
        raise TypeError(f"Grade.agent_scores key {agent!r}; allowed: an agent index >= 0")
      try:
        value = float(value)
      except (TypeError, ValueError):
        raise TypeError(f"Grade.agent_scores[{agent}]={value!r}; allowed: a number") from None
      if not math.isfinite(value):
        raise ValueError(f"Grade.agent_scores[{agent}]={value}; allowed: a finite number")
      scores[int(agent)] = value
    object.__setattr__(self, "agent_scores", scores)

  def to_dict(self) -> dict:
    out = {"score": self.score, "reason": self.reason, "components": dict(self.components)}
    if self.agent_scores:  # joint-only grades keep their record as it was
      out["agent_scores"] = {str(a): v for a, v in self.agent_scores.items()}
    return out


def as_grade(value: Any, what: str = "grader") -> Grade:
  """Coerces a grader function's result: Grade, number, bool, or (score, reason)."""
  if isinstance(value, Grade):
    return value
  if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
    return Grade(float(value[0]), value[1])
  if isinstance(value, (bool, int, float)) or hasattr(value, "__float__"):
    return Grade(float(value))
  raise TypeError(
      f"{what} returned {value!r}; expected a Grade, a number, a bool or (score, reason)"
  )


def normalize_grades(grades: Any) -> dict[str, Grade]:
  """The grades an environment returned, as an ordered dict name -> Grade.

  Accepts None, a Grade (named 'grade'), a sequence of Grades (named
  'grade_0', ...), or a mapping name -> Grade (numbers are coerced).
  """
  if grades is None:
    return {}
  if isinstance(grades, Mapping):
    return {str(k): as_grade(v, f"grade {k!r}") for k, v in grades.items()}
  if isinstance(grades, (list, tuple)) and not (len(grades) == 2 and isinstance(grades[1], str)):
    return {f"grade_{i}": as_grade(g, f"grade #{i}") for i, g in enumerate(grades)}
  return {"grade": as_grade(grades)}
