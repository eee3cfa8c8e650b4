"""The guess example of docs/recipes.md: its golden episode plays through the environment,
a guess against the hints is graded down per turn, and the SFT file is its golden
conversations."""

import os

import pytest

from mtrl_jax import data
from mtrl_jax.envs import StepLimits, resolve_factory, rollout_scripted
from mtrl_jax.run import warmup
from mtrl_jax.tasks import guess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_golden_episode_finds_the_number_with_consistent_guesses():
  task = dict(data.resolve_task_source("guess", "eval")[5])
  env = resolve_factory("guess").create_environment(task)
  golden = guess.golden_conversation(task)
  first = env.initial_thread()
  assert [(t.role, t.content) for t in first.turns] == golden[:2]  # system prompt included
  policy = [content for role, content in golden if role == "assistant"]
  outs, _ = rollout_scripted(env, policy, StepLimits(max_turns=10))
  assert [o.done for o in outs] == [False] * (len(policy) - 1) + [True]
  assert outs[0].next_thread.turns[-1].content == str(task["high"] // 2)  # the tool's reply
  assert [o.grades["consistent"].score for o in outs[1:-1]] == [1.0] * (len(policy) - 2)
  assert outs[-1].grades["found"].score == 1.0


def test_a_guess_against_the_hints_scores_0_and_the_last_guess_ends_unfound():
  task = {"number": 7, "high": 20, "split": "train", "index": 0}
  env = resolve_factory("guess", max_guesses=3).create_environment(task)
  outs, _ = rollout_scripted(
      env,
      ["<answer>10</answer>", "<answer>12</answer>", "<answer>3</answer>"],
      StepLimits(max_turns=10),
  )
  assert [o.next_thread.turns[-1].content for o in outs[:2]] == ["lower", "lower"]
  assert outs[1].grades["consistent"].score == 0.0  # 12 after "lower" than 10
  assert outs[2].done and outs[2].grades["found"].score == 0.0


def test_the_sft_file_is_the_golden_conversations_of_the_first_train_tasks():
  path = os.path.join(ROOT, "docs", "guess_sft.jsonl")
  for i in range(6):
    want = guess.golden_conversation(guess.make_task("train", i % 4))
    assert warmup.file_conversation(guess.make_task("train", i), path) == want
  with pytest.raises(ValueError, match="guess split 'dev'"):
    guess.make_task("dev", 0)
