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
     (`tree_packing.pack_rows`: one row per trained sample), with bucketed
     shapes; both give one `rollout.train_batch.TrainBatch`.

Both return metrics: batch/tokens_trained (non-padding tokens in the batch),
batch/tokens_rows_equivalent (what one row per trained action would hold),
batch/padding_fraction, batch/rows, batch/length, batch/zero_variance_groups.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from mtrl_jax.rollout import train_batch
from mtrl_jax.rollout.train_batch import TrainBatch
from mtrl_jax.rollout.tree import Tree
from mtrl_jax.rollout.tree_packing import pack_actions, pack_rows, tree_actions

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
    values: a value critic's target, 'v' or 'q': batches carry the value
      fields (`train_batch.VALUE_FIELDS`); None: no critic.
  """

  packing: str = "tree"
  length_buckets: tuple = (256,)
  row_buckets: Optional[tuple] = None
  row_multiple: int = 1
  pad_id: int = 0
  zero_variance_filter: bool = True
  keep_kl: bool = False
  values: Optional[str] = None

  def __post_init__(self):
    if self.packing not in PACKINGS:
      raise ValueError(f"BatchConfig.packing={self.packing!r}; allowed: {list(PACKINGS)}")
    if self.values not in (None, "v", "q"):
      raise ValueError(f"BatchConfig.values={self.values!r}; allowed: None, 'v', 'q'")


def trained_samples(
    tree: Tree, zero_variance_filter: bool = True, keep_kl: bool = False
) -> tuple[list[np.ndarray], int]:
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


def _pack(
    tree: Tree, cfg: BatchConfig, trained: list, critic: Optional[tuple] = None
) -> tuple[Optional[TrainBatch], dict]:
  """The batch of the `trained` samples (None when there are none) and its packing stats;
  `critic`: per node (values, targets) of the actions (`tree_actions`)."""
  actions = tree_actions(tree, trained, critic)
  if not any(actions):
    return None, {"actions": 0.0, "tokens_trained": 0.0, "tokens_rows_equivalent": 0.0}
  if cfg.packing == "tree":
    return pack_actions(
        actions,
        length=max(cfg.length_buckets),
        row_buckets=cfg.row_buckets,
        row_multiple=cfg.row_multiple,
        pad_id=cfg.pad_id,
        values=cfg.values,
    )
  return pack_rows(
      actions,
      length_buckets=cfg.length_buckets,
      row_buckets=cfg.row_buckets,
      row_multiple=cfg.row_multiple,
      pad_id=cfg.pad_id,
      values=cfg.values,
  )


def _batch_metrics(stats: dict, rows: int, length: int, copies: int = 1) -> dict:
  return {
      "batch/rows": float(rows),
      "batch/length": float(length),
      "batch/tokens_trained": stats["tokens_trained"],
      "batch/tokens_rows_equivalent": stats["tokens_rows_equivalent"],
      "batch/padding_fraction": 1.0 - stats["tokens_trained"] / float(copies * rows * length),
  }


def make_train_batch(
    tree: Tree, cfg: BatchConfig, critic: Optional[tuple] = None
) -> tuple[Optional[TrainBatch], dict]:
  """The train batch of a finalized tree (None when no sample trains) and its metrics;
  `critic`: per node (values, value targets) [N, G] for the value fields."""
  trained, dropped = trained_samples(tree, cfg.zero_variance_filter, cfg.keep_kl)
  batch, stats = _pack(tree, cfg, trained, critic)
  metrics = {"batch/zero_variance_groups": float(dropped), "batch/actions": stats["actions"]}
  if batch is not None:
    metrics.update(_batch_metrics(stats, *batch.tokens_BxL.shape))
  return batch, metrics


def make_agent_batches(
    tree: Tree, cfg: BatchConfig, critic: Optional[tuple] = None, agents: Sequence[int] = ()
) -> tuple[Optional[TrainBatch], dict]:
  """One batch per agent, stacked on a leading agent axis: every field [A, B, ...].

  Agent a's batch holds only its own trained samples (separate policies never
  train on each other's tokens); all agents are padded to the largest row
  count, length and trained-token bucket among them, so one program updates
  every agent (`train.stacked`). An agent with nothing to train gets an
  all-padding batch (its update is skipped). Returns (None, metrics) when no
  agent trains. Metrics: the overall `batch/*` ones plus `agent_<a>/batch/actions`
  and `agent_<a>/batch/tokens_trained`. `critic` as for `make_train_batch`.
  `agents`: the agents stacked, in this order (empty: every agent), e.g. one group
  of a team of several architectures (`train.team`).
  """
  trained, dropped = trained_samples(tree, cfg.zero_variance_filter, cfg.keep_kl)
  agents = tuple(agents) or tuple(range(tree.cfg.num_agents))
  n = len(agents)
  per = []
  for a in agents:
    per.append(_pack(tree, cfg, _only(trained, [a]), critic))
  metrics = {
      "batch/zero_variance_groups": float(dropped),
      "batch/actions": float(sum(st["actions"] for _, st in per)),
  }
  for a, (_, st) in zip(agents, per):
    metrics[f"agent_{a}/batch/actions"] = st["actions"]
    metrics[f"agent_{a}/batch/tokens_trained"] = st["tokens_trained"]
  present = [b for b, _ in per if b is not None]
  if not present:
    return None, metrics
  stacked = _stack([b for b, _ in per], cfg)
  rows, length = stacked.tokens_BxL.shape[1:]
  total = {f: sum(st[f] for _, st in per) for f in ("tokens_trained", "tokens_rows_equivalent")}
  metrics.update(_batch_metrics(total, rows, length, copies=n))
  return stacked, metrics


def _only(trained: list, agents) -> list:
  """`trained` keeping only `agents`' samples."""
  return [t & np.isin(np.arange(t.shape[0]), agents)[:, None] for t in trained]


def _stack(batches: list, cfg: BatchConfig) -> TrainBatch:
  """Per-agent batches (None: nothing) padded to one shape and stacked [A, ...]."""
  present = [b for b in batches if b is not None]
  rows, length, k = (max(b.shape[i] for b in present) for i in range(3))
  return train_batch.stack(
      [
          train_batch.empty(rows, length, k, cfg.pad_id, cfg.values is not None)
          if b is None
          else train_batch.pad_batch(b, rows, length, k, cfg.pad_id)
          for b in batches
      ]
  )


def critic_values(tree: Tree, cfg: BatchConfig, values_fn, per_agent: bool) -> list:
  """A value critic's value of every sampled action, per node [N, G] (0 where masked).

  One value pass: every valid action (weight > 0) packed as for training, with
  the value fields of `cfg.values`, and `values_fn(batch)` run once on it
  (`TrainStep.values`: [B, K]; per agent, `StackedTrainStep.values` on the
  agents' stacked batches: [A, B, K]); each action's value is read at its value
  slot.
  """
  valid = [node.weight_NxG > 0 for node in tree.nodes]
  n = tree.cfg.num_agents
  groups = [[a] for a in range(n)] if per_agent else [list(range(n))]
  packs = [_pack(tree, cfg, _only(valid, agents)) for agents in groups]
  out = [np.zeros(v.shape, np.float64) for v in valid]
  if all(b is None for b, _ in packs):
    return out
  if per_agent:
    values = np.asarray(values_fn(_stack([b for b, _ in packs], cfg)))
  else:
    values = np.asarray(values_fn(packs[0][0]))[None]
  for a, (agents, (_, stats)) in enumerate(zip(groups, packs)):
    if "value_slots" not in stats:
      continue
    keys = [(k, i, g) for i in agents for k, ok in enumerate(valid) for g in np.flatnonzero(ok[i])]
    for (k, i, g), (row, slot) in zip(keys, stats["value_slots"]):
      out[k][i, g] = values[a, row, slot]
  return out


def global_batch(
    batch: Optional[TrainBatch], metrics: dict, cfg: BatchConfig, mesh
) -> tuple[Optional[TrainBatch], dict]:
  """Every process's train batch as one global batch (several processes).

  Each process packed its own trees; the row count, length and trained-token
  slots are agreed (max over processes), every process pads its rows to them
  (a process with nothing to train brings padding only) and its rows become
  its block of the global arrays. Returns (None, metrics) when no process
  trains. `batch/*` metrics are summed over processes (`batch/rows` and
  `batch/padding_fraction` are the global batch's, so they depend on the
  process count; the trained samples do not).
  """
  import jax

  from mtrl_jax import distributed, sharding  # infrastructure; numpy-only callers skip it

  shape = None if batch is None else batch.shape
  summed = (
      "batch/zero_variance_groups",
      "batch/actions",
      "batch/tokens_trained",
      "batch/tokens_rows_equivalent",
  )
  parts = distributed.allgather((shape, {k: metrics.get(k, 0.0) for k in summed}))
  out = {k: float(sum(m[k] for _, m in parts)) for k in summed}
  shapes = [s for s, _ in parts if s is not None]
  if not shapes:
    return None, {k: out[k] for k in summed[:2]}
  rows, length, k = (max(s[i] for s in shapes) for i in range(3))
  local = (
      train_batch.empty(rows, length, k, cfg.pad_id, cfg.values is not None)
      if batch is None
      else train_batch.pad_batch(batch, rows, length, k, cfg.pad_id)
  )
  total = rows * distributed.process_count()
  arrays = jax.tree.map(
      lambda x: distributed.global_rows(x, sharding.batch_sharding(mesh, x.ndim, total)), local
  )
  out.update(
      _batch_metrics(
          {
              "tokens_trained": out["batch/tokens_trained"],
              "tokens_rows_equivalent": out["batch/tokens_rows_equivalent"],
          },
          total,
          length,
      )
  )
  return arrays, out
