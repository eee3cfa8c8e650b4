"""Episodes the tree cuts: the final grades of an episode the environment would continue.

A tree of `tree.num_turns` turns ends every branch at its last turn. When the
environment would still go on there (`react_to` answered with a next thread),
the episode is cut, and a cut must never pay more than failing: otherwise a
policy learns that not finishing beats finishing badly. `grade_cut` grades
the cut episode as ended at that turn: `env.on_cut(thread)` (default
`Environment.finalize`) gives the final grades; when it gives none, the cut
scores the failure outcome, the bottom of the factory's `outcome_range`. A
fault in `on_cut` is classified like one in `finalize`: the cut still scores
the failure outcome, and the step is masked unless the fault is the model's.

`cut_notice` is the one line the run prints the first time a cut happens.
"""

from __future__ import annotations

from typing import Optional

from mtrl_jax.envs.fault_report import fault_origin, fault_source
from mtrl_jax.envs.faults import Fault, FaultPolicy, classify
from mtrl_jax.envs.grades import Grade, normalize_grades

CUT_GRADE = "cut"


def failure_grades(failure_outcome: float, num_turns: Optional[int] = None) -> dict:
  """The grades of a cut the environment did not grade: one failure outcome."""
  where = "" if num_turns is None else f" after its last turn ({num_turns})"
  return {CUT_GRADE: Grade(float(failure_outcome), f"cut by the tree{where}: not finished")}


def grade_cut(
    env,
    thread,
    failure_outcome: float,
    policy: FaultPolicy = FaultPolicy(),
    num_turns: Optional[int] = None,
) -> tuple[dict, list, bool]:
  """The final grades of a cut episode.

  Args:
    env: the branch's `Environment` (after the step that continued).
    thread: the thread it would continue (a list of them for several agents).
    failure_outcome: the outcome score of a failure (the bottom of the
      factory's `outcome_range`), used when `on_cut` gives no grades.
    policy: which fault kinds are penalised (model-caused) rather than masked.
    num_turns: the tree's depth, for the failure grade's reason.

  Returns:
    (grades name -> Grade, faults of `on_cut`, masked): masked is True when
    `on_cut` raised a fault that is not the model's (no honest reward exists).
  """
  on_cut = getattr(env, "on_cut", None)
  try:
    grades = normalize_grades(on_cut(thread)) if on_cut is not None else {}
  except Exception as e:  # classified like a finalize fault; the run goes on
    fault = Fault.from_exception(e, fault_source(e), where=fault_origin(e, env, "on_cut"))
    return failure_grades(failure_outcome, num_turns), [fault], classify(e) not in policy.penalise
  return grades or failure_grades(failure_outcome, num_turns), [], False


def cut_notice(num_turns: int, max_turns: Optional[int]) -> str:
  """The one-line notice of the run's first cut episode."""
  cap = f"env.max_turns={max_turns}"
  if max_turns is None or max_turns > num_turns:
    cap += " lets episodes run longer"
  return (
      f"tree: an episode went on past the tree's last turn (tree.num_turns={num_turns}; "
      f"{cap}): it is cut and graded as ended there (Environment.on_cut, default: "
      f"finalize, else the failure outcome); raise tree.num_turns to the episodes' length "
      f"or lower env.max_turns (counted in tree/cut_episodes; shown once)"
  )
