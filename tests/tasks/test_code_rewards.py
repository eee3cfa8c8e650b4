"""The gated level reward, on hand-worked examples (values summed in comments)."""

import pytest

from mtrl_jax.tasks.code import rewards

PROMPT = (
    "from typing import List\n\n\ndef total(xs: List[int], start: int) -> int:\n"
    '    """Sum of xs plus start."""\n'
)
TESTS = (
    "\n\nMETADATA = {}\n\n\ndef check(candidate):\n"
    "    assert candidate([1, 2], 0) == 3\n    assert candidate([], 5) == 5\n"
    "    assert candidate([5], 1) == 6\n    assert candidate([1, 1, 1, 1], 0) == 4\n"
)
AUX = "def aux(xs):\n    s = 0\n    for x in xs:\n        s += x\n    return s\n"
MAIN = "def total(xs: List[int], start: int) -> int:\n    s = aux(xs)\n    return s + start\n"


def reward(aux, main, **kw):
  return rewards.execution_reward_aux(aux, main, TESTS, "total", PROMPT, **kw)


def test_full_cooperation_scores_the_maximum():
  # 0.4 + 0.6 (structure) + 0.5 (syntax) + 4/4 (tests) + 0.5 (calls aux)
  # + 1.0 (not a thin wrapper) = 4.0
  r = reward(AUX, MAIN)
  assert r["total_reward"] == pytest.approx(4.0, abs=1e-12) == rewards.MAX_REWARD
  assert (r["level_1_reward"], r["level_2_reward"], r["test_reward"]) == (1.0, 0.5, 1.0)
  assert (r["aux_usage_bonus"], r["anti_wrapper_bonus"]) == (0.5, 1.0)
  assert r["called_wo_used_deduction"] == 0.0
  assert r["bonus_reward"] == 1.5 and r["level_3_reward"] == 2.5
  assert (r["passed_tests"], r["total_tests"], r["passed_rate"], r["timeout_num"]) == (4, 4, 1.0, 0)
  assert r["gated_total_reward"] == r["total_reward"] and r["level_reached"] == 4


def test_thin_wrapper_loses_the_anti_wrapper_bonus():
  aux = "def aux(xs, start):\n    return sum(xs) + start\n"
  main = "def total(xs, start):\n    return aux(xs, start)\n"
  # 1.0 + 0.5 + 1.0 + 0.5 = 3.0
  assert reward(aux, main)["total_reward"] == pytest.approx(3.0, abs=1e-12)


def test_main_alone_is_the_single_agent_baseline():
  main = "def total(xs, start):\n    return sum(xs) + start\n"
  # 0.6 + 0.5 + 1.0 = 2.1: no aux, so no cooperation bonus
  r = rewards.single_agent_reward(main, TESTS, "total", PROMPT)
  assert r["total_reward"] == pytest.approx(2.1, abs=1e-12) == rewards.MAX_SINGLE_AGENT_REWARD
  # An aux that main ignores: 0.4 + 0.6 + 0.5 + 1.0 = 2.5
  assert reward(AUX, main)["total_reward"] == pytest.approx(2.5, abs=1e-12)


def test_gates_stop_at_missing_main_and_syntax_errors():
  r = reward(AUX, "I cannot solve this.")
  assert (r["total_reward"], r["level_reached"], r["main_defined"]) == (0.4, 1, False)
  assert reward("", "def total(xs, start):\n    pass\n")["total_reward"] == 0.0  # no return
  r = reward(AUX, "def total(xs, start):\n    return (sum(xs) + start\n")
  # 1.0 structure, syntax fails: stop
  assert (r["total_reward"], r["level_reached"], r["syntax_ok"]) == (1.0, 2, False)


def test_partial_tests_and_the_discarded_aux_value_deduction():
  # Passes only the tests where start == 0 (2 of 4): 1.0 + 0.5 + 0.5 + 0.5
  # (calls aux) + 1.0 (not a wrapper) - 0.5 (`aux (a)` standalone) = 3.0
  main = "def total(xs, start):\n    a = xs\n    aux (a)\n    s = aux(a)\n    return s\n"
  r = reward(AUX, main)
  assert (r["passed_tests"], r["test_reward"]) == (2, 0.5)
  assert r["called_wo_used_deduction"] == 0.5
  assert r["total_reward"] == pytest.approx(3.0, abs=1e-12)


def test_markdown_and_prose_are_cleaned_and_prompt_imports_prepended():
  main = (
      "Here is my solution:\n```python\ndef total(xs: List[int], start: int) -> int:\n"
      "    return sum(xs) + start\n```\nThis adds the numbers."
  )
  assert reward("", main)["total_reward"] == pytest.approx(2.1, abs=1e-12)


def test_reward_runs_in_the_sandbox_with_timeouts_and_early_exits():
  looping = "def total(xs, start):\n    while True:\n        pass\n    return 0\n"
  r = reward("", looping, timeout_per_assert_s=0.2)
  # 3 timeouts, the fourth assert skipped: 0.6 + 0.5 + 0 = 1.1
  assert (r["timeout_num"], r["passed_tests"], r["total_tests"]) == (3, 0, 4)
  assert r["total_reward"] == pytest.approx(1.1, abs=1e-12)
  exiting = "def total(xs, start):\n    import os\n    os._exit(0)\n    return 0\n"
  assert reward("", exiting)["passed_tests"] == 0


def test_no_test_cases_stops_after_syntax():
  r = rewards.execution_reward_aux(
      "",
      "def total(xs, start):\n    return 1\n",
      "def check(candidate):\n    pass\n",
      "total",
      PROMPT,
  )
  assert (r["total_reward"], r["level_reached"], r["total_tests"]) == (1.1, 3, 0)


def test_reward_processor_shifts_to_non_positive():
  assert rewards.process_reward(4.0) == 0.0
  assert rewards.process_reward(3.8) == pytest.approx(-0.2)
  assert rewards.process_reward(2.1, shift=rewards.GRPO_SHIFT) == 0.0
  assert rewards.process_reward(1.0, scale=2.0, shift=-1.0) == 1.0
