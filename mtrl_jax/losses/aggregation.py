"""Reductions of per-token losses to a scalar, as (numerator, denominator) pairs.

A pair rather than a ratio keeps gradient accumulation exact: the loss of a
batch split into micro-batches is sum(num) / sum(den), which equals the loss of
the whole batch for every aggregation (all denominators are counts or counts
scaled by a constant). Rows without any masked-in token count nowhere, so
padding rows change neither the numerator nor the denominator.

A "sequence" is a row, or, when `sequence_ids` are given (packed trees, where
one row holds many actions and one action may sit anywhere in it), the tokens
of a row that share an id: one action.

Aggregations (m: mask, x: per-token loss, n_b: masked tokens of sequence b,
R: sequences with n_b >= 1):
  token-mean               sum_bt m x / sum_b n_b
  seq-mean-token-mean      (1/R) sum_b (1/n_b) sum_t m x
  seq-mean-token-sum       (1/R) sum_b sum_t m x
  seq-mean-token-sum-norm  (1/R) sum_b (1/max_len) sum_t m x
"""

from __future__ import annotations

from typing import Mapping, Optional

import jax
import jax.numpy as jnp

AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


class Sequences:
  """Sums over sequences: rows, or (row, id) groups of per-token `sequence_ids`.

  Args:
    mask_BxL: bool, True where a token counts.
    sequence_ids_BxL: optional int ids in [0, L) numbering the sequences of
      each row (None: one sequence per row).
  """

  def __init__(self, mask_BxL, sequence_ids_BxL=None):
    b, l = mask_BxL.shape
    self.shape = (b, l)
    self.mask = mask_BxL.astype(bool)
    if sequence_ids_BxL is None:
      self.gid = None
      self.num = b
    else:
      self.gid = (
          jnp.arange(b, dtype=jnp.int32)[:, None] * l + sequence_ids_BxL.astype(jnp.int32)
      ).reshape(-1)
      self.num = b * l

  def sum(self, x_BxL):
    """Per-sequence sums of x over masked tokens: [S]."""
    xm = jnp.where(self.mask, x_BxL, 0)
    if self.gid is None:
      return xm.sum(-1)
    return jax.ops.segment_sum(xm.reshape(-1), self.gid, num_segments=self.num)

  def per_token(self, seq_S):
    """Broadcasts a per-sequence value back to the tokens: [B, L]."""
    if self.gid is None:
      return jnp.broadcast_to(seq_S[:, None], self.shape)
    return seq_S[self.gid].reshape(self.shape)

  def first_token(self):
    """bool [B, L]: the first masked token of each sequence."""
    if self.gid is None:
      first = jnp.argmax(self.mask, axis=-1)
      return self.mask & (jnp.arange(self.shape[1])[None, :] == first[:, None])
    pos = jnp.arange(self.shape[0] * self.shape[1], dtype=jnp.int32)
    big = jnp.iinfo(jnp.int32).max
    pos_m = jnp.where(self.mask.reshape(-1), pos, big)
    seg_first = jax.ops.segment_min(pos_m, self.gid, num_segments=self.num)
    return self.mask & (pos == seg_first[self.gid]).reshape(self.shape)


def aggregate(
    x_BxL, mask_BxL, aggregation: str, max_len: Optional[int] = None, sequence_ids_BxL=None
):
  """Reduces a per-token quantity to (num, den) with value num / den.

  Args:
    x_BxL: per-token values; must be finite where the mask is True.
    mask_BxL: bool, True where the token counts.
    aggregation: one of AGGREGATIONS.
    max_len: the divisor of 'seq-mean-token-sum-norm'.
    sequence_ids_BxL: optional per-token sequence ids within each row
      (`Sequences`); None: one sequence per row.

  Returns:
    Scalars (num, den) in x's floating dtype; den is 0 only when no token counts.
  """
  seqs = Sequences(mask_BxL, sequence_ids_BxL)
  xm_BxL = jnp.where(seqs.mask, x_BxL, 0)
  if aggregation == "token-mean":
    return xm_BxL.sum(), seqs.mask.astype(xm_BxL.dtype).sum()
  ntok_S = seqs.sum(jnp.ones(seqs.shape, xm_BxL.dtype))
  rows = (ntok_S > 0).astype(xm_BxL.dtype).sum()
  seq_sum_S = seqs.sum(xm_BxL)
  if aggregation == "seq-mean-token-mean":
    return (seq_sum_S / jnp.maximum(ntok_S, 1)).sum(), rows
  if aggregation == "seq-mean-token-sum":
    return seq_sum_S.sum(), rows
  if aggregation == "seq-mean-token-sum-norm":
    if max_len is None:
      raise ValueError("aggregate: 'seq-mean-token-sum-norm' needs max_len")
    return seq_sum_S.sum() / max_len, rows
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
    kl (chosen estimator), kl_k3 and entropy, each per masked token; with a
    sampler correction (`losses.offpolicy`) is_weight_mean, is_truncated /
    is_truncated_frac, is_masked / is_masked_frac (token counts and
    fractions), is_ratio_min / is_ratio_max and sampler_gap. Empty batches
    report 0 rather than NaN or inf.
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
  if "is_weight_sum" in s:
    out.update(
        {
            "is_weight_mean": per_tok("is_weight_sum"),
            "is_truncated": s["is_truncated_sum"],
            "is_truncated_frac": per_tok("is_truncated_sum"),
            "is_masked": s["is_masked_sum"],
            "is_masked_frac": per_tok("is_masked_sum"),
            "is_ratio_min": if_any(tokens, s["is_ratio_min"]),
            "is_ratio_max": if_any(tokens, s["is_ratio_max"]),
            "sampler_gap": per_tok("sampler_gap_sum"),
        }
    )
  return out
