"""The tree -> batch boundary: which samples train, and both packings' metrics."""

import numpy as np
import pytest

from mtrl_jax.rollout import Completion, Tree, TreeConfig
from mtrl_jax.rollout.batching import BatchConfig, make_train_batch, trained_samples


def _one_node(returns, mode="mean", valid=None):
  """A finalized one-node tree (N=1) with the given G rewards."""
  tree = Tree(TreeConfig(num_turns=1, num_generations=len(returns), advantage_mode=mode))
  root = tree.add_root([[1, 2, 3]])
  tree.set_completions(
      root,
      [
          [
              Completion(np.array([4, 5 + g], np.int32), np.array([-0.1, -0.2], np.float32))
              for g in range(len(returns))
          ]
      ],
  )
  tree.record(root, np.array(returns, np.float64), valid)
  return tree.finalize()


def test_equal_returns_drop_the_group_only_when_advantages_are_zero_and_kl_is_off():
  tree = _one_node([0.1, 0.1, 0.1])  # 3 * 0.1 / 3 != 0.1 in floats: still exactly 0
  assert not tree.nodes[0].advantages_NxG.any()
  trained, dropped = trained_samples(tree)
  assert dropped == 1 and not trained[0].any()
  # KL on: the group still carries its KL term.
  trained, dropped = trained_samples(tree, keep_kl=True)
  assert dropped == 0 and trained[0].all()
  # advantage_mode='raw': equal returns are equal non-zero advantages, which train.
  raw = _one_node([1.0, 1.0, 1.0, 1.0], mode="raw")
  np.testing.assert_array_equal(raw.nodes[0].advantages_NxG, [[1, 1, 1, 1]])
  trained, dropped = trained_samples(raw)
  assert dropped == 0 and trained[0].all()
  # The filter off keeps everything but fault-masked samples.
  faulted = _one_node([1.0, 0.0, 1.0, 1.0], valid=[True, False, True, True])
  trained, dropped = trained_samples(faulted, zero_variance_filter=False)
  np.testing.assert_array_equal(trained[0], [[True, False, True, True]])


@pytest.mark.parametrize("packing", ["tree", "rows"])
def test_make_train_batch_metrics(packing):
  tree = _one_node([1.0, 0.0, 2.0, 1.0], valid=[True, True, False, True])
  cfg = BatchConfig(packing=packing, length_buckets=(8, 16), row_multiple=2)
  batch, m = make_train_batch(tree, cfg)
  # Three trained samples of 3 prompt + 2 completion tokens each.
  assert m["batch/actions"] == 3 and m["batch/tokens_rows_equivalent"] == 15
  rows, length = batch.tokens_BxL.shape
  assert rows % 2 == 0 and (m["batch/rows"], m["batch/length"]) == (rows, length)
  if packing == "tree":
    assert m["batch/tokens_trained"] == 3 + 3 * 2  # the shared prompt once
    assert length == 16
  else:
    assert m["batch/tokens_trained"] == 15 and length == 8
  assert m["batch/padding_fraction"] == pytest.approx(
      1 - m["batch/tokens_trained"] / (rows * length)
  )
  none, m = make_train_batch(_one_node([1.0, 1.0]), cfg)
  assert none is None and m["batch/zero_variance_groups"] == 1


def test_unknown_packing_is_refused():
  with pytest.raises(ValueError, match="BatchConfig.packing='trees'; allowed"):
    BatchConfig(packing="trees")
