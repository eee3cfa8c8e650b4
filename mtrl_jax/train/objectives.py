"""What a train step minimises: the `Objective` protocol and the policy-gradient objective.

An objective turns per-token policy logprobs (and reference logprobs when it
needs them) into an exact (num, den) pair plus summable metrics, so
micro-batches can sum numerators, denominators and gradients and divide once
(`mtrl_jax.train.update`, inside `mtrl_jax.train.step.TrainStep`).
`PolicyObjective` wraps `mtrl_jax.losses.policy_loss_terms` for row and
tree-packed batches; the SFT cross-entropy (`mtrl_jax.train.sft`) is another
objective on the same step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

from mtrl_jax import losses
from mtrl_jax.rollout.tree_packing import TREE_BATCH_KEYS


class Objective(Protocol):
  """What a `TrainStep` minimises, as exact (num, den) terms."""

  needs_ref: bool  # compute reference logprobs (a second forward, no gradient)
  batch_keys: tuple[str, ...]  # required batch entries
  # Optional (default 1): logprobs, policy and reference, of softmax(logits / temperature).
  temperature: float

  def terms(self, logp_BxL, ref_logp_BxL, entropy_BxL, batch) -> tuple[Any, Any, dict]:
    """(num, den, metric_sums) of one micro-batch; num is differentiated."""

  def merge(self, a: dict, b: dict) -> dict:
    """Combines the metric sums of two micro-batches."""

  def finalize(self, sums: dict) -> dict:
    """Scalar metrics from merged sums."""


def is_tree_batch(batch) -> bool:
  """A tree-packed batch (`rollout.tree_packing`): per-token arrays are [B, K]."""
  return "prev_BxK" in batch


def train_mask(batch) -> jax.Array:
  """loss_mask with padding / fault rows (row_weight 0) removed (and position 0 of rows)."""
  if is_tree_batch(batch):
    return batch["loss_mask_BxK"].astype(bool) & (batch["row_weight_B"] > 0)[:, None]
  mask_BxL = batch["loss_mask_BxL"].astype(bool)
  if "row_weight_B" in batch:
    mask_BxL = mask_BxL & (batch["row_weight_B"] > 0)[:, None]
  # Position 0 has no prediction (logp 0); it can never carry loss.
  return mask_BxL.at[:, 0].set(False)


def trainer_old_key(batch) -> str:
  """The batch entry holding the trainer's own logprobs before the first update."""
  return "trainer_old_logp_BxK" if is_tree_batch(batch) else "trainer_old_logp_BxL"


def _adv(batch):
  for key in ("adv_BxK", "adv_BxL"):
    if key in batch:
      return batch[key]
  return batch["adv_B"]


@dataclasses.dataclass(frozen=True)
class PolicyObjective:
  """GRPO / GSPO / REINFORCE with a KL penalty (`mtrl_jax.losses`).

  Batch: tokens_BxL, loss_mask_BxL, old_logp_BxL, adv_B (or adv_BxL),
  row_weight_B.

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
      first update (`trainer_old_key`, computed by `TrainStep.old_logprobs`;
      the RL loop does it when rl.updates_per_step > 1): the clipped ratio
      is taken against them, and the sampler's `old_logp` enters only the
      off-policy correction (`loss_cfg.is_correction`, `losses.offpolicy`).
      Without it, a correction other than 'none' takes pi_old = the current
      policy (stop-gradient): exact for one update per batch, where the two
      coincide.
  """

  loss_cfg: losses.LossConfig
  temperature: float = 1.0
  recompute_old: bool = False

  def __post_init__(self):
    t = self.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
      raise ValueError(f"PolicyObjective.temperature={t!r}; allowed: a finite number > 0")

  @property
  def needs_ref(self) -> bool:
    return self.loss_cfg.kl_coef > 0

  @property
  def batch_keys(self) -> tuple[str, ...]:
    return ("tokens_BxL", "loss_mask_BxL", "old_logp_BxL", "row_weight_B")

  def keys_for(self, batch) -> tuple[str, ...]:
    """The entries this objective reads from `batch` (row or tree-packed layout)."""
    extra = (trainer_old_key(batch),) if self.recompute_old else ()
    if is_tree_batch(batch):
      return TREE_BATCH_KEYS + extra
    return self.batch_keys + ("adv_BxL" if "adv_BxL" in batch else "adv_B",) + extra

  def _old_and_sampler(self, logp, sampler_logp, batch):
    """(old_logp for the clipped ratio, sampler logp for the correction or None)."""
    if self.recompute_old:
      return batch[trainer_old_key(batch)], sampler_logp
    if self.loss_cfg.is_correction != "none":
      return jax.lax.stop_gradient(logp), sampler_logp
    return sampler_logp, None

  def terms(self, logp_BxL, ref_logp_BxL, entropy_BxL, batch):
    tree = is_tree_batch(batch)
    old, sampler = self._old_and_sampler(
        logp_BxL, batch["old_logp_BxK" if tree else "old_logp_BxL"], batch)
    if tree:
      return losses.policy_loss_terms(logp_BxL, old, ref_logp_BxL, batch["adv_BxK"],
                                      train_mask(batch), self.loss_cfg, entropy=entropy_BxL,
                                      action_ids=batch["action_BxK"], sampler_logp=sampler)
    return losses.policy_loss_terms(logp_BxL, old, ref_logp_BxL, _adv(batch), train_mask(batch),
                                    self.loss_cfg, entropy=entropy_BxL, sampler_logp=sampler)

  def merge(self, a, b):
    return losses.merge_metric_sums(a, b)

  def finalize(self, sums):
    return losses.finalize_metrics(sums)
