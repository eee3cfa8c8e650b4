"""Per-prompt keys and seeds: a reply depends on its prompt and seed, not on its batch."""

import numpy as np
import pytest

from mtrl_jax.models import create_model, get_preset
from mtrl_jax.sampling import SamplingConfig
from mtrl_jax.sampling.batching import BatchingGenerator
from mtrl_jax.sampling.generation import LocalLLM, ScriptedGenerator

HOT = SamplingConfig(temperature=3.0, max_new_tokens=6)  # the random model's replies vary


@pytest.fixture(scope="module")
def model(byte_tokenizer):
  # The tokenizer's vocabulary exactly: every sampled id decodes.
  return create_model(get_preset("tiny").replace(vocab_size=byte_tokenizer.vocab_size), seed=3)


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
