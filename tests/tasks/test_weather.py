"""The weather example: its task source serves tasks its environment runs."""

import json

import pytest

from mtrl_jax import data
from mtrl_jax.envs import StepLimits, resolve_factory, rollout_scripted
from mtrl_jax.tasks import weather


def call(name, **arguments):
  return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_task_source_is_registered_and_deterministic():
  assert "weather" in data.registered_task_sources()
  train = data.resolve_task_source("weather", "train", size=16)
  assert len(train) == 16
  assert [train[i] for i in range(16)] == [weather.make_task("train", i) for i in range(16)]
  assert {t["city"] for t in (train[i] for i in range(16))} <= set(weather.TEMPS_C)
  assert len({train[i]["city"] for i in range(16)}) > 1
  assert len(data.resolve_task_source("weather", "eval")) == 100
  with pytest.raises(ValueError, match="weather split 'validation'"):
    data.resolve_task_source("weather", "validation")


def test_env_accepts_the_tasks_and_a_scripted_episode_succeeds():
  factory = resolve_factory("weather")
  task = dict(data.resolve_task_source("weather", "eval")[3])
  env = factory.create_environment(task)
  first = env.initial_thread()
  assert first.turns[-1].role == "user"
  assert first.turns[-1].content == f"What is the temperature in {task['city'].title()}?"
  outs, _ = rollout_scripted(
      env,
      [call("get_weather", city=task["city"].title()), f"<answer>{task['answer']}</answer>"],
      StepLimits(max_turns=4),
  )
  assert [o.done for o in outs] == [False, True]
  assert outs[0].grades["tools_ok"].score == 1.0
  assert outs[0].next_thread.turns[-1].content == str(task["answer"])
  assert outs[1].grades["final"].components == {"correct": 1.0, "concise": 1.0}
