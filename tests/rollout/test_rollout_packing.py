"""Packing into fixed-shape rows (one action per row), and the per-node JSONL dump."""

import json
import os

import jax
import numpy as np
import pytest

from mtrl_jax.rollout import Completion, Tree, TreeConfig, expand_tree, write_rollout_dump
from mtrl_jax.rollout.train_batch import FIELDS, as_arrays
from mtrl_jax.rollout.tree_packing import pack_rows, tree_actions
from mtrl_jax.rollout.dump import dump_path
from mtrl_jax.testing import FakePolicy, ScriptedTransition


def _comp(ids, lps):
  return Completion(np.asarray(ids, np.int32), np.asarray(lps, np.float32))


def _hand_tree():
  # N=1, G=2, T=2. Root prompt [5, 6]; samples [7, 8] and [9]; the child of
  # action 0 has the full history [5, 6, 7, 8, 3] as its prompt.
  tree = Tree(TreeConfig(num_turns=2, num_generations=2, discount=0.5))
  root = tree.add_root([[5, 6]])
  tree.set_completions(root, [[_comp([7, 8], [-0.1, -0.2]), _comp([9], [-0.3])]])
  tree.record(root, [1.0, 0.0])
  child = tree.add_child(root, 0, [[5, 6, 7, 8, 3]])
  tree.set_completions(child, [[_comp([4], [-0.4]), _comp([4, 4, 2], [-0.5, -0.6, -0.7])]])
  tree.record(child, [0.0, 2.0], [True, True])
  return tree.finalize()


def test_rows_by_hand():
  # Child: R = [0, 2], A = [-1, 1]. Root: R = [1 + 0.5 * 1, 0] = [1.5, 0], A = [0.75, -0.75].
  batch, stats = pack_rows(tree_actions(_hand_tree()), length_buckets=(4, 8, 16))
  assert set(as_arrays(batch)) == set(FIELDS)
  assert batch.shape == (4, 8, 8)  # 4 rows; longest row 5 + 3 = 8; K = L
  np.testing.assert_array_equal(
      batch.tokens_BxL,
      [
          [5, 6, 7, 8, 0, 0, 0, 0],
          [5, 6, 9, 0, 0, 0, 0, 0],
          [5, 6, 7, 8, 3, 4, 0, 0],
          [5, 6, 7, 8, 3, 4, 4, 2],
      ],
  )
  # Only this row's own completion trains: the earlier policy turn [7, 8] inside
  # the child's context does not (it is trained in the root's row). Each trained
  # token is scored from the position before it, on a causal row.
  np.testing.assert_array_equal(batch.loss_mask_BxK.sum(1), [2, 1, 1, 3])
  np.testing.assert_array_equal(batch.prev_BxK[:, :3], [[1, 2, 0], [1, 0, 0], [4, 0, 0], [4, 5, 6]])
  np.testing.assert_array_equal(batch.target_BxK[3, :3], [4, 4, 2])
  np.testing.assert_allclose(batch.old_logp_BxK[0, :2], [-0.1, -0.2])
  np.testing.assert_allclose(batch.old_logp_BxK[3, :3], [-0.5, -0.6, -0.7])
  np.testing.assert_allclose(batch.adv_BxK[:, 0], [0.75, -0.75, -1.0, 1.0])
  np.testing.assert_array_equal(batch.positions_BxL[2], np.arange(8))
  np.testing.assert_array_equal(batch.ends_BxL, 8)  # causal over the whole row
  np.testing.assert_array_equal(batch.action_BxK, 0)  # one action per row
  np.testing.assert_array_equal(batch.row_weight_B, [1, 1, 1, 1])
  assert stats["tokens_trained"] == stats["tokens_rows_equivalent"] == 4 + 3 + 6 + 8
  assert batch.tokens_BxL.dtype == np.int32 and batch.adv_BxK.dtype == np.float32


def test_padding_rows_and_buckets():
  actions = tree_actions(_hand_tree())
  batch, _ = pack_rows(actions, length_buckets=(16, 32), row_buckets=(8, 16), pad_id=1)
  assert batch.shape == (8, 16, 16)
  assert (batch.tokens_BxL[4:] == 1).all() and not batch.loss_mask_BxK[4:].any()
  np.testing.assert_array_equal(batch.row_weight_B, [1, 1, 1, 1, 0, 0, 0, 0])
  assert pack_rows(actions, length_buckets=(8,), row_multiple=3)[0].shape[0] == 6
  with pytest.raises(ValueError, match="row length 8 exceeds the largest bucket 6"):
    pack_rows(actions, length_buckets=(6,))
  with pytest.raises(ValueError, match="row count 4 exceeds"):
    pack_rows(actions, length_buckets=(8,), row_buckets=(2,))


def test_actions_cover_only_policy_tokens_in_engine_run():
  cfg = TreeConfig(num_turns=3, num_generations=2, num_agents=2, joint_mode="cross")
  policy = FakePolicy(vocab=64, max_new_tokens=4, stop_id=2, low=8)
  tr = ScriptedTransition()
  tree = expand_tree(cfg, policy, tr, tr.roots(2, 2), jax.random.key(3))
  actions = tree_actions(tree)
  for i in range(2):  # per agent, in node and sample order
    want = [(n, g) for n in tree.nodes for g in range(2)]
    assert len(actions[i]) == len(want)
    for act, (node, g) in zip(actions[i], want):
      comp = node.completions[i][g]
      assert list(act.prompt) == list(node.prompts[i])
      np.testing.assert_array_equal(act.ids, comp.ids)
      np.testing.assert_array_equal(act.logprobs, comp.logprobs)
      np.testing.assert_array_equal(act.trainable, np.ones(len(comp.ids), bool))
      assert act.advantage == node.advantages_NxG[i, g]
  # Agent 1's rows alone hold exactly its tokens, in order.
  agent1, _ = pack_rows([[], actions[1]], length_buckets=(64,))
  for b, act in enumerate(actions[1]):
    p, c = len(act.prompt), len(act.ids)
    np.testing.assert_array_equal(agent1.tokens_BxL[b, p : p + c], act.ids)
    np.testing.assert_array_equal(agent1.target_BxK[b, :c], act.ids)


def test_rollout_dump(tmp_path):
  tree = _hand_tree()
  path = write_rollout_dump(
      tree, dump_path(str(tmp_path), 12), decode=lambda ids: " ".join(map(str, ids))
  )
  assert path.endswith("rollouts/step_000012.jsonl")
  lines = open(path).read().splitlines()
  assert len(lines) == len(tree.nodes)
  recs = [json.loads(line) for line in lines]
  root, child = recs
  assert (root["node_id"], root["parent_id"], root["parent_action"], root["turn"]) == (0, -1, -1, 0)
  assert (child["node_id"], child["parent_id"], child["parent_action"], child["turn"]) == (
      1,
      0,
      0,
      1,
  )
  assert root["rewards"] == [1.0, 0.0] and root["returns"] == [1.5, 0.0]
  assert root["advantages"] == [[0.75, -0.75]] and child["advantages"] == [[-1.0, 1.0]]
  assert root["terminated"] is False and root["children"] == [1, -1]
  assert root["prompts"] == ["5 6"] and root["completions"] == [["7 8", "9"]]
  recs_ids = [json.loads(x) for x in open(write_rollout_dump(tree, str(tmp_path / "d.jsonl")))]
  assert recs_ids[1]["prompt_ids"] == [[5, 6, 7, 8, 3]]


def test_a_dump_that_cannot_be_written_warns_in_one_line_and_leaves_no_partial_file(
    tmp_path, monkeypatch, capsys
):
  import builtins
  import errno

  real_open = builtins.open

  def full_disk(path, mode="r", *a, **k):
    if "w" in mode:
      f = real_open(path, mode, *a, **k)
      f.close()  # the file exists, as when a write fails part way
      raise OSError(errno.ENOSPC, "No space left on device")
    return real_open(path, mode, *a, **k)

  monkeypatch.setattr(builtins, "open", full_disk)
  path = dump_path(str(tmp_path), 3)
  assert write_rollout_dump(_hand_tree(), path) is None
  monkeypatch.undo()
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and path in err[0] and "errno 28" in err[0]
  assert os.listdir(os.path.dirname(path)) == []  # no partial or temporary file
