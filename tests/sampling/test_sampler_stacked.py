"""Separate policies sampled by one compiled call: each agent equals sampling it alone."""

import jax
import numpy as np
import pytest
from flax import nnx

from mtrl_jax import models, sharding
from mtrl_jax.sampling import Sampler, SamplingConfig
from mtrl_jax.train.stacked import stack_trees

CFG = models.get_preset("tiny")  # float32
PAD, STOP = 0, [7, 9]
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=12)
# Agent 1 has fewer prompts; both fit the same prompt-row (4) and length (16) buckets,
# as every agent of a tree level does, so "alone" runs the same layout.
PROMPTS = [[[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13], [11], [40, 41, 42, 43, 44]],
           [[21, 22], [30, 31, 32, 33, 34, 35], [99]]]


@pytest.fixture(scope="module")
def states():
  return [nnx.split(models.create_model(CFG, seed=s))[1] for s in (0, 1)]


def _keys():
  key = jax.random.PRNGKey(5)
  return [jax.random.fold_in(key, a) for a in range(2)]


def _alone(states, mesh=None):
  s = Sampler(CFG, mesh=mesh)
  return [s.generate(states[a], PROMPTS[a], 3, SAMPLING, k, STOP, PAD)
          for a, k in enumerate(_keys())]


@pytest.mark.parametrize("agent_map, mesh_shape", [("map", None), ("map", (2, 2, 2)),
                                                   ("vmap", None)])
def test_stacked_sampler_equals_each_agent_alone(states, agent_map, mesh_shape):
  mesh = None if mesh_shape is None else sharding.make_mesh(mesh_shape)
  s = Sampler(CFG, mesh=mesh, agent_map=agent_map)
  res = s.generate_stacked(stack_trees(states), PROMPTS, 3, SAMPLING,
                           jax.numpy.stack(_keys()), STOP, PAD)
  assert s.num_compiles == 1  # one program for both agents
  for a, ref in enumerate(_alone(states, mesh)):
    assert res[a].tokens.shape == (len(PROMPTS[a]) * 3, 12)
    np.testing.assert_array_equal(res[a].tokens, ref.tokens)
    np.testing.assert_array_equal(res[a].lengths, ref.lengths)
    assert res[a].finish_reason == ref.finish_reason
    if agent_map == "map":  # each agent runs exactly its single-agent arithmetic
      np.testing.assert_array_equal(res[a].logprobs, ref.logprobs)
    else:
      # Batched matmuls sum in another order than the single-agent ones; the plain
      # tiny init has |logits| below 32, where one float32 ulp is 3.8e-6: allow 8.
      np.testing.assert_allclose(res[a].logprobs, ref.logprobs,
                                 atol=8 * np.spacing(np.float32(32)), rtol=0)
  assert not np.array_equal(res[0].tokens[:9], res[1].tokens[:9])  # own weights, own key


def test_agent_without_prompts_is_padding_and_changes_nothing(states):
  s = Sampler(CFG, agent_map="map")
  ref = _alone(states)[1]
  res = s.generate_stacked(stack_trees(states), [[], PROMPTS[1]], 3, SAMPLING,
                           jax.numpy.stack(_keys()), STOP, PAD)
  assert res[0].tokens.shape == (0, 12) and res[0].finish_reason == []
  np.testing.assert_array_equal(res[1].tokens, ref.tokens)
  np.testing.assert_array_equal(res[1].logprobs, ref.logprobs)


def test_precompiled_stacked_bucket_runs_without_compiling(states):
  from mtrl_jax.metrics import CompileCensus
  s = Sampler(CFG, batch_buckets=(4, 8, 16), prompt_buckets=(16,), agent_map="map")
  s.precompile_stacked(stack_trees(states), num_prompts=4, prompt_len=16, num_generations=3,
                       sampling=SAMPLING, num_stop_ids=len(STOP))
  census = CompileCensus()
  census.register("sampler", s)
  # 4 and 3 prompts of <= 16 tokens, G = 3: prompt rows bucket 4, decode rows 16.
  s.generate_stacked(stack_trees(states), PROMPTS, 3, SAMPLING, jax.numpy.stack(_keys()),
                     STOP, PAD)
  assert s.num_compiles == 1 and census.counts()["compiles/backend_total"] == 0


def test_stacked_sampler_refuses_mismatched_agents(states):
  s = Sampler(CFG)
  with pytest.raises(ValueError, match="one list per stacked agent"):
    s.generate_stacked(stack_trees(states), PROMPTS[:1], 3, SAMPLING,
                       jax.numpy.stack(_keys()), STOP, PAD)
  with pytest.raises(ValueError, match="one PRNG key per agent"):
    s.generate_stacked(stack_trees(states), PROMPTS, 3, SAMPLING, _keys()[0], STOP, PAD)
  with pytest.raises(ValueError, match="agent_map"):
    Sampler(CFG, agent_map="pmap")
