"""The calculator demo task: generation, tool, scripted episodes and rewards."""

import numpy as np
import pytest

from mtrl_jax.envs import FaultKind, RewardConfig, StepLimits, resolve_factory, rollout_scripted
from mtrl_jax.tasks import calculator
from mtrl_jax.testing import byte_renderer

REWARD = RewardConfig(outcome_weight=1.0, step_penalty=-0.05, tool_penalty=-0.2)


@pytest.fixture
def renderer():
  """The shared renderer fixture with the calculator's extra specials."""
  return byte_renderer(calculator.EXTRA_SPECIALS)


def test_evaluate_matches_python_on_random_expressions():
  rng = np.random.default_rng(0)
  for _ in range(200):
    n = rng.integers(2, 5)
    expr = "".join(f"{rng.integers(0, 1000)}{rng.choice(['+', '-', '*'])}" for _ in range(n - 1))
    expr += str(rng.integers(0, 1000))
    assert calculator.evaluate(expr) == eval(expr)  # reference: Python itself
  for bad in ("2**10", "__import__('os')", "1/2", "3+", "x+1"):
    with pytest.raises(ValueError):
      calculator.evaluate(bad)


def test_tasks_are_deterministic_and_splits_differ():
  a = [calculator.make_task("train", i) for i in range(20)]
  assert a == [calculator.make_task("train", i) for i in range(20)]
  assert a != [calculator.make_task("eval", i) for i in range(20)]
  for t in a:
    assert 2 <= t["difficulty"] <= 3
    assert t["answers"][0] == calculator.evaluate(t["expression"])
  with pytest.raises(ValueError, match="allowed"):
    calculator.make_task("validation", 0)


def _env(task):
  return resolve_factory("calculator").create_environment(task)


def test_outcome_range_covers_every_grade():
  # Grades are -1 (wrong, truncated, too many calls, no answer) or +1.
  assert resolve_factory("calculator").outcome_range == (-1.0, 1.0)


def test_golden_episode_succeeds_with_two_user_turns_and_two_tool_calls(renderer):
  task = calculator.make_task("eval", 3)
  convo = calculator.golden_conversation(task)
  assert [r for r, _ in convo].count("user") == 2 and [r for r, _ in convo].count("tool") == 2
  texts = [c for r, c in convo if r == "assistant"]
  outs, seen = rollout_scripted(
      _env(task), texts, StepLimits(max_turns=8), reward_cfg=REWARD, renderer=renderer
  )
  assert [o.done for o in outs] == [False, False, False, True]
  assert outs[-1].reward.outcome == 1.0
  # total = +1 outcome, -0.05 per step; intermediate steps only pay the step penalty
  assert [round(o.reward.total, 6) for o in outs] == [-0.05, -0.05, -0.05, 0.95]
  ledger = seen[-1].ledger
  trainable_text = renderer.tokenizer.decode([i for i, t in zip(ledger.ids, ledger.trainable) if t])
  assert str(task["answers"][0]) in trainable_text  # the policy's own answer is trained on
  assert task["question"] not in trainable_text  # the user's text never is


def test_wrong_answer_ends_the_episode_with_minus_one(renderer):
  task = calculator.make_task("eval", 4)
  texts = [c for r, c in calculator.golden_conversation(task) if r == "assistant"]
  texts[1] = "<answer>-12345</answer>"
  outs, _ = rollout_scripted(_env(task), texts, reward_cfg=REWARD, renderer=renderer)
  assert len(outs) == 2 and outs[-1].done and outs[-1].reward.outcome == -1.0


def test_invalid_expression_is_a_penalised_tool_error_and_the_episode_recovers(renderer):
  task = calculator.make_task("eval", 5)
  golden = [c for r, c in calculator.golden_conversation(task) if r == "assistant"]
  bad_call = golden[0].replace(task["expression"], task["expression"] + "+")
  outs, seen = rollout_scripted(
      _env(task), [bad_call] + golden, reward_cfg=REWARD, renderer=renderer
  )
  assert outs[0].invalid_calls == 1 and not outs[0].masked
  assert [f.kind for f in outs[0].faults] == [FaultKind.TOOL_ERROR]
  assert outs[0].reward.tool == pytest.approx(-0.2)
  assert seen[1].turns[-2].content.startswith("error:")  # the policy sees the error
  assert outs[-1].reward.outcome == 1.0


def test_message_without_call_or_answer_is_a_model_format_fault(renderer):
  outs, _ = rollout_scripted(
      _env(calculator.make_task("eval", 6)), ["hello"], reward_cfg=REWARD, renderer=renderer
  )
  assert outs[0].done and outs[0].reward.outcome == -1.0
  assert [f.kind for f in outs[0].faults] == [FaultKind.MODEL_FORMAT]


def test_episode_is_short_in_tokens(renderer):
  lengths = [
      len(
          renderer.render_conversation(
              calculator.golden_conversation(calculator.make_task("train", i))
          )
      )
      for i in range(50)
  ]
  assert max(lengths) <= 96  # keeps SFT/RL steps fast on CPU (docs/design.md section 3)


def test_truncation_is_a_failure_not_a_free_zero(renderer):
  """Rambling into the turn cap must not beat a wrong answer (-1)."""
  task = calculator.make_task("eval", 7)
  outs, _ = rollout_scripted(
      _env(task), ["<tool_call>"] * 3, StepLimits(max_turns=2), reward_cfg=REWARD, renderer=renderer
  )
  assert outs[-1].truncated and outs[-1].reward.outcome == -1.0


def test_levels_grow_operands_and_digits_and_level_2_is_the_default_task(renderer):
  stats = []
  for level in range(len(calculator.LEVELS)):
    tasks = [calculator.make_task("train", i, level=level) for i in range(300)]
    assert all(t["level"] == level for t in tasks)
    operands = [t["difficulty"] for t in tasks]
    digits = max(
        len(x)
        for t in tasks
        for x in t["expression"].replace("*", "+").replace("-", "+").split("+")
    )
    stats.append((min(operands), max(operands), digits))
    # The hardest level's golden episode still fits configs/calculator.py's env.max_tokens.
    longest = max(
        len(renderer.render_conversation(calculator.golden_conversation(t))) for t in tasks
    )
    assert longest <= 160 - 32, (level, longest)
  assert stats == list(calculator.LEVELS)
  for i in range(20):
    default = calculator.make_task("eval", i)
    assert calculator.make_task("eval", i, level=2) == {**default, "level": 2}
  with pytest.raises(ValueError, match=r"calculator level=5; allowed: 0 \.\. 4"):
    calculator.calculator_tasks("train", level=5)


def _edit_distance_bfs(a: str, b: str, alphabet: str) -> int:
  """Reference: breadth-first search over single-character edits (not a DP table)."""
  frontier, seen, d = {a}, {a}, 0
  while b not in frontier:
    nxt = set()
    for s in frontier:
      for i in range(len(s) + 1):
        for c in alphabet:
          nxt.add(s[:i] + c + s[i:])  # insert
          if i < len(s):
            nxt.add(s[:i] + c + s[i + 1 :])  # substitute
        if i < len(s):
          nxt.add(s[:i] + s[i + 1 :])  # delete
    frontier, d = nxt - seen, d + 1
    seen |= frontier
  return d


def test_copy_similarity_against_hand_worked_cases_and_a_search_reference():
  sim = calculator.copy_similarity
  # Hand-worked: 3 substitutions of 8 ("4|0|-70-|46" vs "4|9|-70-|64"); one deletion of 5.
  assert sim("40-70-46", "49-70-64") == pytest.approx(1 - 3 / 8)
  assert sim("12+3", "12+34") == pytest.approx(1 - 1 / 5)
  assert sim("12+34", "12+34") == 1.0 and sim("", "") == 1.0 and sim("", "7+1") == 0.0
  assert sim("9*9", "12+34") == pytest.approx(0.0)  # 5 edits of 5
  rng = np.random.default_rng(0)
  for _ in range(150):
    a, b = ("".join(rng.choice(list("1+-"), size=rng.integers(0, 5))) for _ in range(2))
    if not a and not b:
      continue
    want = 1 - _edit_distance_bfs(a, b, "1+-") / max(len(a), len(b))
    assert sim(a, b) == pytest.approx(want) == pytest.approx(sim(b, a)), (a, b)


def test_first_tool_call_of_each_stage_is_graded_copy_and_becomes_shaping(renderer):
  task = calculator.make_task("eval", 8)
  golden = [c for r, c in calculator.golden_conversation(task) if r == "assistant"]
  want = calculator.stage_expressions(task)
  assert want[0] == task["expression"] and calculator.evaluate(want[1]) == task["answers"][1]
  # Stage 0: a miscopied call (last character dropped; still a valid expression), a retry
  # with the right expression (not graded: retries collect no shaping), the answer; then
  # stage 1 golden.
  wrong = golden[0].replace(want[0], want[0][:-1])
  cfg = RewardConfig(outcome_weight=1.0, step_penalty=-0.05, shaping_weight=0.5)
  outs, _ = rollout_scripted(
      _env(task), [wrong, golden[0]] + golden[1:], reward_cfg=cfg, renderer=renderer
  )
  assert [sorted(o.grades) for o in outs] == [["copy"], [], [], ["copy"], ["grade"]]
  first = outs[0].grades["copy"].score
  assert first == pytest.approx(1 - 1 / len(want[0]))
  assert outs[0].reward.shaping == pytest.approx(0.5 * first)
  assert outs[1].reward.shaping == 0.0  # the retry
  assert outs[3].grades["copy"].score == 1.0 and outs[3].reward.shaping == pytest.approx(0.5)
  assert outs[-1].done and outs[-1].reward.outcome == 1.0 and outs[-1].reward.shaping == 0.0
  # A call without an expression argument scores 0.
  no_expr = golden[0].replace('"expression"', '"expr"')
  outs, _ = rollout_scripted(_env(task), [no_expr], reward_cfg=cfg, renderer=renderer)
  assert outs[0].grades["copy"].score == 0.0


@pytest.mark.parametrize("num_followups", [1, 3])
def test_max_graded_turns_bounds_the_copy_grades_of_an_episode(renderer, num_followups):
  """The factory's declared bound is reached (every stage called twice, then answered)
  and not passed: one graded call per stage."""
  task = calculator.make_task("eval", 5, num_followups=num_followups)
  golden = calculator.golden_conversation(task)
  script = []
  for role, content in golden:
    if role == "assistant":
      script += [content, content] if content.startswith("<tool_call>") else [content]
  outs, _ = rollout_scripted(
      _env(task),
      script,
      reward_cfg=REWARD,
      renderer=renderer,
      limits=StepLimits(max_turns=len(script)),
  )
  assert outs[-1].done and outs[-1].reward.outcome == 1.0
  graded = sum("copy" in o.grades for o in outs)
  bound = resolve_factory("calculator").max_graded_turns({"num_followups": num_followups})
  assert graded == bound == num_followups + 1
  assert resolve_factory("calculator").max_graded_turns({}) == 2  # make_task's default


def test_demo_config_dominance_check_counts_graded_turns_not_the_turn_cap():
  """shaping_weight 0.5 x 2 graded calls = 1 < the outcome gap 2 (8 x 0.5 = 4 under the
  turn cap alone would warn); 1.0 x 2 = 2 reaches it and warns."""
  import warnings

  from configs import calculator as calc_config
  from mtrl_jax.envs import RewardDominanceWarning
  from mtrl_jax.run import components, experiment

  c = calc_config.get_config()
  c.reward.shaping_weight = 0.5
  with warnings.catch_warnings():
    warnings.simplefilter("error", RewardDominanceWarning)
    components.make_factory(experiment.build(c))
  c.reward.shaping_weight = 1.0
  with pytest.warns(RewardDominanceWarning, match=r"graded steps \(2\) = 2 >= "):
    components.make_factory(experiment.build(c))
