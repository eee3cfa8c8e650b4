"""Off-policy corrections for the sampler / trainer gap: truncated and masked importance sampling.

The sampler (bfloat16, top-k / top-p filtered, another kernel, or simply an
older policy) draws tokens from pi_sampler, while the loss's clipped ratio is
taken against the trainer's own old policy pi_old (`policy_loss_terms`
`old_logp`). The policy gradient is an expectation under pi_old, so each
token's policy term is reweighted by the importance ratio

    rho_t = pi_old(y_t) / pi_sampler(y_t) = exp(old_logp_t - sampler_logp_t)

which can be huge where the sampler picked a token the trainer finds
unlikely. `LossConfig.is_correction` chooses how to tame it (C =
`LossConfig.is_cap` > 1):

  'none'        no weight (the gap shows only in `train/sampler_gap`).
  'tis'         truncated IS, per token: w_t = min(rho_t, C). Biased but low
                variance; keeps every token's gradient direction.
  'mis_token'   masked IS, per token: w_t = rho_t when 1/C <= rho_t <= C,
                else 0 (the token is dropped).
  'mis_action'  masked IS, per action (GSPO's "sequence"): the action's ratio
                is the geometric mean rho_a = exp(mean_t log rho_t); inside
                [1/C, C] every token of the action gets w_t = rho_a, outside
                the whole action is dropped (w = 0).

Weights are constants (no gradient), multiply only the policy term (the KL
penalty is not reweighted), and leave the aggregation's token and sequence
counts unchanged, so micro-batching stays exact. Reported per masked token:
`is_weight_mean`, `is_truncated_frac` (TIS tokens with rho > C),
`is_masked_frac` (MIS tokens dropped), `is_ratio_min` / `is_ratio_max` and
`sampler_gap` (mean |old_logp - sampler_logp|).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CORRECTIONS = ("none", "tis", "mis_token", "mis_action")


def importance_weights(old_logp, sampler_logp, mask, mode: str, cap: float, seqs=None):
  """Per-token importance weights of the sampler / trainer gap.

  Args:
    old_logp: [B, L] the trainer's logprobs of the sampled tokens before the
      update (pi_old).
    sampler_logp: [B, L] the sampler's logprobs of the same tokens.
    mask: [B, L] bool, True on policy tokens (others get weight 0).
    mode: one of CORRECTIONS.
    cap: C > 1.
    seqs: an `aggregation.Sequences` (needed for 'mis_action').

  Returns:
    (w_BxL, sums): the weights (0 off the mask; 1 on it for 'none') and a dict
    of summable metrics: is_weight_sum, is_truncated_sum, is_masked_sum,
    is_ratio_min, is_ratio_max, sampler_gap_sum.
  """
  if mode not in CORRECTIONS:
    raise ValueError(f"importance_weights mode={mode!r}; allowed: {list(CORRECTIONS)}")
  dtype = jnp.promote_types(old_logp.dtype, jnp.float32)
  mask = mask.astype(bool)
  log_rho = jnp.where(mask, old_logp.astype(dtype) - sampler_logp.astype(dtype), 0.0)
  log_rho = jax.lax.stop_gradient(log_rho)
  log_cap = jnp.log(jnp.asarray(cap, dtype))
  # exp only ever sees log-ratios inside [-log C, log C]: min(rho, C) is
  # exp(min(log rho, log C)), and masked ratios are dropped outside the band.
  truncated = jnp.zeros(mask.shape, bool)
  dropped = jnp.zeros(mask.shape, bool)
  if mode == "none":
    w = jnp.ones(mask.shape, dtype)
  elif mode == "tis":
    truncated = mask & (log_rho > log_cap)
    w = jnp.exp(jnp.minimum(log_rho, log_cap))
  elif mode == "mis_token":
    dropped = mask & (jnp.abs(log_rho) > log_cap)
    w = jnp.where(dropped, 0.0, jnp.exp(jnp.clip(log_rho, -log_cap, log_cap)))
  else:
    if seqs is None:
      raise ValueError("importance_weights: mode 'mis_action' needs the actions (seqs)")
    ntok_S = seqs.sum(mask.astype(dtype))
    seq_log_rho_S = seqs.sum(log_rho) / jnp.maximum(ntok_S, 1)
    out_S = jnp.abs(seq_log_rho_S) > log_cap
    dropped = mask & seqs.per_token(out_S)
    w = seqs.per_token(jnp.where(out_S, 0.0, jnp.exp(jnp.clip(seq_log_rho_S, -log_cap, log_cap))))
  w = jnp.where(mask, w, 0.0)
  ratio_sg = jnp.exp(jnp.where(mask, log_rho, 0.0))
  sums = {
      "is_weight_sum": w.sum(),
      "is_truncated_sum": truncated.astype(dtype).sum(),
      "is_masked_sum": dropped.astype(dtype).sum(),
      "is_ratio_min": jnp.min(jnp.where(mask, ratio_sg, jnp.inf)),
      "is_ratio_max": jnp.max(jnp.where(mask, ratio_sg, -jnp.inf)),
      "sampler_gap_sum": jnp.abs(log_rho).sum(),
  }
  return w, sums
