"""LocalLLM on a real tiny random model: choice scores, sampling, judges, batching."""

import math
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from mtrl_jax.envs import Thread
from mtrl_jax.graders import BinaryJudgeGrader, RangeJudgeGrader, ScriptedGenerator
from mtrl_jax.sampling.batching import BatchingGenerator
from mtrl_jax.sampling.generation import LocalLLM
from mtrl_jax.models import create_model, get_preset
from mtrl_jax.sampling import SamplingConfig

THREAD = Thread.from_messages([("user", "2+2?"), ("assistant", "<answer>4</answer>")])


@pytest.fixture(scope="module")
def llm(byte_tokenizer):
  model = create_model(get_preset("tiny"), seed=3)
  graphdef, state = nnx.split(model)
  # The reference forward: jitted (eager op-by-op dispatch is slow), unpadded.
  forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
  return (
      lambda ids_BxL: np.asarray(forward(state, np.asarray(ids_BxL, np.int32)), np.float64),
      LocalLLM(model, byte_tokenizer, seed=0),
  )


def _log_softmax(logits):
  z = logits - logits.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_score_choices_matches_unbatched_forward(llm):
  forward, gen = llm
  prompts = ["Is 2+2=4? PASS or FAIL", "Rate it"]
  choices = ["PASS", "FAIL", "MAYB"]  # equal lengths: one unpadded reference batch per prompt
  scores = gen.score_choices(prompts, choices)
  assert scores.shape == (2, 3) and scores.dtype == np.float64
  tok = gen.tokenizer
  for i, p in enumerate(prompts):
    base = gen.prompt_ids(p)
    assert base[-1] == tok.token_to_id("<|assistant|>")  # compact format for ByteTokenizer
    seqs = [base + tok.encode(c) for c in choices]
    logp_BxLxV = _log_softmax(forward(seqs))  # float64 log-softmax of float32 logits
    for j, ids in enumerate(seqs):
      # Choice token t is predicted at position t - 1.
      want = sum(logp_BxLxV[j, t - 1, ids[t]] for t in range(len(base), len(ids)))
      np.testing.assert_allclose(scores[i, j], want, rtol=1e-5, atol=1e-4)
  compiles = gen.num_score_compiles
  gen.score_choices(["Rate it too", "x"], choices)  # same buckets: no new compile
  assert gen.num_score_compiles == compiles
  # Two environment threads judging at once share one batched forward.
  batcher = BatchingGenerator(gen, max_wait_s=0.2)
  got, barrier = {}, threading.Barrier(2)

  def judge(i):
    barrier.wait()
    got[i] = batcher.score_choices([prompts[i]], choices)

  workers = [threading.Thread(target=judge, args=(i,)) for i in range(2)]
  for w in workers:
    w.start()
  for w in workers:
    w.join()
  assert batcher.inner_calls == 1 and gen.num_score_compiles == compiles
  for i in range(2):
    np.testing.assert_allclose(got[i][0], scores[i], rtol=0, atol=1e-6)


def test_judges_on_local_model(llm):
  _, gen = llm
  judge = BinaryJudgeGrader(gen, "correct answer")
  g = judge.grade(THREAD)
  lp = gen.score_choices([judge.prompt(THREAD)], ["PASS", "FAIL"])[0]
  assert g.score == pytest.approx(1 / (1 + math.exp(lp[1] - lp[0])), rel=1e-9)
  assert 0.0 < g.score < 1.0
  rng = RangeJudgeGrader(gen, "helpful")
  r = rng.grade_batch([THREAD, THREAD])
  assert r[0].score == pytest.approx(r[1].score, abs=1e-9) and 0.0 <= r[0].score <= 1.0
  probs = [r[0].components[f"p_{k}"] for k in "12345"]
  assert sum(probs) == pytest.approx(1.0)


def test_generate_greedy_matches_manual_decode(llm):
  forward, gen = llm
  sampling = SamplingConfig(greedy=True, max_new_tokens=6)
  prompts = ["hello", "a longer prompt"]
  texts = gen.generate(prompts, sampling)
  tok = gen.tokenizer
  stop = set(gen.fmt.stop_ids)
  for p, text in zip(prompts, texts):
    ids = gen.prompt_ids(p)
    new = []
    for _ in range(6):  # full forward (no KV cache) of a fixed-width right-padded row
      row = ids + new
      logits = forward([row + [tok.pad_id] * (32 - len(row))])[0, len(row) - 1]
      nxt = int(np.argmax(logits))
      if nxt in stop:
        break
      new.append(nxt)
    assert text == tok.decode(new)


def test_batching_generator_merges_concurrent_calls():
  inner = ScriptedGenerator(
      replies=lambda p: p.upper(), scores=lambda p, c: [float(len(p)), -float(len(p))]
  )
  batcher = BatchingGenerator(inner, max_wait_s=0.2, max_batch=4)
  results, barrier = {}, threading.Barrier(6)

  def worker(i):
    barrier.wait()
    if i % 2:
      results[i] = batcher.generate([f"p{i}", f"q{i}"])
    else:
      results[i] = batcher.score_choices(["x" * i], ["A", "B"])

  threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for i in range(6):
    if i % 2:
      assert results[i] == [f"P{i}", f"Q{i}"]
    else:
      np.testing.assert_array_equal(results[i], [[i, -i]])
  # 3 generate requests x 2 prompts with max_batch 4 -> 2 calls; 3 score requests -> 1 call.
  assert batcher.inner_calls == inner.calls == 3


def test_batching_generator_propagates_errors():
  def boom(prompt):
    raise RuntimeError("down")

  batcher = BatchingGenerator(ScriptedGenerator(replies=boom), max_wait_s=0.0)
  with pytest.raises(RuntimeError, match="down"):
    batcher.generate(["x"])
  assert batcher.generate([]) == []
