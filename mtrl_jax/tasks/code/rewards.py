"""Gated level reward of the aux/main code task (docs/comlrl.md section 3.1).

`execution_reward_aux` scores one joint action (aux helper + main function)
with the reference's four gated levels, max 4.0:

  level 1, structure (0 to 1.0): +0.4 `aux` defined with a return, +0.6 the
      entry point defined with a return; no entry point -> stop.
  level 2, syntax (0 or 0.5): imports of the prompt + cleaned aux + cleaned
      main parse -> +0.5, else stop.
  level 3, tests (0 to 1.0): +passed/total over the asserts extracted from
      `check(candidate)` (all of them, never sliced); none -> stop.
  bonus, cooperation (0 to 1.5): only if a test passed and aux was extracted:
      +0.5 main calls aux, then +1.0 main is not a thin wrapper, -0.5 aux value
      discarded (the reference's narrow regex).

The code runs in the sandbox (`mtrl_jax.envs.sandbox.run_tests`: one process,
the combined code loaded once into globals that already hold `math`, each
assert under its own alarm, the rest skipped after 3 timeouts), not in the
trainer's process. Difference from the reference: it evaluated the call and
the expected value of `assert f(args) == expected` before executing the assert
(running the function twice and failing asserts whose arguments contain a
`)`); here each assert is executed once, as written.

A sandbox failure raises `SandboxError` (an infrastructure fault, never a
reward). The single-agent baseline is `execution_reward_aux("", main, ...)`
(max 2.1); `process_reward` is the reward processor (scale, then shift).
"""

from __future__ import annotations

from mtrl_jax.envs import sandbox
from mtrl_jax.tasks.code import analysis

MAX_REWARD = 4.0
MAX_SINGLE_AGENT_REWARD = 2.1
MAGRPO_SHIFT = -4.0  # processed multi-agent reward <= 0; tau = -0.2 <=> raw > 3.8
GRPO_SHIFT = -2.1
TEST_TIMEOUT_S = 10.0
MAX_TIMEOUTS = 3


def _result(
    l1=0.0,
    l2=0.0,
    test=0.0,
    passed=0,
    total=0,
    timeouts=0,
    usage=0.0,
    anti_wrapper=0.0,
    deduction=0.0,
    level=1,
    **flags,
) -> dict:
  bonus = usage + anti_wrapper - deduction
  total_reward = l1 + l2 + test + bonus
  return dict(
      level_1_reward=l1,
      level_2_reward=l2,
      level_3_reward=test + bonus,
      test_reward=test,
      passed_tests=passed,
      total_tests=total,
      passed_rate=passed / total if total else 0.0,
      timeout_num=timeouts,
      bonus_reward=bonus,
      aux_usage_bonus=usage,
      anti_wrapper_bonus=anti_wrapper,
      called_wo_used_deduction=deduction,
      total_reward=total_reward,
      gated_total_reward=total_reward,
      level_reached=level,
      **flags,
  )


def execution_reward_aux(
    aux: str,
    main: str,
    tests: str,
    entry_point: str,
    prompt: str = "",
    *,
    timeout_per_assert_s: float = TEST_TIMEOUT_S,
    max_timeouts: int = MAX_TIMEOUTS,
) -> dict:
  """Scores one (aux, main) pair on one task.

  Args:
    aux: raw completion of the aux agent ("" for a single agent).
    main: raw completion of the main agent.
    tests: the task's full HumanEval-style test code.
    entry_point: name of the function the tests call.
    prompt: the task's original prompt (its import lines are prepended).
    timeout_per_assert_s: alarm per assert (10 s in the reference).
    max_timeouts: timeouts after which the remaining asserts are skipped.

  Returns:
    A dict with `total_reward` (the reward) and every level:
    level_1_reward (structure), level_2_reward (syntax), test_reward (tests),
    bonus_reward (cooperation, net of the deduction), level_3_reward
    (tests + cooperation), aux_usage_bonus, anti_wrapper_bonus,
    called_wo_used_deduction, passed_tests, total_tests, passed_rate,
    timeout_num, gated_total_reward (= total_reward), level_reached (1-4:
    the last level evaluated) and the booleans aux_defined, main_defined,
    syntax_ok.
  """
  aux_ok, _ = analysis.check_function_definition(aux, "aux", "Aux function")
  main_ok, _ = analysis.check_function_definition(
      main, entry_point, f"Main function ({entry_point})"
  )
  l1 = 0.4 * aux_ok + 0.6 * main_ok
  flags = dict(aux_defined=aux_ok, main_defined=main_ok, syntax_ok=False)
  if not main_ok:
    return _result(l1, level=1, **flags)
  aux_func = analysis.extract_function(aux, "aux")
  main_func = analysis.extract_function(main, entry_point)
  code = analysis.combine_code(aux_func, main_func, analysis.extract_imports(prompt))
  flags["syntax_ok"], _, _ = analysis.check_syntax(code, "Combined code")
  if not flags["syntax_ok"]:
    return _result(l1, level=2, **flags)
  cases = analysis.extract_test_cases(tests, entry_point)
  if not cases:
    return _result(l1, 0.5, level=3, **flags)
  results = sandbox.run_tests(
      code, cases, timeout_per_assert_s, max_timeouts, prelude="import math"
  )
  passed = sum(r.passed for r in results)
  timeouts = sum(r.status == "timeout" for r in results)
  usage = anti_wrapper = deduction = 0.0
  if passed > 0 and aux_func and analysis.calls_aux(main_func):
    usage = 0.5
    anti_wrapper = 0.0 if analysis.is_thin_wrapper(main_func) else 1.0
    deduction = 0.5 if analysis.discarded_aux_calls(main_func) else 0.0
  return _result(
      l1,
      0.5,
      passed / len(cases),
      passed,
      len(cases),
      timeouts,
      usage,
      anti_wrapper,
      deduction,
      level=4,
      **flags,
  )


def single_agent_reward(
    main: str, tests: str, entry_point: str, prompt: str = "", **kwargs
) -> dict:
  """The GRPO baseline: `execution_reward_aux` with an empty aux (max 2.1)."""
  return execution_reward_aux("", main, tests, entry_point, prompt, **kwargs)


def process_reward(reward: float, *, scale: float = 1.0, shift: float = MAGRPO_SHIFT) -> float:
  """The reward processor of the reference runs: `reward * scale + shift`.

  Code runs use scale 1 and shift -4 (MAGRPO) or -2.1 (GRPO), so processed
  rewards are <= 0 and the termination threshold lives on the shifted scale.
  """
  return reward * scale + shift
