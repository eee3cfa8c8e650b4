"""Tree rollouts with the real tiny model on the rollout engine.

* Same trees as before: the trees of the level-by-level sampler this engine
  replaced, recorded as fixtures (`fixtures/level_sampler_trees.json`, made by
  `fixtures/record_level_sampler_trees.py` at the commit that still had
  `Sampler.generate`), come back token for token under both schedules.
* Schedule independence: continuous and barrier scheduling give identical
  trees, bit for bit, when environment steps take random times (so requests
  arrive in another order every run), for tool sub-steps, align and cross,
  and separate policies.
* A forced tiny KV budget (evictions every level) gives the same tree.
"""

import functools
import json
import os
import random
import time

import jax
import numpy as np
import pytest
from flax import nnx

from mtrl_jax.envs import RewardConfig, StepLimits, resolve_factory
from mtrl_jax.models import create_model
from mtrl_jax.rollout import EnginePolicy, StackedStates, TreeConfig, expand_tree
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.sampling import DecodeEngine, EngineConfig, SamplingConfig
from mtrl_jax.sampling.generation import LocalLLM
from mtrl_jax.tasks import calculator, coop
from mtrl_jax import testing
from mtrl_jax.testing import (
    DuoEnv,
    ScriptedTransition,
    ToolThenUserEnv,
    byte_renderer,
    tiny_model,
)
from mtrl_jax.train.stacked import stack_trees

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "level_sampler_trees.json")
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=6)
STOP = tuple(range(100, 124))
KEY = jax.random.fold_in(jax.random.PRNGKey(0), 1)  # the RL loop's key of step 1
# Same float32 math in another layout (per-slot caches, other batch shapes and
# windows): a logprob is a logit minus a log-sum-exp of logits up to ~16, whose
# float32 spacing is ~2e-6, so logprobs differ by a few of those.
LOGP_TOL = 1e-5


@pytest.fixture(scope="module")
def states():
  model = tiny_model()
  return model.cfg, nnx.split(model)[1], _states(model.cfg, 1)


@pytest.fixture(scope="module")
def fixtures():
  with open(FIXTURES) as f:
    return json.load(f)


def _new_engine(cfg, agents, slots, overlap=False):
  return DecodeEngine(
      cfg, EngineConfig(slots=slots, capacity=128, chunk=4, overlap=overlap), num_agents=agents
  )


# The module's one engine of a configuration: each rollout starts a fresh run on it
# (slots, queue, stats), and its compiled programs carry over from test to test.
_engine = functools.cache(_new_engine)


def _policy(cfg, states, sampling=SAMPLING, stop=STOP, pad=0, slots=32, fresh=False, overlap=False):
  """Runs take fanout 2 (every tree's G, or more): admit programs of one shape.
  `fresh`: on an engine of its own (its compile count is this rollout's)."""
  agents = states.num_agents if isinstance(states, StackedStates) else 1
  engine = (_new_engine if fresh else _engine)(cfg, agents, slots, overlap)
  return EnginePolicy(engine, states, sampling, stop_ids=stop, pad_id=pad, fanout=2)


@functools.cache
def _states(cfg, seed):
  """The parameters of the model of `cfg` and `seed`, built once."""
  return nnx.split(create_model(cfg, seed=seed))[1]


def _assert_same_nodes(want, tree, exact_logprobs=False, cut_at=None):
  """`cut_at`: the tree's last turn, where an environment that never ends is now cut
  and graded as failed (`Environment.on_cut`): the recorded rewards there, and the
  returns and advantages above them, predate that rule; the tokens do not."""
  assert len(want) == len(tree.nodes)
  for w, n in zip(want, tree.nodes):
    assert (w["node_id"], w["parent_id"], w["parent_action"], w["turn"], w["root"]) == (
        n.node_id,
        n.parent_id,
        n.parent_action,
        n.turn,
        n.root,
    )
    assert w["prompts"] == n.prompts and w["children"] == n.children_B.tolist()
    for wa, na in zip(w["completions"], n.completions):
      for wc, nc in zip(wa, na):
        assert wc["ids"] == nc.ids.tolist() and wc["finish_reason"] == nc.finish_reason
        assert wc["trainable"] == nc.sampled_mask.tolist()
        np.testing.assert_allclose(
            nc.logprobs, wc["logprobs"], rtol=0, atol=0 if exact_logprobs else LOGP_TOL
        )
    np.testing.assert_array_equal(n.valid_B, w["valid"])
    assert n.terminated == w["terminated"] and n.substeps_B.tolist() == w["substeps"]
    if cut_at is not None:
      assert all(a.cut for a in n.actions) == (n.turn == cut_at)
      if n.turn < cut_at:
        np.testing.assert_array_equal(n.rewards_B, w["rewards"])
      continue
    np.testing.assert_array_equal(n.rewards_B, w["rewards"])
    np.testing.assert_allclose(n.returns_B, w["returns"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(n.advantages_NxG, w["advantages"], rtol=0, atol=1e-9)


def _tree_json(tree):
  return [
      {
          "node_id": n.node_id,
          "parent_id": n.parent_id,
          "parent_action": n.parent_action,
          "turn": n.turn,
          "root": n.root,
          "prompts": n.prompts,
          "children": n.children_B.tolist(),
          "completions": [
              [
                  {
                      "ids": c.ids.tolist(),
                      "logprobs": c.logprobs.tolist(),
                      "finish_reason": c.finish_reason,
                      "trainable": c.sampled_mask.tolist(),
                  }
                  for c in a
              ]
              for a in n.completions
          ],
          "rewards": n.rewards_B.tolist(),
          "valid": n.valid_B.tolist(),
          "terminated": n.terminated,
          "substeps": n.substeps_B.tolist(),
          "returns": n.returns_B.tolist(),
          "advantages": n.advantages_NxG.tolist(),
      }
      for n in tree.nodes
  ]


SCRIPTED = {
    "scripted_T3_G2": (TreeConfig(num_turns=3, num_generations=2), False, {}),
    "scripted_N2_align": (TreeConfig(num_turns=2, num_generations=2, num_agents=2), False, {}),
    "scripted_N2_cross": (
        TreeConfig(num_turns=2, num_generations=2, num_agents=2, joint_mode="cross"),
        False,
        {},
    ),
    "scripted_N2_stacked": (TreeConfig(num_turns=2, num_generations=2, num_agents=2), True, {}),
    "scripted_chain": (TreeConfig(num_turns=3, num_generations=2, shape="chain"), False, {}),
    "scripted_substeps": (
        TreeConfig(num_turns=2, num_generations=2, branch_on="user_turn"),
        False,
        {"continues": lambda s, a: s.sub == 0},
    ),
}


@pytest.mark.parametrize("schedule", ["continuous", "barrier"])
@pytest.mark.parametrize("name", sorted(SCRIPTED))
def test_same_trees_as_the_level_sampler(name, schedule, states, fixtures):
  cfg, separate, kw = SCRIPTED[name]
  model_cfg, s0, s1 = states
  params = StackedStates(stack_trees([s0, s1]), 2) if separate else s0
  transition = ScriptedTransition(**kw)
  tree = expand_tree(
      cfg.replace(schedule=schedule),
      _policy(model_cfg, params),
      transition,
      transition.roots(2, cfg.num_agents),
      KEY,
  )
  _assert_same_nodes(fixtures[name]["nodes"], tree)


def test_same_greedy_trees_and_local_llm_replies_as_before(states, fixtures):
  model_cfg, s0, _ = states
  greedy = SamplingConfig(greedy=True, max_new_tokens=6)
  renderer = byte_renderer()
  duo = EnvTransition(renderer, num_agents=2, reward_cfg=RewardConfig(shaping_weight=1.0))
  roots = [duo.root_state(DuoEnv({"prompt": p})) for p in ("a", "bb", "ccc")]
  tree = expand_tree(
      TreeConfig(num_turns=3, num_generations=1, num_agents=2),
      _policy(model_cfg, s0, greedy, renderer.fmt.stop_ids, renderer.tokenizer.pad_id),
      duo,
      roots,
      KEY,
  )
  _assert_same_nodes(fixtures["greedy_duo"]["nodes"], tree, cut_at=2)  # DuoEnv never ends
  calc_renderer = byte_renderer(calculator.EXTRA_SPECIALS)
  calc = EnvTransition(calc_renderer, reward_cfg=RewardConfig(shaping_weight=0.2))
  roots = calc.root_states(
      calculator.CalculatorFactory(), [calculator.make_task("eval", i) for i in range(4)]
  )
  tree = expand_tree(
      TreeConfig(num_turns=2, num_generations=1, branch_on="user_turn"),
      _policy(model_cfg, s0, greedy, calc_renderer.fmt.stop_ids, calc_renderer.tokenizer.pad_id),
      calc,
      roots,
      KEY,
  )
  _assert_same_nodes(fixtures["greedy_calculator"]["nodes"], tree)
  tok = renderer.tokenizer
  want = fixtures["local_llm"]
  llm = LocalLLM(
      create_model(model_cfg.replace(vocab_size=tok.vocab_size), seed=3),
      tok,
      sampling=SamplingConfig(temperature=3.0, max_new_tokens=6),
      fixed_rows=4,
  )
  assert llm.generate(want["prompts"], seeds=want["seeds"]) == want["replies"]


class _Jittery:
  """Wraps a transition: every step first sleeps a random 0-30 ms (thread-local draws)."""

  def __init__(self, inner, seed):
    self.inner, self.rng = inner, random.Random(seed)

  def prompts(self, state):
    return self.inner.prompts(state)

  def step(self, state, actions, seed=None):
    time.sleep(self.rng.random() * 0.03)
    return self.inner.step(state, actions, seed=seed)

  def close(self, state):
    self.inner.close(state)


def _roots(name, transition):
  if name == "coop":
    return transition.root_states(
        resolve_factory("coop"), [coop.make_task("eval", i) for i in range(3)]
    )
  return [transition.root_state(name({"prompt": p})) for p in ("12+3=", "7*8=", "x")]


def _env_tree(cfg, params, model_cfg, env, renderer, jitter_seed, **policy_kw):
  transition = EnvTransition(
      renderer,
      num_agents=cfg.num_agents,
      reward_cfg=RewardConfig(shaping_weight=1.0),
      limits=StepLimits(max_turns=8),
  )
  roots = _roots(env, transition)
  policy = _policy(
      model_cfg, params, SAMPLING, renderer.fmt.stop_ids, renderer.tokenizer.pad_id, **policy_kw
  )
  tree = expand_tree(cfg, policy, _Jittery(transition, jitter_seed), roots, KEY)
  return tree, policy


CASES = {
    "tool_substeps": (
        TreeConfig(num_turns=2, num_generations=2, branch_on="user_turn"),
        ToolThenUserEnv,
        False,
    ),
    "coop_align": (TreeConfig(num_turns=2, num_generations=2, num_agents=2), "coop", False),
    "coop_cross": (
        TreeConfig(num_turns=2, num_generations=2, num_agents=2, joint_mode="cross"),
        "coop",
        False,
    ),
    "duo_align": (TreeConfig(num_turns=2, num_generations=2, num_agents=2), DuoEnv, False),
    "duo_cross": (
        TreeConfig(num_turns=2, num_generations=2, num_agents=2, joint_mode="cross"),
        DuoEnv,
        False,
    ),
    "duo_separate": (TreeConfig(num_turns=2, num_generations=2, num_agents=2), DuoEnv, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_continuous_and_barrier_schedules_give_identical_trees(case):
  cfg, env_cls, separate = CASES[case]
  renderer = byte_renderer(calculator.EXTRA_SPECIALS)
  # The tokenizer's vocabulary exactly: every sampled id decodes, episodes go on.
  model_cfg = tiny_model().cfg.replace(vocab_size=renderer.tokenizer.vocab_size)
  s0, s1 = (_states(model_cfg, s) for s in (0, 1))
  params = StackedStates(stack_trees([s0, s1]), 2) if separate else s0
  barrier, _ = _env_tree(cfg.replace(schedule="barrier"), params, model_cfg, env_cls, renderer, 0)
  # The second continuous run reads each decode chunk while the next decodes.
  for jitter, overlap in ((1, False), (2, True)):
    want = _tree_json(barrier)
    tree, policy = _env_tree(cfg, params, model_cfg, env_cls, renderer, jitter, overlap=overlap)
    got = _tree_json(tree)
    # Bit for bit, logprobs included: every engine call has fixed rows and each
    # row a window set by its own prompt and budget, so a sample's arithmetic does not depend
    # on which requests shared its calls.
    assert got == want
    if len(tree.nodes) > len(roots := [n for n in tree.nodes if n.parent_id < 0]):
      assert policy.engine.stats["reused_tokens"] > 0  # children continued cached samples
  assert len(barrier.nodes) > len(roots)


def test_a_tiny_kv_budget_evicts_and_gives_the_same_tree(states):
  model_cfg, s0, _ = states
  cfg = TreeConfig(num_turns=3, num_generations=2)
  transition = ScriptedTransition()
  roots = transition.roots(4, 1)
  roomy = _policy(model_cfg, s0)
  tight = _policy(model_cfg, s0, slots=2)  # a request's G samples, nothing more
  want = expand_tree(cfg, roomy, transition, roots, KEY)
  got = expand_tree(cfg, tight, transition, transition.roots(4, 1), KEY)
  assert tight.engine.stats["evictions"] > 0
  assert tight.engine.stats["prefill_tokens"] > roomy.engine.stats["prefill_tokens"]
  _assert_same_nodes(_tree_json(want), got)


def test_tool_substeps_continue_from_the_sample_cache(tiny_model):
  # The calculator tokenizer (270 ids) under a 300-id model: ids past the
  # tokenizer end the episode as a model format fault instead of crashing.
  renderer = byte_renderer(calculator.EXTRA_SPECIALS)
  policy = _policy(
      tiny_model.cfg,
      nnx.split(tiny_model)[1],
      SAMPLING,
      renderer.fmt.stop_ids,
      renderer.tokenizer.pad_id,
      fresh=True,
  )
  transition = EnvTransition(renderer, reward_cfg=RewardConfig(shaping_weight=1.0))
  roots = [transition.root_state(ToolThenUserEnv({"prompt": p})) for p in ("12+3=", "7*8=")]
  tree = expand_tree(
      TreeConfig(num_turns=2, num_generations=2, branch_on="user_turn"),
      policy,
      transition,
      roots,
      jax.random.key(0),
  )
  nodes = tree.counts()["nodes"]
  assert 2 <= nodes <= 2 * 3 and tree.num_substeps() > 0
  stats = policy.engine.stats
  # A level sampler prefilled every node's whole prompt; the engine prefills the
  # roots' and then only what the environment added.
  assert stats["reused_tokens"] > 0
  assert stats["prefill_tokens"] < sum(len(n.prompts[0]) for n in tree.nodes)
  assert policy.engine.num_compiles <= 8
  batch = testing.rows_of(tree, (128,))
  loss_mask_BxL = testing.dense_rows(batch, batch.loss_mask_BxK, fill=False)
  old_logp_BxL = testing.dense_rows(batch, batch.old_logp_BxK)
  rows = [(n, g) for n in tree.nodes for g in range(2)]
  for b, (node, g) in enumerate(rows):
    comp, action = node.completions[0][g], node.actions[g]
    if action.faults and action.faults[0].kind.value == "model_format":
      continue  # an id past the tokenizer: the environment never answered
    assert comp.num_segments == 1 + node.substeps_B[g] == 2
    assert action.steps[0].details["env_roles"] == [["tool"]]
    mask = loss_mask_BxL[b]
    assert mask.sum() == comp.sampled_mask.sum() and (old_logp_BxL[b, mask] <= 0).all()
  assert np.isfinite(batch.old_logp_BxK).all() and batch.row_weight_B.sum() == 2 * nodes
