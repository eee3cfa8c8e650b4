"""Grades, programmatic graders, CombinedGrader, LLM judges (scripted judge model)."""

import math

import numpy as np
import pytest

from mtrl_jax.envs import InfrastructureError, Thread, Turn
from mtrl_jax.graders import (
    BinaryJudgeGrader,
    CombinedGrader,
    FunctionGrader,
    Grade,
    RangeJudgeGrader,
    ScriptedGenerator,
    TextGenerator,
    normalize_grades,
    register_grader,
    render_transcript,
    resolve_grader,
)

THREAD = Thread.from_messages(
    [
        ("system", "sys"),
        ("user", "2+2?"),
        ("assistant", "4"),
        Turn("tool", "ok", name="calc"),
        ("assistant", "<answer>4</answer>"),
    ]
)


def test_grade_coercion_and_validation():
  assert Grade(1).score == 1.0 and isinstance(Grade(True).score, float)
  with pytest.raises(ValueError, match="finite"):
    Grade(float("nan"))
  with pytest.raises(TypeError, match="must be a number"):
    Grade("high")
  g = normalize_grades([Grade(0.5), 1.0, (0.0, "bad")])
  assert list(g) == ["grade_0", "grade_1", "grade_2"] and g["grade_2"].reason == "bad"
  assert normalize_grades(Grade(0.3)) == {"grade": Grade(0.3)}
  assert normalize_grades((0.7, "reason")) == {"grade": Grade(0.7, "reason")}
  assert normalize_grades(None) == {}


def test_function_grader_results():
  assert FunctionGrader(lambda t: t.count("assistant") == 2).grade(THREAD).score == 1.0
  g = FunctionGrader(lambda t: (0.25, "quarter"), name="q", scope="turn")
  assert g.grade(THREAD) == Grade(0.25, "quarter") and g.scope == "turn"
  with pytest.raises(TypeError, match="FunctionGrader 'bad' returned 'x'"):
    FunctionGrader(lambda t: "x", name="bad").grade(THREAD)
  with pytest.raises(ValueError, match="scope='episode'"):
    FunctionGrader(lambda t: 1.0, scope="episode")


def test_combined_grader_weighted_mean_and_components():
  a = FunctionGrader(lambda t: Grade(1.0, "yes", {"x": 2.0}), name="a")
  b = FunctionGrader(lambda t: 0.4, name="b")
  g = CombinedGrader([(a, 3.0), (b, 1.0)]).grade(THREAD)
  # (3 * 1.0 + 1 * 0.4) / 4 = 0.85
  assert g.score == pytest.approx(0.85)
  assert g.components == {"a": 1.0, "a/x": 2.0, "b": 0.4}
  assert g.reason == "a=1 (yes); b=0.4"
  raw = CombinedGrader({"first": (a, 0.5), "second": b}, normalize=False).grade(THREAD)
  assert raw.score == pytest.approx(0.5 + 0.4) and set(raw.components) == {
      "first",
      "first/x",
      "second",
  }
  with pytest.raises(ValueError, match="duplicate component names"):
    CombinedGrader([a, a])
  with pytest.raises(ValueError, match="weight of 'a' is -1.0"):
    CombinedGrader([(a, -1)])


def _table(**by_choice):
  """A scripted judge: fixed log-prob per choice string."""
  return ScriptedGenerator(scores=lambda prompt, choices: [by_choice[c] for c in choices])


def test_binary_judge_probability_of_pass():
  gen = _table(PASS=math.log(0.6), FAIL=math.log(0.2))
  judge = BinaryJudgeGrader(gen, "The answer is correct.")
  g = judge.grade(THREAD)
  assert g.score == pytest.approx(0.75)  # 0.6 / (0.6 + 0.2)
  assert g.components == {"p_pass": pytest.approx(0.75)}
  prompt = gen.prompts[-1]
  assert "Criteria: The answer is correct." in prompt and "PASS or FAIL" in prompt
  assert "[TOOL calc] ok" in prompt and "[SYSTEM]" not in prompt
  assert "Judge only the last" not in prompt
  # Extreme log-probs stay finite and ordered (stable sigmoid).
  assert BinaryJudgeGrader(_table(PASS=-1000.0, FAIL=0.0), "c").grade(THREAD).score == 0.0
  assert BinaryJudgeGrader(_table(PASS=0.0, FAIL=-1000.0), "c").grade(THREAD).score == 1.0


def test_range_judge_expected_rating():
  p = np.array([0.1, 0.2, 0.3, 0.2, 0.1])  # sums to 0.9: renormalised by the judge
  gen = _table(**{str(k + 1): math.log(p[k]) for k in range(5)})
  g = RangeJudgeGrader(gen, "helpful", scope="turn").grade(THREAD)
  q = p / p.sum()
  expected = float((q * np.arange(1, 6)).sum())  # = 2.7 / 0.9 = 3.0
  assert g.components["expected_rating"] == pytest.approx(expected)
  assert g.score == pytest.approx((expected - 1) / 4)
  assert g.components["p_3"] == pytest.approx(0.3 / 0.9)
  assert "Judge only the last [ASSISTANT] message." in gen.prompts[-1]
  # All mass on '5' -> 1.0; on '1' -> 0.0.
  assert RangeJudgeGrader(
      _table(**{"1": -50.0, "2": -50.0, "3": -50.0, "4": -50.0, "5": 0.0}), "c"
  ).grade(THREAD).score == pytest.approx(1.0, abs=1e-12)


def test_judges_batch_in_one_call_and_combine():
  gen = ScriptedGenerator(
      scores=lambda prompt, choices: (
          [0.0, -1.0] if len(choices) == 2 else [-9.0, -9.0, -9.0, -9.0, 0.0]
      )
  )
  binary = BinaryJudgeGrader(gen, "correct", name="correct")
  rng = RangeJudgeGrader(gen, "helpful", name="helpful")
  combined = CombinedGrader([(binary, 1.0), (rng, 1.0)])
  threads = [THREAD, THREAD.append(Turn("user", "thanks")), THREAD]
  grades = combined.grade_batch(threads)
  assert gen.calls == 2  # one model call per judge for the whole batch
  assert len(gen.prompts) == 6
  p_pass = 1 / (1 + math.exp(-1.0))
  assert grades[0].components["correct"] == pytest.approx(p_pass)
  assert grades[1].score == pytest.approx((p_pass + grades[1].components["helpful"]) / 2)


def test_judge_failures_are_infrastructure():
  bad_shape = ScriptedGenerator(scores=lambda p, c: [0.0])
  with pytest.raises(InfrastructureError, match=r"returned shape \(1, 1\)"):
    BinaryJudgeGrader(bad_shape, "c").grade(THREAD)
  none = _table(PASS=-np.inf, FAIL=-np.inf)
  with pytest.raises(InfrastructureError, match="no probability"):
    BinaryJudgeGrader(none, "c").grade(THREAD)
  with pytest.raises(ValueError, match="criteria must not be empty"):
    BinaryJudgeGrader(none, "")
  with pytest.raises(ValueError, match="need 2 strings"):
    BinaryJudgeGrader(none, "c", choices=["Y"])
  custom = BinaryJudgeGrader(_table(YES=0.0, NO=0.0), "c", choices=["YES", "NO"])
  assert custom.grade(THREAD).score == pytest.approx(0.5)
  assert "YES or NO" in custom.prompt(THREAD)


def test_transcript_and_protocol():
  text = render_transcript(THREAD, include_system=True)
  assert text.splitlines()[0] == "[SYSTEM] sys" and text.splitlines()[-1].startswith("[ASSIST")
  assert isinstance(ScriptedGenerator(replies=["x"]), TextGenerator)


def test_grader_registry():
  gen = ScriptedGenerator(scores=lambda p, c: [0.0] * len(c))
  judge = resolve_grader("range_judge", generator=gen, criteria="helpful", name="h")
  assert isinstance(judge, RangeJudgeGrader) and judge.grade(THREAD).score == pytest.approx(0.5)
  fn = resolve_grader("function", fn=lambda t: 1.0, name="one")
  assert fn.grade(THREAD).score == 1.0
  assert isinstance(resolve_grader("mtrl_jax.graders:FunctionGrader", fn=len), FunctionGrader)
  with pytest.raises(ValueError, match="unknown grader 'nope'; registered: \\['binary_judge'"):
    resolve_grader("nope")
  with pytest.raises(ValueError, match="already registered"):
    register_grader("function")(BinaryJudgeGrader)
