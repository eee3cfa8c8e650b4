"""Code clean-up, static checks and turn-1 prompts of the code task."""

import pytest

from mtrl_jax.tasks.code import analysis, prompts

TASK = {
    "prompt": "from typing import List\n\n\ndef total(xs: List[int], start: int) -> int:\n"
    '    """Sum of xs plus start."""\n',
    "entry_point": "total",
}


def test_cleanup_strips_fences_and_prose_and_keeps_def_blocks():
  raw = (
      "Here is the solution:\n```python\ndef aux(x):\n    # helper\n"
      "    Note this line.\n    return x + 1\n\nprint(aux(1))\n```\nThat is all."
  )
  assert analysis.cleanup_code(raw) == "def aux(x):\n    # helper\n    return x + 1"
  assert analysis.cleanup_code("no code at all") == ""
  assert analysis.cleanup_code(None) == ""


def test_cleanup_loses_the_outer_body_after_a_nested_def():
  # Reference quirk (kept on purpose): a nested def starts a new block, and the
  # outer function's lines after it are not "more indented" than the nested def.
  raw = "def f(x):\n    def g(y):\n        return y + 1\n    return g(x)"
  assert analysis.cleanup_code(raw) == "def f(x):\n\n    def g(y):\n        return y + 1"


def test_extract_function_and_definition_checks():
  raw = "def aux(x):\n    return x\n\ndef total(xs, start):\n    s = start\n    return s\n"
  assert analysis.extract_function(raw, "total") == (
      "def total(xs, start):\n    s = start\n    return s"
  )
  assert analysis.extract_function(raw, "missing") == ""
  assert analysis.check_function_definition(raw, "aux", "Aux function") == (
      True,
      "Aux function properly defined with return statement",
  )
  assert analysis.check_function_definition("def aux(x):\n    pass", "aux", "Aux function") == (
      False,
      "Aux function missing return statement",
  )
  assert analysis.check_function_definition("x = 1", "aux", "Aux function") == (
      False,
      "Aux function not defined",
  )


def test_syntax_check_reports_position():
  ok, msg, err = analysis.check_syntax("def f(:\n  pass", "Combined code")
  assert not ok and msg.startswith("Combined code has syntax error: ")
  assert err == {"line": 1, "offset": 7, "msg": "invalid syntax"}
  assert analysis.check_syntax("x = 1", "Combined code") == (True, "Combined code syntax OK", None)


def test_imports_and_combined_code():
  prompt = "import math\nfrom typing import List\n\nimport math\ndef f(x):\n    import os\n"
  assert analysis.extract_imports(prompt) == "import math\nfrom typing import List\nimport os"
  combined = analysis.combine_code(
      "```python\ndef aux():\n    return 1\n```", "def f():\n    return aux()", "import math"
  )
  assert combined == "import math\n\ndef aux():\n    return 1\n\ndef f():\n    return aux()"


def test_extract_test_cases_keeps_single_line_candidate_asserts():
  test = (
      "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate(1) == 2\n"
      "    assert True, 'a debugging message'\n    assert(candidate(2) == 3)\n"
      "    assert candidate(1) == 2\n    assert abs(candidate(3) - 4) < 1e-6\n"
      "    assert candidate([1,\n        2]) == 3\n"
  )
  assert analysis.extract_test_cases(test, "f") == [
      "assert f(1) == 2",
      "assert abs(f(3) - 4) < 1e-6",
      "assert f([1,",
  ]
  assert analysis.extract_test_cases("def helper():\n    pass", "f") == []


@pytest.mark.parametrize(
    "main,expected",
    [
        ("def f(x):\n    return aux(x)", True),
        ("def f(x):\n    r = aux(x)\n    return r", True),
        ("def f(x):\n    pass", False),  # no aux mention: not a wrapper of it
        ("def f(x):\n    # only a comment", True),  # empty body
        ("def f(x):\n    r = aux(x)\n    return r + 1", False),
        ("def f(x):\n    y = x * 2\n    r = aux(y)\n    return r", False),
        # Reference quirk: a closing triple quote on its own line re-opens
        # docstring mode, so the body is not seen and counts as empty.
        (
            'def f(x):\n    """Doc.\n    more\n    """\n    y = aux(x)\n    z = y + 1\n    return z',
            True,
        ),
    ],
)
def test_thin_wrapper_detection(main, expected):
  assert analysis.is_thin_wrapper(main) is expected


def test_aux_usage_checks():
  assert analysis.calls_aux("def f(x):\n    return aux (x) + 1")
  assert not analysis.calls_aux("def f(x):\n    return auxiliary(x)")
  # The reward's discarded-value regex only sees `aux (c)`: one space, one char.
  assert analysis.discarded_aux_calls("def f(x):\n    aux (x)\n    return 1") == ["Line 2: aux (x)"]
  assert analysis.discarded_aux_calls("def f(x):\n    aux(x)\n    return 1") == []


@pytest.mark.parametrize(
    "main,expected",
    [
        ("def f(x):\n    aux(x)\n    return 1", ["Line 2: standalone call (not assigned)"]),
        ("def f(x):\n    y = aux(x)\n    return 1", ["Line 2: assigned to y but never used"]),
        (
            "def f(x):\n    y = aux(x)\n    y = 2\n    return y",
            ["Line 2: assigned to y but reassigned on line 3 before use"],
        ),
        ("def f(x):\n    y = aux(x)\n    return y + 1", []),
        ("def f(x):\n    return [aux(x), max(aux(x), 1)]", []),
        ("def f(x):\n    return x", []),
    ],
)
def test_misused_aux_calls(main, expected):
  assert analysis.misused_aux_calls(main) == expected


def test_turn_one_prompts_reference_wording():
  assert prompts.extract_function_params(TASK["prompt"]) == ["xs: List[int]", "start: int"]
  main = prompts.main_prompt(TASK)
  assert main.startswith(
      "Solve this coding problem by implementing the required function.\n\n"
      "Problem:\n" + TASK["prompt"] + "\n\nYou have access to a helper "
      "function: aux(...)\n\nIMPORTANT INSTRUCTIONS:\n"
  )
  assert "- Do NOT redefine the aux() function\n- Implement ONLY the 'total' function" in main
  assert main.endswith(
      "Your output should follow this format:\n\n"
      "def total(xs: List[int], start: int):\n # your function code here\n"
      "return result\n"
  )
  aux = prompts.aux_prompt(TASK)
  assert aux.startswith("Create a helper function for this coding problem.\n\nProblem:\n")
  assert aux.endswith("def aux(...):\n # your function code here\nreturn result\n")
  single = prompts.single_agent_prompt(TASK)
  assert "aux" not in single and single.endswith(
      "def total(xs: List[int], start: int):\n    # your function code here\n    return result\n"
  )
  assert prompts.agent_prompts(TASK, 2) == [aux, main]
  assert prompts.agent_prompts(TASK, 1) == [single]


def test_zero_argument_problem_gives_the_literal_error():
  task = {"prompt": "def answer():\n    '''42'''\n", "entry_point": "answer"}
  for fmt in (prompts.aux_prompt, prompts.main_prompt, prompts.single_agent_prompt):
    assert fmt(task) == "Error: Could not extract function information from prompt."
  with pytest.raises(ValueError, match="num_agents"):
    prompts.agent_prompts(TASK, 3)
