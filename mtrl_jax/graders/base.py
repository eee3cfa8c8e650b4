"""Grades and graders: programmatic (`FunctionGrader`) and combined (`CombinedGrader`).

A `Grader` scores a `Thread`. The same interface serves trajectory-level
grading (called once, on the finished conversation) and per-turn grading
(called after each policy message, usually looking at `thread.last_assistant`);
`scope` records which, and LLM judges use it to choose what to show the
judge. `grade_batch(threads)` grades many threads at once; judges override it
to make one batched model call across trajectories.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np

from mtrl_jax.envs.core import SharedResource

SCOPES = ("trajectory", "turn")


@dataclasses.dataclass(frozen=True)
class Grade:
  """A score with its reason and named components.

  Attributes:
    score: the scalar used for reward (graders here produce [0, 1]).
    reason: a short human-readable explanation, logged with the trajectory.
    components: named sub-scores (e.g. each part of a CombinedGrader).
  """

  score: float
  reason: str = ""
  components: Mapping[str, float] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    try:
      score = float(self.score)
    except (TypeError, ValueError):
      raise TypeError(f"Grade.score must be a number, got {self.score!r}") from None
    if not math.isfinite(score):
      raise ValueError(f"Grade.score must be finite, got {score}")
    object.__setattr__(self, "score", score)
    object.__setattr__(self, "components", {k: float(v) for k, v in self.components.items()})

  def to_dict(self) -> dict:
    return {"score": self.score, "reason": self.reason, "components": dict(self.components)}


def as_grade(value: Any, what: str = "grader") -> Grade:
  """Coerces a grader function's result: Grade, number, bool, or (score, reason)."""
  if isinstance(value, Grade):
    return value
  if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
    return Grade(float(value[0]), value[1])
  if isinstance(value, (bool, int, float)) or hasattr(value, "__float__"):
    return Grade(float(value))
  raise TypeError(f"{what} returned {value!r}; expected a Grade, a number, a bool or "
                  "(score, reason)")


def normalize_grades(grades: Any) -> dict[str, Grade]:
  """The grades an environment returned, as an ordered dict name -> Grade.

  Accepts None, a Grade (named 'grade'), a sequence of Grades (named
  'grade_0', ...), or a mapping name -> Grade (numbers are coerced).
  """
  if grades is None:
    return {}
  if isinstance(grades, Mapping):
    return {str(k): as_grade(v, f"grade {k!r}") for k, v in grades.items()}
  if isinstance(grades, (list, tuple)) and not (
      len(grades) == 2 and isinstance(grades[1], str)):
    return {f"grade_{i}": as_grade(g, f"grade #{i}") for i, g in enumerate(grades)}
  return {"grade": as_grade(grades)}


class Grader:
  """Scores a thread. Subclasses implement `grade` (and may batch `grade_batch`).

  Args:
    name: used as the component name inside a `CombinedGrader` and in logs.
    scope: 'trajectory' (the whole conversation) or 'turn' (the last message).
  """

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

  def __init__(self, graders: Union[Sequence, Mapping], name: str = "combined",
               scope: str = "trajectory", normalize: bool = True):
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


_GRADERS: dict[str, Callable[..., Grader]] = {}


def register_grader(name: str):
  """Decorator registering a grader class (or constructor function) under `name`."""
  def decorate(obj):
    if name in _GRADERS and _GRADERS[name] is not obj:
      raise ValueError(f"grader {name!r} is already registered to {_GRADERS[name]!r}")
    _GRADERS[name] = obj
    return obj
  return decorate


def resolve_grader(spec: str, **kwargs) -> Grader:
  """Builds a grader from a registry name ('binary_judge') or 'package.module:Name'.

  Args:
    spec: the name or import path.
    kwargs: constructor arguments (e.g. generator=..., criteria=...).
  """
  if ":" in spec:
    from mtrl_jax.registry import import_object
    ctor = import_object(spec, "grader")
  elif spec in _GRADERS:
    ctor = _GRADERS[spec]
  else:
    raise ValueError(f"unknown grader {spec!r}; registered: {sorted(_GRADERS)}; or use an "
                     "import path 'package.module:Name'")
  grader = ctor(**kwargs)
  if not hasattr(grader, "grade"):
    raise TypeError(f"grader {spec!r} built {grader!r}, which has no grade(thread)")
  return grader


register_grader("function")(FunctionGrader)
register_grader("combined")(CombinedGrader)


@runtime_checkable
class TextGenerator(Protocol):
  """What judges and LLM user simulators need from a language model.

  `generate(prompts, sampling=None) -> list[str]`: one completion per prompt
  (each prompt is the text of one user message; the generator applies its
  chat format). `score_choices(prompts, choices) -> [P, C] array`: log-prob
  of each choice string as the start of the assistant's reply to each prompt.
  `mtrl_jax.graders.local_llm.LocalLLM` implements it on our sampler.
  """

  def generate(self, prompts: Sequence[str], sampling: Any = None) -> list[str]:
    ...

  def score_choices(self, prompts: Sequence[str], choices: Sequence[str]) -> Any:
    ...


class ScriptedGenerator(SharedResource):
  """A deterministic `TextGenerator` for tests and debugging.

  Args:
    replies: a list of completions handed out in order (cycled), or a
      function prompt -> completion.
    scores: a function (prompt, choices) -> list of log-probs, one per choice.
  """

  def __init__(self, replies: Union[Sequence[str], Callable[[str], str], None] = None,
               scores: Optional[Callable[[str, Sequence[str]], Sequence[float]]] = None):
    self.replies = replies
    self.scores = scores
    self.prompts: list[str] = []  # every prompt seen, in order
    self.calls = 0  # batched calls made
    self._next = 0

  def generate(self, prompts, sampling=None):
    del sampling
    self.calls += 1
    out = []
    for p in prompts:
      self.prompts.append(p)
      if callable(self.replies):
        out.append(self.replies(p))
      elif self.replies:
        out.append(self.replies[self._next % len(self.replies)])
        self._next += 1
      else:
        raise ValueError("ScriptedGenerator.generate: no replies configured")
    return out

  def score_choices(self, prompts, choices):
    if self.scores is None:
      raise ValueError("ScriptedGenerator.score_choices: no scores function configured")
    self.calls += 1
    self.prompts.extend(prompts)
    return np.asarray([list(self.scores(p, choices)) for p in prompts], dtype=np.float64)
