"""Returns and advantages on hand-built trees (values worked out in comments)."""

import itertools

import numpy as np
import pytest

from mtrl_jax.rollout import Tree, TreeConfig, advantages, joint_actions


def _root(tree, n=1):
  return tree.add_root([[1]] * n)


def test_joint_action_order():
  align = joint_actions(TreeConfig(num_turns=1, num_generations=3, num_agents=2))
  np.testing.assert_array_equal(align, [[0, 0], [1, 1], [2, 2]])
  cross = joint_actions(
      TreeConfig(num_turns=1, num_generations=2, num_agents=3, joint_mode="cross")
  )
  # itertools.product order: agent 0 slowest.
  np.testing.assert_array_equal(cross, list(itertools.product(range(2), repeat=3)))
  single = joint_actions(TreeConfig(num_turns=1, num_generations=4, joint_mode="cross"))
  np.testing.assert_array_equal(single, [[0], [1], [2], [3]])


def test_two_turn_discounted_returns():
  # T=2, G=2, N=1, gamma=0.9.
  # root r = [1, 0]; child of action 0: r = [1, 0] (mean return 0.5);
  # child of action 1: r = [0, 0] (mean 0).
  # Root R = [1 + 0.9 * 0.5, 0 + 0.9 * 0] = [1.45, 0]; mean 0.725 -> A = [0.725, -0.725].
  tree = Tree(TreeConfig(num_turns=2, num_generations=2, discount=0.9))
  root = _root(tree)
  assert tree.record(root, [1.0, 0.0])
  c0, c1 = tree.add_child(root, 0, [[2]]), tree.add_child(root, 1, [[3]])
  assert not tree.record(c0, [1.0, 0.0])  # last turn: no children
  tree.record(c1, [0.0, 0.0])
  tree.finalize()
  np.testing.assert_allclose(root.returns_B, [1.45, 0.0], rtol=0, atol=1e-12)
  np.testing.assert_allclose(root.advantages_NxG, [[0.725, -0.725]], rtol=0, atol=1e-12)
  np.testing.assert_allclose(c0.advantages_NxG, [[0.5, -0.5]], rtol=0, atol=1e-12)
  np.testing.assert_array_equal(c1.advantages_NxG, [[0.0, 0.0]])  # equal rewards
  m = tree.metrics()
  # turn 0: rewards [1, 0], returns [1.45, 0]; turn 1: rewards [1, 0, 0, 0].
  assert (m["turn_0/mean_reward"], m["turn_1/mean_reward"]) == (0.5, 0.25)
  assert m["turn_0/mean_return"] == pytest.approx(0.725, abs=1e-12)
  assert (m["tree/nodes"], m["tree/terminated"], m["tree/masked_actions"]) == (3, 0, 0)


def test_termination_and_stop_leaves():
  # T=3, G=2, N=1, tau=0.5, gamma=0.9.
  # root r=[0, 1]: mean 0.5 is not > 0.5 (strict) -> expands.
  #   A (action 0), r=[1, 1]: mean 1 > 0.5 -> terminated leaf; R=[1, 1], A=[0, 0].
  #   B (action 1), r=[0, 0.5]: mean 0.25 -> expands, but the env stopped action 1.
  #     B0 (B's action 0, turn 2): r=[1, 0] -> R=[1, 0], mean 0.5, A=[0.5, -0.5].
  #     B's action 1: stopped, no child: R = r = 0.5.
  #   B: R = [0 + 0.9 * 0.5, 0.5] = [0.45, 0.5]; mean 0.475; A = [-0.025, 0.025].
  # root: R = [0 + 0.9 * 1, 1 + 0.9 * 0.475] = [0.9, 1.4275]; mean 1.16375;
  #   A = [-0.26375, 0.26375].
  tree = Tree(TreeConfig(num_turns=3, num_generations=2, termination_threshold=0.5, discount=0.9))
  root = _root(tree)
  assert tree.record(root, [0.0, 1.0]) and not root.terminated
  a, b = tree.add_child(root, 0, [[2]]), tree.add_child(root, 1, [[3]])
  assert not tree.record(a, [1.0, 1.0]) and a.terminated
  assert tree.record(b, [0.0, 0.5])
  b0 = tree.add_child(b, 0, [[4]])
  tree.record(b0, [1.0, 0.0])
  tree.finalize()
  np.testing.assert_allclose(a.returns_B, [1.0, 1.0], atol=1e-12)
  np.testing.assert_allclose(a.advantages_NxG, [[0.0, 0.0]], atol=1e-12)
  np.testing.assert_allclose(b0.advantages_NxG, [[0.5, -0.5]], atol=1e-12)
  np.testing.assert_allclose(b.returns_B, [0.45, 0.5], atol=1e-12)
  np.testing.assert_allclose(b.advantages_NxG, [[-0.025, 0.025]], atol=1e-12)
  np.testing.assert_allclose(root.returns_B, [0.9, 1.4275], atol=1e-12)
  np.testing.assert_allclose(root.advantages_NxG, [[-0.26375, 0.26375]], atol=1e-12)
  assert [n.node_id for n in tree.nodes] == [0, 1, 2, 3]
  np.testing.assert_array_equal(b.children_B, [3, -1])


def test_cross_sum_and_mean_returns():
  # N=2, G=2 cross: actions (0,0),(0,1),(1,0),(1,1) with r = [1, 2, 3, 4], T=1.
  # sum: agent 0: s0 = 1+2 = 3, s1 = 3+4 = 7 -> A = [-2, 2];
  #      agent 1: s0 = 1+3 = 4, s1 = 2+4 = 6 -> A = [-1, 1].
  # mean (divide by G^(N-1) = 2): agent 0 [1.5, 3.5] -> [-1, 1]; agent 1 [2, 3] -> [-0.5, 0.5].
  for mode, want_ret, want_adv in [
      ("sum", [[3, 7], [4, 6]], [[-2, 2], [-1, 1]]),
      ("mean", [[1.5, 3.5], [2, 3]], [[-1, 1], [-0.5, 0.5]]),
  ]:
    tree = Tree(
        TreeConfig(
            num_turns=1, num_generations=2, num_agents=2, joint_mode="cross", cross_return=mode
        )
    )
    root = _root(tree, 2)
    tree.record(root, [1.0, 2.0, 3.0, 4.0])
    tree.finalize()
    np.testing.assert_allclose(root.agent_returns_NxG, want_ret, atol=1e-12)
    np.testing.assert_allclose(root.advantages_NxG, want_adv, atol=1e-12)


def test_cross_two_turns_with_termination():
  # N=2, G=2 cross (B=4), T=2, tau=0.6, gamma=0.9.
  # root r = [0, 1, 0, 0] (mean 0.25) -> 4 children with
  #   c0 r=[1,1,1,1] (R mean 1), c1 r=[0,0,0,0] (0), c2 r=[1,0,1,0] (0.5), c3 r=[0,0,0,1] (0.25).
  # root R = [0.9, 1.0, 0.45, 0.225];
  # agent 0 sums: s0 = 0.9 + 1.0 = 1.9, s1 = 0.45 + 0.225 = 0.675 -> mean 1.2875,
  #   A = [0.6125, -0.6125];
  # agent 1 sums: s0 = 0.9 + 0.45 = 1.35, s1 = 1.0 + 0.225 = 1.225 -> A = [0.0625, -0.0625].
  tree = Tree(
      TreeConfig(
          num_turns=2,
          num_generations=2,
          num_agents=2,
          joint_mode="cross",
          termination_threshold=0.6,
      )
  )
  root = _root(tree, 2)
  assert tree.record(root, [0.0, 1.0, 0.0, 0.0])
  rewards = [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]]
  kids = [tree.add_child(root, j, [[5], [6]]) for j in range(4)]
  for kid, r in zip(kids, rewards):
    tree.record(kid, r)
  assert kids[0].terminated and not kids[2].terminated  # 1 > 0.6; 0.5 is not
  tree.finalize()
  np.testing.assert_allclose(root.returns_B, [0.9, 1.0, 0.45, 0.225], atol=1e-12)
  np.testing.assert_allclose(
      root.advantages_NxG, [[0.6125, -0.6125], [0.0625, -0.0625]], atol=1e-12
  )


def test_terminated_root_is_a_trained_leaf():
  cfg = TreeConfig(
      num_turns=2, num_generations=2, num_agents=2, joint_mode="cross", termination_threshold=2.0
  )
  tree = Tree(cfg)
  root = _root(tree, 2)
  assert not tree.record(root, [1.0, 2.0, 3.0, 4.0])  # mean 2.5 > 2.0
  tree.finalize()
  np.testing.assert_allclose(root.returns_B, [1, 2, 3, 4])
  assert np.abs(root.advantages_NxG).sum() > 0 and (root.weight_NxG == 1).all()
  tree2 = Tree(cfg.replace(termination_threshold=2.5))  # 2.5 is not > 2.5
  assert tree2.record(_root(tree2, 2), [1.0, 2.0, 3.0, 4.0])


@pytest.mark.parametrize(
    "mode, std_norm",
    [("mean", False), ("max", False), ("rloo", False), ("mean", True), ("rloo", True)],
)
@pytest.mark.parametrize("joint", ["align", "cross"])
def test_equal_rewards_give_zero_advantage(mode, std_norm, joint):
  cfg = TreeConfig(
      num_turns=2,
      num_generations=3,
      num_agents=2,
      joint_mode=joint,
      advantage_mode=mode,
      advantage_std_norm=std_norm,
  )
  tree = Tree(cfg)
  root = _root(tree, 2)
  tree.record(root, np.full(cfg.branching, 0.3))
  for j in range(cfg.branching):
    tree.record(tree.add_child(root, j, [[2], [3]]), np.full(cfg.branching, -1.7))
  tree.finalize()
  for node in tree.nodes:
    np.testing.assert_array_equal(node.advantages_NxG, 0.0)


def test_advantage_modes_against_reference():
  r = np.array([1.0, 2.0, 4.0])
  valid = np.ones(3, bool)
  # mean 7/3; max 4; rloo (3R - 7)/2.
  np.testing.assert_allclose(advantages(r, valid, "mean", False), [-4 / 3, -1 / 3, 5 / 3])
  np.testing.assert_allclose(advantages(r, valid, "raw", False), [1, 2, 4])
  np.testing.assert_allclose(advantages(r, valid, "max", False), [-3, -2, 0])
  np.testing.assert_allclose(advantages(r, valid, "rloo", False), [-2, -0.5, 2.5])
  # rloo = R minus the mean of the others.
  others = np.array([(r.sum() - x) / 2 for x in r])
  np.testing.assert_allclose(advantages(r, valid, "rloo", False), r - others)
  for mode in ("mean", "raw", "max", "rloo"):
    a = advantages(r, valid, mode, False)
    want = (a - a.mean()) / max(np.sqrt(((a - a.mean()) ** 2).mean()), 1e-6)
    np.testing.assert_allclose(advantages(r, valid, mode, True), want, rtol=1e-12)
  # std floor: tiny spread is divided by 1e-6, not by its own std.
  tiny = np.array([0.0, 1e-9])
  np.testing.assert_allclose(
      advantages(tiny, np.ones(2, bool), "mean", True), [-0.5e-9 / 1e-6, 0.5e-9 / 1e-6]
  )
  # one sample: no normalisation, mean baseline gives 0, rloo gives 0.
  np.testing.assert_array_equal(advantages(np.array([3.0]), np.ones(1, bool), "mean", True), [0])


def test_fault_masks_align_and_cross():
  # align N=2, G=3; action 1 faulted: baseline over {1, 3} -> mean 2 -> A = [-1, 0, 1].
  tree = Tree(TreeConfig(num_turns=1, num_generations=3, num_agents=2))
  root = _root(tree, 2)
  tree.record(root, [1.0, 99.0, 3.0], [True, False, True])
  tree.finalize()
  np.testing.assert_allclose(root.advantages_NxG, [[-1, 0, 1]] * 2)
  np.testing.assert_array_equal(root.weight_NxG, [[1, 0, 1]] * 2)
  # cross N=2, G=2; (0, 1) faulted: agent 0 sample 0 and agent 1 sample 1 are masked.
  tree = Tree(TreeConfig(num_turns=1, num_generations=2, num_agents=2, joint_mode="cross"))
  root = _root(tree, 2)
  tree.record(root, [1.0, 50.0, 3.0, 4.0], [True, False, True, True])
  tree.finalize()
  np.testing.assert_array_equal(root.weight_NxG, [[0, 1], [1, 0]])
  np.testing.assert_allclose(root.agent_returns_NxG, [[0, 7], [4, 0]])
  np.testing.assert_array_equal(root.advantages_NxG, 0.0)  # one valid sample each


def test_child_with_all_actions_faulted_masks_parent_action():
  tree = Tree(TreeConfig(num_turns=2, num_generations=2))
  root = _root(tree)
  tree.record(root, [1.0, 0.0])
  tree.record(tree.add_child(root, 0, [[2]]), [5.0, 5.0], [False, False])
  tree.record(tree.add_child(root, 1, [[3]]), [1.0, 0.0])
  tree.finalize()
  # action 0 has no value estimate -> masked; action 1 alone -> mean baseline 0.
  np.testing.assert_array_equal(root.valid_B, [False, True])
  np.testing.assert_array_equal(root.weight_NxG, [[0, 1]])
  np.testing.assert_allclose(root.returns_B, [0.0, 0.0 + 0.9 * 0.5])
  np.testing.assert_array_equal(root.advantages_NxG, [[0.0, 0.0]])


def test_record_rejects_bad_input():
  tree = Tree(TreeConfig(num_turns=2, num_generations=2))
  root = _root(tree)
  with pytest.raises(ValueError, match="expected 2 rewards"):
    tree.record(root, [1.0])
  with pytest.raises(ValueError, match="non-finite"):
    tree.record(root, [1.0, float("nan")])
  with pytest.raises(ValueError, match="record"):
    tree.add_child(root, 0, [[1]])
  with pytest.raises(ValueError, match="one prompt per agent"):
    tree.add_root([[1], [2]])
  with pytest.raises(ValueError, match="not recorded"):
    tree.finalize()
