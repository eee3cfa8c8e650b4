"""A tree rollout with the real tiny model, byte tokenizer and branching sampler."""

import jax
import numpy as np
from flax import nnx

from mtrl_jax.envs import RewardConfig
from mtrl_jax.models import create_model
from mtrl_jax.rollout import SamplerPolicy, StackedStates, TreeConfig, expand_tree, pack_tree
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.sampling import Sampler, SamplingConfig
from mtrl_jax.tasks import calculator
from mtrl_jax.testing import DuoEnv, ToolThenUserEnv, byte_renderer
from mtrl_jax.train.stacked import stack_trees


def test_tiny_model_tree_shared_and_separate_policies(tiny_model, renderer):
  cfg = tiny_model.cfg
  tok, fmt = renderer.tokenizer, renderer.fmt
  _, state0 = nnx.split(tiny_model)
  _, state1 = nnx.split(create_model(cfg, seed=1))
  # Fixed buckets: every level of both runs fits one compiled program.
  sampler = Sampler(cfg, batch_buckets=(16,), prompt_buckets=(64,), decode_buckets=(16,),
                    agent_map="map")
  sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
  tree_cfg = TreeConfig(num_turns=2, num_generations=2, num_agents=2)
  transition = EnvTransition(renderer, num_agents=2,
                             reward_cfg=RewardConfig(shaping_weight=1.0))

  def run(states):
    policy = SamplerPolicy(sampler, states, sampling, stop_ids=fmt.stop_ids, pad_id=tok.pad_id)
    roots = [transition.root_state(DuoEnv({"prompt": p})) for p in ("a", "bb")]
    tree = expand_tree(tree_cfg, policy, transition, roots, jax.random.key(0))
    return tree, policy

  shared, shared_policy = run(state0)
  separate, separate_policy = run([state0, state1])
  stacked, stacked_policy = run(StackedStates(stack_trees([state0, state1]), 2))
  assert shared_policy.num_generate_calls == 2  # one call per level
  assert separate_policy.num_generate_calls == 4  # one call per level per agent state
  assert stacked_policy.num_generate_calls == 2  # one call per level for both agents
  assert sampler.num_compiles == 2  # generate's program, and generate_stacked's
  # One stacked call per level samples exactly what one call per agent does.
  for a, b in zip(separate.nodes, stacked.nodes):
    for ca, cb in zip(a.completions, b.completions):
      for x, y in zip(ca, cb):
        np.testing.assert_array_equal(x.ids, y.ids)
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
  for tree in (shared, separate, stacked):
    assert tree.counts() == {"nodes": 6, "generations": 24, "reward_calls": 12}
    for node in tree.nodes:
      for comps in node.completions:
        for c in comps:
          assert 1 <= len(c.ids) <= 6 and (c.logprobs <= 0).all()
          assert (c.finish_reason == "stop") == (c.ids[-1] in fmt.stop_ids)
    batch = pack_tree(tree, length_buckets=(128,))
    assert np.isfinite(batch["old_logp_BxL"]).all() and batch["row_weight_B"].sum() == 24
  # Root 0's agent-0 prompt is row block 0 of a call keyed fold_in(level key, 0)
  # with state0 in both runs, so its samples agree exactly; agent 1 samples
  # with other parameters and another key in the separate run.
  root_ids = lambda t, i: [c.ids.tolist() for c in t.nodes[0].completions[i]]
  assert root_ids(shared, 0) == root_ids(separate, 0)
  assert root_ids(shared, 1) != root_ids(separate, 1)


def test_tiny_model_user_turn_tree_with_tool_substeps(tiny_model):
  # The calculator tokenizer (270 ids) under a 300-id model: ids past the
  # tokenizer end the episode as a model format fault instead of crashing.
  cfg = tiny_model.cfg
  renderer = byte_renderer(calculator.EXTRA_SPECIALS)
  tok, fmt = renderer.tokenizer, renderer.fmt
  _, state = nnx.split(tiny_model)
  sampler = Sampler(cfg, batch_buckets=(16,), prompt_buckets=(64,), decode_buckets=(16,))
  policy = SamplerPolicy(sampler, state, SamplingConfig(temperature=1.0, max_new_tokens=6),
                         stop_ids=fmt.stop_ids, pad_id=tok.pad_id)
  transition = EnvTransition(renderer, reward_cfg=RewardConfig(shaping_weight=1.0))
  roots = [transition.root_state(ToolThenUserEnv({"prompt": p})) for p in ("12+3=", "7*8=")]
  tree_cfg = TreeConfig(num_turns=2, num_generations=2, branch_on="user_turn")
  tree = expand_tree(tree_cfg, policy, transition, roots, jax.random.key(0))
  assert sampler.num_compiles == 1
  nodes = tree.counts()["nodes"]
  assert 2 <= nodes <= 2 * 3 and tree.num_substeps() > 0
  # Each level: its first segments, then one round for the tool continuations.
  assert policy.num_generate_calls == 2 * (2 if nodes > 2 else 1)
  batch = pack_tree(tree, length_buckets=(128,))
  rows = [(n, g) for n in tree.nodes for g in range(2)]
  for b, (node, g) in enumerate(rows):
    comp, info = node.completions[0][g], node.infos[g]
    if info["faults"] and info["faults"][0]["kind"] == "model_format":
      continue  # an id past the tokenizer: the environment never answered
    assert comp.num_segments == 1 + node.substeps_B[g] == 2
    assert info["substeps"][0]["env_roles"] == [["tool"]]
    mask = batch["loss_mask_BxL"][b]
    assert mask.sum() == comp.sampled_mask.sum() and (batch["old_logp_BxL"][b, mask] <= 0).all()
  assert np.isfinite(batch["old_logp_BxL"]).all() and batch["row_weight_B"].sum() == 2 * nodes
