"""Tests of mtrl_jax.losses.logprobs against float64 numpy log-softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrl_jax.losses import chunked_token_logprobs, token_entropy, token_logprobs

B, L, V, D = 2, 5, 11, 6


def _np_log_softmax(x):
  x = np.asarray(x, np.float64)
  z = x - x.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _data(seed=0):
  rng = np.random.default_rng(seed)
  logits = rng.normal(0, 3, (B, L, V)).astype(np.float32)
  tokens = rng.integers(0, V, (B, L)).astype(np.int32)
  return logits, tokens


def test_hand_worked_alignment():
  # Vocabulary of 3, one row of 3 tokens [2, 0, 1]. Logits at position 0
  # predict token 1 (= 0), at position 1 predict token 2 (= 1):
  #   logits[0] = [log 1, log 2, log 1] -> p(0) = 1/4          -> log 0.25
  #   logits[1] = [0, log 3, 0]         -> p(1) = 3/5          -> log 0.6
  # logits[2] predicts nothing inside the row and is unused.
  logits = jnp.log(jnp.array([[[1.0, 2.0, 1.0], [1.0, 3.0, 1.0], [5.0, 1.0, 1.0]]]))
  logp = token_logprobs(logits, jnp.array([[2, 0, 1]]))
  np.testing.assert_allclose(np.asarray(logp), [[0.0, np.log(0.25), np.log(0.6)]], rtol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_numpy_log_softmax(temperature):
  logits, tokens = _data()
  got = np.asarray(
      token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), temperature=temperature)
  )
  ls = _np_log_softmax(logits / temperature)
  want = np.zeros((B, L))
  for b in range(B):
    for t in range(1, L):
      want[b, t] = ls[b, t - 1, tokens[b, t]]
  assert got.dtype == np.float32 and np.all(got[:, 0] == 0.0)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def test_bfloat16_logits_are_computed_in_float32():
  logits, tokens = _data(1)
  bf = jnp.asarray(logits, jnp.bfloat16)
  got = token_logprobs(bf, jnp.asarray(tokens))
  assert got.dtype == jnp.float32
  ls = _np_log_softmax(np.asarray(bf.astype(jnp.float32)))  # same rounded inputs
  want = np.take_along_axis(ls[:, :-1], tokens[:, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(got)[:, 1:], want, rtol=1e-6, atol=1e-5)


def test_entropy_matches_numpy_and_handles_minus_inf():
  logits, _ = _data(2)
  logits[0, 1, :4] = -np.inf  # a masked-out part of the vocabulary
  got = np.asarray(token_entropy(jnp.asarray(logits)))
  ls = _np_log_softmax(logits)
  p = np.exp(ls)
  ent = -np.sum(np.where(p > 0, p * np.where(p > 0, ls, 0), 0), -1)
  assert np.all(np.isfinite(got)) and np.all(got[:, 0] == 0.0)
  np.testing.assert_allclose(got[:, 1:], ent[:, :-1], rtol=1e-6, atol=1e-5)
  # Uniform logits: entropy log V exactly.
  np.testing.assert_allclose(
      np.asarray(token_entropy(jnp.zeros((1, 3, V))))[0, 1:], np.log(V), rtol=1e-6
  )


@pytest.mark.parametrize("chunk", [3, 11, 16])
def test_chunked_equals_plain_values_and_gradients(chunk):
  # V = 11: chunks of 3 leave a tail of 2, 11 is one chunk, 16 > V is all tail.
  rng = np.random.default_rng(3)
  hidden = jnp.asarray(rng.normal(size=(B, L, D)), jnp.float32)
  weight = jnp.asarray(rng.normal(size=(D, V)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, V, (B, L)), jnp.int32)
  cot = jnp.asarray(rng.normal(size=(B, L)), jnp.float32)

  def plain(h, w):
    return token_logprobs(jnp.einsum("bld,dv->blv", h, w), tokens)

  def chunked(h, w):
    return chunked_token_logprobs(h, w, tokens, chunk)

  @jax.jit
  def value_and_grads(h, w):
    out = []
    for f in (plain, chunked):
      # A random cotangent exercises every position's gradient.
      out.append((f(h, w), jax.grad(lambda h, w: jnp.sum(cot * f(h, w)), (0, 1))(h, w)))
    return out

  (want, g_want), (got, g_got) = value_and_grads(hidden, weight)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got)[:, 0] == 0.0)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_chunked_gradient_never_holds_full_logits():
  # XLA's buffer assignment for value + gradient: the plain path needs several
  # [B, L, V] float32 buffers (measured 3x), the chunked one only [B, L, chunk]
  # pieces plus the [D, V] weight gradient.
  b, l, v, d, chunk = 2, 64, 4096, 16, 256
  h, w = jnp.ones((b, l, d)), jnp.ones((d, v))
  tokens = jnp.zeros((b, l), jnp.int32)
  full_logits_bytes = b * l * v * 4

  def temp_bytes(f):
    grad = jax.jit(jax.grad(lambda h, w: jnp.sum(f(h, w)), (0, 1)))
    return grad.lower(h, w).compile().memory_analysis().temp_size_in_bytes

  plain = temp_bytes(lambda h, w: token_logprobs(jnp.einsum("bld,dv->blv", h, w), tokens))
  chunked = temp_bytes(lambda h, w: chunked_token_logprobs(h, w, tokens, chunk))
  assert plain >= full_logits_bytes
  assert chunked < full_logits_bytes / 4, (chunked, full_logits_bytes)


def test_bad_arguments_are_rejected():
  logits, tokens = _data()
  with pytest.raises(ValueError, match="tokens_BxL"):
    token_logprobs(jnp.asarray(logits), jnp.asarray(tokens[:, :3]))
  with pytest.raises(ValueError, match="chunk_size"):
    chunked_token_logprobs(jnp.zeros((B, L, D)), jnp.zeros((D, V)), jnp.asarray(tokens), 0)
  with pytest.raises(ValueError, match="weight_DxV"):
    chunked_token_logprobs(jnp.zeros((B, L, D)), jnp.zeros((D + 1, V)), jnp.asarray(tokens), 4)
