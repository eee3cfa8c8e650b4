"""Policy-gradient losses (GRPO, GSPO, REINFORCE) with a KL penalty: pure array functions.

Every per-token array is `[B, L]` and aligned with the token it describes
(`docs/internals.md`, "Shapes and alignment"); `mask` is True on policy tokens,
the only ones that carry loss. The loss is returned as a (numerator,
denominator) pair by `policy_loss_terms` so that gradient accumulation over
micro-batches is exact: sum the numerators and denominators of all
micro-batches, then divide once. `policy_loss` is that division for one batch.

Masked positions may hold anything (prompt tokens with logprob 0, padding,
1e4, NaN): they are replaced by 0 before any arithmetic, so they reach neither
the loss nor its gradient (docs/design.md invariant 2).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from mtrl_jax.losses import aggregation as agg
from mtrl_jax.losses.offpolicy import CORRECTIONS, importance_weights

AGGREGATIONS = agg.AGGREGATIONS
KL_ESTIMATORS = ("k1", "k2", "k3")
# A sequence ratio is one number per row; summing it over the row's tokens
# scales the row's weight by its length, which GSPO's per-row objective forbids.
_TOKEN_SUM_AGGREGATIONS = ("seq-mean-token-sum", "seq-mean-token-sum-norm")

_sg = jax.lax.stop_gradient


def _token_log_ratio(logp_, old_, seqs):
  """log pi / pi_old per token (GRPO, REINFORCE)."""
  del seqs
  return logp_ - old_


def _sequence_log_ratio(logp_, old_, seqs):
  """GSPO-token: the value is the sequence's mean log-ratio, the gradient that ratio
  times d logp_t for every token of it, so per-token advantages work too."""
  ntok_S = seqs.sum(jnp.ones_like(logp_))
  seq_log_ratio_S = seqs.sum(logp_ - old_) / jnp.maximum(ntok_S, 1)
  return _sg(seqs.per_token(seq_log_ratio_S)) + logp_ - _sg(logp_)


def _clipped_surrogate(logp_, log_ratio, adv_, mask, cfg, dtype):
  """PPO's clipped surrogate max(-A r, -A clip(r)); returns (loss, clip_high, clip_low)."""
  del logp_
  hi, lo = 1.0 + cfg.clip_eps_high, 1.0 - cfg.clip_eps_low
  ratio_sg = jnp.exp(_sg(log_ratio))
  # max(-A r, -A clip(r)) picks the clipped branch exactly in these cases.
  clip_high = mask & (adv_ > 0) & (ratio_sg > hi)
  clip_low = mask & (adv_ < 0) & (ratio_sg < lo)
  clipped = clip_high | clip_low
  bound = jnp.where(adv_ > 0, hi, lo).astype(dtype)
  # exp only sees unclipped log-ratios, so a huge clipped ratio cannot put
  # inf * 0 = NaN into the gradient through the unselected branch.
  ratio = jnp.exp(jnp.where(clipped, 0.0, log_ratio))
  return jnp.where(clipped, -adv_ * bound, -adv_ * ratio), clip_high, clip_low


def _reinforce_surrogate(logp_, log_ratio, adv_, mask, cfg, dtype):
  """-A * logp: no ratio, nothing clipped."""
  del log_ratio, cfg, dtype
  none = jnp.zeros(mask.shape, bool)
  return -adv_ * logp_, none, none


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """One policy-gradient algorithm: how its ratio is formed and which surrogate it takes.

  Attributes:
    log_ratio: (logp, old_logp, sequences) -> the [B, L] log-ratio.
    surrogate: (logp, log_ratio, adv, mask, cfg, dtype) -> ([B, L] loss,
      clipped-high mask, clipped-low mask).
    clipped: it has a clip range (validated: non-empty, lower bound above 0).
    per_sequence: its ratio is one number per sequence (token-sum
      aggregations would scale it by the sequence's length: refused).
  """

  log_ratio: Callable
  surrogate: Callable
  clipped: bool
  per_sequence: bool = False


# The algorithms `LossConfig.algorithm` names: a new one is an entry here.
ALGORITHM_TABLE = {
    "grpo": Algorithm(_token_log_ratio, _clipped_surrogate, clipped=True),
    "gspo": Algorithm(_sequence_log_ratio, _clipped_surrogate, clipped=True, per_sequence=True),
    "reinforce": Algorithm(_token_log_ratio, _reinforce_surrogate, clipped=False),
}
ALGORITHMS = tuple(ALGORITHM_TABLE)


def _is_real(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """What `policy_loss` computes. Hashable, so it can be a static jit argument.

  Attributes:
    algorithm: 'grpo' (clipped token ratio), 'gspo' (clipped sequence ratio,
      typical eps 3e-4 / 4e-4) or 'reinforce' (-A * logp, no ratio).
    clip_eps_low: the ratio is clipped below at 1 - clip_eps_low.
    clip_eps_high: the ratio is clipped above at 1 + clip_eps_high.
    kl_coef: weight of the KL-to-reference penalty (0 disables it).
    kl_estimator: 'k1' (logp - ref), 'k2' ((ref - logp)^2 / 2) or
      'k3' (exp(ref - logp) - (ref - logp) - 1).
    aggregation: how per-token losses become one scalar, see
      `mtrl_jax.losses.aggregation`.
    max_len: the fixed length that 'seq-mean-token-sum-norm' divides each
      row's sum by (ignored by the other aggregations).
    is_correction: off-policy correction of the sampler / trainer gap when
      `policy_loss_terms` gets `sampler_logp` (`mtrl_jax.losses.offpolicy`):
      'none', 'tis' (truncated IS), 'mis_token' or 'mis_action' (masked IS).
    is_cap: C > 1 of the correction: TIS weights are min(ratio, C); MIS keeps
      ratios in [1/C, C].
  """

  algorithm: str = "grpo"
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  aggregation: str = "token-mean"
  max_len: Optional[int] = None
  is_correction: str = "none"
  is_cap: float = 2.0

  def __post_init__(self):
    for name, allowed in (
        ("algorithm", ALGORITHMS),
        ("aggregation", AGGREGATIONS),
        ("kl_estimator", KL_ESTIMATORS),
        ("is_correction", CORRECTIONS),
    ):
      value = getattr(self, name)
      if value not in allowed:
        raise ValueError(f"LossConfig.{name}={value!r}; allowed: {list(allowed)}")
    for name in ("clip_eps_low", "clip_eps_high", "kl_coef"):
      value = getattr(self, name)
      if not _is_real(value) or value < 0:
        raise ValueError(f"LossConfig.{name}={value!r}; must be a finite number >= 0")
    if not _is_real(self.is_cap) or self.is_cap <= 1:
      raise ValueError(
          f"LossConfig.is_cap={self.is_cap!r}; must be a finite number > 1 (the "
          "correction keeps ratios in [1/is_cap, is_cap])"
      )
    algorithm = ALGORITHM_TABLE[self.algorithm]
    if algorithm.clipped:
      # eps = 0 makes every token sit on a clip boundary; eps_low >= 1 puts the
      # lower bound at or below 0, where a positive ratio can never reach it.
      for name in ("clip_eps_low", "clip_eps_high"):
        if getattr(self, name) == 0:
          raise ValueError(
              f"LossConfig.{name}=0 with algorithm={self.algorithm!r}; the clip range "
              f"must be non-empty (use algorithm='reinforce' for an unclipped loss)"
          )
      if self.clip_eps_low >= 1:
        raise ValueError(
            f"LossConfig.clip_eps_low={self.clip_eps_low!r} with algorithm="
            f"{self.algorithm!r}; must be < 1 (the lower clip bound is 1 - clip_eps_low)"
        )
    if algorithm.per_sequence and self.aggregation in _TOKEN_SUM_AGGREGATIONS:
      raise ValueError(
          f"LossConfig.algorithm={self.algorithm!r} with aggregation={self.aggregation!r} is "
          f"unsafe: the sequence ratio is a per-row quantity and a token-sum aggregation scales it by "
          f"the row's length; use aggregation 'seq-mean-token-mean' or 'token-mean'"
      )
    if self.aggregation == "seq-mean-token-sum-norm":
      if (
          not isinstance(self.max_len, numbers.Integral)
          or isinstance(self.max_len, bool)
          or self.max_len <= 0
      ):
        raise ValueError(
            f"LossConfig.max_len={self.max_len!r} with aggregation="
            f"'seq-mean-token-sum-norm'; needs a positive int (the fixed length each "
            f"row's sum is divided by)"
        )

  def replace(self, **kw) -> "LossConfig":
    return dataclasses.replace(self, **kw)


def _check_shapes(
    logp,
    old_logp,
    ref_logp,
    adv,
    mask,
    entropy,
    cfg: LossConfig,
    action_ids=None,
    sampler_logp=None,
):
  if logp.ndim != 2:
    raise ValueError(f"policy_loss: logp must be [B, L]; got shape {logp.shape}")
  shape = logp.shape
  for name, x in (
      ("old_logp", old_logp),
      ("ref_logp", ref_logp),
      ("mask", mask),
      ("entropy", entropy),
      ("action_ids", action_ids),
      ("sampler_logp", sampler_logp),
  ):
    if x is not None and x.shape != shape:
      raise ValueError(f"policy_loss: {name} shape {x.shape} != logp shape {shape}")
  if adv.shape not in (shape[:1], shape):
    raise ValueError(
        f"policy_loss: adv shape {adv.shape}; allowed: [B]={shape[:1]} or [B, L]={shape}"
    )
  if ref_logp is None and cfg.kl_coef != 0:
    raise ValueError(f"policy_loss: ref_logp is None but LossConfig.kl_coef={cfg.kl_coef}")


def _kl(d_BxL, estimator: str):
  """Per-token KL estimate from d = ref_logp - logp (Schulman's k1, k2, k3)."""
  if estimator == "k1":
    return -d_BxL
  if estimator == "k2":
    return 0.5 * d_BxL * d_BxL
  return jnp.expm1(d_BxL) - d_BxL


def policy_loss_terms(
    logp,
    old_logp,
    ref_logp,
    adv,
    mask,
    cfg: LossConfig,
    *,
    entropy=None,
    action_ids=None,
    sampler_logp=None,
):
  """The loss as an exact (numerator, denominator) pair plus summable metrics.

  Args:
    logp: [B, L] policy logprobs of the batch's tokens (differentiated).
    old_logp: [B, L] logprobs of the policy that sampled the tokens.
    ref_logp: [B, L] reference-model logprobs, or None when cfg.kl_coef == 0.
    adv: [B] (one advantage per row) or [B, L] (per token).
    mask: [B, L] bool (nonzero = True), True on policy tokens.
    cfg: the loss configuration.
    entropy: optional [B, L] per-token policy entropy, only reported.
    action_ids: optional [B, L] int ids in [0, L) numbering the actions
      (sequences) within each row, for packed trees: GSPO's sequence ratio,
      the seq-mean aggregations, `rows` and the advantage statistics then
      count one action as one sequence. None: one sequence per row.
    sampler_logp: optional [B, L] logprobs of the sampler that drew the
      tokens, when `old_logp` is the trainer's own (pi_old): the policy term
      of each token is then weighted by `cfg.is_correction` of
      pi_old / pi_sampler (`mtrl_jax.losses.offpolicy`), and the
      correction's metrics are reported. None: old_logp is the sampler's.

  Returns:
    (num, den, metric_sums): scalars num and den with loss = num / den (0 when
    den == 0), and a dict of sums, counts, minima and maxima that
    `aggregation.merge_metric_sums` combines across micro-batches and
    `aggregation.finalize_metrics` turns into the metrics of `policy_loss`.
  """
  _check_shapes(logp, old_logp, ref_logp, adv, mask, entropy, cfg, action_ids, sampler_logp)
  mask = mask.astype(bool)
  seqs = agg.Sequences(mask, action_ids)
  dtype = jnp.promote_types(logp.dtype, jnp.float32)
  clean = lambda x: jnp.where(mask, x.astype(dtype), 0)
  logp_ = clean(logp)
  old_ = _sg(clean(old_logp))
  adv_BxL = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, mask.shape)
  adv_ = _sg(clean(adv_BxL))
  maskf = mask.astype(dtype)
  ntok_S = seqs.sum(maskf)

  token_log_ratio = logp_ - old_
  algorithm = ALGORITHM_TABLE[cfg.algorithm]
  log_ratio = algorithm.log_ratio(logp_, old_, seqs)
  ratio_sg = jnp.exp(_sg(log_ratio))
  pg_BxL, clip_high, clip_low = algorithm.surrogate(logp_, log_ratio, adv_, mask, cfg, dtype)

  is_sums = None
  if sampler_logp is not None:
    is_w, is_sums = importance_weights(
        old_, clean(sampler_logp), mask, cfg.is_correction, cfg.is_cap, seqs
    )
    pg_BxL = pg_BxL * is_w
  loss_BxL = pg_BxL
  kl_BxL = kl3_BxL = None
  if ref_logp is not None:
    d_BxL = _sg(clean(ref_logp)) - logp_
    kl_BxL = _kl(d_BxL, cfg.kl_estimator)
    kl3_BxL = _kl(d_BxL, "k3")
    if cfg.kl_coef != 0:
      loss_BxL = pg_BxL + cfg.kl_coef * kl_BxL

  num, den = agg.aggregate(loss_BxL, mask, cfg.aggregation, cfg.max_len, action_ids)

  # Metrics: sums / counts / extrema only, so micro-batches merge exactly.
  msum = lambda x: jnp.sum(jnp.where(mask, _sg(x), 0))
  m = {
      "loss_num": _sg(num),
      "loss_den": den,
      "pg_num": _sg(agg.aggregate(pg_BxL, mask, cfg.aggregation, cfg.max_len, action_ids)[0]),
      "tokens": maskf.sum(),
      "rows": (ntok_S > 0).astype(dtype).sum(),
      "clip_high_sum": clip_high.astype(dtype).sum(),
      "clip_low_sum": clip_low.astype(dtype).sum(),
      "ratio_sum": msum(ratio_sg),
      "ratio_min": jnp.min(jnp.where(mask, ratio_sg, jnp.inf)),
      "ratio_max": jnp.max(jnp.where(mask, ratio_sg, -jnp.inf)),
      "logp_gap_sum": msum(jnp.abs(token_log_ratio)),
      "logp_gap_max": jnp.max(jnp.where(mask, jnp.abs(_sg(token_log_ratio)), 0)),
  }
  if kl_BxL is not None:
    m["kl_sum"] = msum(kl_BxL)
    m["kl_k3_sum"] = msum(kl3_BxL)
  if entropy is not None:
    m["entropy_sum"] = msum(entropy.astype(dtype))
  if is_sums is not None:
    m.update(is_sums)
  # Advantage statistics per row for [B] advantages, per token for [B, L],
  # per action (its first token's value) with action ids.
  if action_ids is not None:
    has_adv = seqs.first_token()
  else:
    has_adv = (ntok_S > 0) if adv.ndim == 1 else mask
  adv_vals = _sg(jnp.where(has_adv, adv.astype(dtype), 0))
  m.update(
      {
          "adv_count": has_adv.astype(dtype).sum(),
          "adv_sum": adv_vals.sum(),
          "adv_sq_sum": (adv_vals * adv_vals).sum(),
          "adv_min": jnp.min(jnp.where(has_adv, adv_vals, jnp.inf)),
          "adv_max": jnp.max(jnp.where(has_adv, adv_vals, -jnp.inf)),
      }
  )
  return num, den, m


def policy_loss(
    logp,
    old_logp,
    ref_logp,
    adv,
    mask,
    cfg: LossConfig,
    *,
    entropy=None,
    action_ids=None,
    sampler_logp=None,
):
  """The policy loss of one batch (docs/design.md section 4).

  Args:
    logp: [B, L] policy logprobs of the batch's tokens (differentiated).
    old_logp: [B, L] logprobs of the policy that sampled the tokens.
    ref_logp: [B, L] reference-model logprobs, or None when cfg.kl_coef == 0.
    adv: [B] (one advantage per row) or [B, L] (per token).
    mask: [B, L] bool, True on policy tokens.
    cfg: the loss configuration.
    entropy: optional [B, L] per-token policy entropy, only reported.
    action_ids: optional [B, L] action (sequence) ids within each row, for
      packed trees (see `policy_loss_terms`); None: one sequence per row.
    sampler_logp: optional [B, L] sampler logprobs when old_logp is the
      trainer's own (see `policy_loss_terms`).

  Returns:
    (loss, metrics): the scalar loss and a dict of scalar metrics
    (see `aggregation.finalize_metrics`).
  """
  num, den, metric_sums = policy_loss_terms(
      logp,
      old_logp,
      ref_logp,
      adv,
      mask,
      cfg,
      entropy=entropy,
      action_ids=action_ids,
      sampler_logp=sampler_logp,
  )
  return agg.safe_divide(num, den), agg.finalize_metrics(metric_sums)
