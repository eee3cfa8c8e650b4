"""Tree expansion on a deterministic fake engine (`testing.FakePolicy`) and scripted envs."""

import time

import jax
import numpy as np
import pytest

from mtrl_jax.rollout import TreeConfig, expand_tree, plan_tree
from mtrl_jax.rollout.train_batch import as_arrays
from mtrl_jax.rollout.dump import node_records
from mtrl_jax import testing
from mtrl_jax.testing import FEEDBACK, FakePolicy, ScriptedTransition

KEY = jax.random.key(0)


def _run(cfg, num_roots=1, transition=None, key=KEY, policy=None):
  policy = policy or FakePolicy(vocab=64, max_new_tokens=5, stop_id=2)
  transition = transition or ScriptedTransition()
  tree = expand_tree(cfg, policy, transition, transition.roots(num_roots, cfg.num_agents), key)
  return tree, policy


@pytest.mark.parametrize(
    "joint, nodes, gens, calls", [("align", 5, 40, 20), ("cross", 17, 136, 272)]
)
def test_counts_match_formula(joint, nodes, gens, calls):
  cfg = TreeConfig(num_turns=2, num_generations=4, num_agents=2, joint_mode=joint)
  tree, policy = _run(cfg)
  assert tree.counts() == {"nodes": nodes, "generations": gens, "reward_calls": calls}
  plan = plan_tree(cfg, 1, 64, 8)
  assert (plan.nodes, plan.generations, plan.reward_calls) == (nodes, gens, calls)
  # One request per (node, agent) for its G samples.
  assert len(policy.requests) == 2 * nodes
  assert all(len(r.rows) == 4 for r in policy.requests)
  assert [r.agent for r in policy.requests].count(1) == nodes


def test_children_continue_their_parent_samples_cache():
  cfg = TreeConfig(num_turns=3, num_generations=2, num_agents=2, joint_mode="cross")
  tree, policy = _run(cfg, num_roots=3)
  plan = plan_tree(cfg, 3, 64, 8)
  assert tree.counts()["nodes"] == plan.nodes == 3 * (1 + 4 + 16)
  children = [r for r in policy.requests if r.parent is not None]
  assert len(children) == 2 * (plan.nodes - 3) and policy.misses == 0
  # Every child's request extends the cache of the sample its joint action took.
  assert policy.reused == sum(len(r.parent.ids) for r in children)
  # Every sample's cache is released once no later request names it.
  assert policy.released == tree.counts()["generations"]


def test_counts_with_termination_and_stops():
  # Roots 0 and 2 score 1 everywhere at turn 0 (mean 1 > tau = 0.5): leaves.
  # Root 1 scores 0 and expands, but the env stops every odd joint action.
  cfg = TreeConfig(
      num_turns=2, num_generations=4, num_agents=2, joint_mode="cross", termination_threshold=0.5
  )
  reward = lambda s, a: 1.0 if s.turn == 0 and s.root % 2 == 0 else 0.0
  stop = lambda s, a: int(a[0].ids[0]) % 2 == 1  # deterministic, content-based stop

  tree, _ = _run(cfg, num_roots=3, transition=ScriptedTransition(reward=reward, stop=stop))
  root1 = tree.nodes[1]
  assert tree.nodes[0].terminated and tree.nodes[2].terminated and not root1.terminated
  kept = sum(
      1 for a in range(16) if int(root1.completions[0][tree.joint_BxN[a, 0]].ids[0]) % 2 == 0
  )
  assert 0 < kept < 16
  assert tree.counts() == {
      "nodes": 3 + kept,
      "generations": (3 + kept) * 2 * 4,
      "reward_calls": (3 + kept) * 16,
  }
  for j, child in enumerate(root1.children_B):
    stopped = int(root1.completions[0][tree.joint_BxN[j, 0]].ids[0]) % 2 == 1
    assert (child < 0) == stopped
    if stopped:
      assert root1.returns_B[j] == root1.rewards_B[j]


def _reference_returns(tree, node_id, gamma):
  """Independent recursive (DFS, CoMLRL-style) return computation."""
  node = tree.nodes[node_id]
  out = []
  for j, child in enumerate(node.children_B):
    r = node.rewards_B[j]
    if child >= 0:
      r = r + gamma * np.mean(_reference_returns(tree, child, gamma))
    out.append(r)
  return np.array(out)


def test_engine_returns_and_histories():
  cfg = TreeConfig(num_turns=3, num_generations=3, num_agents=2, discount=0.8)
  tree, _ = _run(cfg, num_roots=2)
  for root in tree.nodes[:2]:
    np.testing.assert_allclose(
        root.returns_B, _reference_returns(tree, root.node_id, 0.8), rtol=1e-12
    )
  for node in tree.nodes:
    if node.parent_id < 0:
      continue
    parent = tree.nodes[node.parent_id]
    for i in range(2):  # full per-agent history: parent prompt + own completion + feedback
      comp = parent.completions[i][tree.joint_BxN[node.parent_action, i]]
      assert node.prompts[i] == parent.prompts[i] + comp.ids.tolist() + [FEEDBACK]
    assert node.root == parent.root and node.turn == parent.turn + 1


def test_level_env_steps_run_concurrently():
  cfg = TreeConfig(num_turns=1, num_generations=8)
  t0 = time.perf_counter()
  tree, _ = _run(cfg, transition=ScriptedTransition(sleep_s=0.2))
  wall = time.perf_counter() - t0
  assert tree.counts()["reward_calls"] == 8
  assert wall < 0.8, f"8 steps of 0.2 s took {wall:.2f} s: not concurrent"


def test_fault_masks_samples_and_spawns_no_child():
  cfg = TreeConfig(num_turns=2, num_generations=4)
  fault = lambda s, a: s.turn == 0 and int(a[0].ids[0]) % 3 == 0
  tree, _ = _run(cfg, num_roots=2, transition=ScriptedTransition(fault=fault))
  masked = 0
  for root in tree.nodes[:2]:
    for j in range(4):
      bad = int(root.completions[0][j].ids[0]) % 3 == 0
      masked += bad
      assert root.valid_B[j] == (not bad) and (root.children_B[j] < 0) == bad
      assert root.weight_NxG[0, j] == (0.0 if bad else 1.0)
      if bad:
        assert root.advantages_NxG[0, j] == 0.0
  assert masked > 0
  batch = testing.rows_of(tree, (64,))
  assert batch.row_weight_B.sum() == tree.counts()["generations"] - masked


def test_reproducible_bit_for_bit():
  cfg = TreeConfig(
      num_turns=2,
      num_generations=3,
      num_agents=2,
      joint_mode="cross",
      termination_threshold=0.6,
      advantage_std_norm=True,
  )
  runs = [_run(cfg, num_roots=2)[0] for _ in range(2)]
  b0, b1 = (as_arrays(testing.rows_of(t, (32, 64))) for t in runs)
  for k in b0:
    assert b0[k].dtype == b1[k].dtype and b0[k].tobytes() == b1[k].tobytes(), k
  assert node_records(runs[0]) == node_records(runs[1])
  other = testing.rows_of(_run(cfg, num_roots=2, key=jax.random.key(1))[0], (32, 64))
  assert other.tokens_BxL.tobytes() != b0["tokens_BxL"].tobytes()


@pytest.mark.parametrize("schedule", ["continuous", "barrier"])
def test_arrival_order_never_changes_the_tree(schedule):
  # Requests finish after random numbers of engine steps (another order per seed):
  # node ids, samples, rewards and advantages are the same bit for bit.
  cfg = TreeConfig(
      num_turns=3,
      num_generations=2,
      num_agents=2,
      joint_mode="cross",
      termination_threshold=0.6,
      schedule=schedule,
  )
  stop = lambda s, a: int(a[1].ids[0]) % 5 == 0
  trees = [
      _run(
          cfg,
          num_roots=3,
          transition=ScriptedTransition(stop=stop),
          policy=FakePolicy(
              vocab=64, max_new_tokens=5, stop_id=2, max_latency=4, latency_seed=seed
          ),
      )[0]
      for seed in range(3)
  ]
  base = _run(
      cfg.replace(schedule="continuous"), num_roots=3, transition=ScriptedTransition(stop=stop)
  )[0]
  for tree in trees:
    assert node_records(tree) == node_records(base)


def test_a_transition_must_answer_with_an_action_outcome():
  class Broken(ScriptedTransition):

    def step(self, state, actions):
      return super().step(state, actions).step  # a StepRecord, not an ActionOutcome

  with pytest.raises(TypeError, match="ActionOutcome"):
    _run(TreeConfig(num_turns=1, num_generations=2), transition=Broken())
