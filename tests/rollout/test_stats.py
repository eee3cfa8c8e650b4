"""Rollout statistics (`rollout.stats`): reward components, path success, engine counters."""

import dataclasses

import numpy as np
import pytest

from mtrl_jax.envs import Thread
from mtrl_jax.envs.faults import Fault, FaultKind
from mtrl_jax.envs.runner import StepOutcome
from mtrl_jax.envs.reward import RewardConfig, compose_reward
from mtrl_jax.rollout import ActionRecord, TreeConfig
from mtrl_jax.rollout import stats
from mtrl_jax.rollout.records import StepRecord
from mtrl_jax.rollout import RolloutTimes
from mtrl_jax.rollout.env_transition import _record
from mtrl_jax.rollout.completion import Completion
from mtrl_jax.rollout.tree import Tree

REWARD = RewardConfig(step_penalty=-0.05, tool_penalty=-0.2, shaping_weight=0.5)


def _step(done, **parts):
  """A real step record, as `EnvTransition` builds it from a `StepOutcome`."""
  out = StepOutcome(
      next_threads=None if done else (Thread(()),),
      grades={},
      reward=compose_reward(REWARD, **parts),
      faults=(),
  )
  return dataclasses.replace(_record(out, {}), done=done)


def _action(*steps):
  return ActionRecord(tuple(steps))


def test_reward_components_per_valid_action_sum_over_substeps():
  tree = Tree(TreeConfig(num_turns=1, num_generations=3))
  root = tree.add_root([[1, 2]])
  comp = Completion(np.array([3], np.int32), np.array([-0.5], np.float32))
  tree.set_completions(root, [[comp] * 3])
  one = _action(_step(True, outcome=1.0, steps=1))  # 1.0 - 0.05
  # Two sub-steps: a bad tool call with a shaping grade of 0.5, then a wrong answer.
  two = _action(_step(False, steps=1, invalid_calls=1, shaping=0.5), _step(True, steps=1))
  masked = _action(dataclasses.replace(_step(True, outcome=1.0, steps=1), valid=False))
  totals = [0.95, -0.05 - 0.2 + 0.25 - 0.05, 0.95]
  tree.record(root, totals, valid_B=[True, True, False], actions=[one, two, masked])
  m = stats.reward_metrics(tree)
  # Means over the two valid actions (the masked one is not trained on):
  assert m == pytest.approx(
      {
          "reward/outcome": (1.0 + 0.0) / 2,
          "reward/step_penalty": (-0.05 - 0.10) / 2,
          "reward/tool_penalty": (0.0 - 0.2) / 2,
          "reward/shaping": (0.0 + 0.25) / 2,
      },
      abs=1e-12,
  )
  # The four parts add up to the mean reward of the valid actions.
  assert sum(m.values()) == pytest.approx(np.mean(totals[:2]), abs=1e-12)
  rollout = stats.rollout_metrics(tree.finalize(), success_threshold=0.0)
  assert {k: rollout[k] for k in m} == m  # logged with every RL step


def test_path_success_weighs_each_sampled_path_not_each_ended_action():
  """Hand-worked, T = 2, G = 2. Root A: action 0 succeeds at once, action 1 continues to
  a child whose two actions succeed and fail: a sampled path succeeds with chance
  1/2 + 1/2 * 1/2 = 0.75. Root B: action 0 is masked, action 1 continues to a child
  cut at turn T without ending (no success): 0. Mean over roots 0.375. The ended-action
  share `rollout/success` is 3 / 4: it also counts the masked win."""
  tree = Tree(TreeConfig(num_turns=2, num_generations=2))
  comp = Completion(np.array([3], np.int32), np.array([-0.5], np.float32))
  win = _action(_step(True, outcome=1.0, steps=1))
  lose, go = _action(_step(True, outcome=-1.0, steps=1)), _action(_step(False, steps=1))
  a = tree.add_root([[1]])
  tree.set_completions(a, [[comp] * 2])
  tree.record(a, [1.0, 0.0], actions=[win, go])
  a1 = tree.add_child(a, 1, [[1, 3, 2]])
  tree.set_completions(a1, [[comp] * 2])
  tree.record(a1, [1.0, -1.0], actions=[win, lose])
  b = tree.add_root([[2]])
  tree.set_completions(b, [[comp] * 2])
  masked_win = _action(dataclasses.replace(win.steps[0], valid=False))
  tree.record(b, [1.0, 0.0], valid_B=[False, True], actions=[masked_win, go])
  b1 = tree.add_child(b, 1, [[2, 3, 2]])
  tree.set_completions(b1, [[comp] * 2])
  tree.record(b1, [0.0, 0.0], actions=[go, go])
  tree.finalize()
  assert stats.path_success(tree, success_threshold=0.0) == pytest.approx(0.375, abs=1e-12)
  m = stats.rollout_metrics(tree, success_threshold=0.0)
  assert m["rollout/path_success"] == pytest.approx(0.375, abs=1e-12)
  assert m["rollout/success"] == pytest.approx(3 / 4, abs=1e-12)


def test_reward_metrics_empty_without_records():
  tree = Tree(TreeConfig(num_turns=1, num_generations=2))
  root = tree.add_root([[1]])
  comp = Completion(np.array([3], np.int32), np.array([-0.5], np.float32))
  tree.set_completions(root, [[comp] * 2])
  tree.record(root, [0.0, 1.0])  # scripted transitions without step records
  assert stats.reward_metrics(tree) == {}


def test_engine_counters_become_metrics():
  tree = Tree(TreeConfig(num_turns=1, num_generations=2))
  tree.engine = {
      "prefill_tokens": 30,
      "reused_tokens": 90,
      "decode_tokens": 40,
      "slot_steps": 50,
      "chunks": 4,
      "occupancy_sum": 3.0,
      "parked_sum": 1.0,
      "evictions": 2,
  }
  tree.times = RolloutTimes(
      total=2.0, generation=1.5, environment=1.0, overlap=0.5, device_idle=0.25, env_waiting=1.0
  )
  m = stats.engine_metrics(tree)
  assert m["engine/kv_reuse"] == pytest.approx(0.75)  # 90 of 120 context tokens cached
  assert m["engine/decode_efficiency"] == pytest.approx(0.8)
  assert m["engine/slot_occupancy"] == pytest.approx(0.75) and m["engine/decode_chunks"] == 4
  assert m["engine/slot_parked"] == pytest.approx(0.25)
  assert m["engine/evictions"] == 2 and m["engine/prefill_tokens"] == 30
  assert m["time/overlap"] == 0.5 and m["time/device_idle"] == 0.25


def _tool_step(calls, done=True, faults=(), valid=True):
  """A step of an environment that offers tools: `calls` tool turns answered it."""
  return StepRecord(
      0.0, valid=valid, faults=tuple(faults), done=done, details={"tool_calls": [calls]}
  )


def test_tool_use_and_episodes_past_the_first_turn_on_a_hand_built_tree():
  """Hand-counted, T = 2, G = 2.

  Root A: action 0 makes 2 calls (one rejected: tool_error from tool:lookup) and goes on
  to a child whose 2 actions answer; action 1 answers at once.
  Root B: action 0 sends 1 malformed call (model_format from tool:<parse>) and goes on to
  a child whose action 0 answers without a call or an answer tag (model_format from the
  environment: not a tool call's) and action 1 is masked; action 1 makes 1 call in a
  sub-step, then answers.

  Turns (one per step, the masked one included): 9, 3 with a call. Calls 2 + 1 + 1 = 4,
  2 with a tool-set fault -> 2 valid; 1 parse failure -> 1/4 per call. Episodes (valid
  actions without a child): A.1 (1 turn, 0 calls), A1.0 and A1.1 (2 turns, 2 calls), B.1
  (2 turns: a sub-step; 1 call), B1.0 (2 turns, 1 call): 6 / 5 calls per episode, 4 of 5
  past their first turn."""
  rejected = Fault(FaultKind.TOOL_ERROR, "tool:lookup", "unknown city")
  malformed = Fault(FaultKind.MODEL_FORMAT, "tool:<parse>", "malformed tool call")
  no_answer = Fault(FaultKind.MODEL_FORMAT, "calculator", "neither a tool call nor an answer")
  infra = Fault(FaultKind.INFRASTRUCTURE, "environment", "down")
  tree = Tree(TreeConfig(num_turns=2, num_generations=2))
  comp = Completion(np.array([3], np.int32), np.array([-0.5], np.float32))
  answer = _action(_tool_step(0))
  a = tree.add_root([[1]])
  tree.set_completions(a, [[comp] * 2])
  tree.record(a, [0.0, 0.0], actions=[_action(_tool_step(2, False, [rejected])), answer])
  a1 = tree.add_child(a, 0, [[1, 3, 2]])
  tree.set_completions(a1, [[comp] * 2])
  tree.record(a1, [0.0, 0.0], actions=[answer, answer])
  b = tree.add_root([[2]])
  tree.set_completions(b, [[comp] * 2])
  substep = _action(dataclasses.replace(_tool_step(1, False), continues_turn=True), _tool_step(0))
  tree.record(b, [0.0, 0.0], actions=[_action(_tool_step(1, False, [malformed])), substep])
  b1 = tree.add_child(b, 0, [[2, 3, 2]])
  tree.set_completions(b1, [[comp] * 2])
  tree.record(
      b1,
      [0.0, 0.0],
      valid_B=[True, False],
      actions=[
          _action(_tool_step(0, faults=[no_answer])),
          _action(_tool_step(0, faults=[infra], valid=False)),
      ],
  )
  tree.finalize()
  assert sorted(stats.episodes(tree)) == [(1, 0), (2, 1), (2, 1), (2, 2), (2, 2)]
  m = stats.rollout_metrics(tree, success_threshold=0.0)
  assert {k: v for k, v in m.items() if k.startswith("tools/")} == pytest.approx(
      {
          "tools/turns_with_call": 3 / 9,
          "tools/calls": 4.0,
          "tools/valid_calls": 2.0,
          "tools/parse_failures_per_call": 1 / 4,
          "tools/calls_per_episode": 6 / 5,
      },
      abs=1e-12,
  )
  assert m["rollout/past_first_turn"] == pytest.approx(4 / 5, abs=1e-12)


def test_an_environment_without_tools_logs_no_tool_keys():
  tree = Tree(TreeConfig(num_turns=2, num_generations=2))
  comp = Completion(np.array([3], np.int32), np.array([-0.5], np.float32))
  root = tree.add_root([[1]])
  tree.set_completions(root, [[comp] * 2])
  tree.record(root, [1.0, 1.0], actions=[_action(_step(True, outcome=1.0, steps=1))] * 2)
  tree.finalize()
  m = stats.rollout_metrics(tree, success_threshold=0.0)
  assert (
      not [k for k in m if k.startswith("tools/")]
      and stats.tool_metrics(tree, stats.episodes(tree)) == {}
  )
  assert m["rollout/past_first_turn"] == 0.0  # both episodes ended at the first message
