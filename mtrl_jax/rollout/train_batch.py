"""The training batch: one typed layout for RL trees, plain rows and SFT conversations.

A `TrainBatch` is a packed token forest (`rollout.tree_packing`): each row
holds one or more token trees laid out depth-first, every token attends to
its own path from its tree's root (`ends_BxL`), its position id is its depth
on that path, and the LM head runs only where the loss needs it: at the row
position of each trained token's predecessor (`prev_BxK`). Three producers
fill the same struct:

  * tree packing (`tree_packing.pack_actions`, `rl.packing='tree'`): a
    rollout tree's actions share every common prefix, each token once;
  * rows (`pack_actions(..., share_prefixes=False)`, `rl.packing='rows'`):
    one row per action, its whole context repeated: a tree without shared
    prefixes, the baseline tree packing is measured against;
  * `from_rows`: plain right-padded rows (SFT conversations, hand-written
    test batches) as single-path trees, causal attention over the row.

Per-token training arrays are `[B, K]` (K trained-token slots per row;
`logit_buckets`), so the objectives, the forward and the micro-batch split
read one layout. `action_BxK` numbers the actions (GSPO sequences) of a row.
`trainer_old_logp_BxK` is filled only when several updates share a batch
(the trainer's own logprobs before the first update; `TrainStep.old_logprobs`).
The value fields (`VALUE_FIELDS`) are filled only with a value critic
(`critic.kind`): one slot per action, its first trained token's, carries the
position the value head reads and the action's value target.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import flax.struct
import numpy as np

from mtrl_jax.buckets import bucket


@flax.struct.dataclass
class TrainBatch:
  """The train step's batch (numpy on the host, jax arrays on the device).

  Attributes:
    tokens_BxL: int32 token ids (pad_id on padding).
    positions_BxL: int32 RoPE position of each token: its depth on its path.
    ends_BxL: int32 end of each token's subtree in its row: token q attends
      to key k iff k <= q < ends_BxL[k] (padding: k + 1, itself only).
    prev_BxK: int32 row position of each trained token's predecessor, where
      the LM head runs (0 on empty slots).
    target_BxK: int32 id of each trained token (pad_id on empty slots).
    action_BxK: int32 index of the token's action within its row (GSPO's
      sequence and the seq-mean aggregations' unit).
    loss_mask_BxK: bool, True on a trained token (False on empty slots).
    old_logp_BxK: float32 sampling logprob of each trained token.
    adv_BxK: float32 advantage of each trained token (its action's).
    row_weight_B: float32, 1 on rows with content, 0 on padding rows.
    trainer_old_logp_BxK: float32 trainer logprobs before the first of several
      updates on this batch, or None.
    value_pos_BxK: int32 row position the value head reads for the slot's action
      (V: its last prompt token, the history before it; Q: its last token), or None.
    value_mask_BxK: bool, True on one slot per action (its first trained token).
    value_target_BxK: float32 the action's value target (`rollout.critic`).
    old_value_BxK: float32 the value the rollout's critic gave it (value clipping).
  """

  tokens_BxL: Any
  positions_BxL: Any
  ends_BxL: Any
  prev_BxK: Any
  target_BxK: Any
  action_BxK: Any
  loss_mask_BxK: Any
  old_logp_BxK: Any
  adv_BxK: Any
  row_weight_B: Any
  trainer_old_logp_BxK: Any = None
  value_pos_BxK: Any = None
  value_mask_BxK: Any = None
  value_target_BxK: Any = None
  old_value_BxK: Any = None

  @property
  def shape(self) -> tuple[int, int, int]:
    """(rows B, length L, trained-token slots K): the program's shape bucket."""
    return (*self.tokens_BxL.shape[-2:], self.prev_BxK.shape[-1])

  def program_key(self, rows_axis: int = 0) -> tuple:
    """A compiled program's cache key: the fields present, their ranks and row counts
    (shardings depend on rows only; jax.jit's own cache adds one program per length)."""
    return tuple(
        (f.name, len(v.shape), v.shape[rows_axis])
        for f in dataclasses.fields(self)
        if (v := getattr(self, f.name)) is not None
    )

  def forward_part(self) -> "TrainBatch":
    """The entries a policy forward reads (the rest set to None): the argument of
    the old-logprob pass, so its program does not depend on the training fields."""
    return TrainBatch(
        self.tokens_BxL,
        self.positions_BxL,
        self.ends_BxL,
        self.prev_BxK,
        self.target_BxK,
        None,
        None,
        None,
        None,
        None,
    )


# The fill of every field where padding adds rows, positions or trained-token slots.
_DTYPES = {
    "tokens_BxL": np.int32,
    "positions_BxL": np.int32,
    "ends_BxL": np.int32,
    "prev_BxK": np.int32,
    "target_BxK": np.int32,
    "action_BxK": np.int32,
    "loss_mask_BxK": np.bool_,
    "old_logp_BxK": np.float32,
    "adv_BxK": np.float32,
    "row_weight_B": np.float32,
}
_FILL = {
    "positions_BxL": 0,
    "prev_BxK": 0,
    "action_BxK": 0,
    "loss_mask_BxK": False,
    "old_logp_BxK": 0.0,
    "adv_BxK": 0.0,
    "row_weight_B": 0.0,
    "value_pos_BxK": 0,
    "value_mask_BxK": False,
    "value_target_BxK": 0.0,
    "old_value_BxK": 0.0,
}
FIELDS = tuple(_DTYPES)
VALUE_FIELDS = ("value_pos_BxK", "value_mask_BxK", "value_target_BxK", "old_value_BxK")
_DTYPES.update(
    value_pos_BxK=np.int32,
    value_mask_BxK=np.bool_,
    value_target_BxK=np.float32,
    old_value_BxK=np.float32,
)


def logit_buckets(length: int) -> tuple[int, ...]:
  """Allowed K (trained tokens per row) for rows of `length`: a quarter, a half, all."""
  return tuple(sorted({max(length // 4, 1), max(length // 2, 1), length}))


def _fields(values: bool) -> tuple[str, ...]:
  return FIELDS + (VALUE_FIELDS if values else ())


def _shape(name: str, num_rows: int, length: int, num_logits: int) -> tuple[int, ...]:
  return {"L": (num_rows, length), "K": (num_rows, num_logits)}.get(name[-1], (num_rows,))


def batch_spec(num_rows: int, length: int, num_logits: int, values: bool = False) -> TrainBatch:
  """Shapes and dtypes of a batch as `jax.ShapeDtypeStruct`s (for precompiling);
  `values`: with the value fields of a critic."""
  import jax  # the packing itself is numpy only

  return TrainBatch(
      **{
          f: jax.ShapeDtypeStruct(_shape(f, num_rows, length, num_logits), _DTYPES[f])
          for f in _fields(values)
      }
  )


def empty(
    num_rows: int, length: int, num_logits: int, pad_id: int = 0, values: bool = False
) -> TrainBatch:
  """An all-padding batch: no trained token, every position its own subtree."""
  b = {
      f: np.full(_shape(f, num_rows, length, num_logits), _FILL.get(f, pad_id), _DTYPES[f])
      for f in _fields(values)
  }
  b["ends_BxL"] = np.tile(np.arange(1, length + 1, dtype=np.int32), (num_rows, 1))
  return TrainBatch(**b)


def has_values(batch: TrainBatch) -> bool:
  """Whether `batch` carries the value fields of a critic."""
  return batch.value_mask_BxK is not None


def pad_batch(
    batch: TrainBatch, rows: int, length: int, num_logits: int, pad_id: int = 0
) -> TrainBatch:
  """`batch` padded to `rows` x `length` x `num_logits`; padding never changes the loss."""
  values = has_values(batch)
  out = empty(rows, length, num_logits, pad_id, values)
  fields = {}
  for f in _fields(values):
    x, y = getattr(batch, f), getattr(out, f)
    y[tuple(slice(0, n) for n in x.shape)] = x
    fields[f] = y
  return TrainBatch(**fields)


def stack(batches: Sequence[TrainBatch]) -> TrainBatch:
  """Batches of one shape stacked on a leading agent axis: every field [A, ...]."""
  return TrainBatch(
      **{f: np.stack([getattr(b, f) for b in batches]) for f in _fields(has_values(batches[0]))}
  )


def from_rows(
    tokens_BxL,
    loss_mask_BxL,
    *,
    old_logp_BxL=None,
    adv=None,
    row_weight_B=None,
    num_logits: Optional[int] = None,
) -> TrainBatch:
  """Plain right-padded rows as a batch: each row one causal path, one action.

  The row layout's alignment: `old_logp_BxL[b, t]` is the logprob of token t
  given the tokens before it, so trained token t's logits come from position
  t - 1; position 0 is never trained.

  Args:
    tokens_BxL: int token ids.
    loss_mask_BxL: bool, the trained tokens.
    old_logp_BxL: sampling logprobs (default 0).
    adv: advantages, per row `[B]` or per token `[B, L]` (default 0).
    row_weight_B: 0 drops a row from the loss (default: 1 on every row).
    num_logits: K; default the smallest of `logit_buckets(L)` that holds the
      most trained tokens of a row.
  Returns:
    The `TrainBatch`.
  """
  tokens_BxL = np.asarray(tokens_BxL, np.int32)
  b, length = tokens_BxL.shape
  mask_BxL = np.asarray(loss_mask_BxL, bool).copy()
  mask_BxL[:, 0] = False  # position 0 has no prediction
  if row_weight_B is not None:
    mask_BxL &= (np.asarray(row_weight_B) > 0)[:, None]
  old_BxL = (
      np.zeros((b, length), np.float32)
      if old_logp_BxL is None
      else np.asarray(old_logp_BxL, np.float32)
  )
  adv_BxL = np.zeros((b, length), np.float32) if adv is None else np.asarray(adv, np.float32)
  if adv_BxL.ndim == 1:
    adv_BxL = np.repeat(adv_BxL[:, None], length, axis=1)
  most = int(mask_BxL.sum(axis=1).max(initial=0))
  k = num_logits or bucket(max(most, 1), logit_buckets(length), "trained tokens per row")
  out = empty(b, length, k)
  out.tokens_BxL[:] = tokens_BxL
  out.positions_BxL[:] = np.arange(length, dtype=np.int32)
  out.ends_BxL[:] = length  # causal: every key is seen by the rest of the row
  for r in range(b):
    where = np.flatnonzero(mask_BxL[r])
    n = where.size
    if n > k:
      raise ValueError(f"row {r} has {n} trained tokens; num_logits={k}")
    out.prev_BxK[r, :n] = where - 1
    out.target_BxK[r, :n] = tokens_BxL[r, where]
    out.loss_mask_BxK[r, :n] = True
    out.old_logp_BxK[r, :n] = old_BxL[r, where]
    out.adv_BxK[r, :n] = adv_BxL[r, where]
  out.row_weight_B[:] = 1.0 if row_weight_B is None else (np.asarray(row_weight_B) > 0)
  return out


def as_arrays(batch: TrainBatch) -> dict[str, Any]:
  """The batch's fields by name (None fields left out): for logs and tests."""
  return {
      f.name: getattr(batch, f.name)
      for f in dataclasses.fields(batch)
      if getattr(batch, f.name) is not None
  }
