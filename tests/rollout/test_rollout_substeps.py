"""branch_on='user_turn': tool continuations are sub-steps of one action, not tree turns."""

import json

import jax
import numpy as np
import pytest

from mtrl_jax.rollout import (
    ActionOutcome,
    ActionRecord,
    Completion,
    StepRecord,
    Tree,
    TreeConfig,
    expand_tree,
    node_records,
    plan_tree,
    write_rollout_dump,
)
from mtrl_jax import testing
from mtrl_jax.testing import FEEDBACK, TOOL, FakePolicy, ScriptedTransition

KEY = jax.random.key(0)


def _comp(ids, lps):
  return Completion(np.asarray(ids, np.int32), np.asarray(lps, np.float32))


def _need(s):
  """Tool continuations the scripted environment asks for in this turn."""
  return s.root + 1 if s.turn == 0 else 1


def _transition(**kw):
  # Step reward 0.1 * (sub + 1): an action of k steps earns 0.1 * k (k + 1) / 2.
  return ScriptedTransition(
      reward=lambda s, a: 0.1 * (s.sub + 1), continues=lambda s, a: s.sub < _need(s), **kw
  )


def _run(cfg, transition, num_roots=2, max_latency=0):
  policy = FakePolicy(vocab=64, low=8, max_new_tokens=4, stop_id=2, max_latency=max_latency)
  tree = expand_tree(cfg, policy, transition, transition.roots(num_roots, 1), KEY)
  return tree, policy


def _samples_per_request(policy):
  """How many requests asked for each number of samples."""
  counts = {}
  for r in policy.requests:
    counts[len(r.rows)] = counts.get(len(r.rows), 0) + 1
  return counts


def test_user_turn_tree_counts_calls_and_summed_rewards():
  cfg = TreeConfig(num_turns=2, num_generations=4, branch_on="user_turn")
  tree, policy = _run(cfg, _transition())
  # T=2 user turns, G=4: 1 + 4 nodes per root, whatever the tool calls inside the turns.
  assert len(tree.nodes) == 2 * 5
  assert [n.turn for n in tree.nodes] == [0, 0] + [1] * 8
  # G = 4 requests for the 2 roots and 8 children; one-sample continuations: all 8
  # root actions once, root 1's 4 a second time (it needs two tool calls), the
  # children's 32 actions once. Each continuation extends its action's own cache.
  assert _samples_per_request(policy) == {4: 2 + 8, 1: 8 + 4 + 32}
  assert policy.misses == 0
  substeps = 4 * 1 + 4 * 2 + 32 * 1
  assert tree.counts() == {
      "nodes": 10,
      "generations": 10 * 4 + substeps,
      "reward_calls": 10 * 4 + substeps,
  }
  plan = plan_tree(cfg, 2, 64, 64)
  assert plan.nodes == 10 and plan.generations == 10 * 4 * 5 >= tree.counts()["generations"]
  for node in tree.nodes:
    k = _need(node.state)
    steps = k + 1
    # Summed step rewards: 0.1 + 0.2 (+ 0.3) for k = 1 (2) continuations.
    np.testing.assert_allclose(node.rewards_B, 0.1 * steps * (steps + 1) / 2, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(node.substeps_B, k)
    for j in range(4):
      comp, action = node.completions[0][j], node.actions[j]
      assert comp.num_segments == steps
      assert [s.reward for s in action.steps] == pytest.approx(
          [0.1 * (i + 1) for i in range(steps)], abs=1e-12
      )
      assert [s.continues_turn for s in action.steps] == [True] * k + [False]
      # Context between segments is exactly the tool token, never trainable.
      context = [comp.ids[a:b].tolist() for a, b, sampled in comp.spans() if not sampled]
      assert context == [[TOOL]] * k
      if node.turn == 0:  # hands over to the user: the child continues the whole action
        kid = tree.nodes[node.children_B[j]]
        assert kid.prompts[0] == node.prompts[0] + comp.ids.tolist() + [FEEDBACK]
  # Returns: leaves R = r = 0.3; roots R = r + 0.9 * 0.3.
  np.testing.assert_allclose(tree.nodes[0].returns_B, 0.3 + 0.9 * 0.3, atol=1e-12)
  np.testing.assert_allclose(tree.nodes[1].returns_B, 0.6 + 0.9 * 0.3, atol=1e-12)
  assert tree.metrics()["tree/substeps"] == substeps


def test_arrival_order_never_changes_a_user_turn_tree():
  # Samples come back after random numbers of engine steps, so an action's tool
  # continuations finish before its siblings' first segments: the same tree.
  cfg = TreeConfig(num_turns=2, num_generations=4, branch_on="user_turn")
  want = node_records(_run(cfg, _transition())[0])
  for latency in (3, 7):
    assert node_records(_run(cfg, _transition(), max_latency=latency)[0]) == want


def test_every_turn_branches_at_tool_turns_as_before():
  cfg = TreeConfig(num_turns=2, num_generations=4)
  tree, policy = _run(cfg, _transition())
  # continues_turn is ignored: every step that goes on is a child (CoMLRL).
  assert tree.counts() == {"nodes": 10, "generations": 40, "reward_calls": 40}
  assert _samples_per_request(policy) == {4: 10}
  kid = tree.nodes[tree.nodes[0].children_B[0]]
  assert kid.prompts[0][-1] == TOOL and kid.state.sub == 1
  assert all(n.substeps_B.sum() == 0 for n in tree.nodes)
  assert len(tree.nodes[0].actions[0].steps) == 1


def test_substep_limit_truncates_the_action():
  cfg = TreeConfig(num_turns=2, num_generations=4, branch_on="user_turn", max_substeps=1)
  tree, policy = _run(cfg, _transition())
  root0, root1 = tree.nodes[:2]
  # Root 1 needs 2 continuations, 1 is allowed: its actions end, truncated, no child.
  assert (root0.children_B >= 0).all() and (root1.children_B < 0).all()
  for j in range(4):
    action = root1.actions[j]
    assert action.limit_reached and action.ended
    assert action.faults[-1].kind.value == "truncation"
    assert len(action.steps) == 2 and root1.completions[0][j].num_segments == 2
  np.testing.assert_allclose(root1.rewards_B, 0.1 + 0.2, atol=1e-12)  # the steps taken
  np.testing.assert_array_equal(root1.substeps_B, 1)
  assert (root1.weight_NxG == 1).all()  # model-caused truncation: still trained on
  # No second continuation: the limit is checked before sampling.
  assert _samples_per_request(policy) == {4: 2 + 4, 1: 8 + 16}


def test_masked_substep_masks_the_whole_action():
  # Infrastructure fault on the first continuation of actions whose first token is odd.
  fault = lambda s, a: s.sub == 1 and s.turn == 0 and s.histories[0][3] % 2 == 1
  cfg = TreeConfig(num_turns=2, num_generations=4, branch_on="user_turn")
  tree, _ = _run(cfg, _transition(fault=fault), num_roots=3)
  masked = 0
  for root in tree.nodes[:3]:
    for j in range(4):
      bad = int(root.completions[0][j].ids[0]) % 2 == 1
      masked += bad
      assert root.valid_B[j] == (not bad) and (root.children_B[j] < 0) == bad
      assert root.weight_NxG[0, j] == (0.0 if bad else 1.0)
      steps = root.actions[j].steps
      if bad:  # both steps recorded, the faulted one last; no further sub-step
        assert [s.valid for s in steps] == [True, False]
        assert root.advantages_NxG[0, j] == 0.0
  assert 0 < masked < 12
  batch = testing.rows_of(tree, (64,))
  assert batch.row_weight_B.sum() == 4 * len(tree.nodes) - masked


def test_packing_masks_exactly_the_sampled_tokens():
  # One action: segment [7, 8] (stop 2 last), tool context [6, 9], segment [5, 2].
  comp = _comp([7, 8, 2], [-0.1, -0.2, -0.3]).continued([6, 9], _comp([5, 2], [-0.4, -0.5]))
  tree = Tree(TreeConfig(num_turns=1, num_generations=2, branch_on="user_turn"))
  root = tree.add_root([[3, 4]])
  tree.set_completions(root, [[comp, _comp([11], [-0.6])]])
  two_steps = ActionRecord((StepRecord(0.5, continues_turn=True), StepRecord(0.5)))
  tree.record(root, [1.0, 0.0], actions=[two_steps, ActionRecord((StepRecord(0.0),))])
  np.testing.assert_array_equal(root.substeps_B, [1, 0])
  tree.finalize()
  batch = testing.rows_of(tree, (10,))
  np.testing.assert_array_equal(
      batch.tokens_BxL, [[3, 4, 7, 8, 2, 6, 9, 5, 2, 0], [3, 4, 11, 0, 0, 0, 0, 0, 0, 0]]
  )
  np.testing.assert_array_equal(
      testing.dense_rows(batch, batch.loss_mask_BxK).astype(int),
      [[0, 0, 1, 1, 1, 0, 0, 1, 1, 0], [0, 0, 1, 0, 0, 0, 0, 0, 0, 0]],
  )
  np.testing.assert_allclose(
      testing.dense_rows(batch, batch.old_logp_BxK)[0],
      [0, 0, -0.1, -0.2, -0.3, 0, 0, -0.4, -0.5, 0],
      rtol=0,
      atol=1e-7,
  )
  np.testing.assert_allclose(batch.adv_BxK[:, 0], [0.5, -0.5])
  assert comp.spans() == [(0, 3, True), (3, 5, False), (5, 7, True)]


def test_packing_of_an_engine_run_lines_up():
  cfg = TreeConfig(num_turns=2, num_generations=3, branch_on="user_turn")
  tree, _ = _run(cfg, _transition())
  batch = testing.rows_of(tree, (64,))
  loss_mask_BxL = testing.dense_rows(batch, batch.loss_mask_BxK, fill=False)
  old_logp_BxL = testing.dense_rows(batch, batch.old_logp_BxK)
  rows = [(n, g) for n in tree.nodes for g in range(3)]
  for b, (node, g) in enumerate(rows):
    comp, p = node.completions[0][g], len(node.prompts[0])
    mask = loss_mask_BxL[b]
    np.testing.assert_array_equal(np.flatnonzero(mask), p + np.flatnonzero(comp.sampled_mask))
    row = batch.tokens_BxL[b]
    np.testing.assert_array_equal(row[: p + len(comp.ids)], node.prompts[0] + comp.ids.tolist())
    # The sampled tokens of all segments, in order, with their sampling logprobs.
    segs = [comp.ids[a:e] for a, e, s in comp.spans() if s]
    seg_lps = [comp.logprobs[a:e] for a, e, s in comp.spans() if s]
    np.testing.assert_array_equal(row[mask], np.concatenate(segs))
    np.testing.assert_array_equal(old_logp_BxL[b, mask], np.concatenate(seg_lps))
    assert (row[p : p + len(comp.ids)][~comp.sampled_mask] == TOOL).all()
  assert (old_logp_BxL[~loss_mask_BxL] == 0).all()


def test_dump_shows_segments_and_tool_turns(tmp_path):
  cfg = TreeConfig(num_turns=1, num_generations=2, branch_on="user_turn")
  tree, _ = _run(cfg, _transition(), num_roots=1)
  path = write_rollout_dump(
      tree, str(tmp_path / "d.jsonl"), decode=lambda ids: " ".join(map(str, ids))
  )
  (rec,) = [json.loads(x) for x in open(path)]
  assert rec["substeps"] == [1, 1]
  for g in range(2):
    segs = rec["segments"][0][g]
    assert [s["sampled"] for s in segs] == [True, False, True]
    assert segs[1]["text"] == str(TOOL)
    assert " ".join(s["text"] for s in segs) == rec["completions"][0][g]
    assert [s["r"] for s in rec["actions"][g]["steps"]] == pytest.approx([0.1, 0.2])


def test_continuation_must_extend_the_context():
  class Rewriting(ScriptedTransition):

    def prompts(self, state):
      return [[1] + list(h) for h in state.histories] if state.sub else super().prompts(state)

  cfg = TreeConfig(num_turns=1, num_generations=2, branch_on="user_turn")
  with pytest.raises(ValueError, match="token-in, token-out"):
    _run(cfg, Rewriting(continues=lambda s, a: s.sub < 1))

  class Broken(ScriptedTransition):

    def step(self, state, actions):
      return ActionOutcome(None, StepRecord(0.0, continues_turn=True))

  with pytest.raises(ValueError, match="continues_turn=True needs a next_state"):
    _run(cfg, Broken())


def test_completion_checks():
  with pytest.raises(ValueError, match="logprob 0"):
    Completion(
        np.array([1, 2], np.int32),
        np.array([-0.1, -0.2], np.float32),
        trainable=np.array([True, False]),
    )
  with pytest.raises(ValueError, match="shape"):
    Completion(np.array([1], np.int32), np.array([0.0], np.float32), trainable=np.ones(2, bool))
  two = _comp([1], [-0.1]).continued([6], _comp([2], [-0.2]))
  with pytest.raises(ValueError, match="sampled tokens only"):
    _comp([1], [-0.1]).continued([6], two)
  assert _comp([1, 2], [-0.1, -0.2]).num_segments == 1 and two.num_segments == 2
