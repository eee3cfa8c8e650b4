"""Packing a finalized tree into the fixed-shape training batch (numpy).

Each (node, agent, sample) becomes one row: the agent's prompt context at the
node (not trainable; earlier policy turns in it are trained in their own
node's row) followed by the action's completion: its sampled tokens are
trainable, with their sampling logprobs; under branch_on='user_turn' the
context between its segments (tool turns, headers) is part of the row but not
trainable (logprob 0). Rows are right-padded to a bucketed length and the batch to a
bucketed row count so the jitted train step compiles once per bucket.

Batch fields (docs/design.md / docs/internals.md "rollout"):
  tokens_BxL int32, loss_mask_BxL bool, old_logp_BxL float32, adv_B float32,
  row_weight_B float32 (0 for padding rows and fault-masked samples),
  turn_B, agent_B, node_B int32 (-1 on padding rows).
Alignment: `old_logp_BxL[b, t]` is the logprob of `tokens_BxL[b, t]` given
the tokens before it; position 0 is never trainable.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from mtrl_jax.buckets import bucket, row_count
from mtrl_jax.rollout.tree import Tree

BATCH_KEYS = ("tokens_BxL", "loss_mask_BxL", "old_logp_BxL", "adv_B", "row_weight_B",
              "turn_B", "agent_B", "node_B")


_DTYPES = {"tokens_BxL": np.int32, "loss_mask_BxL": np.bool_, "old_logp_BxL": np.float32,
           "adv_B": np.float32, "row_weight_B": np.float32, "turn_B": np.int32,
           "agent_B": np.int32, "node_B": np.int32}


def batch_spec(num_rows: int, length: int) -> dict:
  """Shapes and dtypes of a `pack_tree` batch, as `jax.ShapeDtypeStruct`s (for precompiling)."""
  import jax  # the packing itself is numpy only
  return {k: jax.ShapeDtypeStruct((num_rows, length) if k.endswith("BxL") else (num_rows,),
                                  _DTYPES[k]) for k in BATCH_KEYS}


def pack_tree(tree: Tree, *, length_buckets: Sequence[int],
              row_buckets: Optional[Sequence[int]] = None, row_multiple: int = 1,
              pad_id: int = 0, agents: Optional[Sequence[int]] = None,
              trained: Optional[Sequence[np.ndarray]] = None) -> dict[str, np.ndarray]:
  """Packs every (node, agent, sample) of a finalized tree into one batch.

  Args:
    tree: a finalized tree (`Tree.finalize`), every node sampled.
    length_buckets: allowed row lengths L; the smallest that holds the
      longest prompt + completion is used.
    row_buckets: allowed row counts B; default: the next power of two,
      rounded up to `row_multiple`.
    row_multiple: B is a multiple of this (e.g. the number of data shards).
    pad_id: token id of padding positions.
    agents: pack only these agents' rows (e.g. one batch per separate
      policy); default: every agent.
    trained: optional per node a bool [N, G] (`batching.trained_samples`):
      only those samples get rows; default: every sample (fault-masked ones
      as rows of weight 0).

  Returns:
    The batch dict of numpy arrays (keys `BATCH_KEYS`).
  """
  if not tree.finalized:
    raise ValueError("pack_tree needs a finalized tree (call Tree.finalize())")
  n = tree.cfg.num_agents
  agents = range(n) if agents is None else list(agents)
  if any(not 0 <= i < n for i in agents):
    raise ValueError(f"pack_tree agents={list(agents)}; allowed: ids in [0, {n})")
  rows = []
  for k, node in enumerate(tree.nodes):
    if node.completions is None:
      raise ValueError(f"node {node.node_id} was never sampled")
    for i in agents:
      for g, comp in enumerate(node.completions[i]):
        if trained is not None and not trained[k][i, g]:
          continue
        rows.append((node.prompts[i], comp, node.advantages_NxG[i, g], node.weight_NxG[i, g],
                     node.turn, i, node.node_id))
  longest = max((len(r[0]) + len(r[1].ids) for r in rows), default=1)
  length = bucket(longest, length_buckets, "row length")
  if row_buckets is not None:
    num_rows = bucket(len(rows), row_buckets, "row count")
    if num_rows % row_multiple:
      raise ValueError(f"row bucket {num_rows} is not a multiple of row_multiple={row_multiple}")
  else:
    num_rows = row_count(len(rows), row_multiple)

  tokens_BxL = np.full((num_rows, length), pad_id, np.int32)
  loss_mask_BxL = np.zeros((num_rows, length), bool)
  old_logp_BxL = np.zeros((num_rows, length), np.float32)
  adv_B = np.zeros(num_rows, np.float32)
  row_weight_B = np.zeros(num_rows, np.float32)
  ids_3xB = np.full((3, num_rows), -1, np.int32)
  for b, (prompt, comp, adv, weight, turn, agent, node_id) in enumerate(rows):
    p, c = len(prompt), len(comp.ids)
    if p == 0:
      raise ValueError(f"node {node_id} agent {agent}: empty prompt (position 0 must be context)")
    tokens_BxL[b, :p] = prompt
    tokens_BxL[b, p:p + c] = comp.ids
    old_logp_BxL[b, p:p + c] = comp.logprobs
    # Fault-masked samples are dropped three ways (mask, advantage, weight) so
    # that no loss aggregation can leak them into the update.
    keep = weight > 0
    loss_mask_BxL[b, p:p + c] = comp.sampled_mask & keep
    adv_B[b] = adv if keep else 0.0
    row_weight_B[b] = 1.0 if keep else 0.0
    ids_3xB[:, b] = (turn, agent, node_id)
  return {"tokens_BxL": tokens_BxL, "loss_mask_BxL": loss_mask_BxL,
          "old_logp_BxL": old_logp_BxL, "adv_B": adv_B, "row_weight_B": row_weight_B,
          "turn_B": ids_3xB[0], "agent_B": ids_3xB[1], "node_B": ids_3xB[2]}
