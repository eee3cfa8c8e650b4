"""Branching KV-cache sampler against the full (uncached) forward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtrl_jax import models, sharding
from mtrl_jax.sampling import Sampler, SamplingConfig

CFG = models.get_preset("tiny")  # float32
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13], [11], [40, 41, 42, 43, 44]]
PAD = 0
ROWS, WIDTH = 16, 32  # reference forwards are padded to [ROWS, WIDTH]: one compile


def _scaled_state(seed, scale=3.0):
  """Random weights x scale: the plain tiny init just repeats its input token greedily."""
  _, state = nnx.split(models.create_model(CFG, seed=seed))
  return jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, state)


@pytest.fixture(scope="module")
def state():
  """For greedy paths: sharp, varied argmax sequences (|logits| up to ~75)."""
  return _scaled_state(0)


@pytest.fixture(scope="module")
def plain_state():
  """The plain init (|logits| up to ~30) for 1e-5 float32 logprob comparisons: the
  x3 weights reach |logits| ~75, where float32 rounding alone is ~1e-5."""
  return _scaled_state(0, scale=1.0)


@pytest.fixture(scope="module")
def sampler():
  return Sampler(CFG)


@pytest.fixture(scope="module")
def full_forward():
  graphdef = nnx.graphdef(models.create_model(CFG, seed=0))
  return jax.jit(lambda st, toks: nnx.merge(graphdef, st)(toks))


def _full_logprobs(full_forward, state, prompts, result, num_generations):
  """log_softmax of the uncached forward over prompt + completion, at each sampled token."""
  rows = []
  for r, toks in enumerate(result.tokens):
    prompt = prompts[r // num_generations]
    rows.append(list(prompt) + list(toks[:result.lengths[r]]))
  batch = np.full((ROWS, WIDTH), PAD, np.int32)  # right padding: causal, never read
  for i, x in enumerate(rows):
    batch[i, :len(x)] = x
  logp = np.asarray(jax.nn.log_softmax(full_forward(state, jnp.asarray(batch)), axis=-1),
                    np.float64)
  out = np.zeros(result.tokens.shape)
  for r in range(len(rows)):
    n0 = len(prompts[r // num_generations])
    for t in range(result.lengths[r]):
      out[r, t] = logp[r, n0 + t - 1, result.tokens[r, t]]
  return out, logp


def test_greedy_equals_stepwise_argmax_of_full_forward(sampler, state, full_forward):
  steps = 12
  res = sampler.generate(state, PROMPTS, 2, SamplingConfig(greedy=True, max_new_tokens=steps),
                         jax.random.key(0), stop_ids=[], pad_id=PAD)
  np.testing.assert_array_equal(res.tokens[0::2], res.tokens[1::2])  # greedy branches agree
  # Reference: no cache, re-run the whole sequence each step, argmax at its end.
  seqs = [list(p) for p in PROMPTS]
  for _ in range(steps):
    batch = np.full((ROWS, WIDTH), PAD, np.int32)
    for i, s in enumerate(seqs):
      batch[i, :len(s)] = s
    logits = np.asarray(full_forward(state, jnp.asarray(batch)))
    for i, s in enumerate(seqs):
      s.append(int(np.argmax(logits[i, len(s) - 1])))
  expected = np.array([s[len(p):] for s, p in zip(seqs, PROMPTS)])
  np.testing.assert_array_equal(res.tokens[0::2], expected)
  assert len(set(map(tuple, expected.tolist()))) == len(PROMPTS)  # not a degenerate model
  assert (res.lengths == steps).all() and res.finish_reason == ["length"] * 2 * len(PROMPTS)


def test_sampled_logprobs_equal_full_forward_log_softmax(sampler, plain_state, full_forward):
  g, state = 3, plain_state
  res = sampler.generate(state, PROMPTS, g, SamplingConfig(max_new_tokens=10),
                         jax.random.key(7), stop_ids=[], pad_id=PAD)
  assert res.tokens.shape == (len(PROMPTS) * g, 10)
  ref, _ = _full_logprobs(full_forward, state, PROMPTS, res, g)
  np.testing.assert_allclose(res.logprobs, ref, atol=1e-5)
  # Branches of one prompt differ (they are sampled, not copied).
  assert len({tuple(r) for r in res.tokens[:g].tolist()}) > 1


def test_branching_equals_separate_prefills(sampler, plain_state):
  g, state = 3, plain_state
  cfg = SamplingConfig(temperature=1.3, max_new_tokens=10)
  key = jax.random.key(3)
  branched = sampler.generate(state, PROMPTS, g, cfg, key, stop_ids=[5], pad_id=PAD)
  repeated = [p for p in PROMPTS for _ in range(g)]
  separate = sampler.generate(state, repeated, 1, cfg, key, stop_ids=[5], pad_id=PAD)
  np.testing.assert_array_equal(branched.tokens, separate.tokens)
  np.testing.assert_allclose(branched.logprobs, separate.logprobs, atol=1e-5)
  np.testing.assert_array_equal(branched.lengths, separate.lengths)
  assert branched.finish_reason == separate.finish_reason


def test_top_k_top_p_sample_only_allowed_tokens(sampler, plain_state, full_forward):
  k, top_p, temp, state = 4, 0.8, 0.9, plain_state
  res = sampler.generate(state, PROMPTS, 4,
                         SamplingConfig(temperature=temp, top_k=k, top_p=top_p,
                                        max_new_tokens=10),
                         jax.random.key(1), stop_ids=[], pad_id=PAD)
  _, logp_full = _full_logprobs(full_forward, state, PROMPTS, res, 4)
  for r in range(res.tokens.shape[0]):
    n0 = len(PROMPTS[r // 4])
    for t in range(res.lengths[r]):
      z = logp_full[r, n0 + t - 1] / temp  # log-softmax shifts, temperature scales
      order = np.argsort(-z, kind="stable")[:k]
      p = np.exp(z[order] - z[order].max())
      p /= p.sum()
      keep = (np.cumsum(p) - p) < top_p
      q = p[keep] / p[keep].sum()
      allowed = order[keep]
      tok = res.tokens[r, t]
      assert tok in allowed
      np.testing.assert_allclose(res.logprobs[r, t], np.log(q[list(allowed).index(tok)]),
                                 atol=1e-5)


def test_stop_tokens_end_rows_and_are_included(sampler, state):
  free = sampler.generate(state, PROMPTS, 2, SamplingConfig(greedy=True, max_new_tokens=12),
                          jax.random.key(0), stop_ids=[], pad_id=PAD)
  stops = [int(free.tokens[0, 3]), int(free.tokens[2, 5])]  # several stop ids at once
  res = sampler.generate(state, PROMPTS, 2, SamplingConfig(greedy=True, max_new_tokens=12),
                         jax.random.key(0), stop_ids=stops, pad_id=PAD)
  for r in range(2 * len(PROMPTS)):
    hits = [t for t in range(12) if free.tokens[r, t] in stops]
    if hits:
      n = hits[0] + 1
      assert res.finish_reason[r] == "stop" and res.lengths[r] == n
      np.testing.assert_array_equal(res.tokens[r, :n], free.tokens[r, :n])
      assert res.tokens[r, n - 1] in stops
      assert (res.tokens[r, n:] == PAD).all() and (res.logprobs[r, n:] == 0).all()
      np.testing.assert_allclose(res.logprobs[r, :n], free.logprobs[r, :n], atol=1e-6)
    else:
      assert res.finish_reason[r] == "length" and res.lengths[r] == 12
  assert res.finish_reason[:4] == ["stop"] * 4


def test_max_new_tokens_gives_length(sampler, state):
  res = sampler.generate(state, PROMPTS, 3, SamplingConfig(max_new_tokens=5),
                         jax.random.key(2), stop_ids=[], pad_id=PAD)
  assert res.tokens.shape == (12, 5) and (res.lengths == 5).all()
  assert res.finish_reason == ["length"] * 12
  assert (res.logprobs <= 0).all() and (res.logprobs < 0).any()


def test_same_bucket_and_new_weights_do_not_recompile(state):
  s = Sampler(CFG)
  s.generate(state, PROMPTS, 2, SamplingConfig(max_new_tokens=10), jax.random.key(0),
             stop_ids=[3], pad_id=PAD)
  assert s.num_compiles == 1
  # Other prompts / P / G / temperature / max_new / stop ids / weights, same buckets.
  other = _scaled_state(1)
  a = s.generate(other, [[7, 8], [9] * 14, [4, 4, 4]], 2,
                 SamplingConfig(temperature=0.5, max_new_tokens=13), jax.random.key(1),
                 stop_ids=[1, 2], pad_id=3)
  b = s.generate(state, [[7, 8], [9] * 14, [4, 4, 4]], 2,
                 SamplingConfig(temperature=0.5, max_new_tokens=13), jax.random.key(1),
                 stop_ids=[1, 2], pad_id=3)
  assert s.num_compiles == 1
  assert not np.array_equal(a.tokens, b.tokens)  # the new weights were used


@pytest.mark.parametrize("mesh_shape,explicit", [((8, 1, 1), False), ((2, 2, 2), False),
                                                 ((1, 4, 2), True)])
def test_sharded_greedy_equals_single_device(mesh_shape, explicit, sampler, state):
  cfg = SamplingConfig(greedy=True, max_new_tokens=12)
  ref = sampler.generate(state, PROMPTS, 2, cfg, jax.random.key(0), stop_ids=[7], pad_id=PAD)
  if explicit:  # jax.make_mesh's default (Explicit axes); the sampler re-types them Auto
    mesh = jax.make_mesh(mesh_shape, sharding.MESH_AXES)
  else:
    mesh = sharding.make_mesh(mesh_shape)
  sharded = Sampler(CFG, mesh=mesh)
  res = sharded.generate(state, PROMPTS, 2, cfg, jax.random.key(0), stop_ids=[7], pad_id=PAD)
  np.testing.assert_array_equal(res.tokens, ref.tokens)
  # Sharded contractions sum in another order; with |logits| up to ~75 here one
  # ulp of a logit is 7.6e-6, so allow a few ulps (8) of it in log q.
  np.testing.assert_allclose(res.logprobs, ref.logprobs, atol=8 * np.spacing(np.float32(75)))
  assert res.finish_reason == ref.finish_reason


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_generations=0), "num_generations"),
    (dict(pad_id=-1), "pad_id"),
    (dict(stop_ids=[CFG.vocab_size]), "stop_ids"),
    (dict(prompts=[[1], []]), r"prompts\[1\]"),
    (dict(prompts=[[1, CFG.vocab_size]]), r"prompts\[0\]"),
    (dict(prompts=[]), "prompts"),
])
def test_bad_inputs_raise_naming_the_argument(sampler, state, kwargs, match):
  args = dict(prompts=PROMPTS, num_generations=1, sampling=SamplingConfig(),
              key=jax.random.key(0), stop_ids=[], pad_id=PAD)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    sampler.generate(state, **args)


def test_bucket_overflow_names_the_bucket_list(state):
  s = Sampler(CFG, prompt_buckets=(8,))
  with pytest.raises(ValueError, match="prompt_buckets"):
    s.generate(state, [[1] * 9], 1, SamplingConfig(), jax.random.key(0), [], PAD)


@pytest.mark.parametrize("mesh_shape", [None, (2, 2, 2)])
def test_precompiled_bucket_runs_without_compiling(mesh_shape, state):
  from mtrl_jax.metrics import CompileCensus
  mesh = None if mesh_shape is None else sharding.make_mesh(mesh_shape)
  s = Sampler(CFG, mesh=mesh, batch_buckets=(4, 8), prompt_buckets=(16,))
  sampling = SamplingConfig(max_new_tokens=10)
  s.precompile(state, num_prompts=4, prompt_len=16, num_generations=2, sampling=sampling,
               num_stop_ids=1)
  assert s.num_compiles == 1
  census = CompileCensus()
  census.register("sampler", s)
  # 3 prompts of <= 16 tokens, G = 2: prompt rows bucket 4, decode rows bucket 8.
  res = s.generate(state, PROMPTS[:3], 2, sampling, jax.random.PRNGKey(1), stop_ids=[3],
                   pad_id=PAD)
  assert res.tokens.shape == (6, 10)
  assert census.counts()["compiles/sampler"] == 1
  assert census.counts()["compiles/backend_total"] == 0


@pytest.mark.parametrize("max_new", [12, 16])  # 16 fills the decode bucket: overflow steps
def test_chunked_decoding_equals_one_step_per_iteration(sampler, state, max_new):
  """decode_chunk=3 (not a divisor of the steps) samples exactly what chunk 1 does."""
  chunked = Sampler(CFG, decode_chunk=3)
  assert sampler.decode_chunk == 1  # the CPU default
  free = sampler.generate(state, PROMPTS, 2, SamplingConfig(greedy=True, max_new_tokens=12),
                          jax.random.key(0), stop_ids=[], pad_id=PAD)
  stops = [int(free.tokens[0, 3])]  # some rows stop early, others run to the limit
  for cfg in (SamplingConfig(greedy=True, max_new_tokens=max_new),
              SamplingConfig(max_new_tokens=max_new, temperature=0.8)):
    a = sampler.generate(state, PROMPTS, 2, cfg, jax.random.key(4), stop_ids=stops, pad_id=PAD)
    b = chunked.generate(state, PROMPTS, 2, cfg, jax.random.key(4), stop_ids=stops, pad_id=PAD)
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_array_equal(b.lengths, a.lengths)
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-6)
    assert b.finish_reason == a.finish_reason
  with pytest.raises(ValueError, match="decode_chunk=0; allowed"):
    Sampler(CFG, decode_chunk=0)
