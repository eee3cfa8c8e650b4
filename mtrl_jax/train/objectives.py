"""What a train step minimises: the `Objective` protocol and the policy-gradient objective.

An objective turns per-token policy logprobs (and reference logprobs when it
needs them) into an exact (num, den) pair plus summable metrics, so
micro-batches can sum numerators, denominators and gradients and divide once
(`mtrl_jax.train.update`, inside `mtrl_jax.train.step.TrainStep`).
`PolicyObjective` wraps `mtrl_jax.losses.policy_loss_terms` over a
`rollout.train_batch.TrainBatch`'s [B, K] arrays; the SFT cross-entropy
(`mtrl_jax.train.sft`) is another objective on the same step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol

import jax
import jax.numpy as jnp

from mtrl_jax import losses


class Objective(Protocol):
  """What a `TrainStep` minimises, as exact (num, den) terms of a `TrainBatch`."""

  needs_ref: bool  # compute reference logprobs (a second forward, no gradient)
  # Optional (default 1): logprobs, policy and reference, of softmax(logits / temperature).
  temperature: float

  def terms(self, logp_BxK, ref_logp_BxK, entropy_BxK, batch) -> tuple[Any, Any, dict]:
    """(num, den, metric_sums) of one micro-batch; num is differentiated."""

  def merge(self, a: dict, b: dict) -> dict:
    """Combines the metric sums of two micro-batches."""

  def finalize(self, sums: dict) -> dict:
    """Scalar metrics from merged sums."""


def train_mask(batch) -> jax.Array:
  """The trained tokens of a `TrainBatch`: loss_mask with padding rows (row_weight 0) removed."""
  return batch.loss_mask_BxK.astype(bool) & (batch.row_weight_B > 0)[:, None]


def value_mask(batch) -> jax.Array:
  """The value slots of a critic's `TrainBatch` (one per trained action), padding removed."""
  return batch.value_mask_BxK.astype(bool) & (batch.row_weight_B > 0)[:, None]


@dataclasses.dataclass(frozen=True)
class PolicyObjective:
  """GRPO / GSPO / REINFORCE with a KL penalty (`mtrl_jax.losses`).

  Batch: a `TrainBatch` (its [B, K] arrays: loss mask, old logprobs,
  advantages, action ids; `trainer_old_logp_BxK` with `recompute_old`).

  Attributes:
    loss_cfg: the loss.
    temperature: the policy being optimised is softmax(logits / temperature).
      Set it to the sampler's temperature (the RL loop does): then on-policy
      ratios start at 1, as they do at temperature 1, instead of measuring
      the gap between the tempered sampler and the untempered model
      (verl and OpenRLHF score the actor at the rollout temperature too).
      top-k / top-p filters are not reproduced; their gap shows in
      `train/logp_gap`.
    recompute_old: the batch carries the trainer's own logprobs before the
      first update (`trainer_old_logp_BxK`, computed by `TrainStep.old_logprobs`;
      the RL loop does it when rl.updates_per_step > 1): the clipped ratio
      is taken against them, and the sampler's `old_logp` enters only the
      off-policy correction (`loss_cfg.is_correction`, `losses.offpolicy`).
      Without it, a correction other than 'none' takes pi_old = the current
      policy (stop-gradient): exact for one update per batch, where the two
      coincide.
    value_coef: a value critic's loss weight (`critic.value_coef`); None: no
      critic. The loss is then pg_num / pg_den + value_coef * value_num /
      value_den (`value_terms`), each over the whole batch.
    value_clip: the value loss is max((v - y)^2, (v_clip - y)^2) / 2 with
      v_clip = v_old + clip(v - v_old, -value_clip, value_clip) (PPO's value
      clipping, as CoMLRL's critics); 0: (v - y)^2 / 2.
  """

  loss_cfg: losses.LossConfig
  temperature: float = 1.0
  recompute_old: bool = False
  value_coef: Optional[float] = None
  value_clip: float = 0.0

  def __post_init__(self):
    t = self.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
      raise ValueError(f"PolicyObjective.temperature={t!r}; allowed: a finite number > 0")

  @property
  def needs_ref(self) -> bool:
    return self.loss_cfg.kl_coef > 0

  def check(self, batch) -> None:
    """Refuses a batch this objective cannot read (before tracing)."""
    if self.recompute_old and batch.trainer_old_logp_BxK is None:
      raise ValueError(
          "PolicyObjective(recompute_old=True) needs the batch's "
          "trainer_old_logp_BxK (TrainStep.old_logprobs)"
      )

  def _old_and_sampler(self, logp, batch):
    """(old_logp for the clipped ratio, sampler logp for the correction or None)."""
    if self.recompute_old:
      return batch.trainer_old_logp_BxK, batch.old_logp_BxK
    if self.loss_cfg.is_correction != "none":
      return jax.lax.stop_gradient(logp), batch.old_logp_BxK
    return batch.old_logp_BxK, None

  def terms(self, logp_BxK, ref_logp_BxK, entropy_BxK, batch):
    old, sampler = self._old_and_sampler(logp_BxK, batch)
    return losses.policy_loss_terms(
        logp_BxK,
        old,
        ref_logp_BxK,
        batch.adv_BxK,
        train_mask(batch),
        self.loss_cfg,
        entropy=entropy_BxK,
        action_ids=batch.action_BxK,
        sampler_logp=sampler,
    )

  def den(self, batch):
    """The policy term's denominator over `batch` (a count: its masks alone decide it)."""
    zeros = jnp.zeros(batch.target_BxK.shape, jnp.float32)
    return losses.aggregate(
        zeros, train_mask(batch), self.loss_cfg.aggregation, self.loss_cfg.max_len, batch.action_BxK
    )[1]

  def value_den(self, batch):
    """The value term's denominator over `batch`: its value slots."""
    return value_mask(batch).astype(jnp.float32).sum()

  def value_terms(self, values_BxK, batch):
    """(value_num, metric sums) of a critic's (clipped) squared error on the value slots."""
    mask = value_mask(batch)
    y, old = batch.value_target_BxK, batch.old_value_BxK
    err = jnp.square(values_BxK - y)
    if self.value_clip > 0:
      clipped = old + jnp.clip(values_BxK - old, -self.value_clip, self.value_clip)
      err = jnp.maximum(err, jnp.square(clipped - y))
    num = 0.5 * jnp.sum(jnp.where(mask, err, 0.0))
    v = jax.lax.stop_gradient(jnp.where(mask, values_BxK, 0.0))
    return num, {
        "value_loss_sum": jax.lax.stop_gradient(num),
        "value_count": mask.astype(jnp.float32).sum(),
        "value_sum": v.sum(),
        "value_target_sum": jnp.where(mask, y, 0.0).sum(),
        "value_target_sq_sum": jnp.where(mask, y * y, 0.0).sum(),
        "value_sq_err_sum": jnp.where(mask, jnp.square(v - y), 0.0).sum(),
    }

  def merge(self, a, b):
    return losses.merge_metric_sums(a, b)

  def finalize(self, sums):
    out = losses.finalize_metrics(sums)
    if "value_count" in sums:
      out.update(value_metrics(sums))
    return out


def value_metrics(sums) -> dict:
  """value_loss, value_mean, value_target_mean and the explained variance of the
  value slots, from `PolicyObjective.value_terms`' (merged) sums."""
  n = sums["value_count"]
  mean_y = losses.safe_divide(sums["value_target_sum"], n)
  var_y = losses.safe_divide(sums["value_target_sq_sum"], n) - mean_y * mean_y
  mse = losses.safe_divide(sums["value_sq_err_sum"], n)
  return dict(
      value_loss=losses.safe_divide(sums["value_loss_sum"], n),
      value_mean=losses.safe_divide(sums["value_sum"], n),
      value_target_mean=mean_y,
      value_explained_var=jnp.where(var_y > 0, 1.0 - mse / jnp.where(var_y > 0, var_y, 1.0), 0.0),
      value_slots=n,
  )


@dataclasses.dataclass(frozen=True)
class ValueObjective:
  """A separate critic model's objective (`critic.model='separate'`): the clipped value
  loss alone, `value_coef * value_num / value_den` on the batch's value slots
  (`PolicyObjective.value_terms`), CoMLRL's critic loss `value_loss_coef * MSE`.

  The update runs the value head only (`values_only`: no LM head, no logprobs); an
  update whose batch has no value slot changes nothing.
  """

  value_coef: float = 1.0
  value_clip: float = 0.0
  needs_ref = False
  values_only = True

  def check(self, batch) -> None:
    if batch.value_mask_BxK is None:
      raise ValueError(
          "ValueObjective needs a batch with the value fields (rollout.train_batch.VALUE_FIELDS)"
      )

  def terms(self, logp_BxK, ref_logp_BxK, entropy_BxK, batch):
    """No policy term: (0, value slots, {}); the value term is `value_terms`'."""
    return jnp.zeros((), jnp.float32), value_mask(batch).astype(jnp.float32).sum(), {}

  def den(self, batch):
    return self.value_den(batch)

  value_den = PolicyObjective.value_den
  value_terms = PolicyObjective.value_terms
  merge = PolicyObjective.merge

  def finalize(self, sums):
    return value_metrics(sums)
