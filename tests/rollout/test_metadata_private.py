"""Thread metadata is private per branch: an environment that changes it in place gives
identical rewards for identical actions across siblings, and the change stays in its branch."""

import jax
import numpy as np

from mtrl_jax.envs import Environment, Grade, RewardConfig, Thread, Turn
from mtrl_jax.rollout import TreeConfig, expand_tree
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.testing import FakePolicy, byte_renderer, byte_tokenizer
from mtrl_jax.text import compact

FMT = compact(byte_tokenizer())


class _SamePolicy(FakePolicy):
  """Every sample of every request is the same message: siblings act identically."""

  def completion(self, req, g):
    ids = np.asarray([ord("o"), ord("k"), FMT.stop_ids[0]], np.int32)
    return ids, np.full(3, -0.5, np.float32), "stop"


class _Counts(Environment):
  """Counts its turns in the thread's metadata, in place, and is graded by the count."""

  def react_to(self, thread):
    thread.metadata["turns"] = thread.metadata.get("turns", 0) + 1
    thread.metadata.setdefault("seen", []).append(thread.last_assistant)
    score = 0.95 + thread.metadata["turns"] - 1  # 0.95 at turn 0, 1.95 at turn 1, ...
    if thread.metadata["turns"] == 2:  # ends within the tree: the count is the outcome
      return None, Grade(score)
    return thread.append(Turn("user", "again")), Grade(score)


def test_in_place_metadata_changes_never_reach_sibling_branches():
  renderer = byte_renderer()
  transition = EnvTransition(renderer, reward_cfg=RewardConfig(shaping_weight=1.0))
  cfg = TreeConfig(num_turns=2, num_generations=4)
  roots = [transition.root_state(_Counts({"prompt": "count"}))]
  tree = expand_tree(cfg, _SamePolicy(vocab=128), transition, roots, jax.random.key(0))
  root = tree.nodes[0]
  # Identical actions, identical rewards: no sibling saw another's turn count.
  np.testing.assert_allclose(root.rewards_B, 0.95, atol=1e-12)
  assert len(set(root.rewards_B.tolist())) == 1
  assert len(tree.level(1)) == 4
  for child in tree.level(1):
    np.testing.assert_allclose(child.rewards_B, 1.95, atol=1e-12)  # the branch's own count
    assert child.state.threads[0].metadata["seen"] == ["ok"]  # one message on this path
  np.testing.assert_array_equal(root.advantages_NxG, 0.0)  # no fake advantages
  assert "turns" not in roots[0].threads[0].metadata  # the root's thread is untouched


def test_thread_fork_copies_metadata_deeply():
  thread = Thread((Turn("user", "hi"),), {"tries": 0, "log": []})
  child = thread.fork()
  child.metadata["tries"] += 1
  child.metadata["log"].append("x")
  assert thread.metadata == {"tries": 0, "log": []}
  assert child.metadata == {"tries": 1, "log": ["x"]} and child.turns == thread.turns
  assert thread.append(Turn("user", "again")).metadata is thread.metadata  # one branch
