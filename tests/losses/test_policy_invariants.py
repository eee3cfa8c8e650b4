"""Invariants of the policy losses: masked positions carry no gradient
(docs/design.md invariant 2), exact micro-batch accumulation, and the identities
that tie GRPO, GSPO and REINFORCE together."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrl_jax.losses import (
    AGGREGATIONS,
    LossConfig,
    finalize_metrics,
    merge_metric_sums,
    policy_loss,
    policy_loss_terms,
    safe_divide,
)

ALGS = ("grpo", "gspo", "reinforce")
EPS = {"grpo": (0.2, 0.28), "gspo": (3e-4, 4e-4), "reinforce": (0.2, 0.2)}
B, L = 6, 7


def _valid(alg, aggr):
  return not (alg == "gspo" and aggr in ("seq-mean-token-sum", "seq-mean-token-sum-norm"))


def _cfg(alg, aggr, est="k3", kl_coef=0.1):
  return LossConfig(alg, *EPS[alg], kl_coef, est, aggr, max_len=L)


ALL = [
    (a, g, e)
    for a, g, e in itertools.product(ALGS, AGGREGATIONS, ("k1", "k2", "k3"))
    if _valid(a, g)
]


def _batch(seed=0, per_token_adv=False):
  """Random batch with ragged masks, a fully masked row and a hole in a row."""
  rng = np.random.default_rng(seed)
  mask = np.zeros((B, L), bool)
  for b, (start, end) in enumerate([(2, 7), (1, 4), (3, 6), (0, 0), (1, 7), (5, 7)]):
    mask[b, start:end] = True
  mask[4, 3] = False  # a tool-output token inside a policy turn
  logp = -rng.uniform(0.05, 3.0, (B, L))
  old = logp + rng.normal(0, 0.3, (B, L))
  ref = logp + rng.normal(0, 0.3, (B, L))
  adv = rng.normal(size=(B, L) if per_token_adv else (B,))
  return [jnp.asarray(x, jnp.float32) for x in (logp, old, ref, adv)] + [jnp.asarray(mask)]


def _grad(cfg, logp, old, ref, adv, mask):
  return jax.grad(lambda lp: policy_loss(lp, old, ref, adv, mask, cfg)[0])(logp)


# ------------------------------------------- invariant 2: masked grads are 0
@pytest.mark.parametrize("alg,aggr,est", ALL)
def test_masked_positions_get_exactly_zero_gradient(alg, aggr, est):
  cfg = _cfg(alg, aggr, est)
  for per_token_adv in (False, True):
    logp, old, ref, adv, mask = _batch(1, per_token_adv)
    clean_loss = policy_loss(logp, old, ref, adv, mask, cfg)[0]
    off = ~mask
    for garbage in (1e4, -1e4, jnp.nan):
      # Every input holds garbage off the mask; nothing may leak into the
      # loss or the gradient.
      dirty = [jnp.where(off, garbage, x) for x in (logp, old, ref)]
      if per_token_adv:
        dirty_adv = jnp.where(off, garbage, adv)
      else:  # the fully masked row's advantage is garbage too
        dirty_adv = adv.at[3].set(garbage)
      loss, _ = policy_loss(dirty[0], dirty[1], dirty[2], dirty_adv, mask, cfg)
      g = np.asarray(_grad(cfg, dirty[0], dirty[1], dirty[2], dirty_adv, mask))
      assert np.all(g[np.asarray(off)] == 0.0), (garbage, g)
      assert np.all(np.isfinite(g))
      assert float(loss) == float(clean_loss)


@pytest.mark.parametrize("alg", ["grpo", "gspo"])
def test_overflowing_clipped_ratio_stays_finite(alg):
  # A policy token whose ratio overflows float32 (exp(100) = inf) but is
  # clipped (A > 0, ratio above 1 + eps) contributes -A (1 + eps_high) and no
  # gradient; the unclipped branch's inf must not turn into NaN.
  logp, old, ref, _, mask = _batch(9)
  adv = jnp.ones((B,), jnp.float32)
  old = old.at[0, 4].set(logp[0, 4] - 100.0 * mask[0].sum())
  cfg = _cfg(alg, "seq-mean-token-mean", kl_coef=0.0)
  loss, m = policy_loss(logp, old, None, adv, mask, cfg)
  g = np.asarray(_grad(cfg, logp, old, None, adv, mask))
  assert np.isfinite(float(loss)) and np.all(np.isfinite(g))
  assert np.isinf(float(m["ratio_max"]))  # reported honestly
  clipped_tokens = [(0, 4)] if alg == "grpo" else [(0, t) for t in range(2, 7)]
  for b, t in clipped_tokens:
    assert g[b, t] == 0.0


@pytest.mark.parametrize("alg,aggr", [(a, g) for a in ALGS for g in AGGREGATIONS if _valid(a, g)])
def test_zero_advantage_without_kl_gives_zero_gradient(alg, aggr):
  logp, old, _, adv, mask = _batch(2)
  g = _grad(_cfg(alg, aggr, kl_coef=0.0), logp, old, None, jnp.zeros_like(adv), mask)
  assert np.all(np.asarray(g) == 0.0)


# ------------------------------------------------ identities between losses
@pytest.mark.parametrize("aggr", AGGREGATIONS)
def test_on_policy_grpo_gradient_equals_reinforce(aggr):
  # At logp == old_logp every ratio is 1, inside the clip range, and
  # d(-A r)/dlogp = -A = d(-A logp)/dlogp.
  logp, _, ref, adv, mask = _batch(3)
  for kl_coef in (0.0, 0.1):
    g_grpo = _grad(_cfg("grpo", aggr, kl_coef=kl_coef), logp, logp, ref, adv, mask)
    g_rf = _grad(_cfg("reinforce", aggr, kl_coef=kl_coef), logp, logp, ref, adv, mask)
    np.testing.assert_allclose(np.asarray(g_grpo), np.asarray(g_rf), rtol=1e-6, atol=0)


@pytest.mark.parametrize("per_token_adv", [False, True])
def test_gspo_gradient_reaches_every_masked_token(per_token_adv):
  logp, _, ref, adv, mask = _batch(4, per_token_adv)
  # Within 1e-4 of the behaviour policy: no row's sequence ratio is clipped.
  old = logp + 1e-4 * jnp.asarray(np.random.default_rng(5).normal(size=(B, L)), jnp.float32)
  adv = jnp.where(jnp.abs(adv) < 1e-3, 1.0, adv)  # no accidental zero advantages
  g = np.asarray(_grad(_cfg("gspo", "seq-mean-token-mean", kl_coef=0.0), logp, old, ref, adv, mask))
  m = np.asarray(mask)
  assert np.all(g[m] != 0.0) and np.all(g[~m] == 0.0)


def test_gspo_token_form_equals_sequence_form():
  # With one advantage per row, GSPO-token equals the sequence-level objective
  # mean_rows max(-A s, -A clip(s)) with s = exp(mean_t(logp - old)), whose
  # gradient autodiff takes through s itself.
  logp, old0, _, adv, mask = _batch(6)
  cfg = _cfg("gspo", "seq-mean-token-mean", kl_coef=0.0)

  # old0 - logp ~ N(0, 0.3): scaled down nothing is clipped, at full size
  # some rows are.
  for scale, clipped in ((3e-5, False), (1.0, True)):
    old = logp + scale * (old0 - logp)

    def sequence_form(lp):
      m = mask.astype(jnp.float32)
      n = m.sum(-1)
      s = jnp.exp(((lp - old) * m).sum(-1) / jnp.maximum(n, 1))
      lo, hi = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high
      row = jnp.maximum(-adv * s, -adv * jnp.clip(s, lo, hi))
      return jnp.sum(jnp.where(n > 0, row, 0.0)) / jnp.sum(n > 0)

    want_l, want_g = jax.value_and_grad(sequence_form)(logp)
    got_l, metrics = policy_loss(logp, old, None, adv, mask, cfg)
    assert (0 < float(metrics["clip_frac"]) < 1) == clipped
    got_g = _grad(cfg, logp, old, None, adv, mask)
    np.testing.assert_allclose(float(got_l), float(want_l), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got_g), np.asarray(want_g), rtol=1e-5, atol=1e-8)


# ------------------------------------------------ micro-batch accumulation
@pytest.mark.parametrize("alg,aggr", [(a, g) for a in ALGS for g in AGGREGATIONS if _valid(a, g)])
def test_micro_batch_accumulation_is_exact(alg, aggr):
  cfg = _cfg(alg, aggr, "k2")
  logp, old, ref, adv, mask = _batch(7)
  entropy = jnp.abs(ref)
  full_loss, full_m = policy_loss(logp, old, ref, adv, mask, cfg, entropy=entropy)
  full_g = _grad(cfg, logp, old, ref, adv, mask)

  def terms(lp, sl):
    return policy_loss_terms(lp, old[sl], ref[sl], adv[sl], mask[sl], cfg, entropy=entropy[sl])

  num = den = 0.0
  grad_num, sums = [], None
  for sl in (slice(0, 2), slice(2, 4), slice(4, 6)):  # row 3 is empty
    n, d, s = terms(logp[sl], sl)
    num, den = num + n, den + d
    sums = s if sums is None else merge_metric_sums(sums, s)
    grad_num.append(jax.grad(lambda lp: terms(lp, sl)[0])(logp[sl]))
  # Same terms summed in another order: float32 rounding of O(1) summands
  # (a few 1e-7 absolute) is all that may differ, also when the loss cancels
  # to near 0.
  np.testing.assert_allclose(float(safe_divide(num, den)), float(full_loss), rtol=1e-6, atol=1e-6)
  acc_g = jnp.concatenate(grad_num) / den
  np.testing.assert_allclose(np.asarray(acc_g), np.asarray(full_g), rtol=1e-6, atol=1e-9)
  acc_m = finalize_metrics(sums)
  assert set(acc_m) == set(full_m)
  for k in full_m:
    np.testing.assert_allclose(float(acc_m[k]), float(full_m[k]), rtol=1e-5, atol=1e-7, err_msg=k)


# --------------------------------------------------------- input checking
def test_bad_shapes_and_missing_reference_are_rejected():
  logp, old, ref, adv, mask = _batch(8)
  cfg = _cfg("grpo", "token-mean", kl_coef=0.1)
  with pytest.raises(ValueError, match="ref_logp is None.*kl_coef"):
    policy_loss(logp, old, None, adv, mask, cfg)
  with pytest.raises(ValueError, match="adv shape"):
    policy_loss(logp, old, ref, adv[:3], mask, cfg)
  with pytest.raises(ValueError, match="old_logp shape"):
    policy_loss(logp, old[:, :3], ref, adv, mask, cfg)
  with pytest.raises(ValueError, match="mask shape"):
    policy_loss(logp, old, ref, adv, mask[:2], cfg)


@pytest.mark.parametrize(
    "kwargs,needles",
    [
        (dict(algorithm="ppo"), ["algorithm", "grpo", "gspo", "reinforce"]),
        (dict(aggregation="mean"), ["aggregation", "token-mean", "seq-mean-token-sum-norm"]),
        (dict(kl_estimator="k4"), ["kl_estimator", "k1", "k2", "k3"]),
        (
            dict(algorithm="gspo", aggregation="seq-mean-token-sum"),
            ["algorithm", "gspo", "aggregation", "unsafe"],
        ),
        (
            dict(algorithm="gspo", aggregation="seq-mean-token-sum-norm", max_len=8),
            ["algorithm", "gspo", "aggregation", "seq-mean-token-sum-norm"],
        ),
        (dict(aggregation="seq-mean-token-sum-norm"), ["max_len", "seq-mean-token-sum-norm"]),
        (dict(aggregation="seq-mean-token-sum-norm", max_len=0), ["max_len"]),
        (dict(aggregation="seq-mean-token-sum-norm", max_len=8.5), ["max_len"]),
        (dict(clip_eps_low=-0.1), ["clip_eps_low", ">= 0"]),
        (dict(clip_eps_high=float("nan")), ["clip_eps_high"]),
        (dict(clip_eps_high=0.0), ["clip_eps_high", "grpo"]),
        (dict(clip_eps_low=1.0), ["clip_eps_low", "< 1"]),
        (dict(kl_coef=-0.01), ["kl_coef", ">= 0"]),
        (dict(kl_coef=float("inf")), ["kl_coef"]),
        (dict(kl_coef=True), ["kl_coef"]),
    ],
)
def test_config_rejects_unsafe_or_unknown_settings(kwargs, needles):
  with pytest.raises(ValueError) as err:
    LossConfig(**kwargs)
  for needle in needles:
    assert needle in str(err.value), (needle, str(err.value))


def test_config_accepts_safe_settings():
  LossConfig("gspo", 3e-4, 4e-4, 0.0, "k3", "seq-mean-token-mean")
  LossConfig("gspo", 3e-4, 4e-4, 0.01, "k2", "token-mean")
  LossConfig("reinforce", 0.0, 0.0, 0.0, "k1", "seq-mean-token-sum")
  LossConfig("grpo", 0.2, 0.28, 0.0, "k3", "seq-mean-token-sum-norm", max_len=512)
