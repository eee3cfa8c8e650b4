"""The calculator demo task as a user-turn tree: tool calls are sub-steps of one action."""

import json
import random
import time

import jax
import numpy as np
import pytest

from mtrl_jax.envs import RewardConfig, StepLimits, resolve_factory
from mtrl_jax.tasks import calculator
from mtrl_jax.rollout import (TreeConfig, expand_tree, node_records, write_rollout_dump)
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax import testing
from mtrl_jax.testing import FakePolicy, byte_renderer, byte_tokenizer
from mtrl_jax.text import compact

TOK = byte_tokenizer(calculator.EXTRA_SPECIALS)
FMT = compact(TOK)
END = "<|end|>"
REWARD = RewardConfig(outcome_weight=1.0, step_penalty=-0.05, tool_penalty=-0.2)


class GoldenPolicy(FakePolicy):
  """Answers every prompt with the golden assistant message of its stage.

  The stage is the number of assistant headers in the prompt (minus one, and
  minus the failed tool calls). With `bad_first_call`, task 0's first message
  is a malformed tool call instead (the tool rejects it, the episode goes on).
  Logprob of token k of a message: -0.01 (k + 1), so alignment is checkable.
  """

  def __init__(self, tasks, bad_first_call=False, **latency):
    super().__init__(**latency)
    self.tasks = tasks
    self.bad_first_call = bad_first_call

  def message(self, prompt):
    text = TOK.decode(prompt)
    (index,) = [i for i, t in enumerate(self.tasks) if f"<|user|>{t['question']}{END}" in text]
    msgs = [c for r, c in calculator.golden_conversation(self.tasks[index]) if r == "assistant"]
    if self.bad_first_call and index == 0 and text.count("<|assistant|>") == 1:
      return msgs[0].replace(self.tasks[0]["expression"], self.tasks[0]["expression"] + "+")
    return msgs[text.count("<|assistant|>") - 1 - text.count("<|tool|>error:")]

  def completion(self, req, g):
    ids = np.asarray(TOK.encode(self.message(req.prompt)) + [FMT.stop_ids[0]], np.int32)
    return ids, (-0.01 * np.arange(1, len(ids) + 1)).astype(np.float32), "stop"


def tool_results(task):
  return [c for r, c in calculator.golden_conversation(task) if r == "tool"]


def _tree(policy, tasks):
  transition = EnvTransition(
      byte_renderer(calculator.EXTRA_SPECIALS), reward_cfg=REWARD, limits=StepLimits(max_turns=8)
  )
  roots = transition.root_states(resolve_factory("calculator"), tasks)
  cfg = TreeConfig(num_turns=2, num_generations=2, branch_on="user_turn", discount=0.9)
  return expand_tree(cfg, policy, transition, roots, jax.random.key(0)), transition


def test_golden_episodes_as_two_user_turns(tmp_path):
  tasks = [calculator.make_task("eval", i) for i in range(2)]
  policy = GoldenPolicy(tasks)
  tree, transition = _tree(policy, tasks)
  # T=2, G=2: 1 + 2 nodes per root (not 1 + 2 + 4 + 8 as with a turn per message).
  assert tree.counts() == {"nodes": 6, "generations": 6 * 2 * 2, "reward_calls": 6 * 2 * 2}
  # Requests: 2 roots and 4 children of G = 2, one tool continuation per action (12).
  assert sorted(len(r.rows) for r in policy.requests) == [1] * 12 + [2] * 6
  for node in tree.nodes:
    task = tasks[node.root]
    for g in range(2):
      action = node.actions[g]
      assert [s.continues_turn for s in action.steps] == [True, False]
      assert action.steps[0].details["env_roles"] == [["tool"]]
      if node.turn == 0:  # hands over to the user's follow-up: a child, step penalties only
        assert action.steps[-1].details["env_roles"] == [["user"]] and not action.ended
        assert node.rewards_B[g] == pytest.approx(-0.1, abs=1e-12)
        kid = tree.nodes[node.children_B[g]]
        assert TOK.decode(kid.prompts[0]).endswith(
            f"<|user|>{task['followups'][0]}{END}<|assistant|>"
        )
      else:  # the last answer: outcome +1 on the step that stops
        assert action.ended and action.outcome == 1.0
        assert action.steps[-1].details["grades"]
        assert node.rewards_B[g] == pytest.approx(0.9, abs=1e-12)
    np.testing.assert_array_equal(node.substeps_B, [1, 1])
  np.testing.assert_allclose(tree.nodes[0].returns_B, -0.1 + 0.9 * 0.9, atol=1e-12)

  batch = testing.rows_of(tree, (128, 256))
  loss_mask_BxL = testing.dense_rows(batch, batch.loss_mask_BxK, fill=False)
  old_logp_BxL = testing.dense_rows(batch, batch.old_logp_BxK)
  rows = [(n, g) for n in tree.nodes for g in range(2)]
  for b, (node, g) in enumerate(rows):
    task = tasks[node.root]
    msgs = [c for r, c in calculator.golden_conversation(task) if r == "assistant"]
    tool_result = tool_results(task)
    mask = loss_mask_BxL[b]
    tokens = batch.tokens_BxL[b]
    # Trainable text: this user turn's assistant messages, each with its stop token.
    call, answer = msgs[2 * node.turn], msgs[2 * node.turn + 1]
    assert TOK.decode(tokens[mask].tolist()) == call + END + answer + END
    p, c = len(node.prompts[0]), len(node.completions[0][g].ids)
    # Between the segments: the tool turn and the next assistant header, masked out.
    context = tokens[p : p + c][~mask[p : p + c]]
    assert TOK.decode(context.tolist()) == f"<|tool|>{tool_result[node.turn]}{END}<|assistant|>"
    lps = [-0.01 * np.arange(1, len(TOK.encode(m)) + 2) for m in (call, answer)]
    np.testing.assert_allclose(old_logp_BxL[b, mask], np.concatenate(lps), rtol=1e-6)
    assert not mask[:p].any()

  path = write_rollout_dump(tree, str(tmp_path / "step.jsonl"), decode=transition.decoders)
  rec = json.loads(open(path).readline())
  segs = rec["segments"][0][0]
  assert [s["sampled"] for s in segs] == [True, False, True]
  assert segs[1]["text"] == f"<|tool|>{tool_results(tasks[0])[0]}{END}<|assistant|>"
  assert rec["actions"][0]["steps"][0]["env_turns"] == [[tool_results(tasks[0])[0]]]


def test_invalid_tool_call_penalty_accumulates_over_substeps():
  tasks = [calculator.make_task("eval", i) for i in range(2)]
  policy = GoldenPolicy(tasks, bad_first_call=True)
  tree, _ = _tree(policy, tasks)
  root0, root1 = tree.nodes[:2]
  # Root 0: bad call (tool error, -0.2 - 0.05), good call (-0.05), answer (-0.05).
  np.testing.assert_allclose(root0.rewards_B, [-0.35, -0.35], atol=1e-12)
  np.testing.assert_array_equal(root0.substeps_B, [2, 2])
  steps = root0.actions[0].steps
  assert [s.details["invalid_calls"] for s in steps] == [1, 0, 0]
  # One tool turn per call, the rejected one's error turn included; the answer has none.
  assert [s.details["tool_calls"] for s in steps] == [[1], [1], [0]]
  assert steps[0].faults[0].kind.value == "tool_error"
  assert root0.completions[0][0].num_segments == 3 and (root0.weight_NxG == 1).all()
  np.testing.assert_allclose(root1.rewards_B, [-0.1, -0.1], atol=1e-12)
  assert (root0.children_B >= 0).all()  # the episode recovered and handed over


class _Jittery(EnvTransition):
  """Every environment step first sleeps a random 0-20 ms (another order every run)."""

  def __init__(self, *a, seed=0, **k):
    super().__init__(*a, **k)
    self.rng = random.Random(seed)

  def step(self, state, actions, seed=None):
    time.sleep(self.rng.random() * 0.02)
    return super().step(state, actions, seed=seed)


@pytest.mark.parametrize("schedule", ["continuous", "barrier"])
def test_schedules_and_arrival_order_never_change_a_calculator_tree(schedule):
  # One bad first call on task 0 (three steps in its first turn), samples and
  # steps finishing in random order: the same tree, record for record.
  tasks = [calculator.make_task("eval", i) for i in range(3)]
  cfg = TreeConfig(num_turns=2, num_generations=2, branch_on="user_turn", schedule=schedule)
  want = None
  for jitter in range(3):
    policy = GoldenPolicy(tasks, bad_first_call=True, max_latency=4, latency_seed=jitter)
    transition = _Jittery(
        byte_renderer(calculator.EXTRA_SPECIALS),
        reward_cfg=REWARD,
        limits=StepLimits(max_turns=8),
        seed=jitter,
    )
    roots = transition.root_states(resolve_factory("calculator"), tasks)
    got = node_records(
        expand_tree(cfg, policy, transition, roots, jax.random.key(0)), transition.decoders
    )
    assert len(got) == 3 * 3 and want in (None, got)
    want = got
