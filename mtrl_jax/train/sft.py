"""The SFT step: masked cross-entropy on the trainable tokens of conversations, and its batches.

The masks are the RL ones: a row is a rendered conversation (its token
ledger's `ids`) and its `trainable` flags (policy tokens only), so the warm-up
teaches exactly the tokens RL later trains. SFT runs on the train-step
machinery (`TrainStep` with `SFTObjective`): same shardings, micro-batching,
non-finite handling and compile-once-per-bucket behaviour. A run's warm-up and
its SFT steps mixed into RL are in `run/warmup.py`.

Data: a list / Python iterable of `(ids, trainable)` rows, or any
random-access source of `{"ids", "trainable"}` records (e.g. a TFDS
`as_data_source`), served in epoch-shuffled fixed-shape batches by
`SFTBatcher`, whose position goes into the checkpoint's host state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtrl_jax import sharding
from mtrl_jax.buckets import bucket, round_up
from mtrl_jax.data import epoch_order
from mtrl_jax.rollout.train_batch import TrainBatch, from_rows
from mtrl_jax.train import optim
from mtrl_jax.train.objectives import train_mask
from mtrl_jax.train.step import StepConfig, TrainStep


@dataclasses.dataclass(frozen=True)
class SFTObjective:
  """Token-mean negative log-likelihood of the trainable tokens.

  loss = -sum_{b,k} m[b,k] logp[b,k] / sum_{b,k} m[b,k], with m the trained
  tokens of a `TrainBatch` minus padding rows (row_weight 0).
  """

  @property
  def needs_ref(self) -> bool:
    return False

  def terms(self, logp_BxK, ref_logp_BxK, entropy_BxK, batch):
    del ref_logp_BxK
    mask_BxK = train_mask(batch)
    maskf = mask_BxK.astype(jnp.float32)
    # where, not multiply: masked positions never reach the loss or its gradient.
    num = -jnp.sum(jnp.where(mask_BxK, logp_BxK, 0.0))
    sums = {
        "nll_sum": jax.lax.stop_gradient(num),
        "tokens": maskf.sum(),
        "rows": jnp.any(mask_BxK, axis=-1).astype(jnp.float32).sum(),
    }
    if entropy_BxK is not None:
      sums["entropy_sum"] = jnp.sum(jnp.where(mask_BxK, entropy_BxK, 0.0))
    return num, maskf.sum(), sums

  def merge(self, a, b):
    return {k: a[k] + b[k] for k in a}

  def finalize(self, sums):
    tokens = sums["tokens"]
    nll = sums["nll_sum"] / jnp.maximum(tokens, 1.0)
    out = {"nll": nll, "perplexity": jnp.exp(nll), "tokens": tokens, "rows": sums["rows"]}
    if "entropy_sum" in sums:
      out["entropy"] = sums["entropy_sum"] / jnp.maximum(tokens, 1.0)
    return out


def make_sft_step(
    model,
    optim_cfg: optim.OptimConfig,
    mesh=None,
    step_cfg: StepConfig = StepConfig(),
    rules=sharding.TRAIN_RULES,
) -> TrainStep:
  """A `TrainStep` minimising `SFTObjective`; call it as `step(state, None, batch)`."""
  return TrainStep(model, SFTObjective(), optim_cfg, mesh=mesh, step_cfg=step_cfg, rules=rules)


def _row(example) -> tuple[np.ndarray, np.ndarray]:
  if isinstance(example, Mapping):
    ids, trainable = example["ids"], example["trainable"]
  else:
    ids, trainable = example
  return np.asarray(ids, np.int64), np.asarray(trainable, bool)


def pack_sft_rows(
    rows: Sequence,
    length_buckets: Sequence[int],
    *,
    pad_id: int = 0,
    num_rows: Optional[int] = None,
    row_multiple: int = 1,
) -> TrainBatch:
  """Right-pads example rows into one fixed-shape SFT batch (each row a single-path tree,
  `rollout.train_batch.from_rows`, with one trained-token slot per position).

  Args:
    rows: `(ids, trainable_mask)` pairs (or dicts with those keys), e.g. a
      ledger's `ids` and `trainable`; position 0 must not be trainable.
    length_buckets: allowed lengths L; the smallest holding the longest row.
    pad_id: id of padding tokens.
    num_rows: batch rows B (>= len(rows)); default len(rows) rounded up to
      `row_multiple`. Padding rows get row_weight 0.
    row_multiple: B is a multiple of this (e.g. the data-parallel size).
  Returns:
    The `TrainBatch` (B x L x L).
  """
  parsed = [_row(r) for r in rows]
  for i, (ids, trainable) in enumerate(parsed):
    if ids.ndim != 1 or ids.shape != trainable.shape or ids.size == 0:
      raise ValueError(
          f"SFT row {i}: ids {ids.shape} and trainable {trainable.shape} must be "
          "equal-length, non-empty 1-D sequences"
      )
    if trainable[0]:
      raise ValueError(
          f"SFT row {i}: position 0 is trainable, but it has no prediction "
          "(it must be context, e.g. a role header)"
      )
  longest = max((ids.size for ids, _ in parsed), default=1)
  length = bucket(longest, length_buckets, "SFT row length")
  if num_rows is None:
    num_rows = round_up(max(len(parsed), 1), row_multiple)
  elif num_rows < len(parsed) or num_rows % row_multiple:
    raise ValueError(
        f"pack_sft_rows num_rows={num_rows}: must be >= len(rows)={len(parsed)} "
        f"and a multiple of row_multiple={row_multiple}"
    )
  tokens_BxL = np.full((num_rows, length), pad_id, np.int32)
  loss_mask_BxL = np.zeros((num_rows, length), bool)
  row_weight_B = np.zeros((num_rows,), np.float32)
  for b, (ids, trainable) in enumerate(parsed):
    tokens_BxL[b, : ids.size] = ids
    loss_mask_BxL[b, : ids.size] = trainable
    row_weight_B[b] = 1.0
  # K = L: one SFT program per (rows, length), whatever the rows' trained counts.
  return from_rows(tokens_BxL, loss_mask_BxL, row_weight_B=row_weight_B, num_logits=length)


class SFTBatcher:
  """Endless epoch-shuffled SFT batches with a resumable position.

  Epoch e visits the rows in `permutation(seed, e)`; batches run across epoch
  boundaries. `get_state()` / `set_state()` give the position for the
  checkpoint's host state, so a resumed run sees the same batches.

  Args:
    source: random-access rows (a list, or a TFDS data source from
      `builder.as_data_source(split)`); other iterables are read into a list.
    batch_size: rows per batch (B).
    length_buckets: allowed row lengths (see `pack_sft_rows`).
    seed: shuffling seed.
    shuffle: False keeps the source order.
    pad_id: id of padding tokens.
  """

  def __init__(
      self,
      source,
      batch_size: int,
      length_buckets: Sequence[int],
      *,
      seed: int = 0,
      shuffle: bool = True,
      pad_id: int = 0,
  ):
    if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
      source = list(source)
    if len(source) == 0:
      raise ValueError("SFTBatcher: the source has no rows")
    if batch_size < 1:
      raise ValueError(f"SFTBatcher batch_size={batch_size}; allowed: an integer >= 1")
    self.source, self.batch_size, self.length_buckets = source, batch_size, tuple(length_buckets)
    self.seed, self.shuffle, self.pad_id = seed, shuffle, pad_id
    self.position = 0  # rows consumed so far, over all epochs
    self._cached_epoch, self._cached_order = None, None

  def _order(self, epoch: int) -> np.ndarray:
    if self._cached_epoch != epoch:
      self._cached_order = epoch_order(len(self.source), self.seed, epoch, self.shuffle)
      self._cached_epoch = epoch
    return self._cached_order

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    n = len(self.source)
    rows = []
    for pos in range(self.position, self.position + self.batch_size):
      epoch, i = divmod(pos, n)
      rows.append(self.source[int(self._order(epoch)[i])])
    self.position += self.batch_size
    return pack_sft_rows(rows, self.length_buckets, pad_id=self.pad_id, num_rows=self.batch_size)

  def get_state(self) -> dict:
    return {"position": self.position, "seed": self.seed}

  def set_state(self, state: Mapping[str, Any]):
    if int(state["seed"]) != self.seed:
      raise ValueError(f"SFTBatcher.set_state: checkpoint seed {state['seed']} != {self.seed}")
    self.position = int(state["position"])
