"""Per-prompt keys and seeds: a reply depends on its prompt and seed, not on its batch."""

import jax
import numpy as np
import pytest
from flax import nnx

from mtrl_jax.models import create_model, get_preset
from mtrl_jax.sampling import Sampler, SamplingConfig
from mtrl_jax.sampling.generation import BatchingGenerator, LocalLLM, ScriptedGenerator

HOT = SamplingConfig(temperature=3.0, max_new_tokens=6)  # the random model's replies vary


@pytest.fixture(scope="module")
def model(byte_tokenizer):
  # The tokenizer's vocabulary exactly: every sampled id decodes.
  return create_model(get_preset("tiny").replace(vocab_size=byte_tokenizer.vocab_size), seed=3)


def test_sampler_prompt_keys_make_rows_independent_of_their_batch(model):
  sampler = Sampler(model.cfg, batch_buckets=(4,), prompt_buckets=(16,), decode_buckets=(16,))
  state = nnx.split(model)[1]
  a, b, c = [5, 6, 7], [9, 9], [11, 12, 13, 14]
  ka, kb, kc = (jax.random.key(i) for i in (1, 2, 3))
  first = sampler.generate(state, [a, b], 2, HOT, jax.random.key(0), [], 0,
                           prompt_keys=jax.numpy.stack([ka, kb]))
  second = sampler.generate(state, [c, a], 2, HOT, jax.random.key(9), [], 0,
                            prompt_keys=jax.numpy.stack([kc, ka]))
  # Prompt a's two branches (rows 0-1, then rows 2-3) are the same tokens and logprobs.
  np.testing.assert_array_equal(first.tokens[:2], second.tokens[2:])
  np.testing.assert_array_equal(first.logprobs[:2], second.logprobs[2:])
  assert not np.array_equal(first.tokens[0], first.tokens[1])  # branches differ
  with pytest.raises(ValueError, match="prompt_keys"):
    sampler.generate(state, [a, b], 1, HOT, jax.random.key(0), [], 0,
                     prompt_keys=jax.numpy.stack([ka]))


def test_local_llm_fixed_rows_replies_and_scores_ignore_batch_company(model, byte_tokenizer):
  llm = LocalLLM(model, byte_tokenizer, sampling=HOT, fixed_rows=4)
  alone = llm.generate(["hello"], seeds=[7])
  crowd = llm.generate(["other words here", "hello", "x" * 40], seeds=[1, 7, 2])
  assert crowd[1] == alone[0]
  assert llm.generate(["hello"], seeds=[8]) != alone  # another seed, another reply
  score_alone = llm.score_choices(["judge this"], ["PASS", "FAIL"])
  score_crowd = llm.score_choices(["a", "judge this", "y" * 100], ["PASS", "FAIL"])
  np.testing.assert_array_equal(score_crowd[1], score_alone[0])  # bitwise
  batched = BatchingGenerator(llm, max_wait_s=0.0)
  assert batched.generate(["hello"], seeds=[7]) == alone
  with pytest.raises(ValueError, match="fixed_rows"):
    LocalLLM(model, byte_tokenizer, fixed_rows=0)
  with pytest.raises(ValueError, match="seeds"):
    llm.generate(["a", "b"], seeds=[1])


def test_scripted_generator_records_seeds():
  gen = ScriptedGenerator(replies=["r"])
  gen.generate(["p", "q"], seeds=[3, 4])
  gen.generate(["s"])
  assert gen.seeds == [3, 4, None]
