"""`TreeConfig(shape='chain')`: G independent trajectories per root, the root's group baseline."""

import jax
import numpy as np
import pytest

from mtrl_jax.rollout import TreeConfig, expand_tree, plan_tree
from mtrl_jax.rollout.config import generations_per_root
from mtrl_jax.rollout.dump import node_records
from mtrl_jax import testing
from mtrl_jax.testing import FakePolicy, ScriptedTransition

KEY = jax.random.key(3)


def _run(cfg, num_roots=2, transition=None):
  policy = FakePolicy(vocab=64, max_new_tokens=5, stop_id=2)
  transition = transition or ScriptedTransition()
  tree = expand_tree(cfg, policy, transition, transition.roots(num_roots, cfg.num_agents), KEY)
  return tree, policy


def _chains(tree, root):
  """Per root action j, the node ids of trajectory j (root first)."""
  out = []
  for j, child in enumerate(root.children_B):
    path = [root.node_id]
    while child >= 0:
      path.append(int(child))
      child = tree.nodes[child].children_B[0]
    out.append(path)
  return out


def _reference_returns(tree, chains, gamma):
  """Discounted sum of each trajectory's rewards (the root's action j, then one per node)."""
  out = []
  for j, path in enumerate(chains):
    rewards = [tree.nodes[path[0]].rewards_B[j]] + [tree.nodes[k].rewards_B[0] for k in path[1:]]
    out.append(sum(gamma**t * r for t, r in enumerate(rewards)))
  return np.array(out)


def _reference_advantages(returns_G, valid_G, mode, std_norm):
  """numpy float64 group baseline over the valid trajectory returns (invalid: 0)."""
  r = returns_G[valid_G]
  if np.all(r == r[0]):
    a = np.zeros_like(r)
  elif mode == "mean":
    a = r - r.mean()
  else:  # rloo
    a = (len(r) * r - r.sum()) / (len(r) - 1)
  if std_norm and np.any(a != 0):
    a = (a - a.mean()) / max(a.std(), 1e-6)
  out = np.zeros_like(returns_G)
  out[valid_G] = a
  return out


@pytest.mark.parametrize("num_agents", [1, 2])
def test_chain_has_g_leaves_per_root_each_with_t_turns(num_agents):
  cfg = TreeConfig(num_turns=3, num_generations=4, num_agents=num_agents, shape="chain")
  tree, policy = _run(cfg, num_roots=2)
  roots = [n for n in tree.nodes if n.parent_id < 0]
  assert len(roots) == 2
  for root in roots:
    assert [len(c) for c in root.completions] == [4] * num_agents
    chains = _chains(tree, root)
    assert len(chains) == 4 and all(len(path) == 3 for path in chains)
    for path in chains:
      assert [tree.nodes[k].turn for k in path] == [0, 1, 2]
      for k in path[1:]:
        node = tree.nodes[k]
        assert [len(c) for c in node.completions] == [1] * num_agents
        assert node.rewards_B.shape == (1,)
  # Per (node, agent) one request: the roots' for G samples, every later node's for one.
  assert sorted(len(r.rows) for r in policy.requests) == (
      [1] * 16 * num_agents + [4] * 2 * num_agents
  )
  counts = tree.counts()
  plan = plan_tree(cfg, 2, 64, 8)
  assert counts["nodes"] == plan.nodes == 2 * (1 + 4 + 4)
  assert counts["generations"] == plan.generations == 2 * generations_per_root(cfg)
  assert generations_per_root(cfg) == num_agents * 4 * 3
  assert counts["reward_calls"] == plan.reward_calls == 2 * (4 + 4 + 4)
  assert plan.level_nodes == (2, 8, 8) and plan.rows == 2 * num_agents * 12
  assert tree.metrics()["tree/sampled_tokens"] == sum(
      len(c.ids) for n in tree.nodes for a in n.completions for c in a
  )


def test_equal_budget_mapping_between_shapes():
  # T = 2, G = 4: a tree samples 4 + 16 = 20 segments per root, a chain of G = 10 too.
  tree_cfg = TreeConfig(num_turns=2, num_generations=4)
  assert generations_per_root(tree_cfg) == 20 == plan_tree(tree_cfg, 1, 64, 8).generations
  chain_cfg = TreeConfig(num_turns=2, num_generations=10, shape="chain")
  assert generations_per_root(chain_cfg) == 20 == plan_tree(chain_cfg, 1, 64, 8).generations
  assert generations_per_root(TreeConfig(num_turns=3, num_generations=2)) == 2 + 4 + 8


@pytest.mark.parametrize("mode, std_norm", [("mean", False), ("rloo", False), ("mean", True)])
@pytest.mark.parametrize("num_agents", [1, 2])
def test_chain_advantages_equal_numpy_group_baseline(mode, std_norm, num_agents):
  # Some trajectories stop early (a shorter chain); rewards vary with the tokens.
  stop = lambda s, a: s.turn == 1 and int(a[0].ids[0]) % 3 == 0
  cfg = TreeConfig(
      num_turns=3,
      num_generations=5,
      num_agents=num_agents,
      discount=0.7,
      advantage_mode=mode,
      advantage_std_norm=std_norm,
      shape="chain",
  )
  tree, _ = _run(cfg, num_roots=3, transition=ScriptedTransition(stop=stop))
  lengths = set()
  for root in (n for n in tree.nodes if n.parent_id < 0):
    chains = _chains(tree, root)
    returns_G = _reference_returns(tree, chains, 0.7)
    lengths.update(len(path) for path in chains)
    np.testing.assert_allclose(root.returns_B, returns_G, rtol=1e-12)
    expected_G = _reference_advantages(returns_G, np.ones(5, bool), mode, std_norm)
    assert np.any(expected_G != 0)
    for i in range(num_agents):
      np.testing.assert_allclose(root.advantages_NxG[i], expected_G, rtol=1e-12, atol=1e-12)
    for j, path in enumerate(chains):
      for k in path[1:]:
        np.testing.assert_allclose(
            tree.nodes[k].advantages_NxG,
            np.full((num_agents, 1), expected_G[j]),
            rtol=1e-12,
            atol=1e-12,
        )
        assert tree.nodes[k].weight_NxG.tolist() == [[1.0]] * num_agents
  assert lengths == {2, 3}
  # Packing trains every action of a chain with its trajectory's advantage.
  batch = testing.rows_of(tree, (64,))
  rows = batch.row_weight_B > 0
  np.testing.assert_array_equal(  # one action per row, its advantage on every token
      np.sort(batch.adv_BxK[rows, 0]),
      np.sort(
          [
              n.advantages_NxG[i, g]
              for n in tree.nodes
              for i, g in zip(*np.nonzero(n.weight_NxG > 0))
          ]
      ).astype(np.float32),
  )
  assert all(
      (batch.adv_BxK[b, batch.loss_mask_BxK[b]] == batch.adv_BxK[b, 0]).all()
      for b in np.flatnonzero(rows)
  )
  records = node_records(tree)
  assert all(len(r["joint_actions"]) == (5 if r["parent_id"] < 0 else 1) for r in records)


def test_a_fault_on_a_chain_masks_the_whole_trajectory():
  # Turn 1 of a trajectory faults when the root's sample began with an even token.
  fault = lambda s, a: s.turn == 1 and int(s.histories[0][3]) % 2 == 0
  cfg = TreeConfig(num_turns=3, num_generations=4, shape="chain")
  tree, _ = _run(cfg, num_roots=2, transition=ScriptedTransition(fault=fault))
  for root in (n for n in tree.nodes if n.parent_id < 0):
    chains = _chains(tree, root)
    valid_G = root.valid_B.copy()
    assert 0 < valid_G.sum() < 4
    returns_G = _reference_returns(tree, chains, 0.9)
    expected_G = _reference_advantages(returns_G, valid_G, "mean", False)
    np.testing.assert_allclose(root.advantages_NxG[0], expected_G, rtol=1e-12, atol=1e-12)
    for j, path in enumerate(chains):
      for k in path:
        node = tree.nodes[k]
        assert node.weight_NxG[0, 0 if k != path[0] else j] == float(valid_G[j])
        if not valid_G[j]:
          assert node.advantages_NxG[0, 0 if k != path[0] else j] == 0.0


def test_bad_shape_is_a_one_line_error():
  with pytest.raises(ValueError, match=r"TreeConfig.shape='forest'; allowed: \['tree', 'chain'\]"):
    TreeConfig(num_turns=2, num_generations=4, shape="forest")
  with pytest.raises(ValueError, match="shape='chain' needs joint_mode='align'"):
    TreeConfig(num_turns=2, num_generations=2, num_agents=2, joint_mode="cross", shape="chain")


def test_config_tree_shape_reaches_the_experiment_and_bad_values_fail():
  from configs import calculator as calc_config
  from mtrl_jax.run import experiment, shapes

  c = calc_config.get_config("smoke=True")
  c.tree.shape = "chain"
  exp = experiment.validate(c)
  assert exp.tree.shape == "chain"
  # The engine is planned for the roots' G samples per request.
  plan = shapes.plan_shapes(exp, row_multiple=2, local_shards=2)
  assert plan.fanout == exp.tree.num_generations and plan.engine.slots >= plan.fanout
  c.tree.shape = "forest"
  with pytest.raises(experiment.ConfigError) as err:
    experiment.validate(c)
  assert "\n" not in str(err.value) and "shape='forest'" in str(err.value)
