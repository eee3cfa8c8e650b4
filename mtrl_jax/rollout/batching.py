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


def make_train_batch(tree: Tree, cfg: BatchConfig) -> tuple[Optional[dict], dict]:
  """The train batch of a finalized tree (None when no sample trains) and its metrics."""
  trained, dropped = trained_samples(tree, cfg.zero_variance_filter, cfg.keep_kl)
  metrics = {"batch/zero_variance_groups": float(dropped),
             "batch/actions": float(sum(int(t.sum()) for t in trained))}
  if not metrics["batch/actions"]:
    return None, metrics
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
  rows, length = batch["tokens_BxL"].shape
  metrics.update({"batch/rows": float(rows), "batch/length": float(length),
                  "batch/tokens_trained": tokens_trained,
                  "batch/tokens_rows_equivalent": equivalent,
                  "batch/padding_fraction": 1.0 - tokens_trained / float(rows * length)})
  return batch, metrics
