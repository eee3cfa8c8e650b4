"""The engine over real `mtrl_jax.envs` environments, ledgers and chat rendering."""

import jax
import pytest

from mtrl_jax.envs import StepLimits
from mtrl_jax.graders.reward import RewardConfig
from mtrl_jax.rollout import FakePolicySampler, TreeConfig, expand_tree, pack_tree
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.text import ByteTokenizer, ChatRenderer, compact
from rollout_envs import CLOSED, DuoEnv, SoloEnv

TOK = ByteTokenizer()
FMT = compact(TOK)


def _setup(n, **env_kw):
  renderer = ChatRenderer(TOK, FMT)
  # CoMLRL scores every joint action, continuing ones included: per-turn grades
  # (shaping) weigh as much as final ones.
  transition = EnvTransition(renderer, num_agents=n, reward_cfg=RewardConfig(shaping_weight=1.0))
  sampler = FakePolicySampler(vocab=128, low=32, max_new_tokens=6, stop_id=FMT.stop_ids[0])
  env_cls = DuoEnv if n == 2 else SoloEnv
  roots = [transition.root_state(env_cls({"prompt": f"task {r}"}, **env_kw)) for r in range(2)]
  return transition, sampler, roots


def test_two_agent_tree_histories_and_rewards():
  cfg = TreeConfig(num_turns=3, num_generations=2, num_agents=2)
  transition, sampler, roots = _setup(2)
  CLOSED.clear()
  tree = expand_tree(cfg, sampler, transition, roots, jax.random.key(0))
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
      if all(len(t.encode()) == len(t) for t in texts):  # ASCII: chars == bytes
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
        assert kid.prompts[i][start:start + len(c)] == c
      assert kid.state.env.steps == kid.turn
      assert f"step {kid.turn}: agent 0" in TOK.decode(kid.prompts[0])
  batch = pack_tree(tree, length_buckets=(128, 256))
  assert batch["loss_mask_BxL"].sum() == sum(len(c.ids) for n in tree.nodes
                                             for a in n.completions for c in a)


def test_stop_and_infrastructure_faults():
  # Stop when both texts are under 3 chars; agent 0 writing exactly 4 chars
  # raises an InfrastructureError (retried, then masked).
  cfg = TreeConfig(num_turns=2, num_generations=4, num_agents=2, joint_mode="cross")
  transition, sampler, roots = _setup(2, stop_below=3, broken_len=4)
  tree = expand_tree(cfg, sampler, transition, roots, jax.random.key(1))
  saw_mask = saw_stop = False
  for node in tree.nodes[:2]:
    for j in range(16):
      info = node.infos[j]
      if info["masked"]:
        saw_mask = True
        assert not node.valid_B[j] and node.children_B[j] < 0
        assert info["faults"][0]["kind"] == "infrastructure"
        assert node.weight_NxG[0, tree.joint_BxN[j, 0]] == 0
      elif info["done"]:
        saw_stop = True
        assert node.children_B[j] < 0 and node.returns_B[j] == node.rewards_B[j]
      else:
        assert node.children_B[j] >= 0
  assert saw_mask and saw_stop


def test_single_agent_and_limits():
  cfg = TreeConfig(num_turns=3, num_generations=2)
  renderer = ChatRenderer(TOK, FMT)
  transition = EnvTransition(renderer, limits=StepLimits(max_turns=2))
  sampler = FakePolicySampler(vocab=128, low=32, max_new_tokens=4, stop_id=FMT.stop_ids[0])
  tree = expand_tree(cfg, sampler, transition,
                     [transition.root_state(SoloEnv({"prompt": "go"}))], jax.random.key(2))
  # The turn cap (2 policy turns) truncates every branch at turn 1.
  assert [n.turn for n in tree.nodes] == [0, 1, 1]
  assert all(info["truncated"] for info in tree.nodes[1].infos)
  with pytest.raises(ValueError, match="num_agents=1 but the tree has num_agents=2"):
    EnvTransition(renderer, num_agents=2).root_state(SoloEnv({"prompt": "go"}))
