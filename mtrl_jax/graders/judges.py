"""LLM judges: `BinaryJudgeGrader` (PASS/FAIL) and `RangeJudgeGrader` (1-5).

Judges do not parse sampled text: they read the judge model's probabilities
of the answer tokens, which gives a smooth score and no format failures.

  Binary: p = P(PASS) / (P(PASS) + P(FAIL)) = sigmoid(logp_PASS - logp_FAIL).
  Range:  p_k = softmax over k in 1..5 of logp_k;  E = sum_k k * p_k;
          score = (E - 1) / 4 in [0, 1].

The judge model is any `TextGenerator` (`score_choices`); on our own models
that is `mtrl_jax.sampling.generation.LocalLLM`. `grade_batch(threads)` makes one
model call for all threads.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from mtrl_jax.envs.faults import InfrastructureError
from mtrl_jax.envs.grades import Grade
from mtrl_jax.graders.base import Grader, register_grader

DEFAULT_TEMPLATE = (
    "You are grading an AI assistant.\n"
    "Criteria: {criteria}\n\n"
    "Conversation:\n{transcript}\n\n"
    "{focus}{instruction}"
)


def render_transcript(thread, include_system: bool = False) -> str:
  """The conversation as '[ROLE] text' lines, for a judge prompt."""
  lines = []
  for t in thread.turns:
    if t.role == "system" and not include_system:
      continue
    label = t.role.upper() + (f" {t.name}" if t.role == "tool" and t.name else "")
    lines.append(f"[{label}] {t.content}")
  return "\n".join(lines)


class _JudgeGrader(Grader):
  """Shared prompt building and batching of the two judges."""

  fault_source = "judge"
  choices: tuple = ()
  instruction: str = ""

  def __init__(
      self,
      generator,
      criteria: str,
      name: str,
      scope: str = "trajectory",
      template: str = DEFAULT_TEMPLATE,
      include_system: bool = False,
      choices: Optional[Sequence[str]] = None,
  ):
    super().__init__(name, scope)
    if not hasattr(generator, "score_choices"):
      raise TypeError(f"{type(self).__name__}: generator {generator!r} has no score_choices")
    if not criteria:
      raise ValueError(f"{type(self).__name__} {name!r}: criteria must not be empty")
    for key in ("{criteria}", "{transcript}"):
      if key not in template:
        raise ValueError(f"{type(self).__name__} {name!r}: template lacks {key}")
    self.generator = generator
    self.criteria = criteria
    self.template = template
    self.include_system = include_system
    if choices is not None:
      if len(choices) != len(self.choices):
        raise ValueError(
            f"{type(self).__name__}: choices={list(choices)}; need "
            f"{len(self.choices)} strings like {list(self.choices)}"
        )
      self.choices = tuple(choices)

  def prompt(self, thread) -> str:
    """The judge prompt for one thread."""
    focus = "Judge only the last [ASSISTANT] message.\n" if self.scope == "turn" else ""
    return self.template.format(
        criteria=self.criteria,
        transcript=render_transcript(thread, self.include_system),
        focus=focus,
        instruction=self.instruction,
    )

  def _logprobs(self, threads) -> np.ndarray:
    prompts = [self.prompt(t) for t in threads]
    try:
      lp = np.asarray(self.generator.score_choices(prompts, list(self.choices)), np.float64)
    except Exception as e:  # the judge model is infrastructure, never the policy's fault
      raise InfrastructureError(f"judge {self.name!r} failed: {type(e).__name__}: {e}") from e
    if lp.shape != (len(prompts), len(self.choices)):
      raise InfrastructureError(
          f"judge {self.name!r}: score_choices returned shape {lp.shape}, "
          f"expected {(len(prompts), len(self.choices))}"
      )
    if np.isnan(lp).any() or np.isneginf(lp).all(axis=1).any():
      raise InfrastructureError(f"judge {self.name!r}: no probability on any choice ({lp})")
    return lp

  def grade(self, thread) -> Grade:
    return self.grade_batch([thread])[0]

  def grade_batch(self, threads) -> list[Grade]:
    if not threads:
      return []
    return [self._from_logprobs(row) for row in self._logprobs(threads)]

  def _from_logprobs(self, lp_C: np.ndarray) -> Grade:
    raise NotImplementedError


@register_grader("binary_judge")
class BinaryJudgeGrader(_JudgeGrader):
  """An LLM judge answering PASS or FAIL; score = P(PASS) / (P(PASS) + P(FAIL)).

  Args:
    generator: the judge model (a `TextGenerator`).
    criteria: what a PASS means, in words.
    name: component name.
    scope: 'trajectory' or 'turn' (judge only the last assistant message).
    template: prompt with {criteria}, {transcript}, {focus}, {instruction}.
    include_system: show the system prompt to the judge.
    choices: the two answer strings (default ('PASS', 'FAIL')).
  """

  choices = ("PASS", "FAIL")
  instruction = "Answer with one word: PASS or FAIL."

  def __init__(self, generator, criteria: str, name: str = "binary_judge", **kw):
    super().__init__(generator, criteria, name, **kw)
    if "choices" in kw and kw["choices"] is not None:
      self.instruction = f"Answer with one word: {self.choices[0]} or {self.choices[1]}."

  def _from_logprobs(self, lp_C):
    # sigmoid(a - b), evaluated stably for either sign.
    d = lp_C[0] - lp_C[1]
    p = 1.0 / (1.0 + np.exp(-d)) if d >= 0 else np.exp(d) / (1.0 + np.exp(d))
    return Grade(float(p), f"P({self.choices[0]})={p:.3f}", {"p_pass": float(p)})


@register_grader("range_judge")
class RangeJudgeGrader(_JudgeGrader):
  """An LLM judge scoring 1-5; score = (expected rating - 1) / 4 in [0, 1].

  The expectation is over the judge's probabilities of '1'..'5', renormalised
  over those five answers.

  Args: as `BinaryJudgeGrader`; choices default to ('1', '2', '3', '4', '5').
  """

  choices = ("1", "2", "3", "4", "5")
  instruction = "Rate from 1 (worst) to 5 (best). Answer with one digit."

  def __init__(self, generator, criteria: str, name: str = "range_judge", **kw):
    super().__init__(generator, criteria, name, **kw)

  def _from_logprobs(self, lp_C):
    z = lp_C - lp_C.max()
    p = np.exp(z) / np.exp(z).sum()
    expected = float((p * np.arange(1, len(p) + 1)).sum())
    score = (expected - 1.0) / (len(p) - 1)
    comps = {"expected_rating": expected}
    comps.update({f"p_{c}": float(q) for c, q in zip(self.choices, p)})
    return Grade(score, f"E[rating]={expected:.2f}", comps)
