"""Token choice (temperature, top-k, top-p, greedy) against a numpy float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrl_jax.sampling import SamplingConfig, choose_tokens, inverse_cdf

# Distinct logits (no ties), so the top-k / nucleus sets are unambiguous.
LOGITS = np.array([2.0, -1.0, 0.5, 3.1, 1.7, -0.3, 0.9, 2.6, -2.2, 0.1, 1.2, -0.8])


def reference_q(logits, temperature, top_k, top_p):
  """numpy float64: the renormalised sampling distribution over the vocabulary."""
  z = logits.astype(np.float64) / temperature
  order = np.argsort(-z, kind="stable")
  keep = np.zeros(z.shape, bool)
  k = len(z) if top_k == 0 else min(top_k, len(z))
  keep[order[:k]] = True
  p = np.exp(z - z.max()) * keep
  p /= p.sum()
  if top_p < 1.0:
    # Walk down the sorted probabilities until the mass reaches top_p; keep
    # everything at least as likely as the last token taken (ties included).
    sorted_p = p[order]
    before = np.cumsum(sorted_p) - sorted_p
    last = order[np.flatnonzero(before < top_p)[-1]]
    p = np.where(p >= p[last], p, 0.0)
    p /= p.sum()
  return p


def _draw(logits, n, temperature, top_k, top_p, greedy=False, seed=0):
  logits_BxV = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
  u_B = jax.random.uniform(jax.random.key(seed), (n,))
  fn = jax.jit(
      lambda lg, u: choose_tokens(
          lg, u, temperature, top_p, greedy=greedy, top_k=top_k, use_top_p=top_p < 1.0
      )
  )
  tok, logq = fn(logits_BxV, u_B)
  return np.asarray(tok), np.asarray(logq)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, 0, 1.0),  # plain sampling
        (1.0, 4, 1.0),  # top-k: {3, 7, 0, 4}
        (1.0, 0, 0.7),  # nucleus
        (0.7, 5, 0.8),  # both, sharper
        (1.6, 0, 0.9),  # nucleus, flatter
    ],
)
def test_samples_follow_reference_distribution(temperature, top_k, top_p):
  n = 40_000
  tok, logq = _draw(LOGITS, n, temperature, top_k, top_p)
  q = reference_q(LOGITS, temperature, top_k, top_p)
  allowed = set(np.flatnonzero(q > 0).tolist())
  assert set(tok.tolist()) <= allowed
  if top_k:
    assert len(allowed) <= top_k
  freq = np.bincount(tok, minlength=len(LOGITS)) / n
  sigma = np.sqrt(q * (1 - q) / n)
  # 5 binomial standard deviations (+ a hair for q = 0 entries).
  np.testing.assert_array_less(np.abs(freq - q), 5 * sigma + 1e-9)
  np.testing.assert_allclose(logq, np.log(q[tok]), atol=1e-5)


@pytest.mark.parametrize("top_k", [0, 3])
def test_nucleus_keeps_ties_at_the_boundary(top_k):
  # p = softmax([2, 1, 1, 0]) = [.532, .196, .196, .072]; mass before the
  # second token .532 < .6 keeps it, and its tie (id 2) is kept as well.
  logits = np.array([2.0, 1.0, 1.0, 0.0])
  tok, logq = _draw(logits, 4000, 1.0, top_k, 0.6)
  assert set(tok.tolist()) == {0, 1, 2}
  q = np.exp(logits[:3]) / np.exp(logits[:3]).sum()
  np.testing.assert_allclose(logq, np.log(q[tok]), atol=1e-6)


def test_inverse_cdf_matches_searchsorted():
  rng = np.random.default_rng(0)
  w = rng.exponential(size=(64, 300)) * (rng.random((64, 300)) < 0.7)  # 30% zeros
  u = rng.random(64)
  j, total = jax.jit(inverse_cdf)(jnp.asarray(w, jnp.float32), jnp.asarray(u, jnp.float32))
  cdf = np.cumsum(w, axis=1)
  target = u * cdf[:, -1]
  expected = np.array([np.searchsorted(c, t, side="right") for c, t in zip(cdf, target)])
  gap = np.min(np.abs(cdf - target[:, None]), axis=1) / cdf[:, -1]
  clear = gap > 1e-5  # float32 rounding cannot move a target across these boundaries
  assert clear.sum() > 50
  np.testing.assert_array_equal(np.asarray(j)[clear], expected[clear])
  assert (w[np.arange(64), np.asarray(j)] > 0).all()
  np.testing.assert_allclose(np.asarray(total), cdf[:, -1], rtol=1e-5)


def test_greedy_takes_argmax_and_reports_its_logprob():
  tok, logq = _draw(LOGITS, 8, 0.5, 3, 0.9, greedy=True)
  assert (tok == 3).all()
  np.testing.assert_allclose(logq, np.log(reference_q(LOGITS, 0.5, 3, 0.9)[3]), atol=1e-6)


def test_huge_logit_range_never_yields_minus_inf():
  # exp underflows to 0 for most of the vocabulary: log q must stay finite.
  logits = np.concatenate([[0.0, -0.5], np.full(2000, -400.0)])
  tok, logq = _draw(logits, 5000, 1.0, 0, 1.0)
  assert set(tok.tolist()) <= {0, 1}
  assert np.isfinite(logq).all()
  np.testing.assert_allclose(logq, np.log(reference_q(logits, 1.0, 0, 1.0)[tok]), atol=1e-5)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", 0.0),
        ("temperature", -1.0),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", 2.0),
        ("max_new_tokens", 0),
        ("max_new_tokens", 3.5),
        ("greedy", 1),
    ],
)
def test_sampling_config_rejects_bad_fields(field, value):
  with pytest.raises(ValueError, match=f"SamplingConfig.{field}"):
    SamplingConfig(**{field: value})


def test_sampling_config_is_frozen_and_hashable():
  cfg = SamplingConfig(temperature=0.8, top_k=5)
  assert hash(cfg) == hash(SamplingConfig(temperature=0.8, top_k=5))
  with pytest.raises(Exception):
    cfg.top_k = 3
