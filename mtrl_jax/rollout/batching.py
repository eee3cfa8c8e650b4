"""The tree -> training batch boundary: which samples train, and how they are packed.

`make_train_batch` is the one place the RL loop turns a finalized tree into the
fixed-shape batch of the train step:

  1. `trained_samples`: a sample trains when it has weight > 0 (no
     infrastructure fault) and its (node, agent) group is not dropped by the
     zero-variance filter. A group is dropped only when every advantage in it
     is exactly zero and the KL term is off: with KL on, a zero-advantage
     group still carries its KL gradient, and under advantage_mode='raw' equal
     returns give equal non-zero advantages that do train.
  2. packing 'tree' (`tree_packing.pack_actions`: every token once) or 'rows'
     (`packing.pack_tree`: one row per trained sample), with bucketed shapes.

Both return metrics: batch/tokens_trained (non-padding tokens in the batch),
batch/tokens_rows_equivalent (what one row per trained action would hold),
batch/padding_fraction, batch/rows, batch/length, batch/zero_variance_groups.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from mtrl_jax.rollout.packing import pack_tree
from mtrl_jax.rollout.tree import Tree
from mtrl_jax.rollout.tree_packing import pack_actions, tree_actions

PACKINGS = ("tree", "rows")


@dataclasses.dataclass(frozen=True)
class BatchConfig:
  """How a tree becomes a batch.

  Attributes:
    packing: 'tree' (every token once, ancestor-only attention) or 'rows'
      (one row per trained action, its whole context repeated).
    length_buckets: row lengths; 'tree' packs into the largest, 'rows' uses
      the smallest that holds the longest row.
    row_buckets: allowed row counts (None: powers of two).
    row_multiple: row counts are multiples of this (the data shards).
    pad_id: token id of padding.
    zero_variance_filter: drop groups whose advantages are all exactly 0
      (unless keep_kl).
    keep_kl: the loss has a KL term, so no group is dropped.
  """

  packing: str = "tree"
  length_buckets: tuple = (256,)
  row_buckets: Optional[tuple] = None
  row_multiple: int = 1
  pad_id: int = 0
  zero_variance_filter: bool = True
  keep_kl: bool = False

  def __post_init__(self):
    if self.packing not in PACKINGS:
      raise ValueError(f"BatchConfig.packing={self.packing!r}; allowed: {list(PACKINGS)}")


def trained_samples(tree: Tree, zero_variance_filter: bool = True,
                    keep_kl: bool = False) -> tuple[list[np.ndarray], int]:
  """Per node a bool [N, G] of the samples that train, and the number of groups dropped."""
  out, dropped = [], 0
  for node in tree.nodes:
    keep = node.weight_NxG > 0
    if zero_variance_filter and not keep_kl:
      for i in range(keep.shape[0]):
        if keep[i].any() and np.all(node.advantages_NxG[i][keep[i]] == 0):
          keep[i] = False
          dropped += 1
    out.append(keep)
  return out, dropped


def _pack(tree: Tree, cfg: BatchConfig, trained: list) -> tuple[Optional[dict], dict]:
  """The batch of the `trained` samples (None when there are none) and its packing stats."""
  actions = float(sum(int(t.sum()) for t in trained))
  if not actions:
    return None, {"actions": 0.0, "tokens_trained": 0.0, "tokens_rows_equivalent": 0.0}
  if cfg.packing == "tree":
    batch, stats = pack_actions(tree_actions(tree, trained), length=max(cfg.length_buckets),
                                row_buckets=cfg.row_buckets, row_multiple=cfg.row_multiple,
                                pad_id=cfg.pad_id)
    tokens_trained, equivalent = stats["tokens_trained"], stats["tokens_rows_equivalent"]
  else:
    batch = pack_tree(tree, length_buckets=cfg.length_buckets, row_buckets=cfg.row_buckets,
                      row_multiple=cfg.row_multiple, pad_id=cfg.pad_id, trained=trained)
    tokens_trained = equivalent = float(sum(
        len(node.prompts[i]) + len(node.completions[i][g].ids)
        for k, node in enumerate(tree.nodes) for i, g in zip(*np.nonzero(trained[k]))))
  return batch, {"actions": actions, "tokens_trained": tokens_trained,
                 "tokens_rows_equivalent": equivalent}


def _batch_metrics(stats: dict, rows: int, length: int, copies: int = 1) -> dict:
  return {"batch/rows": float(rows), "batch/length": float(length),
          "batch/tokens_trained": stats["tokens_trained"],
          "batch/tokens_rows_equivalent": stats["tokens_rows_equivalent"],
          "batch/padding_fraction": 1.0 - stats["tokens_trained"] / float(copies * rows * length)}


def make_train_batch(tree: Tree, cfg: BatchConfig) -> tuple[Optional[dict], dict]:
  """The train batch of a finalized tree (None when no sample trains) and its metrics."""
  trained, dropped = trained_samples(tree, cfg.zero_variance_filter, cfg.keep_kl)
  batch, stats = _pack(tree, cfg, trained)
  metrics = {"batch/zero_variance_groups": float(dropped), "batch/actions": stats["actions"]}
  if batch is not None:
    metrics.update(_batch_metrics(stats, *batch["tokens_BxL"].shape))
  return batch, metrics


# Fill of each batch field where padding adds rows, positions or trained-token slots.
_FILL = {"positions_BxL": 0, "prev_BxK": 0, "action_BxK": 0, "loss_mask_BxK": False,
         "old_logp_BxK": 0.0, "adv_BxK": 0.0, "row_weight_B": 0.0, "loss_mask_BxL": False,
         "old_logp_BxL": 0.0, "adv_B": 0.0, "adv_BxL": 0.0, "turn_B": -1, "agent_B": -1,
         "node_B": -1}


def pad_batch(batch: dict, rows: int, length: int, k: Optional[int], pad_id: int) -> dict:
  """A row or tree-packed batch padded to `rows` x `length` (x `k` trained-token slots).

  Padding rows have row_weight 0 and no trained token; a padding position of a
  tree-packed row attends to itself only; padding never changes the loss.
  """
  out = {}
  for key, x in batch.items():
    shape = [rows] + [length if d == "L" else k for d in key.split("_")[-1][2:]]
    if key == "ends_BxL":  # each padding position its own subtree
      y = np.tile(np.arange(1, length + 1, dtype=x.dtype), (rows, 1))
    else:
      y = np.full(shape, pad_id if key.startswith(("tokens", "target")) else _FILL[key], x.dtype)
    y[tuple(slice(0, n) for n in x.shape)] = x
    out[key] = y
  return out


def make_agent_batches(tree: Tree, cfg: BatchConfig) -> tuple[Optional[dict], dict]:
  """One batch per agent, stacked on a leading agent axis: {key: [A, B, ...]}.

  Agent a's batch holds only its own trained samples (separate policies never
  train on each other's tokens); all agents are padded to the largest row
  count, length and trained-token bucket among them, so one program updates
  every agent (`train.stacked`). An agent with nothing to train gets an
  all-padding batch (its update is skipped). Returns (None, metrics) when no
  agent trains. Metrics: the overall `batch/*` ones plus `agent_<a>/batch/actions`
  and `agent_<a>/batch/tokens_trained`.
  """
  trained, dropped = trained_samples(tree, cfg.zero_variance_filter, cfg.keep_kl)
  n = tree.cfg.num_agents
  per = []
  for a in range(n):
    only_a = [t & (np.arange(t.shape[0]) == a)[:, None] for t in trained]
    per.append(_pack(tree, cfg, only_a))
  metrics = {"batch/zero_variance_groups": float(dropped),
             "batch/actions": float(sum(st["actions"] for _, st in per))}
  for a, (_, st) in enumerate(per):
    metrics[f"agent_{a}/batch/actions"] = st["actions"]
    metrics[f"agent_{a}/batch/tokens_trained"] = st["tokens_trained"]
  present = [b for b, _ in per if b is not None]
  if not present:
    return None, metrics
  rows = max(b["tokens_BxL"].shape[0] for b in present)
  length = max(b["tokens_BxL"].shape[1] for b in present)
  k = max(b["prev_BxK"].shape[1] for b in present) if "prev_BxK" in present[0] else None
  empty = {key: x[:0] for key, x in present[0].items()}
  batches = [pad_batch(b if b is not None else empty, rows, length, k, cfg.pad_id)
             for b, _ in per]
  stacked = {key: np.stack([b[key] for b in batches]) for key in batches[0]}
  total = {f: sum(st[f] for _, st in per) for f in ("tokens_trained", "tokens_rows_equivalent")}
  metrics.update(_batch_metrics(total, rows, length, copies=n))
  return stacked, metrics


def global_batch(batch: Optional[dict], metrics: dict, cfg: BatchConfig,
                 mesh) -> tuple[Optional[dict], dict]:
  """Every process's train batch as one global batch (several processes).

  Each process packed its own trees; the row count, length and trained-token
  slots are agreed (max over processes), every process pads its rows to them
  (a process with nothing to train brings padding only) and its rows become
  its block of the global arrays. Returns (None, metrics) when no process
  trains. `batch/*` metrics are summed over processes (`batch/rows` and
  `batch/padding_fraction` are the global batch's, so they depend on the
  process count; the trained samples do not).
  """
  from mtrl_jax import distributed, sharding  # infrastructure; numpy-only callers skip it
  from mtrl_jax.rollout.packing import batch_spec
  from mtrl_jax.rollout.tree_packing import tree_batch_spec

  tree = cfg.packing == "tree"
  shape = None
  if batch is not None:
    shape = batch["tokens_BxL"].shape + ((batch["prev_BxK"].shape[1],) if tree else (0,))
  summed = ("batch/zero_variance_groups", "batch/actions", "batch/tokens_trained",
            "batch/tokens_rows_equivalent")
  parts = distributed.allgather((shape, {k: metrics.get(k, 0.0) for k in summed}))
  out = {k: float(sum(m[k] for _, m in parts)) for k in summed}
  shapes = [s for s, _ in parts if s is not None]
  if not shapes:
    return None, {k: out[k] for k in summed[:2]}
  rows, length, k = (max(s[i] for s in shapes) for i in range(3))
  spec = tree_batch_spec(0, length, k) if tree else batch_spec(0, length)
  if batch is None:
    batch = {key: np.zeros(s.shape, s.dtype) for key, s in spec.items()}
  local = pad_batch({key: batch[key] for key in spec}, rows, length, k if tree else None,
                    cfg.pad_id)
  total = rows * distributed.process_count()
  arrays = {key: distributed.global_rows(x, sharding.batch_sharding(mesh, x.ndim, total))
            for key, x in local.items()}
  out.update(_batch_metrics(
      {"tokens_trained": out["batch/tokens_trained"],
       "tokens_rows_equivalent": out["batch/tokens_rows_equivalent"]}, total, length))
  return arrays, out
