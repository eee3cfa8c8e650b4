"""Graders: programmatic (`FunctionGrader`) and combined (`CombinedGrader`), and their registry.

A `Grader` scores a `Thread`. The same interface serves trajectory-level
grading (called once, on the finished conversation) and per-turn grading
(called after each policy message, usually looking at `thread.last_assistant`);
`scope` records which, and LLM judges use it to choose what to show the
judge. `grade_batch(threads)` grades many threads at once; judges override it
to make one batched model call across trajectories.

A grader returns a `Grade` (`mtrl_jax.envs.grades`, part of the environment
API); `mtrl_jax.graders` exports it with the graders.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Optional, Sequence, Union

from mtrl_jax.envs.grades import Grade, as_grade
from mtrl_jax.registry import Registry

__all__ = [
    "SCOPES",
    "CombinedGrader",
    "FunctionGrader",
    "GRADERS",
    "Grader",
    "register_grader",
    "resolve_grader",
]

SCOPES = ("trajectory", "turn")


class Grader:
  """Scores a thread. Subclasses implement `grade` (and may batch `grade_batch`).

  Args:
    name: used as the component name inside a `CombinedGrader` and in logs.
    scope: 'trajectory' (the whole conversation) or 'turn' (the last message).
  """

  # What a fault raised while this grader runs is attributed to (`envs.fault_source`).
  fault_source = "grader"

  def __init__(self, name: str, scope: str = "trajectory"):
    if scope not in SCOPES:
      raise ValueError(f"Grader scope={scope!r}; allowed: {list(SCOPES)}")
    self.name = name
    self.scope = scope

  def grade(self, thread) -> Grade:
    raise NotImplementedError(f"{type(self).__name__} must implement grade(thread)")

  def grade_batch(self, threads: Sequence) -> list[Grade]:
    """Grades of many threads (default: one `grade` call each)."""
    return [self.grade(t) for t in threads]

  def __repr__(self):
    return f"{type(self).__name__}(name={self.name!r}, scope={self.scope!r})"


class FunctionGrader(Grader):
  """Any Python function `thread -> Grade | float | bool | (score, reason)`.

  Args:
    fn: the function.
    name: defaults to the function's name.
    scope: 'trajectory' or 'turn'.
  """

  def __init__(self, fn: Callable, name: Optional[str] = None, scope: str = "trajectory"):
    super().__init__(name or getattr(fn, "__name__", "function"), scope)
    self.fn = fn

  def grade(self, thread) -> Grade:
    return as_grade(self.fn(thread), f"FunctionGrader {self.name!r}")


class CombinedGrader(Grader):
  """Weighted combination of graders; each part is kept in `components`.

  score = sum_i w_i * s_i / sum_i w_i (a weighted mean, so [0, 1] parts give a
  [0, 1] score); with `normalize=False`, the plain weighted sum. Components
  hold each part's score under its name and the part's own components as
  'name/component'.

  Args:
    graders: a sequence of Graders (weight 1 each) or (Grader, weight) pairs,
      or a mapping name -> Grader | (Grader, weight).
    name: this grader's name.
    scope: 'trajectory' or 'turn'.
    normalize: divide by the sum of weights.
  """

  def __init__(
      self,
      graders: Union[Sequence, Mapping],
      name: str = "combined",
      scope: str = "trajectory",
      normalize: bool = True,
  ):
    super().__init__(name, scope)
    items = graders.items() if isinstance(graders, Mapping) else [(None, g) for g in graders]
    self.parts: list[tuple[str, Grader, float]] = []
    for key, entry in items:
      g, w = entry if isinstance(entry, tuple) else (entry, 1.0)
      if not hasattr(g, "grade"):
        raise TypeError(f"CombinedGrader: {g!r} is not a Grader")
      w = float(w)
      if not math.isfinite(w) or w < 0:
        raise ValueError(f"CombinedGrader: weight of {key or g.name!r} is {w}; must be >= 0")
      self.parts.append((key or g.name, g, w))
    names = [n for n, _, _ in self.parts]
    if len(set(names)) != len(names):
      raise ValueError(f"CombinedGrader: duplicate component names {names}")
    if not self.parts:
      raise ValueError("CombinedGrader: needs at least one grader")
    self.total_weight = sum(w for _, _, w in self.parts)
    if normalize and self.total_weight <= 0:
      raise ValueError("CombinedGrader: weights sum to 0 with normalize=True")
    self.normalize = normalize

  def _combine(self, grades: Sequence[Grade]) -> Grade:
    total, comps, reasons = 0.0, {}, []
    for (name, _, w), g in zip(self.parts, grades):
      total += w * g.score
      comps[name] = g.score
      for k, v in g.components.items():
        comps[f"{name}/{k}"] = v
      reasons.append(f"{name}={g.score:.3g}" + (f" ({g.reason})" if g.reason else ""))
    score = total / self.total_weight if self.normalize else total
    return Grade(score, "; ".join(reasons), comps)

  def grade(self, thread) -> Grade:
    return self._combine([g.grade(thread) for _, g, _ in self.parts])

  def grade_batch(self, threads: Sequence) -> list[Grade]:
    per_part = [g.grade_batch(threads) for _, g, _ in self.parts]
    return [self._combine([p[i] for p in per_part]) for i in range(len(threads))]


# name -> a grader class or constructor function `(**kwargs) -> Grader`.
GRADERS = Registry("grader")


def register_grader(name: str):
  """Decorator registering a grader class (or constructor function) under `name`."""
  return GRADERS.register(name)


def resolve_grader(spec: str, **kwargs) -> Grader:
  """Builds a grader from a registry name ('binary_judge') or 'package.module:Name'.

  Args:
    spec: the name or import path.
    kwargs: constructor arguments (e.g. generator=..., criteria=...).
  """
  grader = GRADERS.resolve(spec)(**kwargs)
  if not hasattr(grader, "grade"):
    raise TypeError(f"grader {spec!r} built {grader!r}, which has no grade(thread)")
  return grader


register_grader("function")(FunctionGrader)
register_grader("combined")(CombinedGrader)
