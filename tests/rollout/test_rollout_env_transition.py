"""The engine over real `mtrl_jax.envs` environments, ledgers and chat rendering."""

import jax
import numpy as np
import pytest

from mtrl_jax.envs import RewardConfig, StepLimits
from mtrl_jax.rollout import TreeConfig, expand_tree
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax import testing
from mtrl_jax.testing import (
    CLOSED,
    DuoEnv,
    FakePolicy,
    SoloEnv,
    ToolThenUserEnv,
    byte_renderer,
    byte_tokenizer,
)
from mtrl_jax.text import compact

TOK = byte_tokenizer()
FMT = compact(TOK)


def _setup(n, **env_kw):
  renderer = byte_renderer()
  # CoMLRL scores every joint action, continuing ones included: per-turn grades
  # (shaping) weigh as much as final ones.
  transition = EnvTransition(renderer, num_agents=n, reward_cfg=RewardConfig(shaping_weight=1.0))
  policy = FakePolicy(vocab=128, low=32, max_new_tokens=6, stop_id=FMT.stop_ids[0])
  env_cls = DuoEnv if n == 2 else SoloEnv
  roots = [transition.root_state(env_cls({"prompt": f"task {r}"}, **env_kw)) for r in range(2)]
  return transition, policy, roots


def test_two_agent_tree_histories_and_rewards():
  cfg = TreeConfig(num_turns=3, num_generations=2, num_agents=2)
  transition, policy, roots = _setup(2)
  CLOSED.clear()
  tree = expand_tree(cfg, policy, transition, roots, jax.random.key(0))
  assert tree.counts() == {"nodes": 2 * 7, "generations": 2 * 7 * 4, "reward_calls": 2 * 7 * 2}
  # Every state is closed exactly once: the 2 roots and one fork per env step.
  assert len(CLOSED) == len(set(CLOSED)) == 2 + tree.counts()["reward_calls"]
  for node in tree.nodes:
    for i in range(2):
      role_prompt = TOK.decode(node.prompts[i])
      assert f"You are agent {i}. Task: task {node.root}" in role_prompt
      assert node.prompts[i][-1] == TOK.token_to_id("<|assistant|>")
    for j in range(2):
      comps = [node.completions[i][j] for i in range(2)]  # align: sample j of each agent
      texts = [TOK.decode(c.ids[:-1] if c.finish_reason == "stop" else c.ids) for c in comps]
      want = sum(len(t) % 2 == 0 for t in texts) / 2
      ascii_only = all(len(t.encode()) == len(t) for t in texts)  # chars == bytes
      if node.turn == cfg.num_turns - 1:  # DuoEnv never ends: the tree cuts it, a failure
        assert node.actions[j].cut and node.rewards_B[j] == 0.0
        if ascii_only:  # the per-turn grade stays in the record, out of the reward
          assert node.actions[j].steps[-1].details["grades"]["even"]["score"] == want
      elif ascii_only:
        assert node.rewards_B[j] == want
      child = node.children_B[j]
      if child < 0:
        continue
      kid = tree.nodes[child]
      # Token-in, token-out: the child's context holds the sampled ids verbatim,
      # and the env's per-branch step counter was forked, not shared.
      for i in range(2):
        c = comps[i].ids.tolist()
        start = len(node.prompts[i])
        assert kid.prompts[i][:start] == node.prompts[i]
        assert kid.prompts[i][start : start + len(c)] == c
      assert kid.state.env.steps == kid.turn
      assert f"step {kid.turn}: agent 0" in TOK.decode(kid.prompts[0])
  batch = testing.rows_of(tree, (128, 256))
  assert batch.loss_mask_BxK.sum() == sum(
      len(c.ids) for n in tree.nodes for a in n.completions for c in a
  )


def test_stop_and_infrastructure_faults():
  # Stop when both texts are under 3 chars; agent 0 writing exactly 4 chars
  # raises an InfrastructureError (retried, then masked).
  cfg = TreeConfig(num_turns=2, num_generations=4, num_agents=2, joint_mode="cross")
  transition, policy, roots = _setup(2, stop_below=3, broken_len=4)
  tree = expand_tree(cfg, policy, transition, roots, jax.random.key(1))
  saw_mask = saw_stop = False
  for node in tree.nodes[:2]:
    for j in range(16):
      action = node.actions[j]
      if not action.valid:
        saw_mask = True
        assert not node.valid_B[j] and node.children_B[j] < 0
        assert action.faults[0].kind.value == "infrastructure"
        assert node.weight_NxG[0, tree.joint_BxN[j, 0]] == 0
      elif action.ended:
        saw_stop = True
        assert node.children_B[j] < 0 and node.returns_B[j] == node.rewards_B[j]
      else:
        assert node.children_B[j] >= 0
  assert saw_mask and saw_stop


def test_single_agent_and_limits():
  cfg = TreeConfig(num_turns=3, num_generations=2)
  renderer = byte_renderer()
  transition = EnvTransition(renderer, limits=StepLimits(max_turns=2))
  policy = FakePolicy(vocab=128, low=32, max_new_tokens=4, stop_id=FMT.stop_ids[0])
  tree = expand_tree(
      cfg, policy, transition, [transition.root_state(SoloEnv({"prompt": "go"}))], jax.random.key(2)
  )
  # The turn cap (2 policy turns) truncates every branch at turn 1.
  assert [n.turn for n in tree.nodes] == [0, 1, 1]
  assert all(action.steps[-1].truncated for action in tree.nodes[1].actions)
  # No ToolSet, no tool-call counts (no `tools/*` metrics).
  assert not [
      s for n in tree.nodes for a in n.actions for s in a.steps if "tool_calls" in s.details
  ]
  with pytest.raises(ValueError, match="num_agents=1 but the tree has num_agents=2"):
    EnvTransition(renderer, num_agents=2).root_state(SoloEnv({"prompt": "go"}))


def test_ids_past_the_tokenizer_are_a_penalised_format_fault():
  # A model vocabulary larger than the tokenizer's: every sampled id is in
  # [268, 300), past ByteTokenizer()'s 268 ids, so no message can be decoded.
  reward_cfg = RewardConfig(step_penalty=-0.05, tool_penalty=-0.2)
  transition = EnvTransition(byte_renderer(), reward_cfg=reward_cfg)
  policy = FakePolicy(vocab=300, low=TOK.vocab_size, max_new_tokens=3)
  cfg = TreeConfig(num_turns=2, num_generations=2, branch_on="user_turn")
  tree = expand_tree(
      cfg, policy, transition, [transition.root_state(SoloEnv({"prompt": "go"}))], jax.random.key(3)
  )
  root = tree.nodes[0]
  assert len(tree.nodes) == 1 and (root.children_B < 0).all() and root.valid_B.all()
  for action in root.actions:
    step = action.steps[-1]
    assert step.done and step.details["invalid_calls"] == 1
    assert step.faults[0].kind.value == "model_format" and "outside" in step.faults[0].message
  np.testing.assert_allclose(root.rewards_B, -0.25, atol=1e-12)


def test_user_turn_substeps_close_every_state_once():
  transition = EnvTransition(byte_renderer(), limits=StepLimits(max_turns=8))
  policy = FakePolicy(vocab=128, low=32, max_new_tokens=4, stop_id=FMT.stop_ids[0])
  cfg = TreeConfig(num_turns=2, num_generations=2, branch_on="user_turn")
  CLOSED.clear()
  tree = expand_tree(
      cfg,
      policy,
      transition,
      [transition.root_state(ToolThenUserEnv({"prompt": "go"}))],
      jax.random.key(4),
  )
  # 3 nodes; every action is a tool call then a message the user answers: 2 steps each.
  assert tree.counts() == {"nodes": 3, "generations": 12, "reward_calls": 12}
  assert len(CLOSED) == len(set(CLOSED)) == 1 + 12  # the root and one fork per step
  for node in tree.nodes:
    for g in range(2):
      steps = node.actions[g].steps
      assert [s.details["env_roles"] for s in steps] == [[["tool"]], [["user"]]]
      assert [s.continues_turn for s in steps] == [True, False]
  # Sub-steps count as policy turns for the turn cap: with max_turns=3 the
  # child's first step is the 3rd policy message and truncates.
  capped = EnvTransition(byte_renderer(), limits=StepLimits(max_turns=3))
  tree = expand_tree(
      cfg, policy, capped, [capped.root_state(ToolThenUserEnv({"prompt": "go"}))], jax.random.key(4)
  )
  for kid in tree.nodes[1:]:
    assert all(a.steps[-1].truncated and len(a.steps) == 1 for a in kid.actions)
