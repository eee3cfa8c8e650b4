"""Reductions of per-token losses to a scalar, as (numerator, denominator) pairs.

A pair rather than a ratio keeps gradient accumulation exact: the loss of a
batch split into micro-batches is sum(num) / sum(den), which equals the loss of
the whole batch for every aggregation (all denominators are counts or counts
scaled by a constant). Rows without any masked-in token count nowhere, so
padding rows change neither the numerator nor the denominator.

Aggregations (m: mask, x: per-token loss, n_b: masked tokens of row b,
R: rows with n_b >= 1):
  token-mean               sum_bt m x / sum_b n_b
  seq-mean-token-mean      (1/R) sum_b (1/n_b) sum_t m x
  seq-mean-token-sum       (1/R) sum_b sum_t m x
  seq-mean-token-sum-norm  (1/R) sum_b (1/max_len) sum_t m x
"""

from __future__ import annotations

from typing import Mapping, Optional

import jax.numpy as jnp

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                "seq-mean-token-sum-norm")


def aggregate(x_BxL, mask_BxL, aggregation: str, max_len: Optional[int] = None):
  """Reduces a per-token quantity to (num, den) with value num / den.

  Args:
    x_BxL: per-token values; must be finite where the mask is True.
    mask_BxL: bool, True where the token counts.
    aggregation: one of AGGREGATIONS.
    max_len: the divisor of 'seq-mean-token-sum-norm'.

  Returns:
    Scalars (num, den) in x's floating dtype; den is 0 only when no token counts.
  """
  mask_BxL = mask_BxL.astype(bool)
  xm_BxL = jnp.where(mask_BxL, x_BxL, 0)
  ntok_B = mask_BxL.astype(xm_BxL.dtype).sum(-1)
  rows = (ntok_B > 0).astype(xm_BxL.dtype).sum()
  if aggregation == "token-mean":
    return xm_BxL.sum(), ntok_B.sum()
  row_sum_B = xm_BxL.sum(-1)
  if aggregation == "seq-mean-token-mean":
    return (row_sum_B / jnp.maximum(ntok_B, 1)).sum(), rows
  if aggregation == "seq-mean-token-sum":
    return row_sum_B.sum(), rows
  if aggregation == "seq-mean-token-sum-norm":
    if max_len is None:
      raise ValueError("aggregate: 'seq-mean-token-sum-norm' needs max_len")
    return row_sum_B.sum() / max_len, rows
  raise ValueError(f"aggregation={aggregation!r}; allowed: {list(AGGREGATIONS)}")


def safe_divide(num, den):
  """num / den, and 0 (with zero gradient) where den == 0.

  Denominators here are counts, so max(den, 1) is exact whenever den >= 1.
  """
  return num / jnp.maximum(den, 1)


def merge_metric_sums(a: Mapping, b: Mapping) -> dict:
  """Combines the metric sums of two micro-batches (from `policy_loss_terms`).

  Keys ending in '_min' / '_max' combine by minimum / maximum, all others add.
  """
  if set(a) != set(b):
    raise ValueError(f"merge_metric_sums: keys differ: {sorted(set(a) ^ set(b))}")
  out = {}
  for k in a:
    if k.endswith("_min"):
      out[k] = jnp.minimum(a[k], b[k])
    elif k.endswith("_max"):
      out[k] = jnp.maximum(a[k], b[k])
    else:
      out[k] = a[k] + b[k]
  return out


def finalize_metrics(s: Mapping) -> dict:
  """Turns (merged) metric sums into scalar metrics.

  Returns:
    loss, pg_loss (policy term alone, same aggregation), tokens, rows,
    clip_frac / clip_frac_low / clip_frac_high (fraction of masked tokens whose
    surrogate is clipped), ratio_mean / ratio_min / ratio_max (the ratio the
    surrogate uses: token ratio, or the row's sequence ratio for GSPO),
    logp_gap / logp_gap_max (|logp - old_logp| per masked token: the
    sampler-vs-trainer mismatch), adv_mean / adv_std / adv_min / adv_max (per
    row for [B] advantages, per masked token for [B, L]), and when available
    kl (chosen estimator), kl_k3 and entropy, each per masked token. Empty
    batches report 0 rather than NaN or inf.
  """
  tokens, nadv = s["tokens"], s["adv_count"]
  per_tok = lambda key: safe_divide(s[key], tokens)
  if_any = lambda n, x: jnp.where(n > 0, x, 0)
  adv_mean = safe_divide(s["adv_sum"], nadv)
  adv_var = jnp.maximum(safe_divide(s["adv_sq_sum"], nadv) - adv_mean * adv_mean, 0)
  out = {
      "loss": safe_divide(s["loss_num"], s["loss_den"]),
      "pg_loss": safe_divide(s["pg_num"], s["loss_den"]),
      "tokens": tokens,
      "rows": s["rows"],
      "clip_frac": safe_divide(s["clip_high_sum"] + s["clip_low_sum"], tokens),
      "clip_frac_high": per_tok("clip_high_sum"),
      "clip_frac_low": per_tok("clip_low_sum"),
      "ratio_mean": per_tok("ratio_sum"),
      "ratio_min": if_any(tokens, s["ratio_min"]),
      "ratio_max": if_any(tokens, s["ratio_max"]),
      "logp_gap": per_tok("logp_gap_sum"),
      "logp_gap_max": s["logp_gap_max"],
      "adv_mean": adv_mean,
      "adv_std": jnp.sqrt(adv_var),
      "adv_min": if_any(nadv, s["adv_min"]),
      "adv_max": if_any(nadv, s["adv_max"]),
  }
  for key in ("kl", "kl_k3", "entropy"):
    if key + "_sum" in s:
      out[key] = per_tok(key + "_sum")
  return out
