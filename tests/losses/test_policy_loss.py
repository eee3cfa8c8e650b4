"""Tests of mtrl_jax.losses.policy against a float64 numpy re-implementation.

The reference below is written from the formulas (PPO-clip max form, GSPO
sequence ratio, Schulman's k1/k2/k3) with explicit loops over rows and tokens;
it shares no code with the implementation. Gradients are checked against the
analytic derivative of each per-token term times its aggregation weight.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrl_jax.losses import AGGREGATIONS, LossConfig, policy_loss

ALGS = ("grpo", "gspo", "reinforce")
ESTS = ("k1", "k2", "k3")
MAX_LEN = 6
EPS = {"grpo": (0.2, 0.28), "gspo": (3e-4, 4e-4), "reinforce": (0.2, 0.2)}
# float32 implementation vs float64 reference on values of order 1.
RTOL, ATOL = 2e-6, 1e-6


def _combos():
  for alg, aggr, est in itertools.product(ALGS, AGGREGATIONS, ESTS):
    if alg == "gspo" and aggr in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
      continue  # rejected by LossConfig (test_policy_invariants.py)
    yield alg, aggr, est


COMBOS = list(_combos())


def _cfg(alg, aggr, est="k3", kl_coef=0.05):
  lo, hi = EPS[alg]
  return LossConfig(alg, lo, hi, kl_coef, est, aggr, max_len=MAX_LEN)


# --------------------------------------------------------------- the batch
# B=4, L=4. Position 0 is a prompt token everywhere; row 2 is fully masked
# (a padding row); row 3 has a hole (a tool-output token between two policy
# tokens). Log-ratios logp - old_logp per masked token:
#   row 0: +0.30 (r=1.3499 > 1.28: clipped high for A>0), -0.40 (r=0.6703), +0.05
#   row 1: -0.30 (r=0.7408 < 0.8: clipped low for A<0), +0.10
#   row 3: +0.02, -0.01
MASK = np.array([[0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0], [0, 1, 0, 1]], bool)
LOGP = np.array(
    [
        [0.0, -0.5, -1.2, -0.3],
        [0.0, -2.0, -0.8, -1.5],
        [0.0, -0.7, -0.9, -1.1],
        [0.0, -0.2, -3.0, -0.6],
    ]
)
OLD = LOGP - np.array(
    [
        [0.0, 0.30, -0.40, 0.05],
        [0.0, 0.00, -0.30, 0.10],
        [0.0, 0.00, 0.00, 0.00],
        [0.0, 0.02, 0.00, -0.01],
    ]
)
REF = LOGP + np.array(
    [[0.0, 0.1, -0.2, 0.3], [0.0, 0.0, 0.25, -0.15], [0.0, 0.0, 0.0, 0.0], [0.0, -0.05, 0.0, 0.4]]
)
ADV_B = np.array([1.5, -0.7, 2.0, -1.2])
# GSPO row log-ratios: row 0 mean(-0.05/3) -> s=0.9835, A>0: unclipped;
# row 1 mean(-0.1) -> s=0.905 < 1-3e-4 with A<0: clipped; row 3 mean(0.005)
# -> s=1.005, A<0: unclipped (only the low side clips for A<0).


def _adv_BxL(seed=0):
  return np.random.default_rng(seed).normal(size=MASK.shape)


# -------------------------------------------------- float64 numpy reference
def _kl_and_dkl(logp, ref, est):
  """KL estimate of one token and its derivative wrt logp (d = ref - logp)."""
  d = ref - logp
  if est == "k1":
    return -d, 1.0
  if est == "k2":
    return 0.5 * d * d, -d
  return math.exp(d) - d - 1.0, 1.0 - math.exp(d)


def ref_loss_and_grad(
    logp, old, ref, adv, mask, alg, aggr, est, kl_coef, eps_lo, eps_hi, max_len=MAX_LEN
):
  """Returns (loss, dloss/dlogp) in float64."""
  B, L = logp.shape
  adv = np.broadcast_to(adv[:, None], (B, L)) if adv.ndim == 1 else adv
  grad = np.zeros((B, L))
  rows = [[t for t in range(L) if mask[b, t]] for b in range(B)]
  live = [b for b in range(B) if rows[b]]
  n_tok = sum(len(rows[b]) for b in live)
  total = 0.0
  for b in live:
    s = math.exp(np.mean([logp[b, t] - old[b, t] for t in rows[b]]))
    for t in rows[b]:
      a = adv[b, t]
      r = s if alg == "gspo" else math.exp(logp[b, t] - old[b, t])
      if alg == "reinforce":
        pg, dpg = -a * logp[b, t], -a
      else:
        unclipped, clipped = -a * r, -a * min(max(r, 1 - eps_lo), 1 + eps_hi)
        pg = max(unclipped, clipped)
        # GSPO-token (Zheng et al. 2025, eq. 13-14): d/dlogp_t = s * dlogp_t.
        dpg = -a * r if unclipped >= clipped else 0.0
      kl, dkl = _kl_and_dkl(logp[b, t], ref[b, t], est)
      if aggr == "token-mean":
        w = 1.0 / n_tok
      elif aggr == "seq-mean-token-mean":
        w = 1.0 / (len(live) * len(rows[b]))
      elif aggr == "seq-mean-token-sum":
        w = 1.0 / len(live)
      else:
        w = 1.0 / (len(live) * max_len)
      total += w * (pg + kl_coef * kl)
      grad[b, t] = w * (dpg + kl_coef * dkl)
  return total, grad


def _jax_loss_and_grad(cfg, logp=LOGP, old=OLD, ref=REF, adv=ADV_B, mask=MASK):
  f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
  f = lambda lp: policy_loss(lp, f32(old), f32(ref), f32(adv), jnp.asarray(mask), cfg)
  (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(f32(logp))
  return float(loss), np.asarray(grad, np.float64), metrics


# ------------------------------------------------------------------ values
def test_hand_worked_grpo_token_mean():
  # Row 0 of the batch alone, A = 1.5, eps (0.2, 0.28), no KL:
  #   t1: r = e^0.30 = 1.349859 > 1.28 -> clipped: -1.5 * 1.28    = -1.92
  #   t2: r = e^-0.40 = 0.670320        -> -1.5 * 0.670320       = -1.005480
  #   t3: r = e^0.05 = 1.051271         -> -1.5 * 1.051271       = -1.576907
  #   token-mean = (-1.92 - 1.005480 - 1.576907) / 3 = -1.500796
  # gradient: 0 at t1, -1.5 * r / 3 at t2, t3 = -0.335160, -0.525636.
  cfg = LossConfig("grpo", 0.2, 0.28, 0.0, "k3", "token-mean")
  loss, grad, m = _jax_loss_and_grad(cfg, LOGP[:1], OLD[:1], None, ADV_B[:1], MASK[:1])
  np.testing.assert_allclose(loss, -1.500796, atol=1e-6)
  np.testing.assert_allclose(grad[0], [0.0, 0.0, -0.335160, -0.525636], atol=1e-6)
  np.testing.assert_allclose(float(m["clip_frac"]), 1 / 3, rtol=1e-6)


@pytest.mark.parametrize("alg,aggr,est", COMBOS)
def test_matches_numpy_reference(alg, aggr, est):
  cfg = _cfg(alg, aggr, est)
  for adv in (ADV_B, _adv_BxL()):
    want_loss, want_grad = ref_loss_and_grad(
        LOGP, OLD, REF, adv, MASK, alg, aggr, est, cfg.kl_coef, *EPS[alg]
    )
    loss, grad, _ = _jax_loss_and_grad(cfg, adv=adv)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, want_grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("alg", ALGS)
def test_no_reference_without_kl(alg):
  cfg = _cfg(alg, "seq-mean-token-mean", kl_coef=0.0)
  want_loss, want_grad = ref_loss_and_grad(
      LOGP, OLD, REF, ADV_B, MASK, alg, "seq-mean-token-mean", "k3", 0.0, *EPS[alg]
  )
  loss, grad, m = _jax_loss_and_grad(cfg, ref=None)
  np.testing.assert_allclose(loss, want_loss, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(grad, want_grad, rtol=RTOL, atol=ATOL)
  assert "kl" not in m and "kl_k3" not in m


def test_metrics_match_numpy():
  cfg = _cfg("grpo", "token-mean", "k2")
  rng = np.random.default_rng(1)
  ent = rng.uniform(0, 3, size=MASK.shape)
  args = [jnp.asarray(x, jnp.float32) for x in (LOGP, OLD, REF, ADV_B)]
  _, m = policy_loss(*args, jnp.asarray(MASK), cfg, entropy=jnp.asarray(ent, jnp.float32))
  lr = (LOGP - OLD)[MASK]
  r = np.exp(lr)
  d = (REF - LOGP)[MASK]
  adv_rows = ADV_B[MASK.any(1)]  # the padding row's advantage is not counted
  want = {
      "tokens": 7,
      "rows": 3,
      # clipped: row 0 t1 (A>0, r=1.35>1.28) and row 1 t2 (A<0, r=0.74<0.8).
      "clip_frac": 2 / 7,
      "clip_frac_high": 1 / 7,
      "clip_frac_low": 1 / 7,
      "ratio_mean": r.mean(),
      "ratio_min": r.min(),
      "ratio_max": r.max(),
      "logp_gap": np.abs(lr).mean(),
      "logp_gap_max": np.abs(lr).max(),
      "kl": (0.5 * d * d).mean(),
      "kl_k3": (np.exp(d) - d - 1).mean(),
      "entropy": ent[MASK].mean(),
      "adv_mean": adv_rows.mean(),
      "adv_std": adv_rows.std(),
      "adv_min": adv_rows.min(),
      "adv_max": adv_rows.max(),
  }
  for k, v in want.items():
    np.testing.assert_allclose(float(m[k]), v, rtol=2e-6, atol=1e-6, err_msg=k)
  loss, _ = ref_loss_and_grad(
      LOGP, OLD, REF, ADV_B, MASK, "grpo", "token-mean", "k2", 0.05, *EPS["grpo"]
  )
  np.testing.assert_allclose(float(m["loss"]), loss, rtol=RTOL)
  pg, _ = ref_loss_and_grad(
      LOGP, OLD, REF, ADV_B, MASK, "grpo", "token-mean", "k2", 0.0, *EPS["grpo"]
  )
  np.testing.assert_allclose(float(m["pg_loss"]), pg, rtol=RTOL)


def test_per_token_advantage_metrics_use_masked_tokens_only():
  adv = np.random.default_rng(2).uniform(0.5, 2.0, size=MASK.shape)  # all > 0
  _, m = policy_loss(
      *[jnp.asarray(x, jnp.float32) for x in (LOGP, OLD, REF, adv)],
      jnp.asarray(MASK),
      _cfg("reinforce", "token-mean")
  )
  a = adv[MASK]
  for k, v in {
      "adv_mean": a.mean(),
      "adv_std": a.std(),
      "adv_min": a.min(),
      "adv_max": a.max(),
  }.items():
    np.testing.assert_allclose(float(m[k]), v, rtol=2e-6, err_msg=k)


def test_gspo_ratio_metrics_are_sequence_ratios():
  _, m = policy_loss(
      *[jnp.asarray(x, jnp.float32) for x in (LOGP, OLD, REF, ADV_B)],
      jnp.asarray(MASK),
      _cfg("gspo", "token-mean")
  )
  s = [math.exp(np.mean((LOGP - OLD)[b][MASK[b]])) for b in (0, 1, 3)]
  np.testing.assert_allclose(float(m["ratio_min"]), min(s), rtol=1e-6)
  np.testing.assert_allclose(float(m["ratio_max"]), max(s), rtol=1e-6)
  # Only row 1 (2 tokens) is clipped, on the low side.
  np.testing.assert_allclose(float(m["clip_frac_low"]), 2 / 7, rtol=1e-6)


def test_empty_batch_is_zero_not_nan():
  mask = np.zeros_like(MASK)
  for alg, aggr, est in COMBOS:
    loss, grad, m = _jax_loss_and_grad(_cfg(alg, aggr, est), mask=mask)
    assert loss == 0.0 and np.all(grad == 0.0)
    for k, v in m.items():
      assert np.isfinite(float(v)) and float(v) == 0.0, (alg, aggr, k)


def test_jit_with_static_config():
  cfg = _cfg("gspo", "seq-mean-token-mean", "k1")
  args = [jnp.asarray(x, jnp.float32) for x in (LOGP, OLD, REF, ADV_B)]
  f = jax.jit(policy_loss, static_argnames="cfg")
  got, _ = f(*args, jnp.asarray(MASK), cfg=cfg)
  want, _ = policy_loss(*args, jnp.asarray(MASK), cfg)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  assert hash(cfg) == hash(_cfg("gspo", "seq-mean-token-mean", "k1"))
