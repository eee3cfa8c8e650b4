"""External transitions: exact prompt texts, sandbox diagnostics, test slicing."""

import pytest

from mtrl_jax.tasks.code import feedback

TESTS = (
    "\n\nMETADATA = {\n    'author': 'jt',\n}\n\n\ndef check(candidate):\n"
    "    assert candidate([1, 2], 0) == 3\n    assert candidate([], 5) == 5\n"
    "    assert candidate([5], 1) == 6\n    assert candidate([1, 1], 0) == 2\n"
)
TASK = {
    "prompt": 'def total(xs, start):\n    """Sum of xs plus start."""\n',
    "test": TESTS,
    "entry_point": "total",
}
AUX = "def aux(xs):\n    return sum(xs)"
WRAPPER = "def total(xs, start):\n    return aux(xs) + start + 1"  # wrong by one
GOOD = "def total(xs, start):\n    return sum(xs) + start"
HISTORY = ([["AUX PROMPT 1"], ["MAIN PROMPT 1"]], [[AUX], [WRAPPER]])


def transition(mode, completions=(AUX, WRAPPER), history=HISTORY, **kw):
  return feedback.build_transition(
      mode,
      TASK,
      list(completions),
      history[0],
      history[1],
      kw.pop("num_agents", 2),
      kw.pop("sandbox_slice", 1),
      **kw,
  )


def _head(role_label, prompt, response):
  return (
      f"History: previous prompts:\n- Turn 1 prompt:\n{prompt}\n\n"
      f"History: your previous {role_label}:\n- Turn 1 response:\n{response}\n\n"
  )


def test_sandbox_slice_parsing():
  assert [feedback.parse_sandbox_slice(v) for v in (1, 0, -2, None, "all", " 3 ", "-1")] == [
      1,
      0,
      -2,
      None,
      0,
      3,
      -1,
  ]
  for bad in ("first", 1.5, True):
    with pytest.raises(ValueError, match="sandbox_slice"):
      feedback.parse_sandbox_slice(bad)


def test_slice_tests_keeps_preamble_and_selected_asserts():
  # The preamble is stripped and glued to the check header, as in the reference.
  preamble = "METADATA = {\n    'author': 'jt',\n}\ndef check(candidate):\n"
  assert feedback.slice_tests(TESTS, 1) == preamble + "    assert candidate([1, 2], 0) == 3\n"
  assert feedback.slice_tests(TESTS, -2) == (
      preamble + "    assert candidate([5], 1) == 6\n    assert candidate([1, 1], 0) == 2\n"
  )
  assert feedback.slice_tests(TESTS, 0) == TESTS and feedback.slice_tests(TESTS, None) == TESTS
  assert feedback.slice_tests("def check(candidate):\n    pass\n", 1) == (
      "def check(candidate):\n    pass\n"
  )


def test_level_feedback_texts_for_both_agents():
  aux_prompt, main_prompt = transition("level_feedback")
  common = (
      "- Syntax: OK (Combined code syntax OK)\n- Tests: 0/1 passed\n"
      "  Failed case: assert total([1, 2], 0) == 3 -> AssertionError: \n"
  )
  aux_def = "- Aux definition: FOUND (Aux function properly defined with return statement)\n"
  main_def = (
      "- Main definition: FOUND (Main function (total) properly defined with return statement)\n"
  )
  assert aux_prompt == (
      _head("aux(...) responses", "AUX PROMPT 1", AUX)
      + "Static and execution diagnostics:\n"
      + aux_def
      + main_def
      + common
      + "\nRevise your aux(...) accordingly. Output ONLY the function code with no extra text."
  )
  assert main_prompt == (
      _head("main responses", "MAIN PROMPT 1", WRAPPER)
      + "Static and execution diagnostics:\n"
      + main_def
      + aux_def
      + common
      + "- Aux usage: main calls aux and uses its result\n"
      "- Warning: main appears to be a thin wrapper over aux\n"
      "\nRevise your total(...) accordingly. Output ONLY the function code with no extra text."
  )


def test_history_lists_every_turn_in_order():
  history = ([["A1", "A2"], ["M1", "M2"]], [[AUX, "a2"], ["m1", WRAPPER]])
  _, main_prompt = transition("plain", history=history)
  assert main_prompt == (
      "History: previous prompts:\n- Turn 1 prompt:\nM1\n- Turn 2 prompt:\nM2\n\n"
      "History: your previous main responses:\n- Turn 1 response:\nm1\n"
      f"- Turn 2 response:\n{WRAPPER}\n\n"
      "Revise your total(...) accordingly. Output ONLY the function code."
  )


@pytest.mark.parametrize(
    "main,usage",
    [
        (GOOD, "- Aux usage: main does NOT call aux"),
        (
            "def total(xs, start):\n    aux(xs)\n    s = sum(xs)\n    return s + start",
            "- Aux usage: called but misused (Line 2: standalone call (not assigned))",
        ),
        (
            "def total(xs, start):\n    s = aux(xs)\n    t = s + start\n    return t",
            "- Aux usage: main calls aux and uses its result",
        ),
    ],
)
def test_aux_usage_lines(main, usage):
  _, main_prompt = transition("level_feedback", (AUX, main), sandbox_slice="all")
  assert "- Tests: 4/4 passed\n" + usage + "\n\nRevise your total" in main_prompt
  assert "thin wrapper" not in main_prompt


def test_syntax_error_skips_tests():
  aux_prompt, _ = transition("level_feedback", (AUX, "def total(xs, start):\n    return (sum(xs"))
  assert "- Syntax: ERROR (Combined code has syntax error: " in aux_prompt
  assert "  SyntaxError at line 5, col 16: '(' was never closed\n" in aux_prompt
  assert "- Tests: no test cases found\n" in aux_prompt


def test_slices_select_the_asserts_but_the_failures_are_real():
  _, main_prompt = transition("level_feedback", sandbox_slice="all")
  assert "- Tests: 0/4 passed\n" in main_prompt and main_prompt.count("Failed case:") == 4
  _, main_prompt = transition("level_feedback", sandbox_slice=-1)
  assert (
      "- Tests: 0/1 passed\n  Failed case: assert total([1, 1], 0) == 2 -> AssertionError: \n"
      in main_prompt
  )


def test_timeouts_are_reported_and_capped():
  loop = "def total(xs, start):\n    while True:\n        pass\n    return 0"
  _, main_prompt = transition(
      "level_feedback", (AUX, loop), sandbox_slice="all", timeout_per_assert_s=0.2
  )
  assert "- Tests: 0/4 passed\n" in main_prompt
  # three timeouts stop the run: the fourth assert is not listed
  assert main_prompt.count("-> TimeoutException: Code execution timed out") == 3


def test_level_passed_passed_plain_and_bandit_texts():
  aux_prompt, main_prompt = transition("level_passed")
  assert main_prompt == (
      _head("main responses", "MAIN PROMPT 1", WRAPPER) + "Signals:\n- Implementation: OK\n"
      "- Syntax: Syntax correct\n- Tests: No tests passed\n"
      "- Aux usage: Aux call present and used\n\n"
      "Revise your total(...) accordingly. Output ONLY the function code."
  )
  assert aux_prompt.endswith(
      "Signals:\n- Implementation: OK\n- Syntax: Syntax correct\n"
      "- Tests: No tests passed\n\n"
      "Revise your aux(...) accordingly. Output ONLY the function code."
  )
  aux_prompt, main_prompt = transition("passed", (AUX, GOOD), sandbox_slice="all")
  assert main_prompt.endswith(
      "\n\nSignal: All levels passed\n\n"
      "Revise your total(...) if needed. Output ONLY the function code."
  )
  assert transition("passed")[0].endswith(
      "Signal: Not all levels passed\n\nRevise your aux(...) if needed. "
      "Output ONLY the function code."
  )
  assert transition("plain")[0] == (
      _head("aux(...) responses", "AUX PROMPT 1", AUX)
      + "Revise your aux(...) accordingly. Output ONLY the function code."
  )
  assert transition("bandit") == ["AUX PROMPT 1", "MAIN PROMPT 1"]


def test_single_agent_level_feedback():
  (prompt,) = transition("level_feedback", (GOOD,), history=([["P1"]], [[GOOD]]), num_agents=1)
  assert prompt == (
      _head("responses", "P1", GOOD) + "Static and execution diagnostics:\n"
      "- Main definition: FOUND (Main function (total) properly defined with return statement)\n"
      "- Syntax: OK (Combined code syntax OK)\n- Tests: 1/1 passed\n"
      "\nRevise your total(...) accordingly. Output ONLY the function code with no extra text."
  )


class ScriptedExpert:
  """Answers from a script; records the requests."""

  def __init__(self, answers):
    self.answers, self.requests = list(answers), []

  def __call__(self, prompt):
    self.requests.append(prompt)
    answer = self.answers.pop(0)
    if isinstance(answer, Exception):
      raise answer
    return answer


def test_expert_edits_retries_and_formats_the_edits():
  expert = ScriptedExpert(
      [
          RuntimeError("API down"),
          "no json here",
          'Sure. {"aux": "draft"} and finally {"aux": "  def aux(xs): ...  ", "main": "use start"}',
      ]
  )
  aux_prompt, main_prompt = transition("expert_edits", expert=expert)
  assert len(expert.requests) == 3
  request = expert.requests[0]
  assert request.startswith(
      "You are an expert reviewing code collaboratively written by two "
      "agents for the task: " + TASK["prompt"]
  )
  assert request.endswith(
      "Here is the current combined code to consider:\n" + AUX + "\n\n" + WRAPPER + "\n"
  )
  assert aux_prompt == (
      _head("aux(...) responses", "AUX PROMPT 1", AUX)
      + "Here is edited snippet from an expert model:\ndef aux(xs): ...\n\n"
      "Revise your aux(...) accordingly. Output ONLY the function code with "
      "no extra text."
  )
  assert main_prompt.endswith(
      "Here is edited snippet from an expert model:\nuse start\n\n"
      "Revise your total(...) accordingly. Output ONLY the function code "
      "with no extra text."
  )


def test_expert_failing_three_times_gives_empty_edits():
  expert = ScriptedExpert(["nope", ValueError("x"), "[1, 2]", '{"aux": "never asked"}'])
  aux_prompt, _ = transition("expert_edits", expert=expert)
  assert len(expert.requests) == 3
  assert "Here is edited snippet from an expert model:\n\n\nRevise your aux(...)" in aux_prompt


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="external mode 'oracle'"):
    transition("oracle")
  with pytest.raises(ValueError, match="agent_completions"):
    transition("plain", completions=(AUX,))
  with pytest.raises(ValueError, match="needs an expert model"):
    transition("expert_edits")
  with pytest.raises(ValueError, match="num_agents"):
    transition("plain", num_agents=3)
  with pytest.raises(ValueError, match="entry_point"):
    feedback.build_transition("plain", {"prompt": "", "test": ""}, [AUX, GOOD], *HISTORY)
