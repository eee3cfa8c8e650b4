"""Off-policy corrections (truncated / masked IS) against a float64 numpy reference.

The reference is written from the definitions in `mtrl_jax.losses.offpolicy`
with explicit loops over tokens and actions and shares no code with it:

  rho_t = exp(old_logp_t - sampler_logp_t)
  tis:        w_t = min(rho_t, C)
  mis_token:  w_t = rho_t if 1/C <= rho_t <= C else 0
  mis_action: rho_a = exp(mean_{t in a} log rho_t); w_t = rho_a if 1/C <= rho_a <= C else 0

and the GRPO / REINFORCE loss with each token's policy term times w_t.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrl_jax.losses import LossConfig, importance_weights, policy_loss
from mtrl_jax.losses.aggregation import Sequences

CAP = 2.0
B, L = 4, 7


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  mask = rng.random((B, L)) < 0.8
  mask[:, 0] = False
  mask[2] = False  # a padding row
  logp = -rng.random((B, L)) * 2
  old = logp + rng.normal(0, 0.1, (B, L))
  # Sampler gaps from tiny to far outside [1/C, C] (|log rho| up to 3 >> log 2).
  sampler = old - rng.normal(0, 1.2, (B, L))
  sampler[0, 1] = old[0, 1] - 0.5  # rho = 1.65: inside the band
  sampler[0, 2] = old[0, 2] - 3.0  # rho = 20: truncated / masked
  sampler[1, 3] = old[1, 3] + 3.0  # rho = 0.05: masked
  actions = np.zeros((B, L), np.int32)
  actions[:, 4:] = 1  # two actions per row
  adv = rng.normal(0, 1, (B, L))
  return mask, logp, old, sampler, actions, adv


def _ref_weights(mask, old, sampler, actions, mode):
  w = np.zeros((B, L))
  for b in range(B):
    for a in np.unique(actions[b]):
      toks = [t for t in range(L) if mask[b, t] and actions[b, t] == a]
      if not toks:
        continue
      rho_a = math.exp(np.mean([old[b, t] - sampler[b, t] for t in toks]))
      for t in toks:
        rho = math.exp(old[b, t] - sampler[b, t])
        if mode == "none":
          w[b, t] = 1.0
        elif mode == "tis":
          w[b, t] = min(rho, CAP)
        elif mode == "mis_token":
          w[b, t] = rho if 1 / CAP <= rho <= CAP else 0.0
        else:
          w[b, t] = rho_a if 1 / CAP <= rho_a <= CAP else 0.0
  return w


@pytest.mark.parametrize("mode", ["none", "tis", "mis_token", "mis_action"])
def test_importance_weights_match_the_reference(mode):
  mask, _, old, sampler, actions, _ = _batch()
  w, sums = importance_weights(
      jnp.asarray(old, jnp.float32),
      jnp.asarray(sampler, jnp.float32),
      jnp.asarray(mask),
      mode,
      CAP,
      Sequences(jnp.asarray(mask), jnp.asarray(actions)),
  )
  ref = _ref_weights(mask, old, sampler, actions, mode)
  np.testing.assert_allclose(np.asarray(w), ref, rtol=2e-6, atol=1e-7)
  rho = np.exp(old - sampler)
  n_trunc = int((mask & (rho > CAP)).sum()) if mode == "tis" else 0
  n_masked = int((mask & (ref == 0)).sum()) if mode.startswith("mis") else 0
  assert float(sums["is_truncated_sum"]) == n_trunc
  assert float(sums["is_masked_sum"]) == n_masked
  assert (n_trunc > 0) == (mode == "tis") and (n_masked > 0) == mode.startswith("mis")
  np.testing.assert_allclose(float(sums["is_weight_sum"]), ref.sum(), rtol=2e-6)
  np.testing.assert_allclose(
      float(sums["sampler_gap_sum"]), np.abs(old - sampler)[mask].sum(), rtol=2e-6
  )
  np.testing.assert_allclose(float(sums["is_ratio_max"]), rho[mask].max(), rtol=2e-6)


def _ref_loss(alg, mode, mask, logp, old, sampler, actions, adv, aggregation):
  w = _ref_weights(mask, old, sampler, actions, mode)
  hi, lo = 1.28, 0.8
  pg = np.zeros((B, L))
  for b in range(B):
    for t in range(L):
      if not mask[b, t]:
        continue
      a = adv[b, t]
      if alg == "reinforce":
        pg[b, t] = -a * logp[b, t]
      else:
        r = math.exp(logp[b, t] - old[b, t])
        pg[b, t] = max(-a * r, -a * min(max(r, lo), hi))
      pg[b, t] *= w[b, t]
  if aggregation == "token-mean":
    return pg.sum() / mask.sum()
  per_action = []  # seq-mean-token-mean over actions
  for b in range(B):
    for a_id in np.unique(actions[b]):
      toks = mask[b] & (actions[b] == a_id)
      if toks.any():
        per_action.append(pg[b][toks].sum() / toks.sum())
  return sum(per_action) / len(per_action)


@pytest.mark.parametrize(
    "alg,mode,aggregation",
    [
        ("grpo", "tis", "token-mean"),
        ("grpo", "mis_token", "token-mean"),
        ("grpo", "mis_action", "seq-mean-token-mean"),
        ("reinforce", "tis", "seq-mean-token-mean"),
        ("grpo", "none", "token-mean"),
    ],
)
def test_corrected_loss_and_metrics_match_the_reference(alg, mode, aggregation):
  mask, logp, old, sampler, actions, adv = _batch(1)
  cfg = LossConfig(alg, 0.2, 0.28, aggregation=aggregation, is_correction=mode, is_cap=CAP)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  loss, m = policy_loss(
      f32(logp),
      f32(old),
      None,
      f32(adv),
      jnp.asarray(mask),
      cfg,
      action_ids=jnp.asarray(actions),
      sampler_logp=f32(sampler),
  )
  ref = _ref_loss(alg, mode, mask, logp, old, sampler, actions, adv, aggregation)
  np.testing.assert_allclose(float(loss), ref, rtol=2e-5, atol=1e-6)
  w = _ref_weights(mask, old, sampler, actions, mode)
  rho = np.exp(old - sampler)[mask]
  np.testing.assert_allclose(float(m["is_weight_mean"]), w[mask].mean(), rtol=2e-6)
  assert float(m["is_truncated"]) == (int((rho > CAP).sum()) if mode == "tis" else 0)
  assert float(m["is_masked"]) == (int((w[mask] == 0).sum()) if mode.startswith("mis") else 0)
  np.testing.assert_allclose(float(m["is_masked_frac"]), float(m["is_masked"]) / mask.sum())
  np.testing.assert_allclose(float(m["sampler_gap"]), np.abs(np.log(rho)).mean(), rtol=2e-6)


def test_correction_gradient_is_the_weighted_policy_gradient_and_zero_off_the_mask():
  mask, logp, old, sampler, actions, adv = _batch(2)
  sampler = np.where(mask, sampler, np.nan)  # masked positions may hold anything
  cfg = LossConfig("reinforce", is_correction="tis", is_cap=CAP)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  grad = jax.grad(
      lambda lp: policy_loss(
          lp, f32(old), None, f32(adv), jnp.asarray(mask), cfg, sampler_logp=f32(sampler)
      )[0]
  )(f32(logp))
  w = _ref_weights(mask, old, np.where(mask, sampler, 0.0), actions, "tis")
  # REINFORCE token-mean: d/dlogp_t = -A_t w_t / (number of masked tokens).
  np.testing.assert_allclose(
      np.asarray(grad), np.where(mask, -adv * w / mask.sum(), 0.0), rtol=2e-5, atol=1e-7
  )
  assert np.all(np.asarray(grad)[~mask] == 0)


def test_without_sampler_logprobs_the_loss_is_unchanged():
  mask, logp, old, _, _, adv = _batch(3)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  plain = LossConfig("grpo", 0.2, 0.28)
  corrected = plain.replace(is_correction="tis")
  a, ma = policy_loss(f32(logp), f32(old), None, f32(adv), jnp.asarray(mask), plain)
  b, mb = policy_loss(f32(logp), f32(old), None, f32(adv), jnp.asarray(mask), corrected)
  assert float(a) == float(b) and "is_weight_mean" not in mb and set(ma) == set(mb)
  # Sampler == trainer: every ratio is 1, so 'tis' changes nothing either.
  c, mc = policy_loss(
      f32(logp), f32(old), None, f32(adv), jnp.asarray(mask), corrected, sampler_logp=f32(old)
  )
  assert float(c) == float(a) and float(mc["is_truncated"]) == 0
  assert float(mc["is_weight_mean"]) == 1.0


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("is_correction", "clip", "is_correction"),
        ("is_cap", 1.0, "is_cap"),
        ("is_cap", float("inf"), "is_cap"),
    ],
)
def test_loss_config_rejects_bad_corrections(field, value, needle):
  with pytest.raises(ValueError, match=needle):
    LossConfig(**{field: value})
